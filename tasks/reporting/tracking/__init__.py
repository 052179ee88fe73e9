"""Experiment tracking: one small interface (`Backend`), one module per backend (tracking/<name>.py).

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
- Checked before any stage runs (`check`): a server that does not answer, is not the tracker, refuses the
  credentials, or a URI with credentials in it, is a UserError then, not a traceback after the training.
- A tracking server is not needed for the run to succeed once it started. An outage costs a bounded wait (each
  backend bounds its own sends) and loses nothing: the pipeline's files (loss.jsonl, the stage folders, run.json)
  are the source of truth, a backend's `finish` sends whatever its run lacks of them, and a result it could not
  send is remembered in runs_dir/tracking-pending/ and sent by the next run that reaches the same server.
- Every path tracking writes lies under runs_dir or the data's places when the worker confines them (its operator's
  QLORA_DATA_ROOTS, tasks/allowed.py): TensorBoard's folder, a local MLflow store and its artifacts.

Backends are imported by name when used, so a run without tracking needs neither mlflow nor tensorboard.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from tasks import allowed
from tasks.config import RunConfig, TrackArgs
from tasks.errors import UserError
from tasks.log import logger
from tasks.on_disk import disk
from tasks.on_disk.manifest import Manifest, read_manifest

REFS = ".tracking.json"  # in the train_adapter folder while it trains: the runs its Trainer callbacks report into
PENDING = "tracking-pending"  # runs_dir/tracking-pending/<backend>-<export key>.json: results a backend did not take
NOT_SENT = "not sent"  # a finish ref's "logged" when the backend could not take the result (its "reason" says why)

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

    key: str  # the sweep's key (tasks/sweep/grid.py Plan.key): one tracked sweep run per key
    dir: Path  # runs_dir/sweeps/<key>: sweep.json, comparison.png
    record: dict[str, Any]  # sweep.json: every candidate (best first) with its status, rank and metrics; the winner


class Backend(Protocol):
    """A tracking backend: a module tasks/reporting/tracking/<name>.py with REQUIRES (the library it needs) and these
    six functions; its name is one of config.TRACKING_BACKENDS."""

    REQUIRES: str

    def check(self, track: TrackArgs, runs_dir: Path, roots: list[Path] | None) -> None:
        """Before any stage: a UserError if this run cannot be tracked there (unreachable, not the tracker,
        credentials refused, a secret in a URI, or with `roots` set a path written outside them: `confine`)."""

    def open_run(self, track: TrackArgs, runs_dir: Path, name: str, tags: dict[str, str]) -> Ref | None:
        """Open the run a training reports into; what finds it again (JSON-able: torchrun's ranks read it). None
        when the backend cannot take it now (the training goes on; `finish` opens a run and sends its steps)."""

    def callbacks(self, ref: Ref) -> list[Any]:
        """transformers TrainerCallbacks that report the training's logged steps into that run, in bounded time."""

    def finish(self, track: TrackArgs, run: PipelineRun, ref: Ref | None) -> Ref:
        """Log a finished pipeline run (into `ref`, the run its training opened, when there is one) once per
        result, with whatever of loss.jsonl that run lacks; where it is now. In bounded time: a backend that
        cannot take it says so (`"logged": NOT_SENT`, with a "reason") instead of failing the run."""

    def open_sweep(self, track: TrackArgs, runs_dir: Path, key: str, tags: dict[str, str]) -> TrackArgs:
        """Find or open the sweep's own run; the track section its candidates train with (filed under it)."""

    def finish_sweep(self, track: TrackArgs, sweep: SweepRun) -> Ref:
        """Log the ranked sweep into its run (`track`: what open_sweep returned), once per ranking; where it is."""


def backend(name: str) -> Backend:
    """The backend module of that name; a UserError when the library it needs is not installed."""
    module = importlib.import_module(f"tasks.reporting.tracking.{name}")
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


def check(config: RunConfig) -> None:
    """Before any stage runs: every backend of config.track can take this run (a UserError saying what failed)."""
    # the data's places (the operator's QLORA_DATA_ROOTS, or an old config's narrower data.allowed_roots)
    data = config.data.allowed_roots if config.data.allowed_roots is not None else allowed.data_roots()
    roots = None if data is None else [Path(config.runs_dir).expanduser().resolve(), *(
        Path(root).expanduser().resolve() for root in data if "://" not in root)]
    for name in config.track.backend:
        backend(name).check(config.track, Path(config.runs_dir), roots)


def confine(path: Path, what: str, roots: list[Path] | None) -> None:
    """A UserError when `path` (links resolved) lies outside every one of `roots` (runs_dir and the data's places,
    where the worker confines them: QLORA_DATA_ROOTS); None: no confinement."""
    resolved = Path(path).expanduser().resolve()
    if roots is None or any(resolved.is_relative_to(root) for root in roots):
        return
    raise UserError(f"{what} writes to {resolved}, outside runs_dir and the data's places "
                    f"({', '.join(map(str, roots))}): where the worker confines what a run reads "
                    f"({allowed.DATA_ROOTS}), a run writes nowhere else. Put it under runs_dir, or ask whoever runs "
                    "the worker to allow its place.")


def open_training(track: TrackArgs | None, runs_dir: Path, train_dir: Path) -> dict[str, Ref]:
    """Open each backend's run for the training in train_dir, or keep those an interrupted training there opened
    (a resumed training goes on in the same run); written to train_dir/.tracking.json for `trainer_callbacks`."""
    wanted = track.backend if track else []
    refs = {name: ref for name, ref in read_refs(train_dir).items() if name in wanted}
    tags = {**flow_run_tags(), "qlora.train_key": train_dir.name}
    for name in wanted:
        if name not in refs and (ref := backend(name).open_run(track, runs_dir, f"train_adapter-{train_dir.name}",
                                                               tags)) is not None:
            refs[name] = ref
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
    """Log the finished run to every backend in config.track; where each holds it (for run.json). Then, into each
    backend that took it, the results earlier runs could not send there.

    `verdict`: the run summary's metrics (eval metrics and the registry verdict); evaluate_adapter's
    metrics.json, whatever it holds, comes first."""
    run = _pipeline_run(config, [Path(d) for d in stage_dirs], statuses, verdict, flow_run_tags())
    done = {}
    for name in config.track.backend:
        done[name] = _finish_one(name, config.track, run)
        if done[name]["logged"] != NOT_SENT:
            _send_pending(name, Path(config.runs_dir), done[name])
    return done


def _pipeline_run(config: RunConfig, stage_dirs: list[Path], statuses: dict[str, str], verdict: dict[str, Any],
                  flow_run: dict[str, str]) -> PipelineRun:
    manifests = {m.stage: m for m in (read_manifest(d) for d in stage_dirs) if m is not None}
    dirs = {m.stage: d for m, d in zip(manifests.values(), stage_dirs, strict=True)}
    metrics = {**json.loads((dirs["evaluate_adapter"] / "metrics.json").read_text()), **verdict}
    return PipelineRun(config, manifests, dirs, statuses, metrics, flow_run)


def _finish_one(name: str, track: TrackArgs, run: PipelineRun) -> Ref:
    opened = run.manifests["train_adapter"].metrics.tracking.get(name)
    if opened is not None and _claimed(Path(run.config.runs_dir), name, run):
        opened = None  # the training's run belongs to its first result, which waits to be sent: this one gets its own
    ref = backend(name).finish(track, run, opened)
    if ref["logged"] == NOT_SENT:
        logger().warning("tracking: %s could not take this result (%s); the pipeline's files keep it, and the "
                         "next run that reaches it sends it (%s)", name, ref["reason"], PENDING)
    else:
        logger().info("tracking: %s %s", name, ref)
        _pending_file(Path(run.config.runs_dir), name, run.key).unlink(missing_ok=True)
    return ref


def remember_unsent(runs_dir: Path, summary: dict[str, Any], flow_run: dict[str, str]) -> None:
    """For each backend that could not take a run's result (`summary`: record_run's, after its run.json is
    written), a note in runs_dir/PENDING naming the run folder, so that a later run sends it (`_send_pending`)."""
    stages, run_dir = summary["stages"], Path(summary["run_dir"])
    for name, ref in summary.get("tracking", {}).items():
        if ref["logged"] == NOT_SENT:
            note = {"run": str(run_dir.relative_to(Path(runs_dir).resolve())), "target": _target(ref),
                    "train_key": stages["train_adapter"]["key"], "reason": ref["reason"],
                    "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "flow_run": flow_run}
            path = _pending_file(runs_dir, name, stages["export_adapter"]["key"])
            with disk.writing("tracking (the note of an unsent result)", runs_dir, path.parent,
                              "no note: the result stays unsent until a run of the same config"):
                path.parent.mkdir(parents=True, exist_ok=True)
                disk.write_whole(path, json.dumps(note, indent=2))


def _send_pending(name: str, runs_dir: Path, reached: Ref) -> None:
    """The results that earlier runs could not send to the place `reached` (a backend that just took this run's),
    sent now from their run folders; a note stays while its result is not sent (the first failure ends the round:
    one bounded wait per run)."""
    for path in sorted((Path(runs_dir) / PENDING).glob(f"{name}-*.json")):
        note = json.loads(path.read_text())
        if note["target"] != _target(reached):
            continue  # another server: sent by a run tracked there
        try:
            run = _unsent_run(Path(runs_dir), note)
        except (OSError, ValueError, KeyError) as exc:  # its folders or run.json are gone or from another version
            logger().warning("tracking: %s: the result in %s cannot be sent any more (%s); note removed", name,
                             note["run"], exc)
            path.unlink()
            continue
        try:
            ref = backend(name).finish(run.config.track, run, run.manifests["train_adapter"].metrics.tracking.get(name))
        except Exception as exc:  # noqa: BLE001 - an earlier run's record must not fail this run; the note stays
            logger().warning("tracking: %s: the result in %s was not sent: %r (the note %s stays)", name,
                             note["run"], exc, path)
            continue
        if ref["logged"] == NOT_SENT:
            return
        logger().info("tracking: %s: sent the result of %s, unsent since %s: %s", name, note["run"], note["since"], ref)
        path.unlink()


def _unsent_run(runs_dir: Path, note: dict[str, Any]) -> PipelineRun:
    """The PipelineRun of an earlier run, from its run.json and stage folders (found under this runs_dir by key)."""
    record = json.loads((runs_dir / note["run"] / "run.json").read_text())
    config = RunConfig.model_validate(record["config"]).model_copy(update={"runs_dir": runs_dir})
    stages = record["stages"]
    dirs = [runs_dir / stage / info["key"] for stage, info in stages.items()]
    return _pipeline_run(config, dirs, {stage: info["status"] for stage, info in stages.items()}, record["metrics"],
                         note["flow_run"])


def _claimed(runs_dir: Path, name: str, run: PipelineRun) -> bool:
    """Whether an earlier result of the same training waits to be sent to backend `name` (it takes the training's
    run when it is sent: a training's run holds its first result)."""
    train_key, own = run.manifests["train_adapter"].key, _pending_file(runs_dir, name, run.key)
    notes = [path for path in (Path(runs_dir) / PENDING).glob(f"{name}-*.json") if path != own]
    return any(json.loads(path.read_text()).get("train_key") == train_key for path in notes)


def _pending_file(runs_dir: Path, name: str, key: str) -> Path:
    return Path(runs_dir) / PENDING / f"{name}-{key}.json"


def _target(ref: Ref) -> str:
    """Where a backend's ref points: the MLflow tracking URI, the TensorBoard folder."""
    return ref.get("tracking_uri") or ref.get("log_dir") or ""
