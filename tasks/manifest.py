"""Stage folders, cache keys and manifest.json: the on-disk contract between stages.

A stage's output is `runs_dir/<stage>/<key>/`. The folder is done only when its manifest.json exists,
parses, names the same stage and key, and every output file it lists has the recorded size: the
manifest is written last and atomically, so a crash at any moment leaves either no manifest or a
complete one, and a truncated output file is caught by its size.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from filelock import FileLock

from tasks.log import logger

MANIFEST = "manifest.json"
_VERSIONED = ["torch", "transformers", "peft", "bitsandbytes", "prefect", "pyarrow"]
_FILE_HASH_CACHE: dict[tuple[str, int, int], str] = {}


def hash_json(obj: Any) -> str:
    """sha256 of a canonical JSON dump (sorted keys)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def file_sha256(path: Path) -> str:
    """Content hash of one file, memoised per (path, size, mtime) within the process."""
    st = path.stat()
    memo = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if memo not in _FILE_HASH_CACHE:
        h = hashlib.sha256()
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        _FILE_HASH_CACHE[memo] = h.hexdigest()
    return _FILE_HASH_CACHE[memo]


def files_fingerprint(paths: list[Path], root: Path | None = None) -> str:
    """One hash over the names (relative to root) and bytes of several files."""
    entries = sorted((str(p.relative_to(root)) if root else p.name, file_sha256(p)) for p in paths)
    return hash_json(entries)


def read_manifest(folder: Path) -> dict[str, Any] | None:
    """The folder's manifest if the stage finished there and its outputs are intact, else None."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("key") != folder.name:
        return None
    for name, size in manifest.get("outputs", {}).items():
        out = folder / name
        if not out.is_file() or out.stat().st_size != size:
            return None
    return manifest


def upstream_key(folder: Path | str) -> str:
    """The key of a finished upstream stage folder; fails if that stage is not done."""
    manifest = read_manifest(Path(folder))
    if manifest is None:
        raise RuntimeError(f"{folder} has no valid {MANIFEST}: its stage did not finish")
    return manifest["key"]


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

    def __post_init__(self) -> None:
        # absolute, so a folder path stored in Prefect's result cache is valid from any working directory
        self.runs_dir = Path(self.runs_dir).expanduser().resolve()

    @property
    def key(self) -> str:
        upstream = {name: upstream_key(folder) for name, folder in self.upstream.items()}
        return hash_json([self.stage, self.version, self.params, upstream, self.fingerprint])[:16]

    @property
    def dir(self) -> Path:
        return Path(self.runs_dir) / self.stage / self.key


@dataclass
class StageRun:
    """An open stage folder: the body writes outputs into `dir`, then calls `finish`."""

    spec: StageSpec
    dir: Path
    key: str
    done: bool
    started: float = field(default_factory=time.time)
    extra: dict[str, Any] = field(default_factory=dict)

    def finish(self, outputs: list[str], metrics: dict[str, Any] | None = None, **extra: Any) -> None:
        """Write manifest.json last, atomically; `outputs` are file names relative to the folder."""
        manifest = {
            "stage": self.spec.stage,
            "key": self.key,
            "version": self.spec.version,
            "params": self.spec.params,
            "upstream": {n: {"key": upstream_key(f), "dir": str(f)} for n, f in self.spec.upstream.items()},
            "fingerprint": self.spec.fingerprint,
            "outputs": {name: (self.dir / name).stat().st_size for name in sorted(outputs)},
            "metrics": metrics or {},
            "versions": versions(),
            "run_attempt": current_run_attempt(),
            "started_at": self.started,
            "seconds": round(time.time() - self.started, 2),
            **extra,
        }
        tmp = self.dir / f".{MANIFEST}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(manifest, indent=2, default=str))
        os.replace(tmp, self.dir / MANIFEST)
        self.done = True
        from tasks.artifacts import stage_summary  # imports this module

        stage_summary(manifest)


def current_run_attempt() -> str | None:
    """flow-run id and attempt number, so a summary can tell computed-now from reused."""
    try:
        from prefect.runtime import flow_run

        run_id = flow_run.id
    except Exception:  # outside any flow run (a stage called through .fn())
        return None
    return f"{run_id}:{flow_run.run_count}" if run_id else None


@contextmanager
def open_stage(spec: StageSpec, keep: tuple[str, ...] = ()) -> Iterator[StageRun]:
    """Lock the stage folder; yield it done (reuse) or cleared for computing.

    The lock is an OS file lock (flock), so a process killed while holding it releases it: a stale
    lock never blocks. A second run needing the same key waits here and then reuses the result.
    `keep` names entries of a half-finished folder to keep (training checkpoints, for resume).
    """
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
        if read_manifest(folder) is not None:
            logger().info("%s %s: reusing %s", spec.stage, key, folder)
            yield StageRun(spec, folder, key, done=True)
            return
        _clear(folder, keep)
        logger().info("%s %s: computing into %s", spec.stage, key, folder)
        run = StageRun(spec, folder, key, done=False)
        yield run
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
