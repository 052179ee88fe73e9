"""TensorBoard backend: one folder per trained adapter under track.tensorboard_dir (default runs_dir/tensorboard).

    <tensorboard_dir>/train_adapter-<train key>/
        events.out.tfevents.*          train/loss, train/learning_rate, ... per step (transformers' callback)
        events.out.tfevents.*.<key>    one per pipeline result (export key): eval/<metric>, the verdict, config

TensorBoard shows a folder's event files as one run, so eval metrics sit beside the loss curve; the
export key in the file name is how a cached re-run knows its result is logged already.

A sweep adds nothing of its own: TensorBoard has no parent runs, and its candidates' folders already sit side by
side in the log folder (one `train_adapter-<key>` each), where TensorBoard overlays their loss curves; the
ranking is the sweep's comparison artifact and runs_dir/sweeps/<key>/.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from tasks.config import TrackArgs
from tasks.on_disk import disk
from tasks.reporting.tracking import PipelineRun, Ref, SweepRun, confine

REQUIRES = "tensorboard"
EVENTS = "events.out.tfevents.*"


def root(track: TrackArgs, runs_dir: Path) -> Path:
    """The TensorBoard log folder: track.tensorboard_dir, else runs_dir/tensorboard."""
    return Path(track.tensorboard_dir or Path(runs_dir) / "tensorboard").expanduser().resolve()


def check(track: TrackArgs, runs_dir: Path, roots: list[Path] | None) -> None:
    """Before any stage: the log folder lies where the run may write (under runs_dir or the data's places, where the
    worker confines them: QLORA_DATA_ROOTS)."""
    confine(root(track, runs_dir), f"track.tensorboard_dir={track.tensorboard_dir}" if track.tensorboard_dir
            else "TensorBoard's folder (runs_dir/tensorboard)", roots)


def open_run(track: TrackArgs, runs_dir: Path, name: str, tags: dict[str, str]) -> Ref:
    """The folder a training's events go to (created by the callback's writer, on the main process only)."""
    return {"log_dir": str(root(track, runs_dir) / name)}


def callbacks(ref: Ref) -> list[Any]:
    """transformers' TensorBoardCallback, writing into the run's folder."""
    from transformers.integrations import TensorBoardCallback

    callback = TensorBoardCallback()
    callback.logging_dir = ref["log_dir"]  # given, not TENSORBOARD_LOGGING_DIR: trainings may share a process
    return [callback]


def finish(track: TrackArgs, run: PipelineRun, ref: Ref | None) -> Ref:
    """Write the result's eval metrics, verdict and config beside the training's events; once per result."""
    from torch.utils.tensorboard import SummaryWriter

    train = run.manifests["train_adapter"]
    folder = Path(ref["log_dir"]) if ref else root(track, run.config.runs_dir) / f"train_adapter-{train.key}"
    where = {"log_dir": str(folder)}
    if any(folder.glob(f"{EVENTS}.{run.key}")):
        return {**where, "logged": "by an earlier run"}
    with _whole(folder, run.config.runs_dir, run.key) as tmp:
        if not any(folder.glob(EVENTS)):  # the training was not tracked: its logged steps from loss.jsonl
            _backfill(tmp, run, SummaryWriter)
        _result(tmp, run, SummaryWriter)
    return {**where, "logged": "now"}


@contextmanager
def _whole(folder: Path, runs_dir: Path, key: str) -> Iterator[Path]:
    """A temporary folder beside `folder` to write event files into; moved into `folder` only when whole, the
    result's file (the `.<key>` one, which says "logged already") last, so a full disk leaves no half file there."""
    tmp = folder.parent / f".tmp-{folder.name}-{os.getpid()}"
    left = (f"the event files are written beside {folder} and moved in only when whole, the one named after the "
            "result, which says it is logged, last")
    try:
        with disk.writing("tracking (TensorBoard)", runs_dir, folder.parent, left, "the run's TensorBoard events"):
            tmp.mkdir(parents=True, exist_ok=True)
            yield tmp
            folder.mkdir(parents=True, exist_ok=True)
            for event in sorted(tmp.iterdir(), key=lambda p: p.name.endswith(f".{key}")):
                os.replace(event, folder / event.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _backfill(folder: Path, run: PipelineRun, writer_class: Any) -> None:
    """An untracked training's logged steps, from its loss.jsonl."""
    with writer_class(str(folder)) as writer:
        for entry in run.loss_log():
            for name, value in entry.items():
                if name != "step":
                    writer.add_scalar(f"train/{name}", value, entry["step"])


def _result(folder: Path, run: PipelineRun, writer_class: Any) -> None:
    """The result's eval metrics, verdict and config, at the training's last step."""
    step = run.manifests["train_adapter"].metrics.optimizer_steps
    with writer_class(str(folder), filename_suffix=f".{run.key}") as writer:
        for name, value in run.metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                writer.add_scalar(f"eval/{name}", value, step)
        m = run.metrics
        writer.add_text("qlora/verdict", f"{m['export_name']} {m['export_version']} {m['promotion']}: "
                        f"{m['promotion_reason']}", step)
        writer.add_text("qlora/stages", ", ".join(f"{k}: {v}" for k, v in run.statuses.items()), step)
        writer.add_text("qlora/config", "```\n" + yaml.safe_dump(run.config.model_dump(mode="json")) + "```", step)
        if run.flow_run:
            writer.add_text("qlora/flow_run", " ".join(run.flow_run.values()), step)


def open_sweep(track: TrackArgs, runs_dir: Path, key: str, tags: dict[str, str]) -> TrackArgs:
    """Nothing to open: the candidates log into their own folders, as any training does."""
    return track


def finish_sweep(track: TrackArgs, sweep: SweepRun) -> Ref:
    """Where the candidates' folders are (under the sweep's base runs_dir, as runs_dir/sweeps/<key>/ names it)."""
    return {"log_dir": str(root(track, sweep.dir.parent.parent)), "logged": "by the candidates' trainings"}
