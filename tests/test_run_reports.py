"""What a run reports to the people who watch it, under the Prefect test server: the printed summary, the progress bar
and loss curve, the registry's verdict as it is now on cached runs, the eval-metrics table, the evaluation's log
lines, a failure's card and alert, user errors without tracebacks.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest

from deployments.cli import _print_summary
from tasks.errors import UserError
from tests.conftest import flow_run_in, flow_run_logs, run_flow, small_overrides, statuses


def test_summary_names_the_resumed_step_and_the_reward_accuracy(capsys: pytest.CaptureFixture[str]) -> None:
    stages = {"prepare_data": {"status": "cached", "dir": "runs/prepare_data/a"},
              "train_adapter": {"status": "resumed", "dir": "runs/train_adapter/b", "resumed_from_step": 4},
              "evaluate_adapter": {"status": "computed", "dir": "runs/evaluate_adapter/c"}}
    metrics = {"base_eval_loss": 2.0, "tuned_eval_loss": 1.0, "relative_improvement": 0.5, "base_perplexity": 7.4,
               "tuned_perplexity": 2.7, "eval_examples": 20, "eval_pairs": 20, "base_reward_accuracy": 0.5,
               "tuned_reward_accuracy": 0.85,
               "base_reward_margin": 0.0, "tuned_reward_margin": 1.25}  # a dpo run's: its gate compares the accuracy
    _print_summary({"method": "dpo", "stages": stages, "metrics": metrics, "export_dir": "x", "run_dir": "r"})
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.strip()}
    assert "resumed from step 4" in lines["train_adapter"]
    assert "base 0.500 -> tuned 0.850" in lines["reward"] and "20 held-out pairs" in lines["reward"]
    assert "cached" in lines["prepare_data"] and "step" not in lines["prepare_data"]


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
    from prefect import flow, task

    from tasks.log import quiet_user_errors

    @task
    def bad_stage() -> None:
        raise UserError("lora.target_modules names x_proj, which the model does not have.")

    @flow(on_running=[quiet_user_errors])
    def user_error() -> None:
        bad_stage()

    state = user_error(return_state=True)
    assert state.is_failed()
    text = "\n".join(log.message for log in flow_run_logs(state))
    assert "x_proj" in text and "Traceback" not in text, text
    # once: not again in each failed state it passes through; and no line per hook run
    assert text.count("x_proj") == 1 and "Running hook" not in text and "finished running" not in text, text


def _artifact(flow_run_id: Any, key: str) -> Any:
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        (found,) = client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]), key=ArtifactFilterKey(any_=[key])))
        return found


def test_failure_card_keeps_placeholders_and_says_what_to_change(prefect_env: Path) -> None:
    from prefect.states import Failed

    from tasks.reporting.artifacts import failure_summary

    state = Failed(message="Flow run encountered an exception: UserError: lora.target_modules names q_projj, which "
                   "data/tiny-llama does not have.")
    run = flow_run_in(state)
    failure_summary(None, run, state)
    card = _artifact(run.id, "run-failure").data
    assert "`runs_dir/<stage>/<key>/`" in card  # a code span: rendered as written, not as an HTML tag
    assert "lora.target\\_modules names q\\_projj" in card  # the message as text, not markdown
    assert "If it names a config field, start a new run with the field changed" in card
    assert "Retry would run the same parameters" in card
    # the command names the field the message names (a run of `qlora-pipeline run`: that command)
    assert "`qlora-pipeline run --set lora.target_modules=<new value>`" in card and "SECTION.FIELD" not in card


@pytest.mark.parametrize(("message", "retry_helps"), [
    ("Validation of flow parameters failed with error: ParameterTypeError: Flow run received invalid parameters:\n"
     " - config.train.max_steps: Value error, 0 steps would train nothing", False),
    ("Flow run encountered an exception: UserError: data.source='/data/x.jsonl': no such file.", True),
    ("Crashed: the flow-run process exited with -9 (SIGKILL)", True),
    (None, True),
])
def test_failure_alert_gives_the_cards_advice(message: str | None, retry_helps: bool) -> None:
    """The alert's body, rendered as Prefect's server renders it (a sandboxed Jinja template), advises Retry exactly
    where the run-failure card does; for refused parameters neither does."""
    import yaml
    from jinja2 import ChainableUndefined
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from deployments.setup import HERE
    from tasks.reporting.artifacts import _next_step

    (automation,) = yaml.safe_load((HERE / "automations.yaml").read_text())["automations"]
    environment = ImmutableSandboxedEnvironment(undefined=ChainableUndefined)
    environment.filters["ui_url"] = lambda run: f"http://127.0.0.1:4200/runs/flow-run/{run['id']}"
    run = {"name": "calm-otter", "id": "0b6f", "state": {"name": "Failed", "message": message}}
    body = environment.from_string(automation["actions"][0]["body"]).render(flow_run=run)
    card = _next_step(message or "no message", "0b6f", "`qlora-pipeline start embedded-default --set x=<new value>`")
    assert ("press Retry" in body) == retry_helps == ("press **Retry**" in card), body
    assert "prefect flow-run retry 0b6f" in body if retry_helps else "Retry would run the same parameters" in body


@pytest.mark.parametrize(("why", "fix_first"), [
    ("the vLLM server at http://127.0.0.1:8000 cannot be reached (ConnectError); is it running?", False),
    ("the vLLM server at http://127.0.0.1:8000 did not answer /v1/models within 120.0 s (serve.timeout_s)", False),
    ("the vLLM server at http://127.0.0.1:8000 refused the API key: set VLLM_API_KEY to the key it was started with",
     True),
])
def test_a_run_whose_champion_is_not_served_gets_its_own_advice(why: str, fix_first: bool) -> None:
    """A run that published but left serve.url's server as it was (Failed, tag not-served): the alert and the card
    say so, and advise Retry at once where the server was away, only after fixing it where it refused."""
    import yaml
    from jinja2 import ChainableUndefined
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from deployments.setup import HERE
    from tasks.reporting.artifacts import _next_step, failure_advice

    message = f"nightly v0004 promoted: tuned eval loss 5.1 beats the champion's; serving not updated: {why}; " \
              "nightly still serves v0003"
    (automation,) = yaml.safe_load((HERE / "automations.yaml").read_text())["automations"]
    environment = ImmutableSandboxedEnvironment(undefined=ChainableUndefined)
    environment.filters["ui_url"] = lambda run: f"http://127.0.0.1:4200/runs/flow-run/{run['id']}"
    run = {"name": "calm-otter", "id": "0b6f", "state": {"name": "Failed", "message": message}}
    body = " ".join(environment.from_string(automation["actions"][0]["body"]).render(flow_run=run).split())
    card = " ".join(_next_step(message, "0b6f", "`qlora-pipeline run`").split())
    assert failure_advice(message) == ("serving-fix" if fix_first else "serving")
    assert "Not served (tag not-served): the version is published" in body and "press Retry" in body
    assert "The version is published" in card and "press **Retry**" in card and "Only serving runs again" in card
    assert ("fix the server first" in body) == ("Fix the server first" in card) == fix_first, (body, card)
    assert "qlora-pipeline promote NAME VERSION --set serve.url=URL" in body and "qlora-pipeline promote" in card
