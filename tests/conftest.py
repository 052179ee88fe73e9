"""Shared fixtures and helpers: an isolated Prefect test server, a vLLM server started by docs/serving.md's own
command, the first two stages on the real tiny model, small configs, and the CLI as a subprocess."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tasks.config import EMBEDDED_DATA, PROJECT_ROOT, load_config

SMALL_ROWS = 240  # enough for a few optimizer steps and a non-empty eval split
MODULES_SHOWN = 15  # the slowest test modules each run names, beside pytest's slowest tests (--durations)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Every run says what it cost per module: the seconds of each test module's setups, calls and teardowns
    together (module fixtures, servers included), slowest first, and the run's total."""
    totals: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            if hasattr(report, "nodeid") and hasattr(report, "duration") and hasattr(report, "when"):
                module = report.nodeid.split("::")[0]
                totals[module] = totals.get(module, 0.0) + report.duration
    if not totals:
        return
    terminalreporter.write_sep("=", f"slowest {min(MODULES_SHOWN, len(totals))} modules")
    for module, seconds in sorted(totals.items(), key=lambda item: -item[1])[:MODULES_SHOWN]:
        terminalreporter.write_line(f"{seconds:9.1f}s {module}")
    terminalreporter.write_line(f"{sum(totals.values()):9.1f}s in all test modules")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """How the suite is shared among pytest-xdist's workers (`-n`, pyproject's addopts; `--dist loadgroup`).

    A module's tests run in one worker, so its module fixtures (a Prefect server, trained stages, an MLflow server)
    are built once; the modules that use the session's vLLM server share one worker, so one server starts, not one
    per worker. Modules with the most slow tests go first: a worker that takes a long module last would end the run
    alone."""
    vllm = {item.path for item in items if "vllm_server" in getattr(item, "fixturenames", ())}
    slow: dict[Path, int] = {}
    for item in items:
        slow[item.path] = slow.get(item.path, 0) + (item.get_closest_marker("slow") is not None)
        group = "vllm" if item.path in vllm else item.path.name
        item.add_marker(pytest.mark.xdist_group(group))
    weight = {path: sum(slow[p] for p in vllm) if path in vllm else count for path, count in slow.items()}
    items.sort(key=lambda item: -weight[item.path])  # stable: a module's own order stays


@pytest.fixture(scope="session")
def prefect_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A temporary Prefect server and result storage (the harness does not isolate result storage)."""
    from prefect.settings import PREFECT_RESULTS_LOCAL_STORAGE_PATH, temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    storage = tmp_path_factory.mktemp("prefect-results")
    # a busy 2-core machine can take longer than the harness's default 30 s to start the server
    harness = prefect_test_harness(server_startup_timeout=300)
    with temporary_settings({PREFECT_RESULTS_LOCAL_STORAGE_PATH: storage}), harness:
        from deployments.setup import ensure_gpu_limit

        ensure_gpu_limit()  # train_adapter takes it strictly, as on a set-up server
        yield storage


VLLM_PYTHON = Path(os.environ.get("QLORA_VLLM_PYTHON", PROJECT_ROOT / ".venv-vllm" / "bin" / "python"))
VLLM_INSTALL = "docs/serving.md's install command (section vLLM) in this checkout"
VLLM_STARTUP_S = 400  # a loaded 2-core machine: about a minute alone, several when other tests run beside it
VLLM_API_KEY = "test-key-not-a-secret"
# docs/serving.md's command that starts a server the pipeline can update, marked for the tests
_DOCUMENTED_SERVER = re.compile(r"<!-- serving-test: vllm-server -->\n```bash\n(.*?)\n```", re.S)


def documented_vllm_command(port: int) -> str:
    """The script docs/serving.md gives to start vLLM, as written but for its port (and QLORA_VLLM_PYTHON if set)."""
    found = _DOCUMENTED_SERVER.findall((PROJECT_ROOT / "docs" / "serving.md").read_text())
    assert len(found) == 1 and "--port 8000" in found[0], "docs/serving.md marks one vLLM command on port 8000"
    return found[0].replace("--port 8000", f"--port {port}").replace(".venv-vllm/bin/python", str(VLLM_PYTHON))


def require_vllm() -> None:
    """Skip (fail in CI) where vLLM's environment is not installed."""
    if not VLLM_PYTHON.is_file():
        missing = f"vLLM's CPU build is not installed at {VLLM_PYTHON}: run {VLLM_INSTALL}"
        if os.environ.get("CI"):
            pytest.fail(missing)
        pytest.skip(missing)


def wait_for_vllm(proc: subprocess.Popen, url: str, log: Path) -> None:
    """Return once the server at `url` answers /health; fail with its log if it exits or takes too long."""
    import urllib.request

    deadline = time.time() + VLLM_STARTUP_S
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"vLLM exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(1)
    stop_group(proc)
    pytest.fail(f"vLLM did not answer /health within {VLLM_STARTUP_S} s:\n{log.read_text()[-4000:]}")


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One vLLM server for the session, started by docs/serving.md's command as a user runs it (the embedded base
    model alone; runs load their champions into it), with an API key (VLLM_API_KEY, which vLLM reads); its URL.
    Tests isolate themselves by their adapter names. Stopped (its process group) at the end."""
    require_vllm()
    port, log = free_port(), tmp_path_factory.mktemp("vllm") / "server.log"
    env = {**os.environ, "VLLM_API_KEY": VLLM_API_KEY, "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(["bash", "-e", "-c", documented_vllm_command(port)], cwd=PROJECT_ROOT, env=env,
                            stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_vllm(proc, url, log)
        yield url
    finally:
        stop_group(proc)


@pytest.fixture(scope="session")
def stages(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """prepare_data (200 sample rows) and prepare_model (the embedded tiny Llama) through .fn(), once per session;
    tests that need them read these folders and write their own stages into other runs_dirs or keys."""
    from tasks.config import DataArgs, ModelArgs
    from tasks.prepare_data.stage import prepare_data
    from tasks.prepare_model.stage import prepare_model

    runs = tmp_path_factory.mktemp("runs")
    data = tmp_path_factory.mktemp("data") / "d.jsonl"
    data.write_text("".join(EMBEDDED_DATA.read_text().splitlines(keepends=True)[:200]))
    return {"runs": runs, "data": prepare_data.fn(DataArgs(source=str(data)), ModelArgs(), runs),
            "model": prepare_model.fn(ModelArgs(), runs)}


@pytest.fixture
def small_data(tmp_path: Path) -> Path:
    """The first SMALL_ROWS sample records, in a file the test may edit."""
    path = tmp_path / "small.jsonl"
    path.write_text("".join(EMBEDDED_DATA.read_text().splitlines(keepends=True)[:SMALL_ROWS]))
    return path


def settled(*paths: Path) -> None:
    """Wait until each file's last change is old enough for its hash to be memoised (tasks/hashing/files.py
    _SETTLED_NS), as the files of a nightly run usually are."""
    from tasks.hashing.files import _SETTLED_NS

    for path in paths:
        time.sleep(max(0.0, (path.stat().st_ctime_ns + _SETTLED_NS - time.time_ns()) / 1e9 + 0.05))


def small_overrides(data: Path, runs_dir: Path, **extra: Any) -> list[str]:
    """--set overrides for a run of a few seconds: small data, few steps, frequent checkpoints."""
    values = {"runs_dir": str(runs_dir), "data.source": str(data), "train.max_steps": 6,
              "train.save_steps": 2, "train.logging_steps": 1, "train.per_device_train_batch_size": 4,
              "eval.max_samples": 16, **extra}
    return [f"{k}={v}" for k, v in values.items()]


def run_flow(overrides: list[str]) -> dict[str, Any]:
    """Run the flow in this process (under the test server) and return its summary."""
    from flows.qlora_pipeline import qlora_pipeline

    return qlora_pipeline(config=load_config(None, overrides))


def statuses(summary: dict[str, Any]) -> dict[str, str]:
    return {stage: info["status"] for stage, info in summary["stages"].items()}


def cli(args: list[str], env: dict[str, str], logs: Path) -> subprocess.Popen:
    """Start the real `qlora-pipeline` command in its own process group (so a kill reaches its server).

    Output goes to logs.out / logs.err files, never to pipes: a pipe nobody reads fills up and blocks the
    run mid-training (while it holds a stage lock).
    """
    return subprocess.Popen([sys.executable, "-m", "deployments.cli", *args], cwd=PROJECT_ROOT, env=env,
                            stdout=logs.with_suffix(".out").open("w"), stderr=logs.with_suffix(".err").open("w"),
                            start_new_session=True)


def wait_for_checkpoint(proc: subprocess.Popen, runs_dir: Path, logs: Path, timeout: float = 600) -> None:
    """Wait until a cli() run's training has written a complete checkpoint under runs_dir; fail with the run's
    stderr if it exits first, or after timeout."""
    deadline = time.time() + timeout
    while not list((runs_dir / "train_adapter").glob("*/checkpoints/checkpoint-*/complete")):
        assert proc.poll() is None, logs.with_suffix(".err").read_text()[-3000:]
        assert time.time() < deadline, "no checkpoint written in time"
        time.sleep(0.2)


def finish(proc: subprocess.Popen, logs: Path, timeout: float) -> tuple[str, str]:
    """Wait for a cli() process; its stdout and stderr."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        raise
    return logs.with_suffix(".out").read_text(), logs.with_suffix(".err").read_text()


def cli_env(prefect_home: Path) -> dict[str, str]:
    """Environment for a CLI subprocess with its own Prefect home (ephemeral server, SQLite)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(prefect_home), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PYTHONUNBUFFERED="1")
    return env


def last_json(stdout: str) -> dict[str, Any]:
    return json.loads(stdout.strip().splitlines()[-1])


def task_states(flow_run_id: Any) -> dict[str, list[str]]:
    """The states of a flow run's task runs, by stage, oldest first."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    states: dict[str, list[str]] = {}
    for run in sorted(runs, key=lambda r: r.expected_start_time or r.created):
        # Prefect 3 records task runs from events: a run can be read before its first state lands.
        states.setdefault(run.task_key.split("-")[0], []).append(run.state.name if run.state else "(no state yet)")
    return states


def settled_task_states(flow_run_id: Any, timeout: float = 60) -> dict[str, list[str]]:
    """task_states once no task run is without a state, Pending or Running (or after timeout): states reach
    the server as events, and may land after the flow run's own final state."""
    deadline = time.time() + timeout
    while True:
        states = task_states(flow_run_id)
        unsettled = [s for v in states.values() for s in v if s in ("(no state yet)", "Pending", "Running")]
        if not unsettled or time.time() > deadline:
            return states
        time.sleep(1)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_prefect_server(home: Path, port: int) -> subprocess.Popen:
    """`prefect server start` on localhost:port with its own PREFECT_HOME (SQLite, leases as Prefect's default
    keeps them), in its own process group; its output goes to home/server.log. Wait with wait_for_server."""
    home.mkdir(parents=True, exist_ok=True)
    env = {**cli_env(home), "PREFECT_API_URL": f"http://127.0.0.1:{port}/api"}
    return subprocess.Popen([str(Path(sys.executable).parent / "prefect"), "server", "start", "--host", "127.0.0.1",
                             "--port", str(port)], env=env, cwd=home, stdout=(home / "server.log").open("a"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def wait_for_server(port: int, timeout: float = 180) -> None:
    import urllib.request

    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise AssertionError("prefect server did not become healthy")


def stop_group(proc: subprocess.Popen, timeout: float = 30) -> None:
    """SIGTERM to a process group started with start_new_session, SIGKILL if it outlives `timeout`."""
    import signal

    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def session_processes(sid: int) -> list[int]:
    """The processes still alive in session `sid` (a process started with start_new_session and its children)."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if os.getsid(int(proc.name)) == sid and (proc / "stat").read_text().split()[2] != "Z":
                found.append(int(proc.name))
        except (OSError, ProcessLookupError):  # ended meanwhile
            pass
    return found


def flow_run_in(state: Any) -> Any:
    """A run of the qlora-pipeline flow created on the server and set to `state` (a failure's card, --watch)."""
    from prefect import get_client

    from flows.qlora_pipeline import qlora_pipeline

    with get_client(sync_client=True) as client:
        run = client.create_flow_run(qlora_pipeline, parameters={})
        client.set_flow_run_state(run.id, state, force=True)
        return client.read_flow_run(run.id)


def flow_run_logs(state: Any) -> list[Any]:
    """The log records the API holds for the flow run that ended in `state`, once the local handlers have sent
    theirs (the API log handler sends in batches)."""
    import logging

    from prefect import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    for name in ("prefect.flow_runs", "prefect.task_runs"):
        for handler in logging.getLogger(name).handlers:
            handler.flush()
    with get_client(sync_client=True) as client:
        return client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(
            any_=[state.state_details.flow_run_id])))


@contextmanager
def reporting_to(url: str) -> Iterator[None]:
    """Flow runs of this process report to the Prefect API at `url` while in the block, and to the session's server
    after it. Prefect's events and log workers are one per process, bound to the API of the moment they started: a
    flow run here under another server's URL would otherwise send every later run's events (which make its task
    runs) to that server, stopped by then, and Prefect's test harness would wait for them at the session's end."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.settings import PREFECT_API_URL, temporary_settings

    def drain() -> None:
        for worker in (EventsWorker, APILogWorker):
            worker.drain_all(timeout=30)

    drain()
    try:
        with temporary_settings({PREFECT_API_URL: url}):
            yield
            drain()
    finally:
        drain()


def killed_at_a_checkpoint(script: str, folder: Path, log: Path, timeout: float = 600) -> int:
    """Run `script` (python -c) in its own process group, SIGKILL it once its training under stage folder `folder`
    has written a complete checkpoint; the newest complete checkpoint's step."""
    import signal

    proc = subprocess.Popen([sys.executable, "-c", script], cwd=PROJECT_ROOT, start_new_session=True,
                            stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.time() + timeout
    try:
        while not list(folder.glob("checkpoints/checkpoint-*/complete")):
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.time() < deadline, "no checkpoint written in time"
            time.sleep(0.1)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return max(int(p.parent.name.split("-")[1]) for p in folder.glob("checkpoints/checkpoint-*/complete"))


def damaged_copy(adapter: Path, copy: Path) -> Path:
    """A copy of the adapter folder `adapter` at `copy` (a plain folder: no recorded hashes to catch the damage before
    the weights are tried) whose layer-3 down_proj LoRA B weights are 1e28."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(adapter, copy)
    weights = load_file(copy / "adapter_model.safetensors")
    save_file({k: v.fill_(1e28) if "layers.3.mlp.down_proj.lora_B" in k else v for k, v in weights.items()},
              copy / "adapter_model.safetensors")
    return copy
