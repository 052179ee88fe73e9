"""Stage folders: what a stage's key hashes (StageSpec), and the locked folder a stage body writes into (open_stage).

A stage's output is `runs_dir/<stage>/<key>/`, key = hash(stage name, stage code version, its config sections less
the settings that only say where an input lies or only pass or fail it, the upstream stages' keys, and the
fingerprint of the content it reads: tasks/hashing/keys.py cache_key). open_stage locks the folder (an OS file
lock), reuses it when its manifest vouches for it (tasks/on_disk/manifest.py check_stage), else clears it for the
stage body, which writes its outputs and calls finish: the manifest last, atomically.
"""

from __future__ import annotations

import fnmatch
import json
import os
import platform
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from filelock import FileLock

from tasks.errors import UserError
from tasks.hashing.files import HashMemo
from tasks.hashing.keys import cache_key
from tasks.log import current_run_attempt, logger
from tasks.on_disk import disk
from tasks.on_disk.manifest import MANIFEST, REQUIRED, Manifest, Upstream, check_stage, upstream_key
from tasks.on_disk.summary import stage_summary

_VERSIONED = ["torch", "transformers", "peft", "bitsandbytes", "prefect", "pyarrow"]


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
    # the key; the stage holds a reused folder to them again, and Prefect's cache key has them (caching.py), so
    # that a changed one runs that check
    checks: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # absolute, so a folder path stored in Prefect's result cache is valid from any working directory
        self.runs_dir = Path(self.runs_dir).expanduser().resolve()

    @property
    def key(self) -> str:
        upstream = {name: upstream_key(folder) for name, folder in self.upstream.items()}
        return cache_key([self.stage, self.version, _without(self.params, self.located + self.checks), upstream,
                          self.fingerprint])

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
        memo = HashMemo(self.dir)
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
        stage_summary(manifest.model_dump(mode="json"))
        return manifest


@contextmanager
def open_stage(spec: StageSpec, keep: tuple[str, ...] = (),
               tidy: Callable[[Path], object] | None = None) -> Iterator[StageRun]:
    """Lock the stage folder; yield it done (reuse) or cleared for computing.

    The lock is an OS file lock (flock), so a process killed while holding it releases it: a stale
    lock never blocks. A second run needing the same key waits here and then reuses the result.
    `keep` names entries of a half-finished folder to keep (training checkpoints, for resume); `tidy(folder)`
    removes what of those a full disk left half-written (train_adapter: a checkpoint without its marker), so that
    the disk-full paragraph's "partial outputs were removed" holds for them too.
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
            if tidy is not None:
                tidy(folder)
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
