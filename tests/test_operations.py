"""What an operator sees of a run (issue 16), under the Prefect test server: the registry's verdict as it is
now on cached runs, the eval-metrics table on every run, one progress bar per run ending at 100%, the loss
curve inline, evaluation progress in the log, user errors without tracebacks."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any
from uuid import UUID

import pytest

from tasks.errors import UserError
from tests.conftest import run_flow, small_overrides, statuses


def _artifacts(flow_run_prefix: str, key: str) -> list[Any]:
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
    return [a for a in found if str(a.flow_run_id).startswith(flow_run_prefix)]


def _run_prefix(summary: dict[str, Any]) -> str:
    return Path(summary["run_dir"]).name.split("-")[-1]  # the flow run id's first 8 characters


@pytest.fixture(scope="module")
def first_run(prefect_env: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("ops")
    data = tmp / "small.jsonl"
    from tasks.config import EMBEDDED_DATA

    data.write_text("".join(EMBEDDED_DATA.read_text().splitlines(keepends=True)[:240]))
    overrides = small_overrides(data, tmp / "runs", **{"export.name": "gate", "eval.generation_samples": 4})
    logs: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logs.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("prefect").addHandler(handler)
    try:
        summary = run_flow(overrides)
    finally:
        logging.getLogger("prefect").removeHandler(handler)
    return {"summary": summary, "overrides": overrides, "runs_dir": tmp / "runs", "logs": logs}


@pytest.mark.slow
def test_progress_ends_at_100_and_the_loss_curve_is_inline(first_run: dict[str, Any]) -> None:
    prefix = _run_prefix(first_run["summary"])
    progress = _artifacts(prefix, "train-progress")
    assert len(progress) == 1 and progress[0].data == 100.0, [(p.data, p.description) for p in progress]
    assert progress[0].description.startswith("done: 6/6 steps")
    curves = _artifacts(prefix, "loss-curve")
    assert len(curves) == 1 and curves[0].type == "markdown"  # redrawn during training, updated in place
    assert "](data:image/png;base64,iVBORw0KGgo" in curves[0].data and "Step 6: loss" in curves[0].data


@pytest.mark.slow
def test_evaluation_logs_progress_and_a_readable_metrics_line(first_run: dict[str, Any]) -> None:
    lines = [line for line in first_run["logs"] if line.startswith("evaluate_adapter:")]
    assert any("base model: eval loss" in line for line in lines), lines
    assert any("tuned model: 4 answers generated" in line for line in lines), lines
    summary = next(line for line in lines if "eval loss base" in line)
    assert "% lower), perplexity" in summary and "4 greedy answers: exact match" in summary
    assert "{" not in summary  # no raw JSON


@pytest.mark.slow
def test_a_cached_run_reports_the_registry_as_it_is_now(first_run: dict[str, Any]) -> None:
    """Another run promotes a better version after ours; re-running ours (every stage cached) must report
    that champion, as champion.json says, in its summary and in a fresh eval-metrics table."""
    from tasks.registry import store as registry

    first = first_run["summary"]["metrics"]
    assert (first["export_version"], first["promotion"], first["champion_version"]) == ("v0001", "promoted", "v0001")
    assert first["export_published"] == "by this run"
    root = registry.registry_dir(first_run["runs_dir"], "gate")
    better = {**json.loads((root / "v0001" / "version.json").read_text())["metrics"]}
    better["tuned_eval_loss"] *= 0.5
    source = first_run["runs_dir"] / "another-runs-export"  # publishing writes into its stage folder: a copy
    shutil.copytree(first_run["summary"]["export_dir"], source, ignore=shutil.ignore_patterns("published"))
    registry.publish(root, source, "another-run", better, 0.01, "data", lambda folder, record: "card")
    champion = json.loads((root / "champion.json").read_text())
    assert champion["version"] == "v0002"

    again = run_flow(first_run["overrides"])
    assert set(statuses(again).values()) == {"cached"}
    m = again["metrics"]
    assert (m["export_version"], m["promotion"], m["export_published"]) == ("v0001", "promoted", "by an earlier run")
    assert (m["champion_version"], m["champion_tuned_eval_loss"]) == (champion["version"],
                                                                      champion["metrics"]["tuned_eval_loss"])
    tables = _artifacts(_run_prefix(again), "eval-metrics")
    assert len(tables) == 1
    rows = {row["model"]: row for row in json.loads(tables[0].data)}
    assert rows["champion now (v0002)"]["eval loss"] == f"{champion['metrics']['tuned_eval_loss']:.4f}"
    assert rows["tuned (v0001, promoted)"]["eval loss"] == f"{first['tuned_eval_loss']:.4f}"
    assert "Champion now: v0002" in tables[0].description


def test_a_retried_attempt_updates_the_runs_one_progress_bar(prefect_env: Path) -> None:
    from prefect import flow

    from tasks.reporting.artifacts import TrainingProgress

    @flow
    def two_attempts() -> str:
        TrainingProgress().update(3, 10, "first attempt, killed at step 3")
        TrainingProgress().update(10, 10, "second attempt, resumed")  # a new process: a new TrainingProgress
        from prefect.runtime import flow_run

        return flow_run.id

    progress = _artifacts(two_attempts(), "train-progress")
    assert [(p.data, p.description) for p in progress] == [(100.0, "second attempt, resumed")]


def test_a_user_error_reaches_the_run_log_without_a_traceback(prefect_env: Path) -> None:
    from prefect import flow, get_client, task
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    from tasks.log import quiet_user_errors

    @task
    def bad_stage() -> None:
        raise UserError("lora.target_modules names x_proj, which the model does not have.")

    @flow(on_running=[quiet_user_errors])
    def user_error() -> None:
        bad_stage()

    state = user_error(return_state=True)
    assert state.is_failed()
    for name in ("prefect.flow_runs", "prefect.task_runs"):
        for handler in logging.getLogger(name).handlers:
            handler.flush()  # the API log handler sends in batches
    with get_client(sync_client=True) as client:
        client_logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(
            any_=[state.state_details.flow_run_id])))
    text = "\n".join(log.message for log in client_logs)
    assert "x_proj" in text and "Traceback" not in text, text
    # once: not again in each failed state it passes through; and no line per hook run
    assert text.count("x_proj") == 1 and "Running hook" not in text and "finished running" not in text, text


@pytest.mark.slow  # waits for a held slot on purpose
def test_a_run_waiting_for_the_gpu_says_so(prefect_env: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Another run holds the GPU slot: training logs that it waits and its task run shows "Waiting for GPU"."""
    import threading
    import time

    from prefect import flow, get_client, task
    from prefect.concurrency.sync import concurrency
    from prefect.runtime import task_run

    from tasks.pool.gpus import GPU_LIMIT, WAITING_STATE, gpu_slot

    held, release = threading.Event(), threading.Event()

    def other_run() -> None:
        with concurrency(GPU_LIMIT, occupy=1, strict=True, lease_duration=60):
            held.set()
            release.wait(60)

    @task
    def train() -> str:
        with gpu_slot():
            return str(task_run.id)

    @flow
    def waits() -> str:
        return train()

    holder = threading.Thread(target=other_run)
    holder.start()
    assert held.wait(30)
    threading.Timer(8, release.set).start()  # the other run ends after a while
    start = time.monotonic()
    with caplog.at_level(logging.INFO):
        task_run_id = waits()
    holder.join()
    assert time.monotonic() - start >= 6
    messages = [r.getMessage() for r in caplog.records]
    assert any("waiting for the GPU" in m and GPU_LIMIT in m for m in messages), messages
    assert any("took the GPU slot after waiting" in m for m in messages), messages
    with get_client(sync_client=True) as client:
        names = [s.name for s in client.read_task_run_states(UUID(task_run_id))]
    assert names[-3:] == [WAITING_STATE, "Running", "Completed"], names


def test_run_form_has_titled_sections_readable_fields_and_visible_defaults() -> None:
    """The schema Prefect builds for the UI form (the same call `prefect deploy` makes)."""
    from prefect.utilities.callables import parameter_schema

    from flows.qlora_pipeline import qlora_pipeline

    schema = parameter_schema(qlora_pipeline).model_dump_for_openapi()
    defs = schema["definitions"]
    config = defs["RunConfig"]["properties"]
    assert {name: config[name]["title"] for name in ("lora", "speed")} == {"lora": "LoRA adapter",
                                                                          "speed": "Speed and memory (advanced)"}
    assert all(config[name].get("description") for name in config)  # every section says what it holds
    lora = defs["LoraArgs"]["properties"]
    assert lora["r"]["title"] == "LoRA rank (r)" and lora["target_modules"]["default"] == "all-linear"
    assert defs["EvalArgs"]["properties"]["lm_eval_tasks"]["default"] == []  # a default_factory, shown too
    assert defs["TrainArgs"]["properties"]["bf16"]["title"] == "bf16 mixed precision"
    assert defs["DataArgs"]["properties"]["source"]["default"] == "data/sample/instructions.jsonl"  # any checkout
    titles = [p["title"] for d in defs.values() for p in d.get("properties", {}).values()]
    assert not [t for t in titles if t in ("R", "Bf16", "Bnb 4Bit Quant Type")]


def test_watch_prints_artifact_contents_not_ids(prefect_env: Path) -> None:
    from prefect import flow
    from prefect.artifacts import create_markdown_artifact, create_progress_artifact, create_table_artifact
    from prefect.runtime import flow_run

    from deployments.watch import watch

    @flow
    def with_artifacts() -> str:
        create_markdown_artifact("## Loss\n\n![training loss](data:image/png;base64,iVBORw0KGgo" + "A" * 4000 + ")",
                                 key="loss-curve", description="Training loss")
        create_table_artifact([{"model": "base", "eval loss": "2.1000"}, {"model": "tuned", "eval loss": "1.2000"}],
                              key="eval-metrics", description="v0001 promoted")
        create_progress_artifact(100.0, key="train-progress", description="done: 6/6 steps")
        return flow_run.id

    lines: list[str] = []
    assert watch(with_artifacts(), out=lines.append, poll_seconds=0.1) == "COMPLETED"
    text = "\n".join(lines)
    assert "[image: training loss, 2 KiB PNG" in text and "base64" not in text
    assert "tuned  1.2000" in text and "train-progress: 100% done: 6/6 steps" in text
    assert lines[-1] == "state: Completed"


def test_start_overrides_the_deployments_config_field_by_field() -> None:
    """`qlora-pipeline start NAME --set ...` runs the deployment's own config with those fields changed: Prefect
    merges run parameters only at the top level, so sending the fields alone ran the plain default instead (a
    `start dpo-embedded` trained SFT on the sample instructions)."""
    import yaml

    from deployments.watch import overridden
    from tasks.config import PROJECT_ROOT, RunConfig, load_config

    spec = yaml.safe_load((PROJECT_ROOT / "deployments" / "prefect.yaml").read_text())
    dpo = next(d for d in spec["deployments"] if d["name"] == "dpo-embedded")["parameters"]["config"]
    fields = load_config(None, ["train.max_steps=3", "runs_dir=/tmp/r"]).model_dump(mode="json", exclude_unset=True)
    config = overridden(dpo, fields)
    assert config["train"] == {**dpo["train"], "max_steps": 3} and config["runs_dir"] == "/tmp/r"
    assert config["export"] == {"name": "adapter-dpo"} and config["data"] == dpo["data"]
    assert RunConfig.model_validate(config).train.method == "dpo"
