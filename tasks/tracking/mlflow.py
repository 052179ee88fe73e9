"""MLflow backend: one MLflow run per pipeline result, training steps through transformers' MLflowCallback.

The run is created with MlflowClient (tags: the Prefect flow run, the train key, the parent run of a sweep)
and the callback logs into it. At the run's end the same run gets the config as params (`lora.r`, ...),
evaluate_adapter's metrics, the adapter folder and model card as artifacts (`adapter/`), the registry verdict
as tags, and a new name, `<export.name>-<version>`. With track.register_model, a version that is the
registry's champion becomes a version of the registered model with the alias `champion`.

A sweep is a parent run (`sweep-<key>`, tagged qlora.sweep_key), found again by that tag on a re-run; each
candidate's training run is its child. At the sweep's end it gets every candidate's metrics (`c1.tuned_eval_loss`,
...), its place in a tag (`qlora.candidate.c1`), the winner, sweep.json and comparison.png (`sweep/`); the
candidates' child runs get their own eval metrics and rank (the winner's, as any pipeline result, from `finish`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from tasks.config import TrackArgs
from tasks.manifest import hash_json, read_manifest
from tasks.tracking import PipelineRun, Ref, SweepRun

REQUIRES = "mlflow"
KEY_TAG = "qlora.export_key"  # the pipeline result a run holds (tasks/tracking: one run per result)
CHAMPION_ALIAS = "champion"
SWEEP_TAG = "qlora.sweep_key"  # the sweep a parent run holds: one run per sweep key
RANKING_TAG = "qlora.sweep_ranking"  # a hash of the ranking it holds: a re-run that ranks the same logs nothing


def open_run(track: TrackArgs, runs_dir: Path, name: str, tags: dict[str, str]) -> Ref:
    """Create the run a training reports into."""
    import mlflow

    client = mlflow.MlflowClient(track.mlflow_tracking_uri)
    run = client.create_run(_experiment(client, track.experiment_name), run_name=name,
                            tags={**tags, **_parent(track)})
    return {"run_id": run.info.run_id, "tracking_uri": client.tracking_uri}


def callbacks(ref: Ref) -> list[Any]:
    """transformers' MLflowCallback, logging into the run `ref` names."""
    return [_into_run(ref["tracking_uri"], ref["run_id"])]


def _into_run(tracking_uri: str, run_id: str) -> Any:
    from transformers.integrations import MLflowCallback

    class IntoRun(MLflowCallback):
        """MLflowCallback finds an active run in its thread and logs into it (params: TrainingArguments and
        the model config; metrics: every logged step); this makes that run the pipeline's, and ends it after."""

        def setup(self, args: Any, state: Any, model: Any) -> None:
            if state.is_world_process_zero:
                self._ml_flow.set_tracking_uri(tracking_uri)  # MLflow's is per process (so is the callback's)
                active = self._ml_flow.active_run()
                if active is None or active.info.run_id != run_id:  # an out-of-memory retry finds it active
                    self._ml_flow.start_run(run_id=run_id)
            super().setup(args, state, model)
            self._auto_end_run = True  # on_train_end flushes the asynchronous metric queue and ends the run

    return IntoRun()


def finish(track: TrackArgs, run: PipelineRun, ref: Ref | None) -> Ref:
    """Log the finished pipeline run into the run its training opened, or a new one; once per result."""
    import mlflow

    client = mlflow.MlflowClient(track.mlflow_tracking_uri)
    experiment = _experiment(client, track.experiment_name)
    logged = client.search_runs([experiment], f"tags.`{KEY_TAG}` = '{run.key}'", max_results=1)
    if logged:  # every stage cached: this result is logged already
        run_id = logged[0].info.run_id
    else:
        run_id = ref["run_id"] if ref and _unfinished(client, ref["run_id"]) else None
        if run_id is None:  # the training was tracked for another result, or not at all: a run of this result's own
            run_id = client.create_run(experiment, tags={"qlora.train_key": run.manifests["train_adapter"].key,
                                                         **_parent(track)}).info.run_id
            client.log_batch(run_id, metrics=_loss_history(run))
        _log(client, run_id, run)
        client.update_run(run_id, status="FINISHED",
                          name=f"{run.metrics['export_name']}-{run.metrics['export_version']}")
    if track.register_model and run.metrics.get("champion_version") == run.metrics["export_version"]:
        _register(client, run_id, track.registered_model_name or run.config.export.name, run)
    return _where(client, run_id, experiment, reused=bool(logged))


def open_sweep(track: TrackArgs, runs_dir: Path, key: str, tags: dict[str, str]) -> TrackArgs:
    """The sweep's parent run, found by its key or created; the candidates' track section files them under it."""
    import mlflow

    client = mlflow.MlflowClient(track.mlflow_tracking_uri)
    experiment = _experiment(client, track.experiment_name)
    found = client.search_runs([experiment], f"tags.`{SWEEP_TAG}` = '{key}'", max_results=1)
    if found:  # a re-run of the same sweep: its candidates (cached or not) belong to the same parent
        run_id = found[0].info.run_id
    else:
        run_id = client.create_run(experiment, run_name=f"sweep-{key}", tags={**tags, **_parent(track)}).info.run_id
    return track.model_copy(update={"parent_run_id": run_id})


def finish_sweep(track: TrackArgs, sweep: SweepRun) -> Ref:
    """The ranking into the parent run, each candidate's eval metrics and rank into its child run; once per
    ranking."""
    import mlflow
    from mlflow.entities import Metric, RunTag

    client = mlflow.MlflowClient(track.mlflow_tracking_uri)
    run_id = track.parent_run_id
    parent = client.get_run(run_id)
    ranking = {k: v for k, v in sweep.record.items() if k != "flow_run"}  # what a re-run would log again
    digest = hash_json(ranking)[:16]
    logged = parent.data.tags.get(RANKING_TAG) == digest
    if not logged:
        now, winner = int(time.time() * 1000), sweep.record["winner"]
        metrics, tags = [], {"qlora.sweep_winner": winner or "none"}
        for candidate in sweep.record["candidates"]:
            name, numbers = candidate["name"], _numbers(candidate["metrics"])
            metrics += [Metric(f"{name}.{k}", v, now, 0) for k, v in numbers.items()]
            place = f"rank {candidate['rank']}" if candidate["rank"] else candidate["status"]
            tags[f"qlora.candidate.{name}"] = f"{place}: {_label(candidate['overrides'])}"
            if name == winner:
                metrics += [Metric(f"winner.{k}", v, now, 0) for k, v in numbers.items()]
                tags["qlora.sweep_winner_overrides"] = _label(candidate["overrides"])
            _tag_child(client, run_id, candidate, numbers if name != winner else {}, now)
        client.log_batch(run_id, metrics=metrics, tags=[RunTag(k, v[:5000]) for k, v in tags.items()])
        for path in (sweep.dir / "sweep.json", sweep.dir / "comparison.png"):
            client.log_artifact(run_id, str(path), "sweep")
        client.update_run(run_id, status="FINISHED")
        client.set_tag(run_id, RANKING_TAG, digest)  # last: it marks the ranking as logged whole
    return _where(client, run_id, parent.info.experiment_id, reused=logged)


def _tag_child(client: Any, parent_id: str, candidate: dict[str, Any], numbers: dict[str, float], now: int) -> None:
    """The candidate's place (and eval metrics, when given) into the run its training opened, if that run is a
    child of this sweep's (a training cached from another run or sweep belongs to that one)."""
    from mlflow.entities import Metric, RunTag
    from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID

    made = read_manifest(Path(candidate["adapter_dir"])) if candidate["adapter_dir"] else None
    child_id = made.metrics.tracking.get("mlflow", {}).get("run_id") if made is not None else None
    if child_id is None or client.get_run(child_id).data.tags.get(MLFLOW_PARENT_RUN_ID) != parent_id:
        return
    tags = {"qlora.sweep_candidate": candidate["name"], "qlora.sweep_status": candidate["status"],
            **({"qlora.sweep_rank": str(candidate["rank"])} if candidate["rank"] else {})}
    client.log_batch(child_id, metrics=[Metric(k, v, now, 0) for k, v in numbers.items()],
                     tags=[RunTag(k, v) for k, v in tags.items()])


def _numbers(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def _label(overrides: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in overrides.items())


def _log(client: Any, run_id: str, run: PipelineRun) -> None:
    """Params, metrics, tags (the verdict and key last: the key marks the run as complete) and artifacts."""
    from mlflow.entities import Metric, Param, RunTag

    now, step = int(time.time() * 1000), run.manifests["train_adapter"].metrics.optimizer_steps
    params = [Param(k, str(v)) for k, v in _flat(run.config.model_dump(mode="json")).items()]
    numbers = {**run.metrics, **{f"train_adapter.{k}": v for k, v in run.manifests["train_adapter"].metrics
                                 .model_dump(exclude={"tracking"}).items()}}
    metrics = [Metric(k, float(v), now, step) for k, v in numbers.items()
               if isinstance(v, (int, float)) and not isinstance(v, bool)]
    words = {f"qlora.{k}": str(v) for k, v in run.metrics.items() if isinstance(v, str)}
    stages = {f"qlora.stage.{k}": v for k, v in run.statuses.items()}
    tags = {**run.flow_run, **words, **stages}
    for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
        client.log_batch(run_id, params=params[i:i + 100])
    client.log_batch(run_id, metrics=metrics, tags=[RunTag(k, v) for k, v in tags.items()])
    export = run.dirs["export_adapter"]
    for path in sorted(export.iterdir()):  # the adapter, tokenizer, model card (README.md), run_config.yaml
        if path.is_file() and not path.name.startswith(".") and path.name != "manifest.json":
            client.log_artifact(run_id, str(path), "adapter")
    for name in ("metrics.json", "samples.jsonl"):
        client.log_artifact(run_id, str(run.dirs["evaluate_adapter"] / name), "eval")
    client.set_tag(run_id, KEY_TAG, run.key)


def _register(client: Any, run_id: str, name: str, run: PipelineRun) -> None:
    """This run's adapter as a version of the registered model `name`, with the alias `champion`."""
    from mlflow.exceptions import MlflowException

    try:
        client.create_registered_model(name, description="QLoRA adapters published by qlora-pipeline; the "
                                       "exports registry (runs_dir/exports) is the source of truth.")
    except MlflowException as exc:
        if exc.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    # once per run: a cached re-run (or register_model turned on later) points the alias at the same version
    found = client.search_model_versions(f"name = '{name}' and run_id = '{run_id}'")
    version = found[0] if found else client.create_model_version(
        name, f"{client.get_run(run_id).info.artifact_uri}/adapter", run_id=run_id,
        tags={"qlora.export_version": run.metrics["export_version"], "qlora.export_path": run.metrics["export_path"]})
    client.set_registered_model_alias(name, CHAMPION_ALIAS, version.version)


def _loss_history(run: PipelineRun) -> list[Any]:
    """loss.jsonl as MLflow metrics (the names MLflowCallback gives them), for a run its training did not log."""
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    return [Metric(k, float(v), now, entry["step"]) for entry in run.loss_log()
            for k, v in entry.items() if k != "step"]


def _experiment(client: Any, name: str) -> str:
    found = client.get_experiment_by_name(name)
    return found.experiment_id if found is not None else client.create_experiment(name)


def _parent(track: TrackArgs) -> dict[str, str]:
    from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID

    return {MLFLOW_PARENT_RUN_ID: track.parent_run_id} if track.parent_run_id else {}


def _unfinished(client: Any, run_id: str) -> bool:
    """The run exists here and holds no pipeline result yet (its training's pipeline run is ending now)."""
    from mlflow.exceptions import MlflowException

    try:
        found = client.get_run(run_id)
    except MlflowException:  # another tracking server, or deleted
        return False
    return KEY_TAG not in found.data.tags and found.info.lifecycle_stage == "active"


def _where(client: Any, run_id: str, experiment: str, reused: bool) -> Ref:
    uri = client.tracking_uri
    url = f"{uri.rstrip('/')}/#/experiments/{experiment}/runs/{run_id}" if uri.startswith("http") else ""
    return {"run_id": run_id, "tracking_uri": uri, "url": url, "logged": "by an earlier run" if reused else "now"}


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"lora": {"r": 16}} -> {"lora.r": 16}: the config as --set names it."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
