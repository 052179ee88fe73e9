"""The GPU pool (tasks/pool/) on a simulated 2-GPU worker against the session's real Prefect test server:
CUDA_VISIBLE_DEVICES=0,1 on this CPU machine is what the pool reads as the worker's GPUs, and setup sizes the
pool to 2. Runs are flow runs in threads of this process; the ones that train do so in child processes."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from uuid import UUID

import pytest

from tasks.config import PROJECT_ROOT, LoraArgs, SpeedArgs, TrainArgs
from tasks.on_disk.manifest import read_manifest
from tasks.pool.cpus import CPU_LIMIT, THREADS_VARIABLE, cpu_threads
from tasks.pool.gpus import GPU_LIMIT, WAITING_STATE, device_limit, gpu_slot
from tests.conftest import (
    cli,
    cli_env,
    finish,
    free_port,
    session_processes,
    small_overrides,
    start_prefect_server,
    stop_group,
    wait_for_server,
)


@pytest.fixture
def two_gpu_pool(prefect_env: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The session server's pool sized to a 2-GPU worker for one test, then back to this machine's CPU pool."""
    from deployments.setup import ensure_gpu_limit

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert "created 'qlora-gpu-1'" in ensure_gpu_limit(2)
    try:
        yield
    finally:
        ensure_gpu_limit(0)


def _limit(name: str) -> Any:
    from prefect import get_client

    with get_client(sync_client=True) as client:
        return client.read_global_concurrency_limit_by_name(name)


def _task_states(task_run_id: str) -> list[str]:
    from prefect import get_client

    with get_client(sync_client=True) as client:
        return [s.name for s in client.read_task_run_states(UUID(task_run_id))]


def _wait_for(condition: Any, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.3)


@pytest.mark.slow  # three flows, one waits on purpose
def test_runs_share_the_pool_on_different_gpus_and_a_third_waits(two_gpu_pool: None) -> None:
    from prefect import flow, task
    from prefect.runtime import flow_run, task_run

    held: dict[str, list[str] | None] = {}
    task_runs: dict[str, str] = {}
    flow_runs: dict[str, str] = {}
    release = {name: threading.Event() for name in ("a", "b", "c", "both")}

    @task
    def train(name: str, gpus: int) -> None:
        task_runs[name] = str(task_run.id)
        flow_runs[name] = str(flow_run.id)
        with gpu_slot(gpus) as devices:
            held[name] = devices
            assert release[name].wait(120)

    @flow
    def run(name: str, gpus: int = 1) -> None:
        train(name, gpus)

    threads = {n: threading.Thread(target=run, args=(n,)) for n in ("a", "b")}
    for thread in threads.values():
        thread.start()
    _wait_for(lambda: len(held) == 2)
    assert sorted(held["a"] + held["b"]) == ["0", "1"]  # both at once, on different GPUs
    assert _limit(GPU_LIMIT).active_slots == 2
    assert [_limit(device_limit(i)).active_slots for i in (0, 1)] == [1, 1]

    threads["c"] = threading.Thread(target=run, args=("c",))
    threads["c"].start()
    _wait_for(lambda: "c" in task_runs and WAITING_STATE in _task_states(task_runs["c"]))
    time.sleep(2)
    assert "c" not in held  # still waiting: no free GPU
    release["a"].set()
    _wait_for(lambda: "c" in held)
    assert held["c"] == held["a"]  # the GPU that a's end freed
    for name in ("b", "c"):
        release[name].set()
        threads[name].join(60)
    _wait_for(lambda: _limit(GPU_LIMIT).active_slots == 0)
    assert _task_states(task_runs["c"])[-3:] == [WAITING_STATE, "Running", "Completed"]
    assert _flow_run_states(flow_runs["c"])[-3:] == [WAITING_STATE, "Running", "Completed"]  # the runs list too
    assert WAITING_STATE not in _flow_run_states(flow_runs["a"])

    both = threading.Thread(target=run, args=("both", 2))
    both.start()
    _wait_for(lambda: "both" in held)
    assert sorted(held["both"]) == ["0", "1"] and _limit(GPU_LIMIT).active_slots == 2
    release["both"].set()
    both.join(60)


def test_more_gpus_than_the_pool_has_is_a_user_error(two_gpu_pool: None) -> None:
    from prefect import flow

    from tasks.errors import UserError

    @flow
    def run() -> None:
        with gpu_slot(3):
            pass

    with pytest.raises(UserError, match=r"speed.num_gpus=3, but the GPU pool .* has 2 slot\(s\).*--gpus 3"):
        run()


@pytest.mark.slow
def test_two_single_gpu_trainings_run_at_once_on_different_gpus(two_gpu_pool: None, stages: dict[str, Any],
                                                                tmp_path: Path) -> None:
    """Real train_adapter runs: each trains in a child process that sees only its GPU, at the same time."""
    from prefect import flow

    from tasks.train_adapter import launch
    from tasks.train_adapter.stage import train_adapter

    @flow
    def run(seed: int) -> str:
        train = TrainArgs(max_steps=3, save_steps=10, logging_steps=1, per_device_train_batch_size=4, seed=seed)
        return train_adapter(LoraArgs(r=4, lora_alpha=8), train, SpeedArgs(packing=False),
                             tmp_path / "runs", stages["data"], stages["model"])

    folders: dict[int, Path] = {}
    threads = [threading.Thread(target=lambda s=s: folders.__setitem__(s, Path(run(s)))) for s in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(600)
    manifests = {s: read_manifest(f) for s, f in folders.items()}
    assert sorted(m.metrics.devices[0] for m in manifests.values()) == ["0", "1"]
    for manifest, folder in zip(manifests.values(), folders.values(), strict=True):
        assert f"CUDA_VISIBLE_DEVICES={manifest.metrics.devices[0]}," in (folder / launch.LOG).read_text()
    (one, two) = manifests.values()
    assert one.started_at < two.started_at + two.seconds and two.started_at < one.started_at + one.seconds

    # a 2-GPU run taking both slots: the first test, through the same gpu_slot (a gloo run here costs ~80 s more)


@pytest.mark.slow
def test_a_sweeps_candidates_train_at_once_each_as_it_would_alone(two_gpu_pool: None, small_data: Path,
                                                                  tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A 2-candidate sweep: both train at the same time, each in a child process on its own GPU, and each adapter
    is byte for byte the one the same candidate's training gives alone."""
    from prefect import flow

    from flows.qlora_sweep import qlora_sweep
    from tasks.config import load_config
    from tasks.prepare_data.stage import prepare_data
    from tasks.prepare_model.stage import prepare_model
    from tasks.train_adapter import launch
    from tasks.train_adapter.stage import train_adapter
    from tests.conftest import small_overrides

    # one thread per training, alone or not: the CPU share would otherwise give the pair 1 thread each and a
    # lone training 2, and CPU kernels sum in another order with another thread count (not so on a GPU)
    monkeypatch.setenv(THREADS_VARIABLE, "1")
    runs = tmp_path / "runs"
    base = load_config(None, small_overrides(small_data, runs, **{"train.max_steps": 3,
                                                                 "eval.generation_samples": 2}))
    state = qlora_sweep(config=base, candidates=[{"lora.r": 4}, {"lora.r": 8}], return_state=True)
    assert state.is_completed(), state.message
    candidates = {c["name"]: c for c in state.result()["candidates"]}
    manifests = {name: read_manifest(Path(c["adapter_dir"])) for name, c in candidates.items()}
    assert sorted(m.metrics.devices[0] for m in manifests.values()) == ["0", "1"]
    for name, manifest in manifests.items():
        log = (Path(candidates[name]["adapter_dir"]) / launch.LOG).read_text()
        assert f"CUDA_VISIBLE_DEVICES={manifest.metrics.devices[0]}," in log  # in a child process, on that GPU
    one, two = manifests.values()
    assert one.started_at < two.started_at + two.seconds and two.started_at < one.started_at + one.seconds

    @flow
    def alone(r: int) -> str:
        data_dir = prepare_data.fn(base.data, base.model, runs)  # the sweep's, reused
        model_dir = prepare_model.fn(base.model, runs)
        return train_adapter(base.lora.model_copy(update={"r": r}), base.train, base.speed, tmp_path / "alone",
                             data_dir, model_dir)

    for name, candidate in candidates.items():
        folder = Path(alone(candidate["overrides"]["lora.r"]))
        assert folder != Path(candidate["adapter_dir"])  # trained again, not reused
        assert _sha256(folder / "adapter" / "adapter_model.safetensors") == _sha256(
            Path(candidate["adapter_dir"]) / "adapter" / "adapter_model.safetensors"), name


def _sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_cpu_threads_share_the_cores_and_an_explicit_count_wins(prefect_env: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from prefect.concurrency.sync import concurrency

    from tasks.pool import cpus

    monkeypatch.delenv(cpus.THREADS_VARIABLE, raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpus, "host_cores", lambda: 12)  # a bigger host than this one, for distinct shares
    monkeypatch.setattr(cpus.os, "getloadavg", lambda: (0.5, 0.5, 0.5))  # and an idle one
    with concurrency(CPU_LIMIT, occupy=3, lease_duration=60):  # three other runs compute now
        assert cpu_threads("test") == 3
        assert cpus.cpu_share_threads()[1].startswith("4 run(s) computing on 12 cores (active slots of 'qlora-cpu'")
        assert cpu_threads("test", holding=True) == 4  # this run is one of the three
        assert cpu_threads("test", processes=2) == 1
    assert cpu_threads("test") == 12
    # a host busy with other work: the server counts this run alone, the load says the cores are taken (a run
    # started by a worker took both cores of a host at load 11, and its two threads waited for each other)
    monkeypatch.setattr(cpus, "host_cores", lambda: 2)
    monkeypatch.setattr(cpus.os, "getloadavg", lambda: (11.0, 9.0, 6.0))
    assert cpus.cpu_share_threads() == (1, "1 run(s) computing on 2 cores (active slots of 'qlora-cpu', this run "
                                           "included); load average 11.0 on 2 cores: 1 thread(s) (set "
                                           "QLORA_CPU_THREADS to choose)")
    monkeypatch.setenv(cpus.THREADS_VARIABLE, "5")
    assert cpu_threads("test") == 5


# ---- a Prefect server restart, and SIGTERM while waiting (tasks/pool/leases.py) ----------------------------------


def _holder(gpus: int, folder: Path, env: dict[str, str]) -> subprocess.Popen:
    """A run in a process of its own that holds `gpus` GPUs of the pool until folder/release exists."""
    folder.mkdir()
    return subprocess.Popen([sys.executable, "-m", "tests.pool_holder", str(gpus), str(folder)], cwd=PROJECT_ROOT,
                            env=env, stdout=(folder / "log").open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def _held(folder: Path, proc: subprocess.Popen, timeout: float = 240) -> str:
    _wait_for(lambda: (folder / "held").exists() or proc.poll() is not None, timeout)
    assert (folder / "held").exists(), (folder / "log").read_text()[-3000:]
    return (folder / "held").read_text()


def _active() -> dict[str, int]:
    from prefect import get_client

    with get_client(sync_client=True) as client:
        return {limit.name: limit.active_slots for limit in client.read_global_concurrency_limits(limit=200)}


def _flow_run_states(flow_run_id: str) -> list[str]:
    from prefect import get_client

    with get_client(sync_client=True) as client:
        return [s.name for s in client.read_flow_run_states(UUID(flow_run_id))]


def _pipeline_run() -> Any:
    """The one qlora-pipeline flow run on the server, or None."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["qlora-pipeline"])))
    return runs[0] if runs else None


@pytest.mark.slow
@pytest.mark.kill
def test_a_server_restart_frees_the_dead_runs_slots_and_keeps_the_live_ones(tmp_path: Path, small_data: Path) -> None:
    """A real `prefect server start` (leases in its memory, Prefect's default) with a 2-GPU pool; run A holds a
    GPU through a restart, run B was killed before it. After the restart `setup` repairs the counts, A re-claims
    its GPU first (a new run C is placed on B's), and nothing stays taken once they end. A CLI run D that waits for
    both GPUs shows "Waiting for GPU" on its flow run and ends within seconds of SIGTERM, Crashed."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from tasks.pool.leases import GRACE_SECONDS

    port, home = free_port(), tmp_path / "prefect"
    url = f"http://127.0.0.1:{port}/api"
    env = {**cli_env(tmp_path / "client"), "PREFECT_API_URL": url, "CUDA_VISIBLE_DEVICES": "0,1",
           "PYTHONPATH": str(PROJECT_ROOT)}
    server = start_prefect_server(home, port)
    procs: list[subprocess.Popen] = []
    try:
        wait_for_server(port)
        setup = [sys.executable, "-m", "deployments.cli", "setup", "--gpus", "2"]
        assert subprocess.run(setup, env=env, cwd=PROJECT_ROOT, timeout=300).returncode == 0
        procs += [_holder(1, tmp_path / "a", env), _holder(1, tmp_path / "b", env)]
        a, b = procs
        held = {"a": _held(tmp_path / "a", a), "b": _held(tmp_path / "b", b)}
        assert sorted(held.values()) == ["0", "1"]
        os.killpg(b.pid, signal.SIGKILL)  # B dies holding its GPU
        os.kill(a.pid, signal.SIGSTOP)  # A sleeps through the restart, so `setup` is first to see it
        stop_group(server)
        server = start_prefect_server(home, port)
        wait_for_server(port)
        done = subprocess.run(setup, env=env, cwd=PROJECT_ROOT, timeout=300, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-3000:]
        repaired = time.monotonic()
        out = " ".join(done.stdout.split())
        assert "repaired: the server held no leases for these slots" in out, out
        assert "qlora-gpu 2 -> 0; qlora-gpu-0 1 -> 0; qlora-gpu-1 1 -> 0" in out, out
        assert "PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE=prefect.server.concurrency.lease_storage.filesystem" in out

        os.kill(a.pid, signal.SIGCONT)
        procs.append(_holder(1, tmp_path / "c", env))  # a new run, while A has priority on its own GPU
        runs = tmp_path / "runs"
        overrides = small_overrides(small_data, runs, **{"speed.num_gpus": 2})
        procs.append(cli(["run", *sum((["--set", o] for o in overrides), [])], env, tmp_path / "d"))
        c, d = procs[2:]
        assert _held(tmp_path / "c", c) == held["b"]  # the dead run's GPU; A's stayed A's
        assert time.monotonic() - repaired > GRACE_SECONDS - 15  # C waited for A to re-claim first
        assert "re-claimed its 1 slot(s)" in (tmp_path / "a" / "log").read_text()
        with temporary_settings({PREFECT_API_URL: url}):
            assert WAITING_STATE in _flow_run_states((tmp_path / "c" / "flow-run").read_text())
            assert {k: v for k, v in _active().items() if k.startswith(GPU_LIMIT)} == {
                GPU_LIMIT: 2, device_limit(0): 1, device_limit(1): 1, f"{GPU_LIMIT}-placement": 0,
                f"{GPU_LIMIT}-leases": 1}

            # D waits for both GPUs, visibly on its flow run, until SIGTERM ends it
            _wait_for(lambda: (run := _pipeline_run()) is not None and run.state.name == WAITING_STATE, 300)
            stopping = time.monotonic()
            os.kill(d.pid, signal.SIGTERM)
            _, err = finish(d, tmp_path / "d", timeout=60)
            assert time.monotonic() - stopping < 15, err[-3000:]
            assert d.returncode == 143 and "stopped: the run got SIGTERM" in " ".join(err.split()), err[-3000:]
            _wait_for(lambda: not session_processes(d.pid), 10)
            assert _pipeline_run().state.type.value == "CRASHED"

            for name in ("a", "c"):
                (tmp_path / name / "release").touch()
            assert [p.wait(timeout=60) for p in (a, c)] == [0, 0]
            _wait_for(lambda: not any(v for k, v in _active().items() if k != f"{GPU_LIMIT}-leases"), 30)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        stop_group(server)


def test_the_cpu_share_says_what_it_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a server the share comes from the load average, and the line says so (not a count of runs)."""
    from tasks.pool import cpus

    monkeypatch.delenv(cpus.THREADS_VARIABLE, raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpus, "uses_server", lambda: False)
    monkeypatch.setattr(cpus, "host_cores", lambda: 2)
    monkeypatch.setattr(cpus.os, "getloadavg", lambda: (76.0, 40.0, 20.0))  # a host busy with other work
    assert cpus.cpu_share_threads() == (1, "load average 76.0 on 2 cores: 1 thread(s) (set QLORA_CPU_THREADS "
                                           "to choose)")
    monkeypatch.setattr(cpus.os, "getloadavg", lambda: (0.3, 0.2, 0.1))
    assert cpus.cpu_share_threads(processes=2) == (
        1, "load average 0.3 on 2 cores: 1 thread(s) for each of 2 processes (set QLORA_CPU_THREADS to choose)")
    monkeypatch.setenv(cpus.THREADS_VARIABLE, "2")
    assert cpus.cpu_share_threads() == (2, "2 thread(s) per process (QLORA_CPU_THREADS is set)")


# ---- a run that waits for the GPU says so -------------------------------------------------------------------------


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
