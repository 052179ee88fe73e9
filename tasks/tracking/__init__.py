"""Experiment tracking: one small interface (`Backend`), one module per backend (tasks/tracking/<name>.py).

Two moments. While train_adapter computes, it opens each backend's run (`open_training`) and the Trainer
reports per-step metrics into it through transformers' own callbacks (MLflowCallback, TensorBoardCallback).
At the run's end, record_run calls `finish`: config as params, evaluate_adapter's metrics.json, the adapter
and model card as artifacts, the Prefect flow run and the registry verdict go into that same run.

Decisions:
- Tracking is in no stage's cache key (train_adapter takes the track section but its spec leaves it out):
  it changes where numbers are sent, not what any stage writes. The run ids a training opened are recorded
  in its manifest's metrics (`tracking`), so a later run's end finds them.
- One tracked run per pipeline result, identified by export_adapter's key (which hashes every upstream
  key). A re-run whose stages are all cached finds that run and logs nothing again: no duplicates, and
  run.json names the run. A run that reuses a training but evaluates or exports anew (other eval settings)
  gets a run of its own, tagged as reusing the training, with the per-step loss read from loss.jsonl.
- A sweep (flows/qlora_sweep.py) has a run of its own, once per sweep key: `open_sweep` before the candidates
  train returns the track section they train with (MLflow: track.parent_run_id set to the sweep's run, so each
  candidate's run is its child), `finish_sweep` logs the ranking into it. A re-run of the same sweep reuses it.

Backends are imported by name when used, so a run without tracking needs neither mlflow nor tensorboard.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from tasks.config import RunConfig, TrackArgs
from tasks.errors import UserError
from tasks.log import logger
from tasks.manifest import Manifest, read_manifest

REFS = ".tracking.json"  # in the train_adapter folder while it trains: the runs its Trainer callbacks report into

Ref = dict[str, str]  # what finds one backend's run: an MLflow run id and tracking URI, a TensorBoard folder


@dataclass(frozen=True)
class PipelineRun:
    """A finished pipeline run, as every backend logs it."""

    config: RunConfig
    manifests: dict[str, Manifest]  # by stage name
    dirs: dict[str, Path]  # stage folders, by stage name
    statuses: dict[str, str]  # computed | resumed | cached, by stage name
    metrics: dict[str, Any]  # evaluate_adapter's metrics.json, then the registry verdict (export_version, ...)
    flow_run: dict[str, str]  # Prefect's flow-run id and UI URL, where known

    @property
    def key(self) -> str:
        """What identifies this result: export_adapter's stage key, which hashes every upstream key."""
        return self.manifests["export_adapter"].key

    def loss_log(self) -> list[dict[str, Any]]:
        """train_adapter's loss.jsonl: one entry per logged optimizer step."""
        text = (self.dirs["train_adapter"] / "loss.jsonl").read_text()
        return [json.loads(line) for line in text.splitlines() if line.strip()]


@dataclass(frozen=True)
class SweepRun:
    """A ranked sweep, as every backend logs it."""

    key: str  # the sweep's key (tasks/sweep.py Plan.key): one tracked sweep run per key
    dir: Path  # runs_dir/sweeps/<key>: sweep.json, comparison.png
    record: dict[str, Any]  # sweep.json: every candidate (best first) with its status, rank and metrics; the winner


class Backend(Protocol):
    """A tracking backend: a module tasks/tracking/<name>.py with REQUIRES (the library it needs) and these five
    functions; its name is one of config.TRACKING_BACKENDS."""

    REQUIRES: str

    def open_run(self, track: TrackArgs, runs_dir: Path, name: str, tags: dict[str, str]) -> Ref:
        """Open the run a training reports into; what finds it again (JSON-able: torchrun's ranks read it)."""

    def callbacks(self, ref: Ref) -> list[Any]:
        """transformers TrainerCallbacks that report the training's logged steps into that run."""

    def finish(self, track: TrackArgs, run: PipelineRun, ref: Ref | None) -> Ref:
        """Log a finished pipeline run (into `ref`, the run its training opened, when there is one) once per
        result; where it is now."""

    def open_sweep(self, track: TrackArgs, runs_dir: Path, key: str, tags: dict[str, str]) -> TrackArgs:
        """Find or open the sweep's own run; the track section its candidates train with (filed under it)."""

    def finish_sweep(self, track: TrackArgs, sweep: SweepRun) -> Ref:
        """Log the ranked sweep into its run (`track`: what open_sweep returned), once per ranking; where it is."""


def backend(name: str) -> Backend:
    """The backend module of that name; a UserError when the library it needs is not installed."""
    module = importlib.import_module(f"tasks.tracking.{name}")
    if importlib.util.find_spec(module.REQUIRES) is None:
        raise UserError(f"track.backend names {name}, but {module.REQUIRES} is not installed. Install the tracking "
                        "extra (pip install -e \".[tracking]\"), or take it out of track.backend.")
    return module  # type: ignore[return-value]


def flow_run_tags() -> dict[str, str]:
    """The Prefect flow run this is (id, and its page in the UI where the UI's address is known); {} outside one."""
    try:
        from prefect.runtime import flow_run
        from prefect.settings import PREFECT_UI_URL

        run_id, ui = flow_run.id, PREFECT_UI_URL.value()
    except Exception:  # outside a flow run (a stage through .fn())
        return {}
    if not run_id:
        return {}
    # not flow_run.ui_url: it reads "None/flow-runs/..." when the UI's address is unknown (a temporary server)
    return {"prefect.flow_run_id": str(run_id), **({"prefect.flow_run_url": f"{ui}/flow-runs/flow-run/{run_id}"}
                                                     if ui else {})}


def open_training(track: TrackArgs | None, runs_dir: Path, train_dir: Path) -> dict[str, Ref]:
    """Open each backend's run for the training in train_dir, or keep those an interrupted training there opened
    (a resumed training goes on in the same run); written to train_dir/.tracking.json for `trainer_callbacks`."""
    wanted = track.backend if track else []
    refs = {name: ref for name, ref in read_refs(train_dir).items() if name in wanted}
    tags = {**flow_run_tags(), "qlora.train_key": train_dir.name}
    for name in wanted:
        if name not in refs:
            refs[name] = backend(name).open_run(track, runs_dir, f"train_adapter-{train_dir.name}", tags)
            logger().info("train_adapter: tracking into %s %s", name, refs[name])
    if refs:
        (train_dir / REFS).write_text(json.dumps(refs))
    else:  # tracking turned off since an interrupted training: its runs get no more steps
        (train_dir / REFS).unlink(missing_ok=True)
    return refs


def read_refs(train_dir: Path) -> dict[str, Ref]:
    """The runs a training in train_dir reports into, by backend; {} when it is not tracked."""
    path = train_dir / REFS
    return json.loads(path.read_text()) if path.is_file() else {}


def trainer_callbacks(train_dir: Path) -> list[Any]:
    """The Trainer callbacks for the runs open_training opened for train_dir (none when not tracked).

    The integrations' own callbacks, built here with their run and folder given, not through report_to and
    environment variables: several trainings can share a process (a sweep's candidates as mapped tasks)."""
    return [cb for name, ref in read_refs(train_dir).items() for cb in backend(name).callbacks(ref)]


def open_sweep(track: TrackArgs, runs_dir: Path, key: str) -> TrackArgs:
    """The track section a sweep's candidates train with: each backend's sweep run found or opened first."""
    tags = {**flow_run_tags(), "qlora.sweep_key": key}
    for name in track.backend:
        track = backend(name).open_sweep(track, runs_dir, key, tags)
    return track


def finish_sweep(track: TrackArgs, sweep: SweepRun) -> dict[str, Ref]:
    """Log the ranked sweep to every backend in `track` (open_sweep's); where each holds it."""
    done = {}
    for name in track.backend:
        done[name] = backend(name).finish_sweep(track, sweep)
        logger().info("tracking: sweep %s: %s %s", sweep.key, name, done[name])
    return done


def finish(config: RunConfig, stage_dirs: list[str], statuses: dict[str, str], verdict: dict[str, Any]
           ) -> dict[str, Ref]:
    """Log the finished run to every backend in config.track; where each holds it (for run.json).

    `verdict`: the run summary's metrics (eval metrics and the registry verdict); evaluate_adapter's
    metrics.json, whatever it holds, comes first."""
    manifests = {m.stage: m for m in (read_manifest(Path(d)) for d in stage_dirs) if m is not None}
    dirs = {m.stage: Path(d) for m, d in zip(manifests.values(), stage_dirs, strict=True)}
    metrics = {**json.loads((dirs["evaluate_adapter"] / "metrics.json").read_text()), **verdict}
    run = PipelineRun(config, manifests, dirs, statuses, metrics, flow_run_tags())
    opened: dict[str, Ref] = manifests["train_adapter"].metrics.tracking
    done = {}
    for name in config.track.backend:
        done[name] = backend(name).finish(config.track, run, opened.get(name))
        logger().info("tracking: %s %s", name, done[name])
    return done
