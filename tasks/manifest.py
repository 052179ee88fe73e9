"""Stage folders, cache keys and manifest.json: the on-disk contract between stages.

A stage's output is `runs_dir/<stage>/<key>/`. The folder is done only when its manifest.json exists,
validates as a `Manifest` (with the metrics type of its stage), names the same key, lists every output
its stage must have (REQUIRED: a manifest cannot vouch for less), and every output file it lists has
the recorded size and sha256: the manifest is written last and atomically, so a crash at any moment
leaves either no manifest or a complete one, and damaged output (truncated, or bytes changed in
place) is caught. Hashes are memoised per file identity (path, size, mtime_ns, ctime_ns, inode, device) in this
process, in the stage folder's `.hashes.json` (outputs) and in runs_dir's `.input-hashes.json` (the base model's and
the data's files, read by the cache keys), so a reused stage or an unchanged input costs a stat per file, not a read.
Where the identity cannot vouch for the bytes (a filesystem whose ctime this kernel does not keep, a file changed
moments before it was read) the hash is not memoised across processes: the file is read again next time.
Files not in a memo are hashed in parallel, one file per thread, on the run's share of the host's cores; a flow
starts hashing the base model's files early (prefetch_sha256), and a key that needs them waits for that read.
Manifests are read and written here only; every other module reads them as typed objects.
"""

from __future__ import annotations

import contextvars
import fnmatch
import hashlib
import json
import os
import platform
import re
import shutil
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

from filelock import FileLock
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from tasks import disk
from tasks.errors import UserError
from tasks.log import current_run_attempt, logger

MANIFEST = "manifest.json"
_VERSIONED = ["torch", "transformers", "peft", "bitsandbytes", "prefect", "pyarrow"]
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
# The outputs each stage must have (fnmatch patterns, relative to the folder); a manifest lists them all.
REQUIRED: dict[str, tuple[str, ...]] = {
    "prepare_data": ("train.parquet", "eval.parquet"),
    "prepare_model": ("config.json", "modules.json", "*.safetensors"),
    "train_adapter": ("adapter/adapter_config.json", "adapter/adapter_model.safetensors", "loss.jsonl"),
    "evaluate_adapter": ("metrics.json", "samples.jsonl"),
    "export_adapter": ("adapter_config.json", "adapter_model.safetensors", "run_config.yaml", "README.md",
                       "published/version.json"),
}


PREFERENCE_FORMATS = ("preference", "unpaired_preference")  # prepare_data formats for train.method dpo / kto


class _Metrics(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DataMetrics(_Metrics):
    """prepare_data: the format chosen, what was dropped or cut, token-length percentiles."""

    format: str
    completion_only_loss: bool
    chat_template: str | None
    pack_examples: bool
    rows_in: int
    dropped_empty: int
    dropped_prompt_too_long: int
    truncated: int
    truncated_tokens: int
    rows_out: int
    train_examples: int
    eval_examples: int
    train_rows: int
    truncation_rate: float
    len_p50: int
    len_p90: int
    len_p99: int
    len_max: int
    len_min: int
    tokens: int
    train_label_tokens: int
    padding_waste: float
    # a source of several files is tokenized per file into parts reused by content (None: one file or the hub)
    parts_tokenized: int | None = None
    parts_reused: int | None = None
    # eval examples that are training examples too (tasks/prepare_data/overlap.py): 0 by construction for a split by
    # data.eval_fraction; None in manifests written before it was counted
    eval_overlap: int | None = None


class ModelMetrics(_Metrics):
    """prepare_model: what later stages need to load the 4-bit checkpoint as it was made."""

    memory_footprint_bytes: int
    compute_dtype: str
    device: str
    linear_4bit_layers: int
    attn_implementation: str


class TrainMetrics(_Metrics):
    """train_adapter: loss, steps, throughput and the micro-batches actually used."""

    real_tokens_per_s: float
    peak_gpu_allocated_gib: float | None = None
    train_loss: float
    optimizer_steps: int
    train_examples: int
    train_seconds: float | None
    trainable_parameters: int
    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    processes: int
    sharding: Literal["none", "ddp", "fsdp"]
    method: Literal["sft", "dpo", "kto"] = "sft"
    # on a GPU with packing: the memory plan (tasks/train_adapter/memory_plan.py MemoryPlan: tokens, recompute_layers,
    # recompute_mlp_layers, chunk_recomputed, offloads, predicted_peak_gib, budget_gib); compare predicted_peak_gib
    # with peak_gpu_allocated_gib
    memory_plan: dict[str, Any] | None = None
    # dpo/kto: TRL's loss on the real tokens only (speed.packing; tasks/train_adapter/padding_free.py), and for DPO
    # the micro-batches of whole pairs per epoch that packing made (None: TRL's batches of per_device pairs)
    padding_free: bool | None = None
    micro_batches_per_epoch: int | None = None
    tracking: dict[str, dict[str, str]] = {}  # the tracking runs this training reported into, by backend
    gpu_wait_seconds: float | None = None  # of the stage's seconds, waiting for the GPU slot (other runs' training)
    devices: list[str] | None = None  # the GPUs of the pool it trained on (CUDA_VISIBLE_DEVICES); None: no pool


class ChampionScores(_Metrics):
    """The export registry's champion scored on a run's eval data, on the same batches and prompts as the adapter
    (evaluate_adapter's score_champion; README: Nightly retraining); absent when there is none or it cannot be
    scored (another base model, damaged, an old record)."""

    judged_against: str | None = None  # the champion's version (champion_version is the export's: champion now)
    champion_adapter: str | None = None  # its identity: a hash of its adapter files' sha256, not a path
    champion_eval_loss: float | None = None
    champion_perplexity: float | None = None
    champion_exact_match: float | None = None
    champion_rouge_l: float | None = None
    champion_reward_accuracy: float | None = None
    champion_reward_margin: float | None = None
    champion_chosen_logps: float | None = None
    champion_rejected_logps: float | None = None
    champion_preference_accuracy: float | None = None


class EvalMetrics(ChampionScores):
    """evaluate_adapter: base vs tuned on the held-out split (the champion_* fields: manifests written before the
    champion was scored apart, by score_champion)."""

    base_eval_loss: float
    tuned_eval_loss: float
    base_perplexity: float
    tuned_perplexity: float
    eval_examples: int
    eval_tokens: int
    relative_improvement: float
    base_exact_match: float | None
    tuned_exact_match: float | None
    base_rouge_l: float | None
    tuned_rouge_l: float | None
    generation_samples: int
    max_new_tokens: int
    lm_eval: str | None = None
    # preference data (train.method dpo/kto; docs/preference.md). reward = log p(answer) - log p_base(answer),
    # summed over the answer's tokens; accuracy = share of held-out pairs with reward(chosen) > reward(rejected)
    # (ties count half, so the base model scores 0.5); margin = mean reward(chosen) - reward(rejected)
    eval_pairs: int | None = None
    base_reward_accuracy: float | None = None
    tuned_reward_accuracy: float | None = None
    base_reward_margin: float | None = None
    tuned_reward_margin: float | None = None
    base_chosen_logps: float | None = None
    tuned_chosen_logps: float | None = None
    base_rejected_logps: float | None = None
    tuned_rejected_logps: float | None = None
    base_preference_accuracy: float | None = None  # share with log p(chosen) > log p(rejected), no reference
    tuned_preference_accuracy: float | None = None
    # where the base model's results on this eval data are remembered (runs_dir/evaluate_adapter/.memo/<memo>), so
    # the champion's are looked up there without loading the model (score_champion); None: eval.parquet unhashed
    memo: str | None = None


class ExportMetrics(ChampionScores):
    """export_adapter: the registry verdict for the version this stage published, with the champion's scores the
    gate compared (champion_*)."""

    export_name: str
    export_version: str
    export_path: str  # relative to runs_dir (exports/<name>/vNNNN): the run summary names it under its own runs_dir
    promotion: str
    promotion_reason: str
    champion_version: str | None
    champion_tuned_eval_loss: float | None
    gate_rule: str | None = None  # first | same-data | cross-night | same-adapter | unlike (tasks/gate.py)


METRICS: dict[str, type[_Metrics]] = {"prepare_data": DataMetrics, "prepare_model": ModelMetrics,
                                      "train_adapter": TrainMetrics, "evaluate_adapter": EvalMetrics,
                                      "export_adapter": ExportMetrics}
StageName = Literal["prepare_data", "prepare_model", "train_adapter", "evaluate_adapter", "export_adapter"]


class Upstream(BaseModel):
    key: str
    dir: str


class Manifest(BaseModel):
    """manifest.json: what produced a stage folder, what it holds, and the stage's typed metrics."""

    model_config = ConfigDict(extra="forbid")

    stage: StageName
    key: str
    version: str
    params: dict[str, Any]  # the stage's config sections by name, e.g. {"model": {...}}
    upstream: dict[str, Upstream]
    fingerprint: dict[str, str]
    outputs: dict[str, int]  # file name relative to the folder -> size in bytes
    hashes: dict[str, str] = {}  # file name relative to the folder -> sha256 of its bytes
    metrics: DataMetrics | ModelMetrics | TrainMetrics | EvalMetrics | ExportMetrics
    versions: dict[str, str]
    run_attempt: str | None
    started_at: float
    seconds: float
    resumed_from_step: int | None = None

    @model_validator(mode="before")
    @classmethod
    def _metrics_of_stage(cls, data: Any) -> Any:
        """Parse metrics with its stage's type (a union alone would take the first type that fits)."""
        if isinstance(data, dict) and isinstance(data.get("metrics"), dict) and data.get("stage") in METRICS:
            data = {**data, "metrics": METRICS[data["stage"]].model_validate(data["metrics"])}
        return data


def hash_json(obj: Any) -> str:
    """sha256 of a canonical JSON dump (sorted keys)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def file_sha256(path: Path, runs_dir: Path | None = None) -> str:
    """Content hash of one file, memoised per identity (see _identity) within the process and, given runs_dir,
    across processes (runs_dir/.input-hashes.json)."""
    return files_sha256([path], runs_dir)[path]


def files_sha256(paths: Iterable[Path], runs_dir: Path | None = None) -> dict[Path, str]:
    """sha256 of each file's bytes, the files not memoised hashed in parallel; see file_sha256."""
    paths = list(paths)
    if runs_dir is None:
        return _hash_files(paths)
    memo = _HashMemo(Path("/"), Path(runs_dir).expanduser() / INPUT_HASH_MEMO)
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
    """Threads for hashing: the run's share of the host's cores (tasks/limits.py), at least 1."""
    from tasks.limits import cpu_share_threads  # lazily: limits reads the Prefect server where there is one

    try:
        return cpu_share_threads()[0]
    except Exception as exc:  # noqa: BLE001 - a server that cannot say must not fail a stage: hash as before, on one
        logger().warning("hashing on 1 thread: the host's share of cores is unknown (%s)", exc)
        return 1


def read_manifest(folder: Path) -> Manifest | None:
    """The folder's manifest if the stage finished there and its outputs are intact, else None."""
    return check_stage(folder)[0]


def check_stage(folder: Path) -> tuple[Manifest | None, str]:
    """(manifest, "") for a finished, intact stage folder; (None, why not) otherwise."""
    try:
        manifest = Manifest.model_validate_json((folder / MANIFEST).read_bytes())
    except FileNotFoundError:
        return None, f"no {MANIFEST}"
    except (OSError, ValidationError) as exc:
        return None, f"{MANIFEST} is unreadable ({type(exc).__name__})"
    if manifest.key != folder.name:
        return None, f"{MANIFEST} names key {manifest.key}"
    lacking = [p for p in REQUIRED[manifest.stage] if not fnmatch.filter(manifest.outputs, p)]
    if lacking:
        return None, f"{MANIFEST} does not list {', '.join(lacking)}"
    unhashed = sorted(set(manifest.outputs) - set(manifest.hashes))
    if unhashed:
        return None, f"{MANIFEST} records no content hash for {', '.join(unhashed)}"
    for name, size in manifest.outputs.items():
        out = folder / name
        if not out.is_file():
            return None, f"{name} is missing"
        if out.stat().st_size != size:
            return None, f"{name} has {out.stat().st_size} bytes, not the {size} recorded"
    memo = _HashMemo(folder)
    hashes = memo.sha256_all(list(manifest.outputs))
    memo.save()
    damaged = [name for name in manifest.outputs if hashes[name] != manifest.hashes[name]]
    if damaged:
        return None, f"{damaged[0]} is damaged (its sha256 differs from the one recorded)"
    return manifest, ""


class _HashMemo:
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


def check_runs_dir(runs_dir: Path) -> None:
    """Fail with the fix when runs_dir cannot hold stage folders: a file, or a folder this user cannot write."""
    path = Path(runs_dir).expanduser()
    probe = path / f".write-test-{os.getpid()}-{threading.get_ident()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        why = ("it, or a folder above it, is a file" if isinstance(exc, (FileExistsError, NotADirectoryError))
               else f"{exc.strerror or exc} ({type(exc).__name__})")
        raise UserError(
            f"runs_dir={str(runs_dir)!r} cannot be used: {why}. The pipeline writes stage folders, their locks and "
            "run records there, even when every stage is reused. Point runs_dir at a folder this user can write "
            "(--set runs_dir=PATH), or fix its permissions.") from None


def upstream_key(folder: Path | str) -> str:
    """The key of a finished upstream stage folder; fails if that stage is not done."""
    manifest = read_manifest(Path(folder))
    if manifest is None:
        raise RuntimeError(f"{folder} has no valid {MANIFEST}: its stage did not finish")
    return manifest.key


def versions() -> dict[str, str]:
    """Versions of Python and the libraries whose behaviour shapes a stage's output."""
    found = {"python": platform.python_version()}
    for name in _VERSIONED:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return found


@dataclass
class StageSpec:
    """What identifies one stage's output: the inputs of its cache key."""

    stage: str
    version: str
    runs_dir: Path
    params: dict[str, Any]
    upstream: dict[str, Path] = field(default_factory=dict)
    fingerprint: dict[str, str] = field(default_factory=dict)
    # dotted names of params that say where an input lies ("data.source"): recorded in the manifest, left out of
    # the key, whose fingerprint holds the input's content (two checkouts or mounts of the same data, one key)
    located: tuple[str, ...] = ()
    # dotted names of params that only pass or fail the stage (a threshold), never change what it writes: left out of
    # the key; the stage holds a reused folder to them again, and Prefect's cache key has them (tasks/caching.py), so
    # that a changed one runs that check
    checks: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # absolute, so a folder path stored in Prefect's result cache is valid from any working directory
        self.runs_dir = Path(self.runs_dir).expanduser().resolve()

    @property
    def key(self) -> str:
        upstream = {name: upstream_key(folder) for name, folder in self.upstream.items()}
        return hash_json([self.stage, self.version, _without(self.params, self.located + self.checks), upstream,
                          self.fingerprint])[:16]

    def checked(self) -> dict[str, Any]:
        """The values of the `checks` params, by dotted name."""
        values = {}
        for name in self.checks:
            node: Any = self.params
            for part in name.split("."):
                node = node.get(part) if isinstance(node, dict) else None
            values[name] = node
        return values

    @property
    def dir(self) -> Path:
        return Path(self.runs_dir) / self.stage / self.key


def _without(params: dict[str, Any], dotted: tuple[str, ...]) -> dict[str, Any]:
    """A copy of params less the entries named section.field."""
    kept = json.loads(json.dumps(params, default=str))
    for name in dotted:
        section, _, leaf = name.rpartition(".")
        node = kept
        for part in filter(None, section.split(".")):
            node = node.get(part, {}) if isinstance(node, dict) else {}
        if isinstance(node, dict):
            node.pop(leaf, None)
    return kept


@dataclass
class StageRun:
    """An open stage folder: the body writes outputs into `dir`, then calls `finish`."""

    spec: StageSpec
    dir: Path
    key: str
    done: bool
    started: float = field(default_factory=time.time)

    def finish(self, outputs: list[str], metrics: dict[str, Any], resumed_from_step: int | None = None) -> Manifest:
        """Write manifest.json last, atomically; `outputs` are file names relative to the folder."""
        lacking = [p for p in REQUIRED[self.spec.stage] if not fnmatch.filter(outputs, p)]
        if lacking:
            raise RuntimeError(f"{self.spec.stage}: outputs lack {', '.join(lacking)}, which the stage must write")
        memo = _HashMemo(self.dir)
        hashes = dict(sorted(memo.sha256_all(outputs, just_written=True).items()))
        memo.save()
        manifest = Manifest(
            stage=self.spec.stage, key=self.key, version=self.spec.version, params=self.spec.params,
            upstream={n: Upstream(key=upstream_key(f), dir=str(f)) for n, f in self.spec.upstream.items()},
            fingerprint=self.spec.fingerprint,
            outputs={name: (self.dir / name).stat().st_size for name in sorted(outputs)}, hashes=hashes,
            metrics=metrics, versions=versions(), run_attempt=current_run_attempt(), started_at=self.started,
            seconds=round(time.time() - self.started, 2), resumed_from_step=resumed_from_step,
        )
        # metrics as the stage reported them
        disk.write_whole(self.dir / MANIFEST, manifest.model_dump_json(indent=2, exclude_unset=True))
        self.done = True
        from tasks.artifacts import stage_summary  # lazily: artifacts needs prefect, this module does not

        stage_summary(manifest.model_dump(mode="json"))
        return manifest


@contextmanager
def open_stage(spec: StageSpec, keep: tuple[str, ...] = ()) -> Iterator[StageRun]:
    """Lock the stage folder; yield it done (reuse) or cleared for computing.

    The lock is an OS file lock (flock), so a process killed while holding it releases it: a stale
    lock never blocks. A second run needing the same key waits here and then reuses the result.
    `keep` names entries of a half-finished folder to keep (training checkpoints, for resume).
    """
    check_runs_dir(spec.runs_dir)
    key = spec.key
    folder = spec.dir
    folder.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(folder) + ".lock")
    try:
        lock.acquire(timeout=0)
    except TimeoutError:
        logger().info("%s %s: another run is computing it; waiting for its lock", spec.stage, key)
        lock.acquire()
    try:
        manifest, problem = check_stage(folder)
        if manifest is not None:
            logger().info("%s %s: reusing %s", spec.stage, key, folder)
            yield StageRun(spec, folder, key, done=True)
            return
        if (folder / MANIFEST).exists():
            logger().warning("%s %s: recomputing %s: %s", spec.stage, key, folder, problem)
        _clear(folder, keep)
        logger().info("%s %s: computing into %s", spec.stage, key, folder)
        run = StageRun(spec, folder, key, done=False)
        try:
            yield run
        except Exception as exc:
            if not disk.is_out_of_space(exc, folder):
                raise
            _clear(folder, keep)  # the partial outputs: free what they held
            raise disk.out_of_space(spec.stage, spec.runs_dir, folder) from exc
        if not run.done:
            raise RuntimeError(f"{spec.stage}: the stage body returned without calling finish()")
    finally:
        lock.release()


def _clear(folder: Path, keep: tuple[str, ...]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for entry in folder.iterdir():
        if entry.name in keep:
            continue
        if entry.is_dir():
            shutil.rmtree(entry)
        else:
            entry.unlink()
