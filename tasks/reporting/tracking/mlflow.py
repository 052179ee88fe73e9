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

Outages. `check` (before any stage) asks the server for the experiment, so a server that is down, is some other
HTTP server, refuses the credentials, or a garbage URI, fails the run then. Later, no send waits long:
- MLflow retries a request up to 7 times, up to 120 s apart, each waiting 120 s for an answer, and the end of a
  training waits for every step queued meanwhile; BOUNDED_REQUESTS makes one request cost seconds when the
  server is down (connection refused) and at most about (retries + 1) x timeout when it hangs.
- MLflowCallback queues one send per logged step; `_Bounded` lets at most MAX_IN_FLIGHT be on the way and none
  after one failed, so the training's end waits for those few only.
- `finish` sends whatever the run lacks of loss.jsonl (steps lost in an outage, or never sent), compared with the
  run's metric history, then the result; STEPS_TAG and KEY_TAG mark each as whole, so a later run with the
  server back (tracking/__init__.py: runs_dir/tracking-pending) completes a run that holds part of them, and a run that
  holds all costs one search. What cannot be sent is "not sent", with the reason, never a failed run.
Not sent again: the Trainer's own params (TrainingArguments, the model config) when the server was down as the
training began; the config params, which determine them, are.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from tasks import credentials
from tasks.config import TrackArgs
from tasks.errors import UserError
from tasks.hashing.keys import cache_key
from tasks.log import logger
from tasks.on_disk.manifest import read_manifest
from tasks.reporting.tracking import NOT_SENT, PipelineRun, Ref, SweepRun, confine

REQUIRES = "mlflow"
KEY_TAG = "qlora.export_key"  # the pipeline result a run holds (tracking/__init__.py: one run per result)
STEPS_TAG = "qlora.loss_steps"  # the number of loss.jsonl entries the run is known to hold every metric of
CHAMPION_ALIAS = "champion"
SWEEP_TAG = "qlora.sweep_key"  # the sweep a parent run holds: one run per sweep key
RANKING_TAG = "qlora.sweep_ranking"  # a hash of the ranking it holds: a re-run that ranks the same logs nothing
# MLflow reads these at every request; values set in the environment win (the defaults retry for minutes, which a
# rate-limited hosted server may need; here what is not sent waits on disk for a later run)
BOUNDED_REQUESTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                    "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}
MAX_IN_FLIGHT = 8  # a training's sends on the way at once: fewer than MLflow's 10 sending threads, so all run at once
METRICS_PER_BATCH = 1000  # MLflow's limit for one log_batch
# what a send raises when it did not reach the server or the server did not take it
_NOT_TAKEN = ("mlflow.exceptions.MlflowException", "requests.exceptions.RequestException", "builtins.OSError")


def check(track: TrackArgs, runs_dir: Path, roots: list[Path] | None) -> None:
    """Before any stage: the tracking URI holds no credentials, a local store lies where the run may write, and
    MLflow answers there (the experiment found or created, track.parent_run_id found)."""
    import mlflow

    _bound_requests()
    uri = track.mlflow_tracking_uri or mlflow.get_tracking_uri()
    field = ("track.mlflow_tracking_uri" if track.mlflow_tracking_uri else
             "MLflow's tracking URI (track.mlflow_tracking_uri is unset: the MLFLOW_TRACKING_URI environment variable, "
             "else MLflow's default)")
    if why := credentials.refusal(field, uri):
        raise UserError(why + ".")
    where = f"{field}={credentials.mask(uri)}"
    if (database := _sqlite_file(uri)) is not None:
        confine(database, f"{where} (a local MLflow store)", roots)
    try:
        client = mlflow.MlflowClient(uri)
        experiment = client.get_experiment(_experiment(client, track.experiment_name))
        if track.parent_run_id:
            client.get_run(track.parent_run_id)
    except Exception as exc:  # noqa: BLE001 - whatever MLflow raised, the run cannot be tracked there
        raise UserError(f"{where}: {_failure(exc, uri)}. Nothing has run yet. {_advice(exc, uri)}") from None
    if (artifacts := _local_path(experiment.artifact_location)) is not None:
        confine(artifacts, f"MLflow experiment {track.experiment_name!r} (its artifact location)", roots)


def _advice(exc: BaseException, uri: str) -> str:
    from mlflow.exceptions import RestException

    if isinstance(exc, RestException) and exc.error_code == "RESOURCE_DOES_NOT_EXIST":
        return "Check track.parent_run_id (a run id of that server), or leave it unset."
    if _status(exc) in (401, 403):
        return ("Set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) in the "
                "environment of the process that runs the flow.")
    return ("Start the tracking server or correct the URI (an MLflow server is http(s)://host:port; a local store "
            "sqlite:///path/mlflow.db), or set track.backend without mlflow to run untracked.")


def _bound_requests() -> None:
    """BOUNDED_REQUESTS, and the log without the lines each failed try would add (idempotent): urllib3's warning
    per retry, MLflow's error per queued send that failed; `_not_taken` says it once, with what happens next."""
    for name, value in BOUNDED_REQUESTS.items():
        os.environ.setdefault(name, value)
    for name in ("urllib3.connectionpool", "mlflow.utils.async_logging.async_logging_queue"):
        log = logging.getLogger(name)
        if not any(isinstance(f, _DropFailedTries) for f in log.filters):
            log.addFilter(_DropFailedTries())


class _DropFailedTries(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not ("Failed to log run data" in text or (text.startswith("Retrying") and "/mlflow" in text))


def open_run(track: TrackArgs, runs_dir: Path, name: str, tags: dict[str, str]) -> Ref | None:
    """Create the run a training reports into; None when the server does not take it (said in the log)."""
    client = _client(track)
    try:
        run = client.create_run(_experiment(client, track.experiment_name), run_name=name,
                                tags={**tags, **_parent(track)})
    except Exception as exc:
        _not_taken(exc, client.tracking_uri, "the training's run was not opened; the run's end opens one and sends "
                   "the training's steps from loss.jsonl")
        return None
    return {"run_id": run.info.run_id, "tracking_uri": client.tracking_uri}


def callbacks(ref: Ref) -> list[Any]:
    """transformers' MLflowCallback, logging into the run `ref` names, its sends bounded (`_Bounded`)."""
    _bound_requests()  # also in a torchrun rank, which reports from a process of its own
    return [_into_run(ref["tracking_uri"], ref["run_id"])]


def _into_run(tracking_uri: str, run_id: str) -> Any:
    from transformers.integrations import MLflowCallback

    class IntoRun(MLflowCallback):
        """MLflowCallback finds an active run in its thread and logs into it (params: TrainingArguments and
        the model config; metrics: every logged step); this makes that run the pipeline's, and ends it after.
        A server that does not answer costs the training no more than a bounded wait (`_Bounded`)."""

        def __init__(self) -> None:
            super().__init__()
            self._ml_flow = _Bounded(self._ml_flow, tracking_uri)

        def setup(self, args: Any, state: Any, model: Any) -> None:
            try:
                if state.is_world_process_zero:
                    self._ml_flow.set_tracking_uri(tracking_uri)  # MLflow's is per process (so is the callback's)
                    active = self._ml_flow.active_run()
                    if active is None or active.info.run_id != run_id:  # an out-of-memory retry finds it active
                        self._ml_flow.start_run(run_id=run_id)
                super().setup(args, state, model)
            except Exception as exc:
                self._ml_flow.stop(exc)  # the training goes on, sending nothing more
                self._initialized = True
            # on_train_end flushes the asynchronous metric queue and ends the run (one this setup started)
            self._auto_end_run = self._ml_flow.active_run() is not None

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            try:
                super().on_train_end(args, state, control, **kwargs)
            except Exception as exc:
                self._ml_flow.stop(exc)
            self._auto_end_run = False  # nothing left for __del__ to end (it would wait out the retries again)

    return IntoRun()


class _Bounded:
    """The mlflow module as MLflowCallback calls it, with its sends to the server bounded: at most MAX_IN_FLIGHT
    on the way at once, and none after one failed (each would wait out its retries, and the training's end waits
    for them all). A step not sent stays in loss.jsonl; `finish` sends what the run lacks."""

    def __init__(self, mlflow: Any, tracking_uri: str) -> None:
        self._mlflow, self._uri = mlflow, tracking_uri
        self._in_flight: list[Future] = []
        self.stopped = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._mlflow, name)

    def log_metrics(self, metrics: dict[str, float], step: int | None = None, **_kwargs: Any) -> None:
        self._send(self._mlflow.log_metrics, metrics, step=step)

    def log_params(self, params: dict[str, Any], **_kwargs: Any) -> None:
        self._send(self._mlflow.log_params, params)

    def stop(self, exc: BaseException) -> None:
        """Send nothing more; say so once (`exc`: what a send raised)."""
        if not self.stopped:
            self.stopped = True
            _not_taken(exc, self._uri, "this training sends it nothing more; the run's end sends what its run "
                       "lacks from loss.jsonl, or the next run does if the server is still down")

    def _send(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        self._in_flight = [future for future in self._in_flight if not self._settled(future)]
        if not self.stopped and len(self._in_flight) < MAX_IN_FLIGHT:  # else: left to finish, from loss.jsonl
            # MLflow's RunOperations keeps its futures to itself; they are what tells a failed send
            self._in_flight += call(*args, **kwargs, synchronous=False)._operation_futures

    def _settled(self, future: Future) -> bool:
        if not future.done():
            return False
        if future.exception() is not None:
            self.stop(future.exception())
        return True


def finish(track: TrackArgs, run: PipelineRun, ref: Ref | None) -> Ref:
    """Log the finished pipeline run into the run its training opened, or a new one, once per result, with the
    steps of loss.jsonl that run lacks; "not sent" (with the reason) when the server does not take it."""
    client = _client(track)
    try:
        return _finish(client, track, run, ref)
    except Exception as exc:
        reason = _not_taken(exc, client.tracking_uri, "the result was not sent")
        return {"tracking_uri": credentials.mask(client.tracking_uri), "logged": NOT_SENT, "reason": reason}


def _finish(client: Any, track: TrackArgs, run: PipelineRun, ref: Ref | None) -> Ref:
    experiment = _experiment(client, track.experiment_name)
    logged = client.search_runs([experiment], f"tags.`{KEY_TAG}` = '{run.key}'", max_results=1)
    if logged:  # every stage cached: this result is logged already (its steps too, unless an outage lost some)
        run_id = logged[0].info.run_id
        sent = _send_missing_steps(client, run_id, run, logged[0].data.tags)
    else:
        run_id = ref["run_id"] if ref and _unfinished(client, ref["run_id"]) else None
        if run_id is None:  # the training was tracked for another result, or not at all: a run of this result's own
            run_id = client.create_run(experiment, tags={"qlora.train_key": run.manifests["train_adapter"].key,
                                                         **_parent(track)}).info.run_id
        sent = _send_missing_steps(client, run_id, run, {})
        sent = sent if run_id == (ref or {}).get("run_id") else 0  # a new run gets them all: nothing was missing
        _log(client, run_id, run)
        client.update_run(run_id, status="FINISHED",
                          name=f"{run.metrics['export_name']}-{run.metrics['export_version']}")
    where = _where(client, run_id, experiment, reused=bool(logged), steps_sent=sent)
    if track.register_model:  # registered or not, the summary says which and why
        name = track.registered_model_name or run.config.export.name
        champion, version = run.metrics.get("champion_version"), run.metrics["export_version"]
        where["registered"] = (_register(client, run_id, name, run) if champion == version else
                               f"not registered in {name}: {version} is not the champion of the exports registry "
                               f"({run.metrics.get('promotion')}; the champion is {champion or 'none'}), and only the "
                               "champion is registered")
    return where


def _send_missing_steps(client: Any, run_id: str, run: PipelineRun, tags: dict[str, str]) -> int:
    """Send the loss.jsonl entries (by step, per metric) the run lacks: those the training's callback did not
    send (an outage, a full queue, a training not tracked); how many steps lacked something. Nothing is read
    when STEPS_TAG says the run holds them all."""
    from mlflow.entities import Metric

    entries = run.loss_log()
    if tags.get(STEPS_TAG) == str(len(entries)):
        return 0
    now, missing = int(time.time() * 1000), []
    for name in sorted({key for entry in entries for key in entry} - {"step"}):
        held = {metric.step for metric in client.get_metric_history(run_id, name)}
        missing += [Metric(name, float(entry[name]), now, entry["step"]) for entry in entries
                    if name in entry and entry["step"] not in held]
    for i in range(0, len(missing), METRICS_PER_BATCH):
        client.log_batch(run_id, metrics=missing[i:i + METRICS_PER_BATCH])
    client.set_tag(run_id, STEPS_TAG, str(len(entries)))  # after them: it says they are all there
    return len({metric.step for metric in missing})


def open_sweep(track: TrackArgs, runs_dir: Path, key: str, tags: dict[str, str]) -> TrackArgs:
    """The sweep's parent run, found by its key or created; the candidates' track section files them under it
    (unchanged when the server does not answer: the candidates are then not filed under it)."""
    client = _client(track)
    try:
        run_id = _sweep_run(client, track, key, tags)
    except Exception as exc:
        _not_taken(exc, client.tracking_uri, "the sweep's run was not opened; the candidates' runs are not its "
                   "children, and the sweep's end opens it")
        return track
    return track.model_copy(update={"parent_run_id": run_id})


def _sweep_run(client: Any, track: TrackArgs, key: str, tags: dict[str, str]) -> str:
    experiment = _experiment(client, track.experiment_name)
    found = client.search_runs([experiment], f"tags.`{SWEEP_TAG}` = '{key}'", max_results=1)
    if found:  # a re-run of the same sweep: its candidates (cached or not) belong to the same parent
        return found[0].info.run_id
    return client.create_run(experiment, run_name=f"sweep-{key}", tags={**tags, **_parent(track)}).info.run_id


def finish_sweep(track: TrackArgs, sweep: SweepRun) -> Ref:
    """The ranking into the parent run, each candidate's eval metrics and rank into its child run; once per
    ranking; "not sent" when the server does not take it (a re-run of the sweep sends it)."""
    client = _client(track)
    try:
        return _finish_sweep(client, track, sweep)
    except Exception as exc:
        reason = _not_taken(exc, client.tracking_uri, "the sweep's ranking was not sent; a re-run of the same "
                            "sweep sends it")
        return {"tracking_uri": credentials.mask(client.tracking_uri), "logged": NOT_SENT, "reason": reason}


def _finish_sweep(client: Any, track: TrackArgs, sweep: SweepRun) -> Ref:
    from mlflow.entities import Metric, RunTag

    run_id = track.parent_run_id or _sweep_run(client, track, sweep.key, {})
    parent = client.get_run(run_id)
    ranking = {k: v for k, v in sweep.record.items() if k != "flow_run"}  # what a re-run would log again
    digest = cache_key(ranking)
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
    return _where(client, run_id, parent.info.experiment_id, reused=logged, steps_sent=0)


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


def _register(client: Any, run_id: str, name: str, run: PipelineRun) -> str:
    """This run's adapter as a version of the registered model `name`, with the alias `champion`; what was done."""
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
    return f"registered as {name} version {version.version}, alias {CHAMPION_ALIAS}"


def _client(track: TrackArgs) -> Any:
    import mlflow

    _bound_requests()
    return mlflow.MlflowClient(track.mlflow_tracking_uri)


def _experiment(client: Any, name: str) -> str:
    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    # a local store keeps artifacts in ./mlruns of whatever the working directory is: beside its database instead
    database = _sqlite_file(client.tracking_uri)
    return client.create_experiment(name, artifact_location=(database.parent / "mlartifacts").as_uri()
                                    if database is not None else None)


def _sqlite_file(uri: str) -> Path | None:
    """The database file of a local SQLite store URI (sqlite:///relative.db, sqlite:////absolute.db), else None."""
    if not uri.startswith("sqlite:///"):
        return None
    name = unquote(uri[len("sqlite:///"):].split("?")[0])
    return Path(name).resolve() if name and name != ":memory:" else None


def _local_path(location: str | None) -> Path | None:
    """The local folder an artifact location names (file:///x, /x), else None (a server's or a bucket's)."""
    parts = urlsplit(location or "")
    if parts.scheme == "file":
        return Path(unquote(parts.path))
    return Path(location) if location and not parts.scheme else None


def _not_taken(exc: BaseException, uri: str, consequence: str) -> str:
    """Log that the server at `uri` did not take a send (re-raise what is no send failure: a bug); the reason."""
    if not any(cls.__module__ + "." + cls.__qualname__ in _NOT_TAKEN for cls in type(exc).__mro__):
        raise exc
    reason = _failure(exc, uri)
    logger().warning("tracking: MLflow at %s: %s; %s", credentials.mask(uri), reason, consequence)
    return reason


def _failure(exc: BaseException, uri: str) -> str:
    """What went wrong talking to MLflow at `uri`, in words (credentials masked)."""
    from mlflow.exceptions import MlflowException, RestException

    transport = _cause(exc, "requests.exceptions.RequestException")
    if transport is not None:
        return _transport_failure(transport)
    http, status = uri.startswith(("http://", "https://")), _status(exc)
    text = credentials.mask(str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)
    if status in (401, 403):
        return f"the server refused the credentials (HTTP {status})"
    if isinstance(exc, RestException) and http and "error_code" not in exc.json:  # JSON, but not MLflow's
        return f"a server answers there, but not as an MLflow tracking server (it answered {exc.json})"[:300]
    if isinstance(exc, RestException) or not isinstance(exc, MlflowException):
        return f"MLflow answered: {text[:300]}"
    if http:  # an MLflow server answers its API in JSON, errors included
        return "a server answers there, but not as an MLflow tracking server (its reply is not MLflow's JSON)"
    return f"MLflow cannot track into it: {text.split('. ')[0][:200]}"


def _transport_failure(exc: BaseException) -> str:
    names = {cls.__name__ for seen in _chain(exc) for cls in type(seen).__mro__}
    if "NameResolutionError" in names or "gaierror" in names:
        return "its host name does not resolve"
    if "ConnectionRefusedError" in names:
        return "nothing answers there (connection refused)"
    if names & {"Timeout", "TimeoutError", "ReadTimeoutError", "ConnectTimeoutError"}:
        return f"no answer within {os.environ.get('MLFLOW_HTTP_REQUEST_TIMEOUT', '120')} s"
    if "SSLError" in names:
        return "the TLS handshake failed"
    if "InvalidURL" in names or "InvalidSchema" in names or "MissingSchema" in names:
        return "it is not a URL a client can reach"
    return credentials.mask(str(exc))[:300]


def _status(exc: BaseException) -> int | None:
    from mlflow.exceptions import MlflowException

    return exc.get_http_status_code() if isinstance(exc, MlflowException) else None


def _cause(exc: BaseException, qualified: str) -> BaseException | None:
    """The first exception in exc's chain (itself, what it was raised from or during) of that class or a subclass."""
    for seen in _chain(exc):
        if any(f"{cls.__module__}.{cls.__qualname__}" == qualified for cls in type(seen).__mro__):
            return seen
    return None


def _chain(exc: BaseException) -> list[BaseException]:
    chain: list[BaseException] = []
    seen: BaseException | None = exc
    while seen is not None and seen not in chain:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    return chain


def _parent(track: TrackArgs) -> dict[str, str]:
    from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID

    return {MLFLOW_PARENT_RUN_ID: track.parent_run_id} if track.parent_run_id else {}


def _unfinished(client: Any, run_id: str) -> bool:
    """The run exists here and holds no pipeline result yet (its training's pipeline run is ending now, or an
    earlier one could not send the result)."""
    from mlflow.exceptions import MlflowException

    try:
        found = client.get_run(run_id)
    except MlflowException as exc:  # another tracking server, or deleted (a server that does not answer: raised)
        if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
        return False
    return KEY_TAG not in found.data.tags and found.info.lifecycle_stage == "active"


def _where(client: Any, run_id: str, experiment: str, reused: bool, steps_sent: int) -> Ref:
    uri = credentials.mask(client.tracking_uri)
    url = f"{uri.rstrip('/')}/#/experiments/{experiment}/runs/{run_id}" if uri.startswith("http") else ""
    return {"run_id": run_id, "tracking_uri": uri, "url": url, "logged": "by an earlier run" if reused else "now",
            **({"steps_sent": str(steps_sent)} if steps_sent else {})}


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"lora": {"r": 16}} -> {"lora.r": 16}: the config as --set names it."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
