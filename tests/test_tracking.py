"""Experiment tracking (README: Experiment tracking) against a real local MLflow server, read back with MLflow's
client, and TensorBoard event files read back with TensorBoard's own reader."""

from __future__ import annotations

import http.server
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError

from tasks.config import PROJECT_ROOT, load_config
from tasks.on_disk.manifest import read_manifest
from tests.conftest import cli, cli_env, finish, run_flow, small_overrides, statuses


class MlflowServer:
    """`mlflow server` with a SQLite store and a local artifact root on a free localhost port; a test may kill it
    (SIGKILL, as a crash) and start it again on the same port and store."""

    def __init__(self, root: Path) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self.root, self.uri, self.proc = root, f"http://127.0.0.1:{port}", None
        self.command = [str(Path(sys.executable).parent / "mlflow"), "server", "--backend-store-uri",
                        f"sqlite:///{root / 'mlflow.db'}", "--artifacts-destination", str(root / "artifacts"),
                        "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]

    def start(self) -> None:
        log = self.root / "server.log"
        # its own session, so the stop reaches the workers uvicorn starts
        self.proc = subprocess.Popen(self.command, stdout=log.open("a"), stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.time() + 400  # about a minute on a busy 2-core machine
        while not _healthy(self.uri):
            if self.proc.poll() is not None or time.time() > deadline:
                self.stop()
                raise AssertionError("mlflow server did not start:\n" + log.read_text()[-3000:])
            time.sleep(1)

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=5)  # its store is a temporary folder: nothing to lose by a kill after that
        except subprocess.TimeoutExpired:
            self.kill()


@pytest.fixture(scope="module")
def mlflow_control(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    """The module's MLflow server, for tests that stop and start it (they leave it running)."""
    server = MlflowServer(tmp_path_factory.mktemp("mlflow"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def mlflow_server(mlflow_control: MlflowServer) -> str:
    return mlflow_control.uri


def _healthy(uri: str) -> bool:
    try:
        with urllib.request.urlopen(f"{uri}/health", timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


def test_backend_takes_a_name_or_a_list_and_registering_needs_mlflow() -> None:
    assert load_config(None, ["track.backend=mlflow"]).track.backend == ["mlflow"]
    assert load_config(None, ["track.backend=none"]).track.backend == []
    assert load_config(None, ["track.backend=[mlflow, tensorboard]"]).track.backend == ["mlflow", "tensorboard"]
    with pytest.raises(ValidationError, match="add mlflow to track.backend"):
        load_config(None, ["track.backend=tensorboard", "track.register_model=true"])


def test_a_resumed_training_reports_into_the_runs_it_opened(tmp_path: Path) -> None:
    from tasks.config import TrackArgs
    from tasks.reporting import tracking

    train_dir = tmp_path / "train_adapter" / "0123456789abcdef"
    train_dir.mkdir(parents=True)
    track = TrackArgs(backend=["tensorboard"])
    opened = tracking.open_training(track, tmp_path, train_dir)
    folder = str(tmp_path.resolve() / "tensorboard" / "train_adapter-0123456789abcdef")
    assert opened == {"tensorboard": {"log_dir": folder}}
    assert tracking.open_training(track, tmp_path, train_dir) == opened  # resumed: the same runs
    [callback] = tracking.trainer_callbacks(train_dir)
    assert type(callback).__name__ == "TensorBoardCallback" and callback.logging_dir == folder
    assert tracking.open_training(TrackArgs(), tmp_path, train_dir) == {}  # turned off: no more reporting
    assert tracking.trainer_callbacks(train_dir) == [] and not (train_dir / tracking.REFS).exists()


@pytest.mark.slow
def test_one_tracked_run_per_result_in_mlflow_and_tensorboard(mlflow_server: str, prefect_env: Path,
                                                             small_data: Path, tmp_path: Path) -> None:
    from mlflow import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs, tb = tmp_path / "runs", tmp_path / "tb"
    track = {"track.backend": "[mlflow, tensorboard]", "track.mlflow_tracking_uri": mlflow_server,
             "track.experiment_name": "pipeline", "track.tensorboard_dir": str(tb)}
    first = run_flow(small_overrides(small_data, runs, **track, **{"track.register_model": "true"}))
    client = MlflowClient(mlflow_server)
    run_id = first["tracking"]["mlflow"]["run_id"]
    run = client.get_run(run_id)
    train = read_manifest(Path(first["stages"]["train_adapter"]["dir"]))
    metrics = json.loads((Path(first["stages"]["evaluate_adapter"]["dir"]) / "metrics.json").read_text())

    # per-step loss through transformers' MLflowCallback, into the run the stage opened
    assert train.metrics.tracking["mlflow"]["run_id"] == run_id
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == [1, 2, 3, 4, 5, 6]
    assert run.data.params["lora.r"] == "16" and run.data.params["train.max_steps"] == "6"
    assert run.data.params["max_steps"] == "6"  # the TrainingArguments, as the callback logs them
    assert run.data.metrics["tuned_eval_loss"] == pytest.approx(metrics["tuned_eval_loss"])
    assert run.data.metrics["base_eval_loss"] == pytest.approx(metrics["base_eval_loss"])
    tags = run.data.tags
    flow_run_id = train.run_attempt.split(":")[0]
    assert tags["prefect.flow_run_id"] == flow_run_id and tags["qlora.train_key"] == train.key
    assert tags["prefect.flow_run_url"].endswith(f"/flow-runs/flow-run/{flow_run_id}")
    assert tags["qlora.promotion"] == "promoted" and tags["qlora.export_version"] == "v0001"
    assert tags["qlora.stage.train_adapter"] == "computed" and run.info.run_name == "adapter-v0001"
    artifacts = {f.path for f in client.list_artifacts(run_id, "adapter")}
    assert {"adapter/adapter_model.safetensors", "adapter/adapter_config.json", "adapter/README.md"} <= artifacts
    champion = client.get_model_version_by_alias("adapter", "champion")
    assert champion.run_id == run_id and champion.tags["qlora.export_version"] == "v0001"
    assert first["tracking"]["mlflow"]["registered"] == "registered as adapter version 1, alias champion"

    events = EventAccumulator(str(tb / f"train_adapter-{train.key}"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4, 5, 6]
    assert events.Scalars("eval/tuned_eval_loss")[0].value == pytest.approx(metrics["tuned_eval_loss"])

    # the same result again, tracking settings changed: every stage cached, no second run, the same model version
    again = run_flow(small_overrides(small_data, runs, **track, **{"track.register_model": "true",
                                                                   "track.registered_model_name": "bot"}))
    assert set(statuses(again).values()) == {"cached"}
    assert again["tracking"]["mlflow"]["run_id"] == run_id
    assert again["tracking"]["mlflow"]["logged"] == again["tracking"]["tensorboard"]["logged"] == "by an earlier run"
    experiment = client.get_experiment_by_name("pipeline").experiment_id
    assert len(client.search_runs([experiment])) == 1
    assert client.get_model_version_by_alias("bot", "champion").run_id == run_id  # registered later, once
    assert len(client.search_model_versions("name = 'adapter'")) == 1

    # another result of the same training, as a child run of a sweep's: its own run, the loss from loss.jsonl
    parent = client.create_run(experiment, run_name="sweep").info.run_id
    child = run_flow(small_overrides(small_data, runs, **track, **{"eval.max_samples": 8,
                                                                   "track.parent_run_id": parent}))
    assert statuses(child)["train_adapter"] == "cached" and statuses(child)["evaluate_adapter"] == "computed"
    child_id = child["tracking"]["mlflow"]["run_id"]
    assert child_id != run_id
    child_run = client.get_run(child_id)
    assert child_run.data.tags["mlflow.parentRunId"] == parent
    assert child_run.data.tags["qlora.stage.train_adapter"] == "cached"
    assert [m.step for m in client.get_metric_history(child_id, "loss")] == [1, 2, 3, 4, 5, 6]
    events.Reload()  # the training's folder: the second result's eval metrics beside the first's
    assert len(events.Scalars("eval/tuned_eval_loss")) == 2

    # a version the gate rejects is not registered, and the summary says why (it said nothing)
    rejected = run_flow(small_overrides(small_data, runs, **track, **{
        "track.register_model": "true", "train.max_steps": 5, "export.promotion_margin": 0.99}))
    assert rejected["metrics"]["promotion"] == "rejected"
    assert rejected["tracking"]["mlflow"]["registered"].startswith(
        "not registered in adapter: v0002 is not the champion of the exports registry (rejected; the champion is "
        "v0001), and only the champion is registered"), rejected["tracking"]
    assert len(client.search_model_versions("name = 'adapter'")) == 1


@pytest.mark.slow
def test_a_sweep_is_a_parent_run_with_its_candidates_as_children(mlflow_server: str, prefect_env: Path,
                                                                  small_data: Path, tmp_path: Path) -> None:
    from mlflow import MlflowClient

    from flows.qlora_sweep import qlora_sweep
    from tasks.reporting.tracking.mlflow import RANKING_TAG, SWEEP_TAG

    base = load_config(None, small_overrides(small_data, tmp_path / "runs", **{
        "train.max_steps": 3, "eval.generation_samples": 2, "track.backend": "mlflow",
        "track.mlflow_tracking_uri": mlflow_server, "track.experiment_name": "sweeps"}))
    grid = {"lora.r": [4, 8]}
    state = qlora_sweep(config=base, grid=grid, return_state=True)
    assert state.is_completed(), state.message
    summary = state.result()
    client = MlflowClient(mlflow_server)
    experiment = client.get_experiment_by_name("sweeps").experiment_id
    (parent,) = client.search_runs([experiment], f"tags.`{SWEEP_TAG}` = '{summary['key']}'")
    parent_id = parent.info.run_id
    assert parent.info.run_name == f"sweep-{summary['key']}" and parent.info.status == "FINISHED"
    assert parent.data.tags["prefect.flow_run_id"] == str(state.state_details.flow_run_id)
    assert parent.data.tags["qlora.sweep_winner"] == summary["winner"]
    by_name = {c["name"]: c for c in summary["candidates"]}
    for name, candidate in by_name.items():
        assert parent.data.metrics[f"{name}.tuned_eval_loss"] == pytest.approx(candidate["metrics"]["tuned_eval_loss"])
        assert parent.data.tags[f"qlora.candidate.{name}"].startswith(f"rank {candidate['rank']}: lora.r=")
    assert {f.path for f in client.list_artifacts(parent_id, "sweep")} == {"sweep/sweep.json",
                                                                          "sweep/comparison.png"}

    # every candidate's training is a child run, with its per-step loss; the winner's holds the published result
    children = client.search_runs([experiment], f"tags.`mlflow.parentRunId` = '{parent_id}'")
    assert len(children) == 2 and len(client.search_runs([experiment])) == 3
    trained = {c["name"]: read_manifest(Path(c["adapter_dir"])).metrics.tracking["mlflow"]["run_id"]
               for c in summary["candidates"]}
    assert {r.info.run_id for r in children} == set(trained.values())
    for name, run_id in trained.items():
        child = client.get_run(run_id)
        assert child.data.tags["qlora.sweep_candidate"] == name
        assert child.data.tags["qlora.sweep_rank"] == str(by_name[name]["rank"])
        assert [m.step for m in client.get_metric_history(run_id, "loss")] == [1, 2, 3]
        assert child.data.metrics["tuned_eval_loss"] == pytest.approx(by_name[name]["metrics"]["tuned_eval_loss"])
    winner = client.get_run(trained[summary["winner"]])
    assert winner.data.tags["qlora.export_version"] == "v0001" and winner.data.params["lora.r"] == str(
        by_name[summary["winner"]]["overrides"]["lora.r"])
    assert len(client.get_metric_history(winner.info.run_id, "tuned_eval_loss")) == 1  # logged once, by finish

    # the same sweep again, all cached: the same parent, nothing logged again, no new run
    again = qlora_sweep(config=base, grid=grid, return_state=True)
    assert again.is_completed(), again.message
    assert len(client.search_runs([experiment])) == 3
    reused = client.get_run(parent_id)
    assert reused.data.tags[RANKING_TAG] == parent.data.tags[RANKING_TAG]
    assert len(client.get_metric_history(parent_id, "c1.tuned_eval_loss")) == 1


SECRET = "s3cr3t-Pa55w0rd"  # a password no test output or record may hold


def test_a_uri_with_credentials_is_refused_and_its_secret_never_printed() -> None:
    from prefect.utilities.callables import parameter_schema
    from prefect.utilities.schema_tools import validate

    from flows.qlora_pipeline import qlora_pipeline

    # what Prefect's server checks a deployment run's parameters against before it stores them
    schema = parameter_schema(qlora_pipeline).model_dump_for_openapi()
    for uri in (f"http://bot:{SECRET}@127.0.0.1:5000", f"https://{SECRET}@mlflow.example.com",
                f"http://127.0.0.1:5000/?token={SECRET}", f"http://127.0.0.1:5000/?a=1&API_KEY={SECRET}"):
        with pytest.raises(ValidationError) as refused:
            load_config(None, ["track.backend=mlflow", f"track.mlflow_tracking_uri={uri}"])
        message = refused.value.errors()[0]["msg"]
        assert "holds credentials" in message and "MLFLOW_TRACKING_PASSWORD" in message and SECRET not in message
        assert validate({"config": {"track": {"mlflow_tracking_uri": uri}}}, schema), uri
    for uri in ("http://127.0.0.1:5000", "sqlite:////srv/x@y/mlflow.db", "postgresql://db/mlflow?sslmode=require"):
        assert load_config(None, [f"track.mlflow_tracking_uri={uri}"]).track.mlflow_tracking_uri == uri
        assert not validate({"config": {"track": {"mlflow_tracking_uri": uri}}}, schema), uri

    # the command line quotes what it refuses: masked
    result = subprocess.run([sys.executable, "-m", "deployments.cli", "validate", "--set", "track.backend=mlflow",
                             "--set", f"track.mlflow_tracking_uri=http://bot:{SECRET}@127.0.0.1:5000"],
                            capture_output=True, text=True, cwd=PROJECT_ROOT, timeout=120)
    assert result.returncode == 2 and SECRET not in result.stdout + result.stderr
    assert "http://***@127.0.0.1:5000" in result.stderr and "Traceback" not in result.stderr


def test_tracking_writes_only_under_runs_dir_or_allowed_roots(tmp_path: Path) -> None:
    from mlflow import MlflowClient

    from tasks.errors import UserError
    from tasks.reporting import tracking

    runs, data, elsewhere = tmp_path / "runs", tmp_path / "data", tmp_path / "elsewhere"
    for folder in (runs, data, elsewhere):
        folder.mkdir()
    (runs / "link").symlink_to(elsewhere)

    def check(**fields: object) -> None:
        confined = {"runs_dir": runs, "data.allowed_roots": f"[{data}]", **fields}
        tracking.check(load_config(None, [f"{k}={v}" for k, v in confined.items()]))

    for outside in (elsewhere / "tb", runs / "link" / "tb", f"{runs}/../elsewhere/tb"):
        with pytest.raises(UserError, match="outside runs_dir and the data's places"):
            check(**{"track.backend": "tensorboard", "track.tensorboard_dir": outside})
    check(**{"track.backend": "tensorboard"})  # runs_dir/tensorboard
    check(**{"track.backend": "tensorboard", "track.tensorboard_dir": data / "tb"})
    tracking.check(load_config(None, [f"runs_dir={runs}", "track.backend=tensorboard",  # no confinement set
                                      f"track.tensorboard_dir={elsewhere}"]))

    # a local MLflow store: refused before MLflow creates it; its artifacts go beside it, not to ./mlruns
    with pytest.raises(UserError, match="a local MLflow store"):
        check(**{"track.backend": "mlflow", "track.mlflow_tracking_uri": f"sqlite:///{elsewhere}/mlflow.db"})
    assert not list(elsewhere.iterdir())
    store = f"sqlite:///{runs}/mlflow.db"
    check(**{"track.backend": "mlflow", "track.mlflow_tracking_uri": store})
    location = MlflowClient(store).get_experiment_by_name("qlora-pipeline").artifact_location
    assert location == (runs / "mlartifacts").as_uri()


def test_a_tracking_target_that_cannot_take_the_run_is_refused_in_one_paragraph(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tasks.errors import UserError
    from tasks.reporting import tracking

    def refusal(uri: str | None) -> tuple[str, float]:
        started = time.monotonic()
        with pytest.raises(UserError) as refused:
            tracking.check(load_config(None, [f"runs_dir={tmp_path}", "track.backend=mlflow",
                                              f"track.mlflow_tracking_uri={uri or 'null'}"]))
        return " ".join(str(refused.value).split()), time.monotonic() - started

    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    silent = socket.socket()  # accepts connections, never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    threading.Thread(target=other.serve_forever, daemon=True).start()
    try:
        web = f"http://127.0.0.1:{other.server_address[1]}"
        message, _ = refusal(web)
        assert message.startswith(f"track.mlflow_tracking_uri={web}: a server answers there, but not as an MLflow "
                                  "tracking server") and "Nothing has run yet" in message
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            closed = f"http://127.0.0.1:{probe.getsockname()[1]}"
        message, took = refusal(closed)
        assert f"{closed}: nothing answers there (connection refused)" in message and took < 30
        monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
        message, took = refusal(f"http://127.0.0.1:{silent.getsockname()[1]}")
        assert "no answer within 2 s" in message and took < 30
    finally:
        other.shutdown()
        silent.close()
    assert "MLflow cannot track into it" in refusal("not a tracking uri")[0]
    assert "MLflow cannot track into it" in refusal("htp://127.0.0.1:5000")[0]
    # credentials in the URI MLflow takes from its environment: refused too, masked
    import mlflow

    mlflow.set_tracking_uri(None)  # a tracked training earlier in this process set MLflow's own, which outranks it
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://bot:{SECRET}@127.0.0.1:5000")
    message, _ = refusal(None)
    assert "MLFLOW_TRACKING_URI" in message and "http://***@127.0.0.1:5000 holds credentials" in message
    assert SECRET not in message


@pytest.mark.slow
def test_prefect_refuses_a_deployment_run_with_credentials_before_storing_it(prefect_env: Path) -> None:
    from prefect import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
    from prefect.settings import PREFECT_SERVER_DATABASE_CONNECTION_URL
    from prefect.utilities.callables import parameter_schema

    from flows.qlora_pipeline import qlora_pipeline

    config = {"track": {"backend": ["mlflow"], "mlflow_tracking_uri": f"http://bot:{SECRET}@127.0.0.1:5000"}}
    with get_client(sync_client=True) as client:
        flow_id = client.create_flow_from_name("qlora-pipeline")
        deployment = client.create_deployment(
            flow_id, "credentials-refused", enforce_parameter_schema=True,
            parameter_openapi_schema=parameter_schema(qlora_pipeline).model_dump_for_openapi())
        with pytest.raises(Exception, match="409") as refused:  # what the UI form's Submit gets
            client.create_flow_run_from_deployment(deployment, parameters={"config": config})
        assert "mlflow_tracking_uri" in str(refused.value)
        assert not client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment])))
    url = PREFECT_SERVER_DATABASE_CONNECTION_URL.value()
    database = Path(getattr(url, "get_secret_value", lambda: url)().split("///", 1)[1])
    stored = b"".join(path.read_bytes() for path in database.parent.glob(f"{database.name}*"))
    assert stored and SECRET.encode() not in stored


@pytest.mark.slow
def test_an_outage_costs_seconds_and_the_next_run_sends_what_the_server_missed(
        mlflow_control: MlflowServer, prefect_env: Path, small_data: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow import MlflowClient

    from tasks.reporting.tracking import PENDING
    from tasks.reporting.tracking.mlflow import KEY_TAG

    # credentials come from MLflow's environment variables (the server ignores them): none may be written anywhere
    creds = {"MLFLOW_TRACKING_USERNAME": "bot", "MLFLOW_TRACKING_PASSWORD": SECRET}
    for name, value in creds.items():
        monkeypatch.setenv(name, value)
    runs, uri = tmp_path / "runs", mlflow_control.uri
    track = {"track.backend": "mlflow", "track.mlflow_tracking_uri": uri, "track.experiment_name": "outage",
             "train.max_steps": 16, "train.save_steps": 8, "eval.generation_samples": 2}
    killed: list[float] = []

    def kill_mid_training() -> None:
        deadline = time.time() + 900
        while not killed and time.time() < deadline:
            logs = list((runs / "train_adapter").glob("*/loss.jsonl"))
            if logs and len(logs[0].read_text().splitlines()) >= 5:
                mlflow_control.kill()  # SIGKILL: a crash, mid-training
                killed.append(time.time())
            time.sleep(0.1)

    threading.Thread(target=kill_mid_training, daemon=True).start()
    try:
        first = run_flow(small_overrides(small_data, runs, **track))
        ended = time.time()
        train_dir = Path(first["stages"]["train_adapter"]["dir"])
        steps = [json.loads(line)["step"] for line in (train_dir / "loss.jsonl").read_text().splitlines()]
        assert killed and steps == list(range(1, 17))
        # after its last step the run waited seconds for the dead server (evaluation and export included), not
        # MLflow's minutes of retries per queued step
        assert ended - (train_dir / "loss.jsonl").stat().st_mtime < 150
        unsent = first["tracking"]["mlflow"]
        assert unsent["logged"] == "not sent" and unsent["reason"] == "nothing answers there (connection refused)"
        export_key = first["stages"]["export_adapter"]["key"]
        assert (runs / PENDING / f"mlflow-{export_key}.json").is_file()

        # down at the start: refused before any stage, in one paragraph, as exit 2
        env = {**cli_env(tmp_path / "prefect-home"), **creds}
        fresh = tmp_path / "fresh"
        down = cli(["run", *_sets(small_overrides(small_data, fresh, **track))], env, tmp_path / "down")
        out, err = finish(down, tmp_path / "down", timeout=600)
        assert down.returncode == 2, err[-3000:]
        assert f"track.mlflow_tracking_uri={uri}: nothing answers there (connection refused)" in " ".join(err.split())
        assert "Traceback" not in err and "View at" not in out + err and not (fresh / "prepare_data").exists()

        # the server is back: the next run (another result of the same training) also sends the first run's
        mlflow_control.start()
        again = cli(["run", *_sets(small_overrides(small_data, runs, **track, **{"eval.max_samples": 8}))], env,
                    tmp_path / "again")
        out, err = finish(again, tmp_path / "again", timeout=900)
        assert again.returncode == 0, err[-3000:]
    finally:
        if mlflow_control.proc.poll() is not None:
            mlflow_control.start()  # the other tests of the module use it
    # the summary says where the run is tracked
    where = re.search(rf"^tracked in mlflow: {re.escape(uri)}/#/experiments/\d+/runs/(\w+) \(logged now\)$", out, re.M)
    assert where and re.search(r"^train_adapter +cached ", out, re.M), out
    assert re.search(r"tracking: mlflow: sent the result of runs/\S+, unsent since ", out + err), err[-3000:]
    assert not list((runs / PENDING).iterdir())
    client = MlflowClient(uri)
    trained_in = read_manifest(train_dir).metrics.tracking["mlflow"]["run_id"]
    assert client.get_run(trained_in).data.tags[KEY_TAG] == export_key  # the training's run holds its first result
    own = client.get_run(where.group(1))
    assert own.info.run_id != trained_in and own.data.tags["qlora.stage.train_adapter"] == "cached"
    for run_id in (trained_in, own.info.run_id):
        assert sorted({m.step for m in client.get_metric_history(run_id, "loss")}) == list(range(1, 17))
    # the CLI's Prefect server ends with the command: no link to it, printed or tagged
    assert "View at" not in out + err and "prefect.flow_run_url" not in own.data.tags

    # no secret anywhere: the run folders and stage folders, the logs, MLflow's params and tags, Prefect's database
    experiment = client.get_experiment_by_name("outage").experiment_id
    for run in client.search_runs([experiment]):
        assert SECRET not in json.dumps({**run.data.params, **run.data.tags})
    written = [path for path in tmp_path.rglob("*") if path.is_file() and "prefect-home" not in path.parts]
    assert all(SECRET.encode() not in path.read_bytes() for path in written)
    from prefect.settings import PREFECT_SERVER_DATABASE_CONNECTION_URL

    url = PREFECT_SERVER_DATABASE_CONNECTION_URL.value()
    database = Path(getattr(url, "get_secret_value", lambda: url)().split("///", 1)[1])
    for path in [*database.parent.glob(f"{database.name}*"), *(tmp_path / "prefect-home").rglob("*.db*")]:
        assert SECRET.encode() not in path.read_bytes(), path


def _sets(overrides: list[str]) -> list[str]:
    return [part for item in overrides for part in ("--set", item)]
