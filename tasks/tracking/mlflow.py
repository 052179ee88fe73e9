"""MLflow backend: one MLflow run per pipeline result, training steps through transformers' MLflowCallback.

The run is created with MlflowClient (tags: the Prefect flow run, the train key, the parent run of a sweep)
and the callback logs into it. At the run's end the same run gets the config as params (`lora.r`, ...),
evaluate_adapter's metrics, the adapter folder and model card as artifacts (`adapter/`), the registry verdict
as tags, and a new name, `<export.name>-<version>`. With track.register_model, a version that is the
registry's champion becomes a version of the registered model with the alias `champion`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from tasks.config import TrackArgs
from tasks.tracking import PipelineRun, Ref

REQUIRES = "mlflow"
KEY_TAG = "qlora.export_key"  # the pipeline result a run holds (tasks/tracking: one run per result)
CHAMPION_ALIAS = "champion"


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
