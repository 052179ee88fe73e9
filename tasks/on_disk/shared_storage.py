"""What several GPU hosts sharing one runs_dir need of its filesystem, checked as far as one host can check it.

Hosts that share a Prefect server share one runs_dir (NFS or similar) so that the cache, the registry and the
checkpoints are one. The pipeline relies on two things there: an OS file lock (flock, through filelock) on each stage
folder that every host sees (open_stage: a second host needing a stage another host is computing waits for it and
then reuses it, rather than computing it again into the same folder), and atomic renames within a folder (the
manifest, the registry's records and champion.json are written beside and renamed into place, so a reader on another
host sees the old file or the new one, never half of one). NFS v4, and v3 with its lock manager, give both; a mount
with `nolock` or `local_lock=flock|all` keeps locks on the host that took them, so two hosts could compute one stage
into one folder at once.

check_shared_storage writes, renames and locks a probe file, has a second process try the same lock, and reads the
mount's options from /proc/mounts. What one host cannot see: whether another host's lock reaches this one (its mount
options are checked on that host, by its own `setup`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from filelock import FileLock

from tasks.errors import UserError
from tasks.on_disk.folders import check_runs_dir

PROBE = ".qlora-storage-probe"
LOCAL_LOCKS = ("nolock", "local_lock=flock", "local_lock=all")  # NFS mount options that keep locks on one host
_TRY_LOCK = "import sys; from filelock import FileLock; FileLock(sys.argv[1]).acquire(timeout=0)"


def check_shared_storage(runs_dir: Path, mounts: str | None = None) -> tuple[list[str], list[str]]:
    """What was checked of runs_dir's filesystem, and every problem found (empty: the pipeline can share it).
    `mounts`: /proc/mounts' text (read here when None)."""
    try:
        check_runs_dir(runs_dir)
    except UserError as exc:
        return [], [str(exc)]
    root = Path(runs_dir).expanduser().resolve()
    checked, problems = [], []
    probe = root / f"{PROBE}-{os.uname().nodename}-{os.getpid()}"
    try:
        _rename(probe)
        checked.append("atomic rename")
        if _lock_is_exclusive(probe):
            checked.append("a file lock another process sees")
        else:
            problems.append(f"a file lock on {probe}.lock taken here was not seen by another process on this host: "
                            "the stage locks cannot keep two runs from computing one stage into one folder")
    except OSError as exc:
        problems.append(f"writing, renaming or locking a probe file in {root} failed: {exc}")
    finally:
        for path in (probe, probe.with_name(probe.name + ".tmp"), probe.with_name(probe.name + ".lock")):
            path.unlink(missing_ok=True)
    kind, options = mount_of(root, mounts if mounts is not None else _read_mounts())
    if kind.startswith("nfs") and (local := [o for o in options if o in LOCAL_LOCKS]):
        problems.append(f"runs_dir {root} is on NFS mounted with {', '.join(local)}: file locks stay on the host "
                        "that takes them, so two hosts could compute the same stage into the same folder at once. "
                        "Mount it without that option (NFS v4, or v3 with the lock manager running)")
    checked.append(f"filesystem {kind or 'unknown'}")
    return checked, problems


def _rename(probe: Path) -> None:
    """Write a probe beside its final name and rename it into place, as the manifest and the registry do."""
    staging = probe.with_name(probe.name + ".tmp")
    with staging.open("wb") as handle:
        handle.write(b"probe")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(staging, probe)
    if probe.read_bytes() != b"probe":
        raise OSError(f"{probe} does not hold what was renamed into place")


def _lock_is_exclusive(probe: Path) -> bool:
    """Hold the probe's lock and have another process try it: it must find it taken."""
    lock = FileLock(str(probe) + ".lock")
    with lock.acquire(timeout=10):
        other = subprocess.run([sys.executable, "-c", _TRY_LOCK, str(probe) + ".lock"], capture_output=True,
                               timeout=60)
    return other.returncode != 0


def _read_mounts() -> str:
    try:
        return Path("/proc/mounts").read_text()
    except OSError:  # not Linux: nothing to say about the mount
        return ""


def mount_of(path: Path, mounts: str) -> tuple[str, list[str]]:
    """The filesystem type and mount options of the mount that holds `path` (the longest mount point above it)."""
    best, found = -1, ("", [])
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        point = fields[1].replace("\\040", " ")
        if (str(path) == point or str(path).startswith(point.rstrip("/") + "/")) and len(point) > best:
            best, found = len(point), (fields[2], fields[3].split(","))
    return found
