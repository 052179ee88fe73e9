"""The GPU pool (tasks/limits.py) on a simulated 2-GPU worker against the session's real Prefect test server:
CUDA_VISIBLE_DEVICES=0,1 on this CPU machine is what the pool reads as the worker's GPUs, and setup sizes the
pool to 2. Runs are flow runs in threads of this process; the ones that train do so in child processes."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from uuid import UUID

import pytest

from tasks.config import LoraArgs, SpeedArgs, TrainArgs
from tasks.limits import CPU_LIMIT, GPU_LIMIT, THREADS_VARIABLE, WAITING_STATE, cpu_threads, device_limit, gpu_slot
from tasks.manifest import read_manifest


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
    from prefect.runtime import task_run

    held: dict[str, list[str] | None] = {}
    task_runs: dict[str, str] = {}
    release = {name: threading.Event() for name in ("a", "b", "c", "both")}

    @task
    def train(name: str, gpus: int) -> None:
        task_runs[name] = str(task_run.id)
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

    from tasks import limits

    monkeypatch.delenv(limits.THREADS_VARIABLE, raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(limits, "host_cores", lambda: 12)  # a bigger host than this one, for distinct shares
    with concurrency(CPU_LIMIT, occupy=3, lease_duration=60):  # three other runs compute now
        assert cpu_threads("test") == 3
        assert limits.cpu_share_threads()[1].startswith("4 run(s) computing on 12 cores (active slots of 'qlora-cpu'")
        assert cpu_threads("test", holding=True) == 4  # this run is one of the three
        assert cpu_threads("test", processes=2) == 1
    assert cpu_threads("test") == 12
    monkeypatch.setenv(limits.THREADS_VARIABLE, "5")
    assert cpu_threads("test") == 5


def test_the_cpu_share_says_what_it_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a server the share comes from the load average, and the line says so (not a count of runs)."""
    from tasks import limits

    monkeypatch.delenv(limits.THREADS_VARIABLE, raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(limits, "uses_server", lambda: False)
    monkeypatch.setattr(limits, "host_cores", lambda: 2)
    monkeypatch.setattr(limits.os, "getloadavg", lambda: (76.0, 40.0, 20.0))  # a host busy with other work
    assert limits.cpu_share_threads() == (1, "load average 76.0 on 2 cores: 1 thread(s) (set QLORA_CPU_THREADS "
                                             "to choose)")
    monkeypatch.setattr(limits.os, "getloadavg", lambda: (0.3, 0.2, 0.1))
    assert limits.cpu_share_threads(processes=2) == (
        1, "load average 0.3 on 2 cores: 1 thread(s) for each of 2 processes (set QLORA_CPU_THREADS to choose)")
    monkeypatch.setenv(limits.THREADS_VARIABLE, "2")
    assert limits.cpu_share_threads() == (2, "2 thread(s) per process (QLORA_CPU_THREADS is set)")
