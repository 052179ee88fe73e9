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

from pathlib import Path
from typing import Any

import yaml

from tasks.config import TrackArgs
from tasks.tracking import PipelineRun, Ref, SweepRun

REQUIRES = "tensorboard"
EVENTS = "events.out.tfevents.*"


def root(track: TrackArgs, runs_dir: Path) -> Path:
    """The TensorBoard log folder: track.tensorboard_dir, else runs_dir/tensorboard."""
    return Path(track.tensorboard_dir or Path(runs_dir) / "tensorboard").expanduser().resolve()


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
    if not any(folder.glob(EVENTS)):  # the training was not tracked: its logged steps from loss.jsonl
        with SummaryWriter(str(folder)) as writer:
            for entry in run.loss_log():
                for name, value in entry.items():
                    if name != "step":
                        writer.add_scalar(f"train/{name}", value, entry["step"])
    step = train.metrics.optimizer_steps
    with SummaryWriter(str(folder), filename_suffix=f".{run.key}") as writer:
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
    return {**where, "logged": "now"}


def open_sweep(track: TrackArgs, runs_dir: Path, key: str, tags: dict[str, str]) -> TrackArgs:
    """Nothing to open: the candidates log into their own folders, as any training does."""
    return track


def finish_sweep(track: TrackArgs, sweep: SweepRun) -> Ref:
    """Where the candidates' folders are (under the sweep's base runs_dir, as runs_dir/sweeps/<key>/ names it)."""
    return {"log_dir": str(root(track, sweep.dir.parent.parent)), "logged": "by the candidates' trainings"}
