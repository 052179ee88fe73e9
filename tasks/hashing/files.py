"""The sha256 of files, memoised per file identity, read in parallel and started early.

Hashes are memoised per file identity (path, size, mtime_ns, ctime_ns, inode, device) in this process, in a stage
folder's `.hashes.json` (outputs, checked by tasks/on_disk/manifest.py) and in runs_dir's `.input-hashes.json` (the
base model's and the data's files, read by the cache keys), so a reused stage or an unchanged input costs a stat per
file, not a read. Where the identity cannot vouch for the bytes (a filesystem whose ctime this kernel does not keep,
a file changed moments before it was read) the hash is not memoised across processes: the file is read again next
time. Files not in a memo are hashed in parallel, one file per thread, on the run's share of the host's cores; a flow
starts hashing the base model's files early (prefetch_sha256), and a key that needs them waits for that read.
"""

from __future__ import annotations

import contextvars
import hashlib
import json
import os
import re
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from tasks.hashing.keys import hash_json
from tasks.log import logger

HASH_MEMO = ".hashes.json"  # in each stage folder: file name -> [size, mtime_ns, ctime_ns, inode, device, sha256]
INPUT_HASH_MEMO = ".input-hashes.json"  # in runs_dir: absolute path of an input file -> the same
Identity = tuple[str, int, int, int, int, int]  # resolved path, size, mtime_ns, ctime_ns, inode, device (_identity)
_FILE_HASH_CACHE: dict[Identity, str] = {}  # only hashes whose identity held across the read (_settled)
# files being hashed now by some thread, by identity: a second caller waits for the first one's result
_IN_FLIGHT: dict[Identity, Future[str]] = {}
# A file whose ctime is this close to the end of its read may still be changing inside one timestamp tick (1 s on
# filesystems with second timestamps, such as ext4 with 128-byte inodes), where a write leaves ctime as it was: its
# hash is used, not memoised, and the next look reads the file again.
_SETTLED_NS = 2 * 10**9
# Filesystems whose ctime the kernel does not stamp on every write: a FUSE daemon (s3fs, rclone, gcsfuse, sshfs)
# reports what it likes, often the mtime; FAT has no ctime; SMB and NTFS let a program set the change time. Their
# files are hashed on every run (a content check) instead of trusted by identity across processes.
_UNTRUSTED_FS = ("fuse", "fuseblk", "vfat", "msdos", "exfat", "ntfs", "ntfs3", "cifs", "smb3", "smbfs", "9p")
_MOUNTINFO = Path("/proc/self/mountinfo")
_SAID_CONTENT_CHECKED: set[str] = set()  # mount points already named in the log by this process
_IN_FLIGHT_LOCK = threading.Lock()
_READ_BYTES = 16 << 20  # one read of a file being hashed (_sha256)


def file_sha256(path: Path, runs_dir: Path | None = None) -> str:
    """Content hash of one file, memoised per identity (see _identity) within the process and, given runs_dir,
    across processes (runs_dir/.input-hashes.json)."""
    return files_sha256([path], runs_dir)[path]


def files_sha256(paths: Iterable[Path], runs_dir: Path | None = None) -> dict[Path, str]:
    """sha256 of each file's bytes, the files not memoised hashed in parallel; see file_sha256."""
    paths = list(paths)
    if runs_dir is None:
        return _hash_files(paths)
    memo = HashMemo(Path("/"), Path(runs_dir).expanduser() / INPUT_HASH_MEMO)
    hashes = memo.sha256_all([str(p.resolve()) for p in paths])
    memo.save()
    return {p: hashes[str(p.resolve())] for p in paths}


def files_fingerprint(paths: list[Path], root: Path | None = None, runs_dir: Path | None = None) -> str:
    """One hash over the names (relative to root) and bytes of several files (runs_dir: see file_sha256)."""
    hashes = files_sha256(paths, runs_dir)
    return hash_json(sorted((str(p.relative_to(root)) if root else p.name, hashes[p]) for p in paths))


def _identity(path: Path) -> Identity:
    """What must stay the same for a memoised hash to hold. Any write moves the file's ctime, which no program can
    set: `cp -p`, `rsync -t --inplace` and `touch -d` put the old mtime back, and the kernel stamps ctime with the
    clock as they do. A replacement by rename changes the inode, the same path on another mount the device; size
    and mtime are kept too, so a memo entry says what changed when one looks."""
    st = path.stat()
    return str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev


def _settled(before: Identity, path: Path, just_written: bool = False) -> bool:
    """True when a hash read under identity `before` may be memoised: the file is as it was when the read began,
    and its last change lies further back than one timestamp tick (_SETTLED_NS), or it is one of `just_written`
    files, which this process finished writing and no one else writes (a stage's outputs, under its lock)."""
    try:
        after = _identity(path)
    except OSError:  # removed meanwhile: the hash stands for this read, not for the next
        return False
    return after == before and (just_written or time.time_ns() - before[3] >= _SETTLED_NS)


def _hash_files(paths: list[Path], just_written: bool = False) -> dict[Path, str]:
    """sha256 of each file through the process memo; the others read in parallel, one file per thread (one
    file's sha256 cannot be split), on the run's share of the host's cores. A file another thread is hashing now
    (prefetch_sha256) is waited for, not read twice. just_written: see _settled."""
    identities = {p: _identity(p) for p in paths}
    known: dict[Identity, str] = {}
    mine: dict[Identity, tuple[Path, Future[str]]] = {}
    theirs: dict[Identity, Future[str]] = {}
    with _IN_FLIGHT_LOCK:
        for identity, path in sorted({i: p for p, i in identities.items()}.items(), key=lambda item: -item[0][1]):
            if identity in _FILE_HASH_CACHE:  # largest first (above): the longest file starts at once
                known[identity] = _FILE_HASH_CACHE[identity]
            elif identity in _IN_FLIGHT:
                theirs[identity] = _IN_FLIGHT[identity]
            else:
                _IN_FLIGHT[identity] = future = Future()
                mine[identity] = (path, future)
    if mine:
        _hash_now(mine, just_written)
        known.update({identity: future.result() for identity, (_, future) in mine.items()})
    wait(theirs.values())
    known.update({identity: future.result() for identity, future in theirs.items() if future.exception() is None})
    # the other thread's read failed: read them here, and raise what this read meets
    left = [p for p, i in identities.items() if i not in known]
    return {**{p: known[i] for p, i in identities.items() if i in known},
            **(_hash_files(left, just_written) if left else {})}


def _hash_now(mine: dict[Identity, tuple[Path, Future[str]]], just_written: bool = False) -> None:
    """Hash the files this thread took in flight, each into the memo (where it settled) and its waiters told as soon
    as it is read."""
    started, size = time.monotonic(), sum(identity[1] for identity in mine)
    workers = min(len(mine), _hash_threads()) if len(mine) > 1 else 1

    def one(identity: Identity) -> None:
        path, future = mine[identity]
        try:
            digest = _sha256(path)
        except BaseException as exc:
            _settle(identity, future, exc)
            raise
        _settle(identity, future, digest, memoise=_settled(identity, path, just_written))

    try:
        if workers == 1:  # no pool to start for one file (checkpoints, registry checks, data parts)
            for identity in mine:
                one(identity)
        else:
            with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sha256") as pool:
                list(pool.map(one, mine))
    finally:  # files left unread after a failure: their waiters must not wait forever
        for identity, (_, future) in mine.items():
            if not future.done():
                _settle(identity, future, RuntimeError(f"{identity[0]} was not hashed: another file failed first"))
    if size >= 1 << 30:  # worth a line where it takes seconds
        logger().info("sha256 of %d file(s), %.1f GB, in %.1f s on %d thread(s)", len(mine), size / 1e9,
                      time.monotonic() - started, workers)


def _settle(identity: Identity, future: Future[str], outcome: str | BaseException, memoise: bool = False) -> None:
    with _IN_FLIGHT_LOCK:
        if _IN_FLIGHT.get(identity) is future:
            del _IN_FLIGHT[identity]
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            if memoise:
                _FILE_HASH_CACHE[identity] = outcome
            future.set_result(outcome)


def _content_checked(paths: list[Path]) -> set[Path]:
    """Those of `paths` on a filesystem whose ctime cannot vouch for unchanged bytes (_UNTRUSTED_FS), by this
    process's mount table: their hashes are never taken from, or put into, a memo file."""
    mounts = _mounts()
    checked = set()
    for path in paths:
        where, kind = _mount_of(str(path.resolve()), mounts)
        if kind.split(".")[0] in _UNTRUSTED_FS:
            checked.add(path)
            if where not in _SAID_CONTENT_CHECKED:
                _SAID_CONTENT_CHECKED.add(where)
                logger().info("files under %s (%s) are hashed on every run: that filesystem's ctime cannot show "
                              "that a file is unchanged", where, kind)
    return checked


def _mounts() -> list[tuple[str, str]]:
    """(mount point, filesystem type) of each mount in /proc/self/mountinfo, in its order; [] where there is none
    (not Linux: APFS and the BSDs' filesystems keep ctime)."""
    try:
        lines = _MOUNTINFO.read_text().splitlines()
    except OSError:
        return []
    mounts = []
    for line in lines:
        head, _, tail = line.partition(" - ")
        fields, kind = head.split(), tail.split()[:1]
        if len(fields) > 4 and kind:  # the 5th field is the mount point, octal-escaped (\040 for a space)
            mounts.append((re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), fields[4]), kind[0]))
    return mounts


def _mount_of(path: str, mounts: list[tuple[str, str]]) -> tuple[str, str]:
    """The mount that holds `path` (resolved): the longest mount point above it, the later one of equals (it is
    mounted over the earlier)."""
    found = ("/", "")
    for point, kind in mounts:
        if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) >= len(found[0]):
            found = (point, kind)
    return found


def prefetch_sha256(paths: list[Path], runs_dir: Path | None = None) -> threading.Thread:
    """Start hashing `paths` (as files_sha256 does, into the same memos) on a background thread, and return it.

    Why: a stage's key needs its inputs' hashes before the stage can start, and the flow knows those inputs
    earlier: hashing a base model's files takes seconds (docs/performance.md, "The whole job"), time the flow can
    spend while prepare_data runs. A later files_sha256 of the same files waits for the hashes in flight instead of
    reading the files again; where a read here failed, that call reads the file itself and raises what it meets,
    inside the stage that needs the hash."""
    context = contextvars.copy_context()  # the run's logger and settings on the thread too

    def run() -> None:
        try:
            files_sha256(paths, runs_dir)
        except Exception:  # noqa: BLE001 - the stage's own call reads again and raises there
            return

    thread = threading.Thread(target=context.run, args=(run,), name="sha256-prefetch", daemon=True)
    thread.start()
    return thread


def _sha256(path: Path) -> str:
    """sha256 of a file read in 16 MiB pieces. Why not hashlib.file_digest: its 256 KiB reads take the GIL back
    twice per piece, and beside a thread running Python (prepare_data importing transformers while the base model
    is prefetched) each take waits up to the interpreter's 5 ms switch interval, which made hashing beside a busy
    Python thread tens of times slower (docs/performance.md, "The whole job"). Read and update both release the
    GIL, so threads hash files at once."""
    digest, piece = hashlib.sha256(), bytearray(_READ_BYTES)
    view = memoryview(piece)
    with path.open("rb", buffering=0) as f:
        while size := f.readinto(piece):
            digest.update(view[:size])
    return digest.hexdigest()


def _hash_threads() -> int:
    """Threads for hashing: the run's share of the host's cores (tasks/pool/cpus.py), at least 1."""
    from tasks.pool.cpus import cpu_share_threads  # lazily: it reads the Prefect server where there is one

    try:
        return cpu_share_threads()[0]
    except Exception as exc:  # noqa: BLE001 - a server that cannot say must not fail a stage: hash as before, on one
        logger().warning("hashing on 1 thread: the host's share of cores is unknown (%s)", exc)
        return 1


class HashMemo:
    """sha256 of files by identity (size, mtime_ns, ctime_ns, inode, device), kept in a JSON file across processes: a
    stage folder's `.hashes.json` (names relative to the folder), runs_dir's `.input-hashes.json` (absolute paths).

    Any write to a file moves its ctime, so its memo entry no longer applies and it is hashed again, also when its
    size and mtime were put back. A copied runs_dir (cp -a, rsync -a) has new inodes and ctimes: its stage folders'
    memos no longer apply and each output is read once; a hard-linked copy (cp -al) shares the inodes, so the bytes
    too. What can still fool it: bytes changed beneath the filesystem (a write to the block device, or to a disk
    image that is then mounted again), a clock set back to the very nanosecond of a recorded ctime, and an NFS
    client's attribute cache, which can show another client's change up to its actimeo seconds late (the stage's own
    read then sees it and fails the run instead). Files on filesystems without a kernel-kept ctime (_UNTRUSTED_FS)
    are hashed on every run instead.
    """

    def __init__(self, folder: Path, store: Path | None = None) -> None:
        self.folder, self.store = folder, store or folder / HASH_MEMO
        self.entries, self.new = self._read(), {}

    def _read(self) -> dict[str, list[Any]]:
        try:
            entries = json.loads(self.store.read_text())
        except (OSError, ValueError):
            return {}
        return entries if isinstance(entries, dict) else {}

    def sha256_all(self, names: list[str], just_written: bool = False) -> dict[str, str]:
        """Each file's sha256: the memo's where the file's identity is unchanged, else read (in parallel);
        just_written: see _settled."""
        identities = {name: _identity(self.folder / name) for name in names}
        checked = _content_checked([self.folder / name for name in names])
        found = {name: str(entry[5]) for name, entry in ((n, self.entries.get(n)) for n in names)
                 if isinstance(entry, list) and len(entry) == 6 and entry[:5] == list(identities[name][1:])
                 and self.folder / name not in checked}
        read = _hash_files([self.folder / name for name in names if name not in found], just_written)
        for name in set(names) - set(found):
            found[name] = read[self.folder / name]
            # memoised here only where this process memoised it: the read settled under the identity seen above
            if _FILE_HASH_CACHE.get(identities[name]) == found[name] and self.folder / name not in checked:
                self.entries[name] = self.new[name] = [*identities[name][1:], found[name]]
        return found

    def save(self) -> None:
        """Add the entries hashed here to the file as it is now (another process may have added its own)."""
        if not self.new:
            return
        tmp = self.store.with_name(f".{self.store.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            self.store.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps({**self._read(), **self.new}))
            os.replace(tmp, self.store)
        except OSError:  # a read-only folder: verification still works, only slower next time
            tmp.unlink(missing_ok=True)
        self.new = {}
