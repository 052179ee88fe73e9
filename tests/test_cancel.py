"""Stopping a run from outside: Cancel after a Prefect server restart (flows/cancellation.py), Cancel of a run started
in a terminal, and SIGTERM to a worker's flow-run process alone. Against real servers and a real process worker."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tasks.config import PROJECT_ROOT
from tests.conftest import (
    cli,
    cli_env,
    finish,
    free_port,
    small_overrides,
    start_prefect_server,
    stop_group,
    task_states,
    wait_for_server,
)

pytestmark = [pytest.mark.slow, pytest.mark.kill]  # real servers, a worker, trainings stopped from outside


def _wait_for(check: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while not (found := check()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f} s"
        time.sleep(0.5)
    return found


def _state(run_id: Any) -> Any:
    from prefect import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(run_id).state


def _processes() -> dict[int, tuple[int, bytes]]:
    """Every live process: pid -> (parent pid, environment)."""
    found = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            if stat[0] != "Z":
                found[int(proc.name)] = (int(stat[1]), (proc / "environ").read_bytes())
        except (OSError, IndexError, ValueError):
            pass
    return found


def _flow_run_pids(run_id: Any) -> list[int]:
    """The processes running flow run `run_id` (their environment names it) and their descendants (the training
    child, whose environment does not)."""
    marker = f"PREFECT__FLOW_RUN_ID={run_id}".encode()
    processes = _processes()
    found = {pid for pid, (_, environ) in processes.items() if marker in environ.split(b"\0")}
    while grown := {pid for pid, (parent, _) in processes.items() if parent in found} - found:
        found |= grown
    return sorted(found)


def _training(run_id: Any, runs: Path) -> None:
    """Wait until the run's train_adapter runs and has written a complete checkpoint."""
    _wait_for(lambda: task_states(run_id).get("train_adapter", [""])[-1] == "Running"
              and list(runs.glob("train_adapter/*/checkpoints/checkpoint-*/complete")), 600, "training")


def _long_config(runs: Path, data: Path) -> dict[str, Any]:
    return {"runs_dir": str(runs), "data": {"source": str(data)},
            "train": {"max_steps": 5000, "save_steps": 2, "logging_steps": 1, "per_device_train_batch_size": 4},
            "eval": {"max_samples": 8}}


@pytest.fixture(scope="module")
def worker_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A `prefect server start` of this module's own (the test restarts it), set up for a 1-GPU worker, with the
    embedded-default deployment and a `qlora-pipeline worker`."""
    from prefect import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.utilities.callables import parameter_schema

    from flows.qlora_pipeline import qlora_pipeline

    home, port = tmp_path_factory.mktemp("cancel-server"), free_port()
    url = f"http://127.0.0.1:{port}/api"
    # a 1-GPU worker, simulated as tests/test_gpu_pool.py does: its runs train in a child process of the flow run
    env = {**cli_env(home / "client"), "PREFECT_API_URL": url, "PYTHONPATH": str(PROJECT_ROOT),
           "CUDA_VISIBLE_DEVICES": "0"}
    state = {"server": start_prefect_server(home / "server", port)}
    worker = None
    try:
        wait_for_server(port)
        done = subprocess.run([sys.executable, "-m", "deployments.cli", "setup", "--gpus", "1"], env=env,
                              cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        with temporary_settings({PREFECT_API_URL: url}):
            with get_client(sync_client=True) as client:  # what `qlora-pipeline deploy` registers, for one flow
                deployment = client.create_deployment(
                    client.create_flow_from_name("qlora-pipeline"), "embedded-default", work_pool_name="qlora-process",
                    entrypoint="flows/qlora_pipeline.py:qlora_pipeline", parameters={"config": {}},
                    parameter_openapi_schema=parameter_schema(qlora_pipeline).model_dump_for_openapi(),
                    pull_steps=[{"prefect.deployments.steps.set_working_directory": {
                        "directory": "{{ $QLORA_PIPELINE_ROOT }}"}}], enforce_parameter_schema=True)
        log = home / "worker.log"
        worker = subprocess.Popen([sys.executable, "-m", "deployments.cli", "worker"], env=env, cwd=home,
                                  stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
        # outside the block: the module's other tests run against the session's server (its tests set this one's URL
        # themselves); yielded inside, a terminal's run of the next test met this server's 1-GPU pool
        yield {"home": home, "port": port, "url": url, "state": state, "deployment": deployment, "log": log}
    finally:
        if worker is not None:
            stop_group(worker)
        stop_group(state["server"])


def _start(worker_server: dict[str, Any], config: dict[str, Any]) -> Any:
    from prefect import get_client

    with get_client(sync_client=True) as client:
        return client.create_flow_run_from_deployment(worker_server["deployment"], parameters={"config": config}).id


def test_cancel_after_a_server_restart_stops_the_run(worker_server: dict[str, Any], small_data: Path,
                                                     tmp_path: Path) -> None:
    """The server goes away for longer than the worker's cancellation observer waits ("Cancellation observer failed.
    Flow run cancellation disabled."), comes back, and Cancel is pressed: the run stops itself within its watcher's
    grace, ends Cancelled, no process of it stays, and its latest checkpoint is kept."""
    from prefect import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.states import Cancelling

    from flows.cancellation import GRACE_S, POLL_S

    runs = tmp_path / "runs"
    with temporary_settings({PREFECT_API_URL: worker_server["url"]}):
        run_id = _start(worker_server, _long_config(runs, small_data))
        _training(run_id, runs)
        stop_group(worker_server["state"]["server"])
        time.sleep(45)  # three failed polls of the observer (every 10 s), and then some
        worker_server["state"]["server"] = start_prefect_server(worker_server["home"] / "server", worker_server["port"])
        wait_for_server(worker_server["port"])
        log = worker_server["log"]
        _wait_for(lambda: "Cancellation observer failed" in log.read_text(), 120, "the observer failing")
        assert _state(run_id).type.value == "RUNNING" and _flow_run_pids(run_id)

        with get_client(sync_client=True) as client:  # what the UI's Cancel does
            client.set_flow_run_state(run_id, Cancelling(message="cancelled from the UI"))
        pressed = time.monotonic()
        _wait_for(lambda: _state(run_id).type.value == "CANCELLED", GRACE_S + 4 * POLL_S + 90, "Cancelled")
        _wait_for(lambda: not _flow_run_pids(run_id), 60, "the run's processes ending")
        took = time.monotonic() - pressed
        assert took < GRACE_S + 4 * POLL_S + 60, took
        assert "the run stopped itself" in _state(run_id).message, _state(run_id)
    (folder,) = [f for f in runs.glob("train_adapter/*") if f.is_dir()]
    assert list(folder.glob("checkpoints/checkpoint-*/complete")) and not (folder / "manifest.json").exists()


def test_sigterm_to_a_workers_flow_run_process_alone_ends_it_promptly(worker_server: dict[str, Any],
                                                                      small_data: Path, tmp_path: Path) -> None:
    """systemd and Kubernetes signal one process: the flow-run process the worker started ends within seconds of
    SIGTERM, its training child with it (it stayed alive for minutes, waiting for the child), Crashed, with nothing of
    it left running, and the latest checkpoint kept."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    runs = tmp_path / "runs"
    with temporary_settings({PREFECT_API_URL: worker_server["url"]}):
        run_id = _start(worker_server, _long_config(runs, small_data))
        _training(run_id, runs)
        pids = _flow_run_pids(run_id)
        parents = {pid: _processes()[pid][0] for pid in pids}
        top = [pid for pid in pids if parents[pid] not in pids]  # the process the worker started
        assert len(top) == 1 and len(pids) > 1, (pids, parents)  # and the training child of the GPU pool's path
        os.kill(top[0], signal.SIGTERM)
        signalled = time.monotonic()
        _wait_for(lambda: not _flow_run_pids(run_id), 90, "the flow run's processes ending")
        took = time.monotonic() - signalled
        state = _wait_for(lambda: (s := _state(run_id)).is_final() and s, 90, "a final state")
        assert state.type.value == "CRASHED", state
        assert took < 45, f"the flow-run process took {took:.0f} s to end after SIGTERM"
    (folder,) = [f for f in runs.glob("train_adapter/*") if f.is_dir()]
    assert list(folder.glob("checkpoints/checkpoint-*/complete")) and not (folder / "manifest.json").exists()


def test_cancel_reaches_a_run_started_in_a_terminal(prefect_env: Path, small_data: Path, tmp_path: Path) -> None:
    """`qlora-pipeline run` against a server has no worker to stop it: Cancel in the UI stops it all the same, as
    Cancelled, with one paragraph and exit 143."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType
    from prefect.settings import PREFECT_API_URL
    from prefect.states import Cancelling

    runs = tmp_path / "runs"
    overrides = small_overrides(small_data, runs, **{"train.max_steps": 5000, "train.save_steps": 2})
    env = {**cli_env(tmp_path / "prefect"), "PREFECT_API_URL": PREFECT_API_URL.value()}
    proc = cli(["run", *sum((["--set", o] for o in overrides), [])], env, tmp_path / "run")
    try:
        _wait_for(lambda: list(runs.glob("train_adapter/*/checkpoints/checkpoint-*/complete")) or proc.poll(), 600,
                  "a checkpoint")
        assert proc.poll() is None, (tmp_path / "run.err").read_text()[-3000:]
        with get_client(sync_client=True) as client:
            (run,) = [r for r in client.read_flow_runs(flow_run_filter=FlowRunFilter(state=FlowRunFilterState(
                type=FlowRunFilterStateType(any_=["RUNNING"])))) if r.parameters["config"]["runs_dir"] == str(runs)]
            client.set_flow_run_state(run.id, Cancelling(message="cancelled from the UI"))
        _, err = finish(proc, tmp_path / "run", timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 143, err[-3000:]
    assert "cancelled: the run was cancelled (from the Prefect UI or its API) and ended as Cancelled" in " ".join(
        err.split()) and "Traceback" not in err, err[-3000:]
    assert _state(run.id).type.value == "CANCELLED"
    assert json.dumps(task_states(run.id)).count("Running") == 0, task_states(run.id)


def test_the_watcher_ends_with_its_run(prefect_env: Path) -> None:
    """A run that ends in this process stops its watcher at once (its final-state hooks), so no thread outlives it to
    poll a server that may be gone by then (a terminal's temporary server stops as the command ends)."""
    import threading

    from prefect import flow

    from flows.cancellation import stop_watching, watch_for_cancel

    @flow(on_running=[watch_for_cancel], on_completion=[stop_watching], on_failure=[stop_watching])
    def quick() -> str:
        from prefect.runtime import flow_run

        return str(flow_run.id)

    run_id = quick()
    _wait_for(lambda: not [t for t in threading.enumerate() if t.name == f"cancel-watch {run_id}"], 3,
              "the watcher ending")
