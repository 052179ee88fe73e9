"""End to end through a real Prefect server on localhost: setup, deploy, a worker, runs started like the UI's.

One server (SQLite in a temporary PREFECT_HOME) and one process worker for the whole module; each run
uses its own runs_dir. Webhook notifications go to a local HTTP server, never anywhere else.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from tasks import methods
from tasks.config import EMBEDDED_DATA, PRESETS_DIR, PROJECT_ROOT, RunConfig, load_config
from tests.conftest import settled_task_states, task_states

pytestmark = pytest.mark.slow  # whole flow runs against a real Prefect server

STAGES = ["prepare_data", "prepare_model", "train_adapter", "evaluate_adapter", "export_adapter"]
TASKS = [*STAGES, "score_champion"]  # the stages and the champion's scoring for the gate (not a stage)
FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Hook(BaseHTTPRequestHandler):
    received: list[dict[str, Any]] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        _Hook.received.append(json.loads(body or b"{}"))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """prefect server + setup + deploy + a process worker; everything is stopped afterwards."""
    home = tmp_path_factory.mktemp("prefect-home")
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    # PREFECT_API_URL before the server starts: the UI it serves calls the API there (README: Operating it)
    env.update(PREFECT_HOME=str(home), PREFECT_API_URL=f"http://127.0.0.1:{port}/api",
               PREFECT_SERVER_ANALYTICS_ENABLED="false", PYTHONUNBUFFERED="1", PYTHONPATH=str(PROJECT_ROOT),
               PREFECT_API_LOG_RETRYABLE_ERRORS="true")  # the 503s it answers, with their cause, in server.log
    hook = HTTPServer(("127.0.0.1", 0), _Hook)
    threading.Thread(target=hook.serve_forever, daemon=True).start()
    logs = home / "logs"
    logs.mkdir()
    procs = [_start(["prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)], env,
                    logs / "server.log")]
    try:
        _wait_healthy(port)
        for args in (["setup", "--notify-url", f"http://127.0.0.1:{hook.server_port}/hook"], ["deploy"]):
            _cli(args, env, cwd=home)  # from any directory
        # the worker runs flows in its own checkout, whatever its working directory
        procs.append(_start(["python", "-m", "deployments.cli", "worker", "--limit", "1"], env, logs / "worker.log"))
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings({PREFECT_API_URL: env["PREFECT_API_URL"]}):  # this process's client too
            yield {"env": env, "port": port, "hook": _Hook.received, "logs": logs}
    finally:
        for proc in reversed(procs):
            os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        hook.shutdown()


def _start(args: list[str], env: dict[str, str], log: Path, cwd: Path | None = None) -> subprocess.Popen:
    exe = str(Path(sys.executable).parent / args[0])
    return subprocess.Popen([exe, *args[1:]], env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True, cwd=cwd or log.parent)


def _cli(args: list[str], env: dict[str, str], cwd: Path) -> str:
    """`qlora-pipeline ARGS` of the checkout on env's PYTHONPATH (the console script may belong to another)."""
    done = subprocess.run([sys.executable, "-m", "deployments.cli", *args], env=env, capture_output=True, text=True,
                          timeout=300, cwd=cwd)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def _wait_healthy(port: int, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise AssertionError("prefect server did not become healthy")


def _config(runs_dir: Path, data: Path) -> dict[str, Any]:
    return {"runs_dir": str(runs_dir), "data": {"source": str(data)},
            "train": {"max_steps": 4, "save_steps": 2, "logging_steps": 1},
            "eval": {"max_samples": 8}}


def _start_run(deployment: str, config: dict[str, Any]) -> Any:
    """What the UI's Run button does: create a flow run of the deployment with the form's parameters."""
    from prefect import get_client

    with get_client(sync_client=True) as client:
        dep = client.read_deployment_by_name(f"qlora-pipeline/{deployment}")
        return client.create_flow_run_from_deployment(dep.id, parameters={"config": config}).id


def _wait(flow_run_id: Any, timeout: float = 600) -> Any:
    from prefect import get_client

    deadline = time.time() + timeout
    with get_client(sync_client=True) as client:
        while time.time() < deadline:
            run = client.read_flow_run(flow_run_id)
            if run.state and run.state.type.value in FINAL and run.state.name != "AwaitingRetry":
                return run
            time.sleep(1)
    raise AssertionError(f"flow run {flow_run_id} did not finish in {timeout}s")


def _artifact_keys(flow_run_id: Any) -> set[str]:
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
    return {a.key for a in found if a.key}


def _artifacts(flow_run_id: Any, key: str) -> list[Any]:
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        return client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]), key=ArtifactFilterKey(any_=[key])))


def test_deployments_match_the_presets() -> None:
    spec = yaml.safe_load((PROJECT_ROOT / "deployments" / "prefect.yaml").read_text())
    by_name = {d["name"]: d for d in spec["deployments"]}
    for name in ("embedded-default", "reference-recipe", "dpo-embedded", "grpo-embedded"):
        assert RunConfig.model_validate(by_name[name]["parameters"]["config"]) == load_config(
            PRESETS_DIR / f"{name}.yaml")
    nightly = by_name["nightly"]["schedules"][0]
    assert nightly["cron"] == "0 2 * * *" and nightly["timezone"] == "Europe/Berlin"


def test_sweep_deployment_is_a_small_grid_the_flow_accepts() -> None:
    """The sweep deployment has no preset: its parameters must pass the qlora-sweep flow's signature and expand to
    the 2 x 2 grid on the embedded model."""
    from flows.qlora_sweep import qlora_sweep
    from tasks.sweep.grid import expand

    spec = yaml.safe_load((PROJECT_ROOT / "deployments" / "prefect.yaml").read_text())
    (sweep,) = [d for d in spec["deployments"] if d["name"] == "sweep"]
    assert sweep["entrypoint"] == "flows/qlora_sweep.py:qlora_sweep"
    params = qlora_sweep.validate_parameters(sweep["parameters"])
    plan = expand(params["config"], params["grid"], params.get("candidates"))
    assert [c.label for c in plan.candidates] == [f"lora.r={r}, train.learning_rate={lr}" for r in (4, 8)
                                                  for lr in (0.001, 0.003)]
    assert params["config"].model.base_model == RunConfig().model.base_model  # the embedded model


def test_run_from_deployment_then_cached_rerun(server: dict[str, Any], tmp_path: Path) -> None:
    data = tmp_path / "data.jsonl"
    data.write_text("".join(EMBEDDED_DATA.read_text().splitlines(keepends=True)[:200]))
    config = _config(tmp_path / "runs", data)
    first = _wait(_start_run("embedded-default", config))
    assert first.state.type.value == "COMPLETED", (server["logs"] / "worker.log").read_text()[-3000:]
    assert {k: v[-1] for k, v in settled_task_states(first.id).items()} == dict.fromkeys(TASKS, "Completed")
    keys = _artifact_keys(first.id)
    assert {"prepare-data", "prepare-model", "train-adapter", "evaluate-adapter", "export-adapter",
            "train-progress", "loss-curve", "eval-samples", "eval-metrics"} <= keys
    assert list((tmp_path / "runs" / "runs").glob("*/loss.png"))

    (read,) = _artifacts(first.id, "prepare-data")
    assert "`data.source`" in read.data and "- none" not in read.data  # what it read, not "none"
    (samples,) = _artifacts(first.id, "eval-samples")
    rows = json.loads(samples.data) if isinstance(samples.data, str) else samples.data
    cells = [str(v) for row in rows for v in row.values()]
    assert any("\\#\\#\\# Instruction" in c for c in cells)  # escaped: text in the cell, not a heading
    assert not any("\n" in c for c in cells)

    again = _wait(_start_run("embedded-default", config))
    assert again.state.type.value == "COMPLETED"
    assert {k: v[-1] for k, v in settled_task_states(again.id).items()} == dict.fromkeys(TASKS, "Cached")
    (progress,) = _artifacts(again.id, "train-progress")  # one per run, cached training included
    assert progress.data == 100.0 and "cached" in progress.description


def test_failed_run_notifies_and_retry_skips_finished_stages(server: dict[str, Any], tmp_path: Path) -> None:
    """A nightly run whose data went bad fails in prepare_data, before any GPU work; once the data is fixed,
    Retry on that same flow run reuses every stage an earlier run finished instead of recomputing it."""
    from prefect import get_client
    from prefect.states import Scheduled

    data = tmp_path / "data.jsonl"
    good = "".join(EMBEDDED_DATA.read_text().splitlines(keepends=True)[:200])
    data.write_text(good)
    config = _config(tmp_path / "runs", data)
    assert _wait(_start_run("nightly", config)).state.type.value == "COMPLETED"
    manifests = {p: p.stat().st_mtime_ns for p in (tmp_path / "runs").glob("*/*/manifest.json")}
    assert len(manifests) == 5

    data.write_text(good + "{not json\n")  # last night's export went wrong
    failed = _wait(_start_run("nightly", config))
    assert failed.state.type.value == "FAILED"
    assert settled_task_states(failed.id) == {"prepare_data": ["Failed"]}
    assert "line(s)" in failed.state.message or "bad rows" in failed.state.message
    (card,) = _artifacts(failed.id, "run-failure")
    assert "`runs_dir/<stage>/<key>/`" in card.data and "If it names the data or another file" in card.data

    data.write_text(good)  # the fix
    with get_client(sync_client=True) as client:  # what the UI's Retry (and `prefect flow-run retry`) does
        client.set_flow_run_state(failed.id, Scheduled(message="Retried"), force=True)
    retried = _wait(failed.id)
    assert retried.state.type.value == "COMPLETED", (server["logs"] / "worker.log").read_text()[-3000:]
    assert {k: v[-1] for k, v in settled_task_states(failed.id).items()} == dict.fromkeys(TASKS, "Cached")
    assert {p: p.stat().st_mtime_ns for p in manifests} == manifests  # nothing recomputed
    (card,) = _artifacts(failed.id, "run-failure")
    assert card.data.startswith("## Resolved: the run completed on a later attempt"), card.data[:200]

    deadline = time.time() + 90  # the automation fires from the server's event stream
    while not any(failed.name in m.get("subject", "") for m in server["hook"]) and time.time() < deadline:
        time.sleep(1)
    message = next(m for m in server["hook"] if failed.name in m.get("subject", ""))
    assert str(failed.id) in message["body"]  # the run's id and its page in the UI
    assert f"http://127.0.0.1:{server['port']}/runs/flow-run/{failed.id}" in message["body"], message


def test_sweep_deployment_runs_on_the_worker(server: dict[str, Any], tmp_path: Path) -> None:
    """The sweep deployment started like the UI's Run, with a smaller config and a 2-candidate grid: both
    candidates trained on the worker, the winner published, the comparison artifact on the flow run."""
    from prefect import get_client

    data = tmp_path / "data.jsonl"
    data.write_text("".join(EMBEDDED_DATA.read_text().splitlines(keepends=True)[:200]))
    config = {**_config(tmp_path / "runs", data), "eval": {"max_samples": 8, "generation_samples": 2},
              "export": {"name": "adapter-sweep"}}
    with get_client(sync_client=True) as client:
        dep = client.read_deployment_by_name("qlora-sweep/sweep")
        run_id = client.create_flow_run_from_deployment(dep.id, parameters={
            "config": config, "grid": {"train.learning_rate": [1e-3, 3e-3]}}).id
    run = _wait(run_id)
    assert run.state.type.value == "COMPLETED", (server["logs"] / "worker.log").read_text()[-3000:]
    states = settled_task_states(run_id)
    assert states["train_adapter"] == ["Completed"] * 2 and states["export_adapter"] == ["Completed"]
    (comparison,) = _artifacts(run_id, "sweep-comparison")
    assert comparison.data.count("| finished |") == 2
    assert [p.name for p in (tmp_path / "runs" / "exports" / "adapter-sweep").glob("v*")] == ["v0001"]


def test_the_ui_calls_the_api_of_its_own_port(server: dict[str, Any]) -> None:
    """On a non-default port the UI works only if PREFECT_API_URL was set before the server started."""
    with urllib.request.urlopen(f"http://127.0.0.1:{server['port']}/ui-settings", timeout=10) as r:
        assert json.loads(r.read())["api_url"] == f"http://127.0.0.1:{server['port']}/api"


def test_deploy_from_a_copy_at_another_path_and_from_git(server: dict[str, Any], tmp_path: Path) -> None:
    """Deploying stores no path of the deploying checkout: a copy elsewhere deploys, and the worker (started in
    its own checkout) runs it; with --git, each run clones the repository instead."""
    from prefect import get_client

    copy = tmp_path / "elsewhere" / "qlora-pipeline"
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=PROJECT_ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    for name in files:
        if (PROJECT_ROOT / name).is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            (copy / name).write_bytes((PROJECT_ROOT / name).read_bytes())
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@localhost", "-c", "init.defaultBranch=main"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "copy"]):
        subprocess.run([*git, *args], cwd=copy, check=True)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(EMBEDDED_DATA.read_text().splitlines(keepends=True)[:200]))
    env = {**server["env"], "PYTHONPATH": str(copy)}
    try:
        for deploy in (["deploy"], ["deploy", "--git", copy.as_uri(), "--branch", "main"]):
            _cli(deploy, env, cwd=copy)
            with get_client(sync_client=True) as client:
                dep = client.read_deployment_by_name("qlora-pipeline/embedded-default")
            stored = json.dumps([dep.pull_steps, dep.parameter_openapi_schema, dep.parameters])
            assert str(PROJECT_ROOT) not in stored and (str(copy) not in stored or "--git" in deploy), stored
            assert "--git" in deploy or "{{ $QLORA_PIPELINE_ROOT }}" in stored  # resolved by each worker
            assert ("git_clone" in stored) == ("--git" in deploy)
            run = _wait(_start_run("embedded-default", _config(tmp_path / "runs", data)))
            assert run.state.type.value == "COMPLETED", (server["logs"] / "worker.log").read_text()[-3000:]
    finally:
        _cli(["deploy"], server["env"], cwd=PROJECT_ROOT)  # the module's other tests use the plain deployments


def test_what_a_run_may_read_is_the_operators(server: dict[str, Any], tmp_path: Path) -> None:
    """The operator allows a folder (QLORA_DATA_ROOTS in the deployment's job variables): a run from the form cannot
    widen it, neither by data.allowed_roots (not in the form; refused by the server, and before any stage with the
    form's check off) nor by its own job variables, and a source outside is refused before any stage."""
    from prefect import get_client
    from prefect.client.schemas.actions import DeploymentUpdate

    allowed = tmp_path / "allowed"
    allowed.mkdir()
    data = allowed / "data.jsonl"
    data.write_text("".join(EMBEDDED_DATA.read_text().splitlines(keepends=True)[:200]))
    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("qlora-pipeline/embedded-default")
        client.update_deployment(deployment.id, DeploymentUpdate(job_variables={"env": {
            "QLORA_DATA_ROOTS": str(allowed)}}))
    try:
        runs = {"runs_dir": str(tmp_path / "runs")}
        with get_client(sync_client=True) as client:
            with pytest.raises(Exception, match="409") as refused:  # the form has no such field: refused at Submit
                client.create_flow_run_from_deployment(deployment.id, parameters={"config": {
                    **runs, "data": {"source": "/etc/hostname", "allowed_roots": ["/"]}}})
            assert "allowed_roots" in str(refused.value)
            widened = client.create_flow_run_from_deployment(deployment.id, parameters={"config": {
                **runs, "data": {"source": str(data)}}}, job_variables={"env": {"QLORA_DATA_ROOTS": "/"}}).id
            client.update_deployment(deployment.id, DeploymentUpdate(enforce_parameter_schema=False))
            wider = client.create_flow_run_from_deployment(deployment.id, parameters={"config": {
                **runs, "data": {"source": "/etc/hostname", "allowed_roots": ["/"]}}}).id
            outside = client.create_flow_run_from_deployment(deployment.id, parameters={"config": {
                **runs, "data": {"source": "/etc/hostname"}}}).id
        for run_id, said in ((widened, "this run's job variables set QLORA_DATA_ROOTS in its environment"),
                             (wider, "data.allowed_roots names /, outside what the worker allows (QLORA_DATA_ROOTS="),
                             (outside, "data.source='/etc/hostname' reads /etc/hostname, outside what the worker "
                                       "allows (QLORA_DATA_ROOTS)")):
            run = _wait(run_id)
            assert run.state.type.value == "FAILED" and said in " ".join(run.state.message.split()), run.state
            assert settled_task_states(run_id) == {}, run_id  # before any stage
        assert not (tmp_path / "runs" / "prepare_data").exists()
    finally:
        with get_client(sync_client=True) as client:
            client.update_deployment(deployment.id, DeploymentUpdate(job_variables={}, enforce_parameter_schema=True))


def test_deploy_says_its_next_steps_once(server: dict[str, Any], tmp_path: Path) -> None:
    """Prefect's report repeats `prefect worker start ...` for every deployment; ours names our worker, once."""
    out = _cli(["deploy"], server["env"], cwd=tmp_path)
    assert "deployed 8: qlora-node/train, qlora-pipeline/dpo-embedded, qlora-pipeline/embedded-default" in out, out
    assert out.count("qlora-pipeline worker") == 1 and "prefect worker start" not in out, out
    assert out.count("qlora-pipeline start DEPLOYMENT") == 1 and "prefect deployment run" not in out, out


def test_a_refused_config_is_one_line_in_the_run_log(server: dict[str, Any], tmp_path: Path) -> None:
    """A run started with a config the flow refuses fails at its parameters, before any hook or stage: its log
    says why in one line, without Prefect's repeats and traceback."""
    from prefect import get_client
    from prefect.client.schemas.actions import DeploymentUpdate
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    # the server refuses this config before it creates a run (the schema's bounds); with the deployment's schema
    # check off ("Validate parameters" off in the UI) the run is created and the flow refuses it
    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("qlora-pipeline/embedded-default")
        client.update_deployment(deployment.id, DeploymentUpdate(enforce_parameter_schema=False))
    # three rules between sections broken at once: every one is named (the flow checked them one after another and
    # named the first)
    rules = {"runs_dir": str(tmp_path / "runs"), "train": {"loss_type": "sigmoid"},
             "speed": {"fsdp": True, "num_nodes": 2, "num_gpus": "auto"}}
    try:
        run = _wait(_start_run("embedded-default", {"runs_dir": str(tmp_path / "runs"), "train": {"max_steps": 0}}))
        ruled = _wait(_start_run("embedded-default", rules))
    finally:
        with get_client(sync_client=True) as client:
            client.update_deployment(deployment.id, DeploymentUpdate(enforce_parameter_schema=True))

    def error_lines(run: Any) -> tuple[list[str], str]:
        deadline = time.time() + 30  # the log lines reach the server in batches, after the state
        while True:
            with get_client(sync_client=True) as client:
                logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id])))
            errors = [log.message for log in logs if log.level >= 40]
            if errors or time.time() > deadline:
                return errors, "\n".join(log.message for log in logs)

    assert run.state.type.value == "FAILED" and ruled.state.type.value == "FAILED"
    errors, text = error_lines(run)
    assert len(errors) == 1, errors
    assert errors[0].startswith("Invalid configuration: config.train.max_steps: 0 steps would train nothing"), errors
    assert "Traceback" not in text and "Engine execution exited" not in text and text.count("max_steps") == 1, text
    errors, text = error_lines(ruled)
    assert len(errors) == 1 and "Traceback" not in text, errors
    for sentence in ("train.loss_type=sigmoid does not go with train.method=sft",
                     "speed.num_nodes=2 trains on speed.num_gpus GPUs of each host",
                     "speed.fsdp needs the 4-bit weights stored in the compute dtype"):
        assert sentence in errors[0], errors


def _browser() -> Any:
    """Headless Debian Chromium through chromedriver, with no background network of its own."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1400,2000"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # console errors, e.g. a refused image
    options.binary_location = CHROMIUM
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
SCREENSHOTS = PROJECT_ROOT / "test-output" / "ui"


def _submit(browser: Any, submit: Any) -> list[dict[str, Any]]:
    """Press the run form's Submit; [] once the browser has left the form, else what its console logged."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    browser.execute_script("arguments[0].click();", submit)  # a toast (an earlier refusal's) may lie over it
    try:
        WebDriverWait(browser, 60).until(lambda b: not b.current_url.split("?")[0].endswith("/run"))
    except TimeoutException:
        return browser.get_log("browser") or [{"message": "(nothing in the console)"}]
    return []


def _retryable(console: list[dict[str, Any]]) -> bool:
    return any("create_flow_run" in e["message"] and "status of 503" in e["message"] for e in console)


def _open_form(browser: Any, port: int, deployment_id: Any, ui: str) -> None:
    """The deployment's Custom run form: "v1" is the UI that Prefect's own links (the alert's) open, "v2" the one a
    browser without a saved choice gets at the server's root."""
    from selenium.webdriver.support.ui import WebDriverWait

    base = f"http://127.0.0.1:{port}" + ("/v2" if ui == "v2" else "")
    browser.get(f"{base}/deployments/deployment/{deployment_id}/run")
    WebDriverWait(browser, 60).until(lambda b: "Max tokens per example" in b.page_source)
    time.sleep(2)  # the form fills its defaults in after it renders


def _type(browser: Any, title: str, value: str) -> None:
    """Replace what the number box of the field titled `title` holds with `value`."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    box = browser.find_element(By.XPATH, f"//*[starts-with(normalize-space(text()), '{title}')]/following::input[1]")
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'});", box)
    box.click()
    box.send_keys(Keys.CONTROL, "a")
    box.send_keys(value)


def _submit_button(browser: Any) -> Any:
    from selenium.webdriver.common.by import By

    submit = next(b for b in browser.find_elements(By.TAG_NAME, "button") if b.text.strip() == "Submit")
    browser.execute_script("arguments[0].scrollIntoView(true);", submit)
    return submit


def _submit_form(browser: Any) -> list[dict[str, Any]]:
    """Press the form's Submit (again after a 503, as a user would); [] once the browser has left the form."""
    submit = _submit_button(browser)
    console = _submit(browser, submit)
    if console and _retryable(console):
        # Prefect's server answers 503 for errors a client may retry (its SQLite busy, say); the UI shows "Something
        # went wrong" and a user presses Submit again (the server logs the cause: PREFECT_API_LOG_RETRYABLE_ERRORS)
        console += _submit(browser, submit)
    return console


def _field_text(browser: Any, title: str, next_title: str) -> str:
    """What the form shows of the field titled `title`: its text up to the next field's title."""
    text = browser.execute_script("return document.body.innerText")
    start = text.index(title)
    return text[start:text.index(next_title, start)]


def _choose(browser: Any, title: str, value: str) -> list[str]:
    """Pick `value` in the dropdown of the field titled `title` (the V1 form's select); its options."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    box = browser.find_element(By.XPATH, f"//*[starts-with(normalize-space(text()), '{title}')]/following::select[1]")
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'});", box)
    Select(box).select_by_value(value)
    return [o.get_attribute("value") for o in Select(box).options]


def _runs_of(deployment_id: Any) -> list[Any]:
    from prefect import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
    from prefect.client.schemas.sorting import FlowRunSort

    with get_client(sync_client=True) as client:
        return client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])),
                                     sort=FlowRunSort.EXPECTED_START_TIME_ASC)


def _keys_on_disk(runs_dir: Path) -> dict[str, str]:
    """Each stage's key in a runs_dir that one configuration ran in: the name of its one folder."""
    return {stage: next(p.name for p in (runs_dir / stage).iterdir() if (p / "manifest.json").exists())
            for stage in STAGES}


def _keys_of(config: RunConfig) -> dict[str, str]:
    """The stage keys `config` computes, as each stage computes its own (nothing runs); the later stages' keys
    build on the folders of the earlier stages' keys, which must already be in its runs_dir."""
    from tasks.evaluate_adapter.stage import spec as evaluate
    from tasks.export_adapter.stage import spec as export
    from tasks.prepare_data.stage import spec as data
    from tasks.prepare_model.stage import spec as model
    from tasks.train_adapter.stage import spec as train

    runs_dir = config.runs_dir
    specs = [data(config.data, config.model, runs_dir), model(config.model, runs_dir)]
    folders = [str(s.dir) for s in specs]
    specs.append(train(config.lora, config.train, config.speed, runs_dir, *folders))
    specs.append(evaluate(config.eval, runs_dir, *folders, str(specs[-1].dir)))
    specs.append(export(config.export, runs_dir, *folders, str(specs[2].dir), str(specs[3].dir)))
    return {s.stage: s.key for s in specs}


@pytest.mark.ui
@pytest.mark.skipif(not Path(CHROMEDRIVER).exists() and not os.environ.get("CI"),
                    reason="Debian's chromium and chromium-driver are not installed (.ci/run installs them)")
def test_ui_form_runs_what_the_cli_runs(server: dict[str, Any], tmp_path: Path) -> None:
    """The Custom run form of embedded-default, in a real browser: a field left alone means what it means on the
    CLI (the "auto" fields stay automatic), so a run with one field changed computes the stage keys that
    `qlora-pipeline start embedded-default --set` of that field computes, in either UI; the form refuses a 0 where
    the config wants 1 or more; a run whose configuration is refused alerts without advising Retry."""
    from prefect import get_client
    from prefect.client.schemas.actions import DeploymentUpdate
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from deployments.watch import overridden

    data, runs = tmp_path / "data.jsonl", tmp_path / "runs"
    data.write_text("".join(EMBEDDED_DATA.read_text().splitlines(keepends=True)[:200]))
    operator = {"runs_dir": str(runs), "data": {"source": str(data)}, "train": {"logging_steps": 1},
                "eval": {"max_samples": 8, "generation_samples": 4}}
    with get_client(sync_client=True) as client:  # an operator's defaults for this deployment's form
        dep = client.read_deployment_by_name("qlora-pipeline/embedded-default")
        client.update_deployment(dep.id, DeploymentUpdate(parameters={"config": operator}))
    earlier = {r.id for r in _runs_of(dep.id)}  # other tests of this module's server start this deployment too

    def new_runs() -> list[Any]:
        return [r for r in _runs_of(dep.id) if r.id not in earlier]

    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    browser = _browser()
    try:
        _open_form(browser, server["port"], dep.id, "v1")
        browser.save_screenshot(str(SCREENSHOTS / "1-run-form.png"))
        page = browser.page_source
        for description in ("Folder that every stage writes its output to", "LoRA rank: the adapters' size.",
                            "4-bit data type of the base model's weights"):
            assert description in page  # the sections of RunConfig, with their help text
        for title in ("LoRA adapter", "LoRA rank (r)", "Speed and memory (advanced)", "bf16 mixed precision"):
            assert title in page  # readable titles, not "R" or "Bf16"
        for field, after in (("bf16 mixed precision", "Save steps"), ("Loss on answers only", "Max tokens per example"),
                             ("Fused LoRA", "Recompute skip")):  # automatic: "auto" chosen, no off switch
            assert "\nauto" in _field_text(browser, field, after), _field_text(browser, field, after)
        lora = _field_text(browser, "Target modules", "Trained biases")
        assert "Every linear layer" in lora and "all-linear" in lora and "list | str" not in lora, lora
        title = browser.find_element(By.XPATH, "//*[starts-with(normalize-space(text()), 'Target modules')]")
        browser.execute_script("arguments[0].scrollIntoView(true);", title)
        browser.save_screenshot(str(SCREENSHOTS / "1b-run-form-lora.png"))

        # every training method is offered, and its rules hold: ORPO has no loss type to choose (tasks/methods.py)
        assert _choose(browser, "Method", "orpo") == list(methods.NAMES)
        _choose(browser, "Loss type", "sigmoid")
        browser.execute_script("arguments[0].click();", _submit_button(browser))
        WebDriverWait(browser, 30, poll_frequency=0.2).until(  # the rule's sentence, as the CLI says it
            lambda b: "train.loss_type does not go with train.method=orpo" in b.page_source)
        browser.save_screenshot(str(SCREENSHOTS / "1c-run-form-refuses-orpo-with-a-loss-type.png"))
        assert browser.current_url.split("?")[0].endswith("/run") and not new_runs()
        _choose(browser, "Method", "sft")
        _choose(browser, "Loss type", "auto")
        # 0 steps: the form refuses it, says why, and no run is created
        _type(browser, "Max optimizer steps", "0")
        browser.execute_script("arguments[0].click();", _submit_button(browser))  # V1 shows the refusal in a toast
        WebDriverWait(browser, 30, poll_frequency=0.2).until(lambda b: "0 trains nothing" in b.page_source)
        browser.save_screenshot(str(SCREENSHOTS / "1c-run-form-refuses-0-steps.png"))
        assert browser.current_url.split("?")[0].endswith("/run") and not new_runs()
        # ... unless its "Validate parameters" is off: the run is created, and its configuration is refused
        label = browser.find_element(By.XPATH, "//label[normalize-space(.)='Validate parameters']")
        validate = browser.find_element(By.ID, label.get_attribute("for"))
        browser.execute_script("arguments[0].click();", validate)
        assert not validate.is_selected()
        assert not _submit_form(browser), "the run form stayed open"

        # one field changed, in each UI: train.max_steps
        for ui in ("v1", "v2"):
            _open_form(browser, server["port"], dep.id, ui)
            if ui == "v2":
                assert "\nauto" in _field_text(browser, "bf16 mixed precision", "Save steps")
            _type(browser, "Max optimizer steps", "3")
            console = _submit_form(browser)
            browser.save_screenshot(str(SCREENSHOTS / f"2-after-submit-{ui}.png"))
            assert not browser.current_url.split("?")[0].endswith("/run"), f"the {ui} form stayed open: {console}"
        refused, v1, v2 = new_runs()
        assert [r.parameters["config"]["train"]["max_steps"] for r in (refused, v1, v2)] == [0, 3, 3]

        failed = _wait(refused.id)
        assert failed.state.type.value == "FAILED" and "Validation of flow parameters" in failed.state.message
        (card,) = _artifacts(refused.id, "run-failure")
        assert "`qlora-pipeline start embedded-default --set train.max_steps=<new value>`" in card.data, card.data
        assert "Retry would run the same parameters" in card.data and "press **Retry**" not in card.data
        deadline = time.time() + 90  # the automation fires from the server's event stream
        while not any(refused.name in m.get("subject", "") for m in server["hook"]) and time.time() < deadline:
            time.sleep(1)
        alert = next(m for m in server["hook"] if refused.name in m.get("subject", ""))["body"]
        assert "configuration was refused" in alert and "press Retry" not in alert, alert
        assert "flow-run retry" not in alert, alert

        run = _wait(v1.id)
        assert run.state.type.value == "COMPLETED", (server["logs"] / "worker.log").read_text()[-3000:]
        cli = RunConfig.model_validate(overridden(operator, load_config(None, ["train.max_steps=3"]).model_dump(
            mode="json", exclude_unset=True)))  # what `qlora-pipeline start embedded-default --set ...` sends
        assert _keys_on_disk(runs) == _keys_of(cli)
        assert run.state.message.startswith("adapter v0001 promoted: first version"), run.state.message
        assert "promoted" in run.tags
        (samples,) = _artifacts(run.id, "eval-samples")  # answers learned on the answers only, then generated
        rows = json.loads(samples.data) if isinstance(samples.data, str) else samples.data
        assert len(rows) == 4 and list(rows[0])[:3] == ["tuned answer", "base answer", "reference answer"], rows[0]
        cells = [str(v) for row in rows for v in row.values()]
        assert any("\\#\\#\\# Instruction" in c for c in cells)  # escaped: text in the cell, not a heading
        assert not any("\n" in c for c in cells)
        again = _wait(v2.id)  # the V2 form's run: the same keys, so every stage is reused
        assert again.state.type.value == "COMPLETED"
        assert {k: v[-1] for k, v in settled_task_states(again.id).items()} == dict.fromkeys(TASKS, "Cached")

        browser.get(f"http://127.0.0.1:{server['port']}/runs/flow-run/{run.id}")
        WebDriverWait(browser, 60).until(lambda b: "Completed" in b.page_source)
        browser.save_screenshot(str(SCREENSHOTS / "3-flow-run-completed.png"))
        browser.get_log("browser")  # drop what came before
        for number, key in ((4, "loss-curve"), (5, "train-progress"), (6, "eval-metrics"), (7, "eval-samples")):
            (artifact,) = _artifacts(run.id, key)
            browser.get(f"http://127.0.0.1:{server['port']}/artifacts/artifact/{artifact.id}")
            if key == "loss-curve":  # the PNG inline in the markdown, loaded by the browser from the page itself
                WebDriverWait(browser, 60).until(lambda b: b.execute_script(
                    "return [...document.images].some(i => i.alt === 'training loss' && i.complete "
                    "&& i.naturalWidth > 300)"))
            else:
                time.sleep(3)
            browser.save_screenshot(str(SCREENSHOTS / f"{number}-artifact-{key}.png"))
        errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
        assert not errors, errors
    finally:
        browser.quit()


def _flow_run_pids(flow_run_id: Any) -> list[int]:
    """The processes a worker started for this flow run (their environment names it)."""
    marker = f"PREFECT__FLOW_RUN_ID={flow_run_id}".encode()
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker in (proc / "environ").read_bytes().split(b"\0"):
                pids.append(int(proc.name))
        except OSError:
            pass
    return pids


@pytest.mark.kill
def test_a_killed_run_crashes_alerts_and_leaves_no_task_running(server: dict[str, Any], tmp_path: Path) -> None:
    """kill -9 of the flow-run process during train_adapter (what the OOM killer or a pre-empted node does):
    the run is Crashed, the worker's on_crashed hook ends the task run and writes run-failure naming the crash,
    and the automation (Crashed as well as Failed) posts the run's id and link. Last in the module: the killed
    run's GPU slot stays taken until its lease runs out."""
    data = tmp_path / "data.jsonl"
    data.write_text("".join(EMBEDDED_DATA.read_text().splitlines(keepends=True)[:200]))
    config = {**_config(tmp_path / "runs", data), "train": {"max_steps": 400, "save_steps": 100, "logging_steps": 1}}
    run_id = _start_run("embedded-default", config)
    deadline = time.time() + 300
    while task_states(run_id).get("train_adapter", [""])[-1] != "Running":
        assert time.time() < deadline, task_states(run_id)
        time.sleep(1)
    time.sleep(3)  # training, not starting
    pids = _flow_run_pids(run_id)
    assert pids, "no process of the flow run found"
    for pid in pids:
        os.kill(pid, signal.SIGKILL)

    run = _wait(run_id)
    assert run.state.type.value == "CRASHED", run.state
    deadline = time.time() + 90  # the worker runs the hook, the automation fires from the event stream
    while time.time() < deadline and not (_artifacts(run_id, "run-failure")
                                          and any(str(run_id) in m.get("body", "") for m in server["hook"])):
        time.sleep(1)
    states = settled_task_states(run_id)
    assert states["train_adapter"] == ["Crashed"] and not [s for v in states.values() for s in v
                                                            if s in ("Running", "Pending")], states
    failure = _artifacts(run_id, "run-failure")
    assert len(failure) == 1 and "crashed during train_adapter" in failure[0].data, failure
    assert "-9" in failure[0].data or "SIGKILL" in failure[0].data, failure[0].data
    message = next(m for m in server["hook"] if str(run_id) in m.get("body", ""))
    assert "Crashed" in message["subject"] and f"/runs/flow-run/{run_id}" in message["body"], message
