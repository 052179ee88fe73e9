"""Experiment tracking (README: Experiment tracking) against a real local MLflow server, read back with MLflow's
client, and TensorBoard event files read back with TensorBoard's own reader."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError

from tasks.config import load_config
from tasks.manifest import read_manifest
from tests.conftest import run_flow, small_overrides, statuses


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`mlflow server` with a SQLite store and a local artifact root on a free localhost port; stopped by pid."""
    root = tmp_path_factory.mktemp("mlflow")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = root / "server.log"
    command = [str(Path(sys.executable).parent / "mlflow"), "server", "--backend-store-uri",
               f"sqlite:///{root / 'mlflow.db'}", "--artifacts-destination", str(root / "artifacts"),
               "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    # its own session, so the stop reaches the workers uvicorn starts
    proc = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    deadline = time.time() + 400  # about a minute on a busy 2-core machine
    try:
        while not _healthy(uri):
            assert proc.poll() is None and time.time() < deadline, "mlflow server did not start:\n" + log.read_text()
            time.sleep(1)
        yield uri
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=5)  # its store is a temporary folder: nothing to lose by a kill after that
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


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
    from tasks import tracking
    from tasks.config import TrackArgs

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


@pytest.mark.slow
def test_a_sweep_is_a_parent_run_with_its_candidates_as_children(mlflow_server: str, prefect_env: Path,
                                                                  small_data: Path, tmp_path: Path) -> None:
    from mlflow import MlflowClient

    from flows.qlora_sweep import qlora_sweep
    from tasks.tracking.mlflow import RANKING_TAG, SWEEP_TAG

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
