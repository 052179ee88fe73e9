"""Stage folders, cache keys and manifest.json: the on-disk contract between stages.

A stage's output is `runs_dir/<stage>/<key>/`. The folder is done only when its manifest.json exists,
validates as a `Manifest` (with the metrics type of its stage), names the same key, and every output
file it lists has the recorded size: the manifest is written last and atomically, so a crash at any
moment leaves either no manifest or a complete one, and a truncated output file is caught by its size.
Manifests are read and written here only; every other module reads them as typed objects.
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
from typing import Any, Literal

from filelock import FileLock
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from tasks.log import current_run_attempt, logger

MANIFEST = "manifest.json"
_VERSIONED = ["torch", "transformers", "peft", "bitsandbytes", "prefect", "pyarrow"]
_FILE_HASH_CACHE: dict[tuple[str, int, int], str] = {}


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


class EvalMetrics(_Metrics):
    """evaluate_adapter: base vs tuned on the held-out split."""

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


class ExportMetrics(_Metrics):
    """export_adapter: the registry verdict for the version this stage published."""

    export_name: str
    export_version: str
    export_path: str
    promotion: str
    promotion_reason: str
    champion_version: str | None
    champion_tuned_eval_loss: float | None


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


def file_sha256(path: Path) -> str:
    """Content hash of one file, memoised per (path, size, mtime) within the process."""
    st = path.stat()
    memo = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if memo not in _FILE_HASH_CACHE:
        with path.open("rb") as f:
            _FILE_HASH_CACHE[memo] = hashlib.file_digest(f, "sha256").hexdigest()
    return _FILE_HASH_CACHE[memo]


def files_fingerprint(paths: list[Path], root: Path | None = None) -> str:
    """One hash over the names (relative to root) and bytes of several files."""
    entries = sorted((str(p.relative_to(root)) if root else p.name, file_sha256(p)) for p in paths)
    return hash_json(entries)


def read_manifest(folder: Path) -> Manifest | None:
    """The folder's manifest if the stage finished there and its outputs are intact, else None."""
    try:
        manifest = Manifest.model_validate_json((folder / MANIFEST).read_bytes())
    except (OSError, ValidationError):
        return None
    if manifest.key != folder.name:
        return None
    for name, size in manifest.outputs.items():
        out = folder / name
        if not out.is_file() or out.stat().st_size != size:
            return None
    return manifest


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

    def finish(self, outputs: list[str], metrics: dict[str, Any], resumed_from_step: int | None = None) -> Manifest:
        """Write manifest.json last, atomically; `outputs` are file names relative to the folder."""
        manifest = Manifest(
            stage=self.spec.stage, key=self.key, version=self.spec.version, params=self.spec.params,
            upstream={n: Upstream(key=upstream_key(f), dir=str(f)) for n, f in self.spec.upstream.items()},
            fingerprint=self.spec.fingerprint,
            outputs={name: (self.dir / name).stat().st_size for name in sorted(outputs)},
            metrics=metrics, versions=versions(), run_attempt=current_run_attempt(), started_at=self.started,
            seconds=round(time.time() - self.started, 2), resumed_from_step=resumed_from_step,
        )
        tmp = self.dir / f".{MANIFEST}.{os.getpid()}.tmp"
        tmp.write_text(manifest.model_dump_json(indent=2, exclude_unset=True))  # metrics as the stage reported them
        os.replace(tmp, self.dir / MANIFEST)
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
