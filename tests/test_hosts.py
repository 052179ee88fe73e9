"""Several GPU hosts under one Prefect server (tasks/pool/hosts.py): a real `prefect server start`, two real process
workers started by `qlora-pipeline worker --host`, each with two simulated GPUs (CUDA_VISIBLE_DEVICES=0,1 on this
CPU machine, as in tests/test_gpu_pool.py), and real train_adapter runs (tests/host_training.py)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tasks.config import PROJECT_ROOT
from tasks.on_disk.manifest import read_manifest
from tasks.pool.gpus import WAITING_STATE
from tests.conftest import cli_env, free_port, reporting_to, start_prefect_server, stop_group, wait_for_server

FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


def _qlora(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deployments.cli", *args], env=env, cwd=PROJECT_ROOT,
                          capture_output=True, text=True, timeout=300)


def _limits() -> dict[str, Any]:
    from prefect import get_client

    with get_client(sync_client=True) as client:
        return {limit.name: limit for limit in client.read_global_concurrency_limits(limit=200)}


def test_each_host_has_its_own_limits_and_a_single_host_keeps_its_names(prefect_env: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from deployments.setup import ensure_gpu_limit

    before = {name: limit.limit for name, limit in _limits().items()}
    monkeypatch.setenv("QLORA_HOST", "gpu-a")
    said = ensure_gpu_limit(2)
    assert said.startswith("host 'gpu-a' (QLORA_HOST): GPU pool for 2 GPU(s): 'qlora-gpu@gpu-a' 2 slot(s)"), said
    try:
        names = set(_limits())
        assert {"qlora-gpu@gpu-a", "qlora-gpu@gpu-a-0", "qlora-gpu@gpu-a-1", "qlora-gpu@gpu-a-placement",
                "qlora-cpu@gpu-a"} <= names
        resized = ensure_gpu_limit(1)
        assert resized.count("deleted") == 1 and "deleted 'qlora-gpu@gpu-a-1'" in resized, resized
        assert "qlora-gpu@gpu-a-1" not in _limits()
        # the unnamed single host's pool is as it was
        assert {n: v for n, v in ((n, lim.limit) for n, lim in _limits().items()) if "@" not in n} == before
    finally:
        from prefect import get_client

        with get_client(sync_client=True) as client:
            for name in _limits():
                if name.endswith("@gpu-a") or "@gpu-a-" in name:
                    client.delete_global_concurrency_limit_by_name(name)


def test_pinning_to_an_unknown_host_or_a_bad_name_is_a_user_error(prefect_env: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from prefect import get_client

    from deployments.setup import ensure_work_pool
    from tasks.errors import UserError
    from tasks.pool.hosts import placement

    monkeypatch.setenv("QLORA_HOST", "gpu-a")
    assert "work queue 'host-gpu-a'" in ensure_work_pool("hosts-test")
    with get_client(sync_client=True) as client:
        assert placement(client, "hosts-test", "gpu-a")["work_queue_name"] == "host-gpu-a"
        assert placement(client, "hosts-test", None)["state"].name == WAITING_STATE
        assert placement(client, "qlora-process", None) == {}  # a pool without hosts: runs are created as before
        with pytest.raises(UserError, match=r"--host gpu-c: work pool 'hosts-test' has no host of that name "
                                            r"\(hosts: gpu-a\)\. Run `qlora-pipeline setup --host gpu-c`"):
            placement(client, "hosts-test", "gpu-c")
        client.delete_work_pool("hosts-test")
    # a run in a terminal without QLORA_HOST, against a server whose work pool has hosts, is told what it takes
    from deployments import cli

    made = ensure_work_pool()
    assert "host-gpu-a" in made
    monkeypatch.delenv("QLORA_HOST")
    try:
        cli._warn_unnamed_host()
        said = " ".join(capsys.readouterr().err.split())
        assert "this server has GPU hosts (gpu-a) but QLORA_HOST is not set here" in said, said
    finally:
        with get_client(sync_client=True) as client:  # the session server's pool as it was
            if made.startswith("created work pool"):
                client.delete_work_pool("qlora-process")
            else:
                client.delete_work_queue_by_id(client.read_work_queue_by_name("host-gpu-a", "qlora-process").id)
    cli._warn_unnamed_host()
    assert capsys.readouterr().err == ""  # no hosts: nothing to say
    env = {**cli_env(Path(prefect_env)), "QLORA_HOST": "gpu a"}
    done = _qlora(["setup", "--gpus", "1"], env)  # refused before any server is asked
    assert done.returncode == 2 and "QLORA_HOST='gpu a' cannot name a GPU host" in " ".join(done.stderr.split())


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory: pytest.TempPathFactory, stages: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """A server, `setup` and a worker per host (a, b), the host-training flow and the sweep's candidate training
    deployed; all stopped after."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.train_candidate import train_candidate
    from flows.train_node import train_node
    from tests.host_training import host_training

    tmp_path = tmp_path_factory.mktemp("hosts")
    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    base = {**cli_env(tmp_path / "client"), "PREFECT_API_URL": url, "PYTHONPATH": str(PROJECT_ROOT),
            "CUDA_VISIBLE_DEVICES": "0,1", "PREFECT_WORKER_QUERY_SECONDS": "1",
            # a training across the two hosts: its rendezvous and gloo on localhost
            "QLORA_NODE_ADDRESS": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo"}
    base.pop("QLORA_CPU_THREADS", None)
    base.pop("OMP_NUM_THREADS", None)
    server = start_prefect_server(tmp_path / "prefect", port)
    workers: list[subprocess.Popen] = []
    try:
        wait_for_server(port)
        for host in ("a", "b"):
            done = _qlora(["setup", "--gpus", "2", "--host", host, "--runs-dir", str(tmp_path / "runs")], base)
            assert done.returncode == 0, done.stderr[-3000:]
            assert "atomic rename, a file lock another process sees, filesystem" in done.stdout, done.stdout
            assert f"'qlora-gpu@{host}' 2 slot(s)" in done.stdout, done.stdout
        with temporary_settings({PREFECT_API_URL: url}):
            host_training.from_source(str(PROJECT_ROOT), "tests/host_training.py:host_training").deploy(
                name="hosts", work_pool_name="qlora-process", print_next_steps=False)
            train_candidate.from_source(str(PROJECT_ROOT), "flows/train_candidate.py:train_candidate").deploy(
                name="candidate", work_pool_name="qlora-process", print_next_steps=False)
            train_node.from_source(str(PROJECT_ROOT), "flows/train_node.py:train_node").deploy(
                name="train", work_pool_name="qlora-process", print_next_steps=False)
            for host in ("a", "b"):
                log = (tmp_path / f"worker-{host}.log").open("w")
                workers.append(subprocess.Popen(
                    [sys.executable, "-m", "deployments.cli", "worker", "--host", host], env=base, cwd=tmp_path,
                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
            yield {**stages, "url": url, "logs": tmp_path, "runs": tmp_path / "runs",  # not the shared stages' runs_dir
                   "env": base}
    finally:
        for proc in workers:
            stop_group(proc)
        stop_group(server)


def _start(seed: int, fixture: dict[str, Any], host: str | None = None, **more: Any) -> Any:
    """A run of the deployment, placed as `qlora-pipeline start [--host]` places it (deployments/watch.py); `more`:
    host_training's other parameters."""
    from prefect import get_client

    from tasks.pool.hosts import placement

    params = {"runs_dir": str(fixture["runs"]), "data_dir": fixture["data"], "model_dir": fixture["model"],
              "seed": seed, **more}
    with get_client(sync_client=True) as client:
        dep = client.read_deployment_by_name("host-training/hosts")
        placed = placement(client, dep.work_pool_name, host)
        return client.create_flow_run_from_deployment(dep.id, parameters=params, **placed)


def _run(run_id: Any) -> Any:
    from prefect import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(run_id)


def _states(run_id: Any) -> list[str]:
    from prefect import get_client

    with get_client(sync_client=True) as client:
        return [s.name for s in client.read_flow_run_states(run_id)]


def _log(run_id: Any) -> str:
    from prefect import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    with get_client(sync_client=True) as client:
        return "\n".join(r.message for r in client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id]))))


def _wait(condition: Any, timeout: float, why: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, why
        time.sleep(0.5)


@pytest.mark.slow  # a server, two workers, six short runs (five trainings)
def test_four_runs_train_at_once_on_two_hosts_and_pinned_runs_wait(two_hosts: dict[str, Any]) -> None:
    """Four runs started at once train at the same time, on GPUs 0 and 1 of each host; each host's CPU share counts
    its own runs. Then the same training twice, pinned to b and to a: each waits as "Waiting for GPU" (saying for
    which host) and runs on its host once that host frees a GPU, and the stage is computed once between the two
    hosts (the stage lock on the shared runs_dir; the other reuses it)."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: two_hosts["url"]}):
        four = [_start(seed, two_hosts).id for seed in (1, 2, 3, 4)]
        _wait(lambda: all(_run(r).state.type.value in ("RUNNING", *FINAL) for r in four), 240,
              "the four runs did not all start: " + (two_hosts["logs"] / "worker-a.log").read_text()[-2000:])
        pinned = {"b": _start(5, two_hosts, host="b"), "a": _start(5, two_hosts, host="a")}
        for host, run in pinned.items():
            assert run.state.name == WAITING_STATE and f"pinned to host '{host}'" in run.state.message, run.state
        time.sleep(3)
        assert [_run(r.id).state.name for r in pinned.values()] == [WAITING_STATE] * 2  # every GPU is taken
        every = [*four, *(r.id for r in pinned.values())]
        _wait(lambda: all(_run(r).state.type.value in FINAL for r in every), 400, "runs did not end")
        runs = {r: _run(r) for r in every}
        assert all(r.state.type.value == "COMPLETED" for r in runs.values()), [r.state for r in runs.values()]
        logs = {r: _log(r) for r in runs}
        states = {r: _states(r) for r in runs}
    folders = list((two_hosts["runs"] / "train_adapter").glob("*/manifest.json"))
    by_run = {str(m.run_attempt).split(":")[0]: m for m in map(read_manifest, (f.parent for f in folders))}
    manifests = {r: by_run[str(r)] for r in runs if str(r) in by_run}

    placed = sorted((manifests[r].metrics.host, *manifests[r].metrics.devices) for r in four)
    assert placed == [("a", "0"), ("a", "1"), ("b", "0"), ("b", "1")], placed
    for r in four:  # taken by the worker of the host whose GPU it trained on
        assert f"Worker 'qlora-{manifests[r].metrics.host}' submitting" in logs[r], logs[r][-2000:]
    starts = [manifests[r].started_at for r in four]
    ends = [manifests[r].started_at + manifests[r].seconds for r in four]
    assert max(starts) < min(ends), (starts, ends)  # all four trained at the same time
    # queued as "Waiting for GPU" until a host took them (once running, a run may show it for a moment while
    # another run of its host places itself: the pool's placement limit, tasks/pool/gpus.py)
    assert all(s[0] == WAITING_STATE and "Running" in s for s in states.values()), states
    for r in four:  # the CPU share counted the runs of the run's own host: at most its two
        host = manifests[r].metrics.host
        assert f"active slots of 'qlora-cpu@{host}'" in logs[r], logs[r][-2000:]
        counted = [int(line.split(" run(s) computing")[0].rsplit(" ", 1)[-1]) for line in logs[r].splitlines()
                   if " run(s) computing on " in line]
        assert counted and max(counted) <= 2, counted

    for host, run in pinned.items():
        assert f"Worker 'qlora-{host}' submitting" in logs[run.id], logs[run.id][-2000:]
    computed = [(host, run.id) for host, run in pinned.items() if run.id in manifests]
    assert len(computed) == 1 and len(folders) == 5, computed  # one training between the two hosts
    (host, trained), = computed
    reused = next(run.id for run in pinned.values() if run.id != trained)
    assert "holds GPU(s)" not in logs[reused], logs[reused][-2000:]  # waited for the stage lock, or found it done
    last = manifests[trained]
    assert last.metrics.host == host
    host_ends = [manifests[r].started_at + manifests[r].seconds for r in four if manifests[r].metrics.host == host]
    assert last.started_at >= min(host_ends) - 1, (last.started_at, host_ends)  # once a GPU of its host was free


@pytest.mark.slow  # a sweep whose four candidates train on the two hosts' workers
def test_a_sweeps_candidates_train_on_every_host_with_free_gpus(two_hosts: dict[str, Any], small_data: Path,
                                                               tmp_path: Path) -> None:
    """The sweep's flow runs here; each candidate's training is a flow run that the first host with a free GPU
    takes (flows/sweep_runner.py train_on_fleet): the four train at once, two on each host, on GPUs 0 and 1."""
    from flows.qlora_sweep import qlora_sweep
    from tasks.config import load_config
    from tests.conftest import small_overrides

    base = load_config(None, small_overrides(small_data, tmp_path / "runs", **{"train.max_steps": 3,
                                                                               "eval.generation_samples": 2}))
    grid = {"train.learning_rate": [1e-3, 2e-3, 3e-3, 4e-3]}
    with reporting_to(two_hosts["url"]):  # the sweep's flow runs in this process, against the hosts' server
        state = qlora_sweep(config=base, grid=grid, return_state=True)
    assert state.is_completed(), state.message
    candidates = state.result()["candidates"]
    manifests = [read_manifest(Path(c["adapter_dir"])) for c in candidates]
    placed = sorted((m.metrics.host, *m.metrics.devices) for m in manifests)
    assert placed == [("a", "0"), ("a", "1"), ("b", "0"), ("b", "1")], placed
    starts = [m.started_at for m in manifests]
    ends = [m.started_at + m.seconds for m in manifests]
    assert max(starts) < min(ends), (starts, ends)  # all four trained at the same time
    assert all(c["status"] == "finished" and c["metrics"]["tuned_eval_loss"] for c in candidates), candidates


def _stage_of(run_id: Any, runs: Path) -> Path | None:
    """The stage folder of a training across hosts started by flow run `run_id` (its plan names the run)."""
    import json

    for plan in runs.glob("train_adapter/*/.nodes.json"):
        if json.loads(plan.read_text())["parent"] == str(run_id):
            return plan.parent
    return None


def _node_runs(parent: Any) -> list[Any]:
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags

    with get_client(sync_client=True) as client:
        return client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[f"node-of:{parent}"])))


def _held(hosts: tuple[str, ...]) -> dict[str, int]:
    """Active slots of every GPU limit of `hosts` that has any."""
    return {name: limit.active_slots for name, limit in _limits().items()
            if limit.active_slots and any(name.startswith(f"qlora-gpu@{h}") for h in hosts)}


@pytest.mark.slow  # a 2-node training through both workers, and the 1-process run of the same global batch
def test_one_adapter_trains_across_two_hosts(two_hosts: dict[str, Any], tmp_path: Path) -> None:
    """speed.num_nodes=2: the run (taken by host a) holds a GPU of each host's pool, starts a node run on host b's
    queue, and both train one adapter under torchrun's c10d rendezvous: 2 processes, the same global batch of 8 as
    the 1-process run, a loss within tests/test_multinode.py's tolerance of it, every slot free after."""
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from safetensors.torch import load_file

    from tasks.config import SpeedArgs
    from tasks.train_adapter.stage import train_adapter
    from tests.host_training import HOST_LORA, host_train_args

    runs = two_hosts["logs"] / "node-runs"
    fixture = {**two_hosts, "runs": runs}
    with temporary_settings({PREFECT_API_URL: two_hosts["url"]}):
        run = _start(11, fixture, host="a", num_nodes=2, max_steps=8, per_device=4, learning_rate=2e-3)
        _wait(lambda: _run(run.id).state.type.value in FINAL, 400, "the 2-node run did not end")
        state = _run(run.id).state
        log = _log(run.id)
        nodes = _node_runs(run.id)
        assert state.type.value == "COMPLETED", (state, log[-3000:])
        assert [n.state.type.value for n in nodes] == ["COMPLETED"], nodes
        node_log = _log(nodes[0].id)
        assert _held(("a", "b")) == {}
    assert "Worker 'qlora-b' submitting" in node_log, node_log[-2000:]
    stage = _stage_of(run.id, runs)
    made = read_manifest(stage).metrics
    assert made.processes == 2 and made.sharding == "ddp" and made.optimizer_steps == 8, made
    assert [(n["node"], n["host"], len(n["devices"])) for n in made.nodes] == [(0, "a", 1), (1, "b", 1)], made.nodes
    assert made.host == "a" and made.devices == made.nodes[0]["devices"]

    one = Path(train_adapter.fn(HOST_LORA, host_train_args(11, 8, 8, 2e-3), SpeedArgs(packing=False), tmp_path,
                                two_hosts["data"], two_hosts["model"]))
    single = read_manifest(one).metrics
    shapes = {k: v.shape for k, v in load_file(stage / "adapter" / "adapter_model.safetensors").items()}
    assert shapes == {k: v.shape for k, v in load_file(one / "adapter" / "adapter_model.safetensors").items()}
    # the same global batch of 8 (4 on each node), another example order: close, not identical
    assert abs(made.train_loss - single.train_loss) < 0.1 * single.train_loss, (made, single)


@pytest.mark.slow  # a third host without a worker: the acquisition waits all-or-nothing, then its node never joins
def test_a_training_across_hosts_waits_holding_nothing_and_fails_when_a_node_never_joins(
        two_hosts: dict[str, Any]) -> None:
    """Hosts b and c full: the 2-node run waits as "Waiting for GPU" holding no slot of its own host a. c freed: it
    takes a and c at once, but c has no worker, so its node never starts: the run fails within the join timeout
    naming host c, cancels that node run and leaves every slot free."""
    from prefect import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    done = _qlora(["setup", "--gpus", "2", "--host", "c"], two_hosts["env"])
    assert done.returncode == 0, done.stderr[-3000:]
    fixture = {**two_hosts, "runs": two_hosts["logs"] / "node-runs"}
    with temporary_settings({PREFECT_API_URL: two_hosts["url"]}), get_client(sync_client=True) as client:
        full = {h: client.increment_concurrency_slots_with_lease(
            names=[f"qlora-gpu@{h}"], slots=2, mode="concurrency", lease_duration=300).json()["lease_id"]
            for h in ("b", "c")}
        try:
            run = _start(12, fixture, host="a", num_nodes=2, join_timeout=15)
            _wait(lambda: (s := _run(run.id).state).type.value == "PENDING" and s.name == WAITING_STATE, 120,
                  "the run did not wait for GPUs: " + _log(run.id)[-2000:])
            time.sleep(4)
            assert _held(("a",)) == {}, "a waiting run holds GPUs of its own host"
            assert _run(run.id).state.name == WAITING_STATE
            client.release_concurrency_slots_with_lease(lease_id=full.pop("c"))
            _wait(lambda: "holds GPU(s)" in _log(run.id), 60, "the run did not take the GPUs once c was free")
            took = time.monotonic()
            _wait(lambda: _run(run.id).state.type.value in FINAL, 120, "the run did not end")
            failed_after = time.monotonic() - took
            state, log, nodes = _run(run.id).state, _log(run.id), _node_runs(run.id)
            assert state.type.value == "FAILED", (state, log[-3000:])
            assert failed_after < 15 + 20, failed_after  # the join timeout, a poll and the flow's end
            said = " ".join(log.split())
            assert "did not all join within speed.node_join_timeout_s=15: not started on host 'c'" in said, said
            assert [n.state.type.value for n in nodes] == ["CANCELLED"], nodes
            assert nodes[0].work_queue_name == "host-c"
            _wait(lambda: _held(("a", "c")) == {}, 10, f"slots left held: {_held(('a', 'c'))}")
        finally:
            for lease in full.values():
                client.release_concurrency_slots_with_lease(lease_id=lease)
            for name in [n for n in _limits() if n.startswith("qlora-gpu@c") or n == "qlora-cpu@c"]:
                client.delete_global_concurrency_limit_by_name(name)
            client.delete_work_queue_by_id(client.read_work_queue_by_name("host-c", "qlora-process").id)


@pytest.mark.slow  # a long 2-node training, cancelled from the server as the UI's Cancel does
def test_cancelling_a_training_across_hosts_stops_its_node_runs(two_hosts: dict[str, Any]) -> None:
    """Cancelling the run while both nodes train stops the node run on host b too: no rank of it is left running,
    and every slot of both hosts is free."""
    from prefect import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.states import Cancelling

    runs = two_hosts["logs"] / "node-runs"
    with temporary_settings({PREFECT_API_URL: two_hosts["url"]}):
        run = _start(13, {**two_hosts, "runs": runs}, host="a", num_nodes=2, max_steps=100_000)
        _wait(lambda: (stage := _stage_of(run.id, runs)) is not None and (stage / "loss.jsonl").exists()
              and (stage / "loss.jsonl").read_text().count("\n") >= 2, 240,
              "the 2-node training did not start: " + _log(run.id)[-2000:])
        stage = _stage_of(run.id, runs)
        (node,) = _node_runs(run.id)
        assert _run(node.id).state.type.value == "RUNNING"
        with get_client(sync_client=True) as client:
            client.set_flow_run_state(run.id, Cancelling(), force=True)
        _wait(lambda: _run(node.id).state.type.value in FINAL, 60, "the node run did not stop")
        _wait(lambda: _run(run.id).state.type.value in FINAL, 60, "the run did not stop")
        assert _run(run.id).state.type.value == "CANCELLED"
        assert _run(node.id).state.type.value in ("CANCELLED", "FAILED"), _run(node.id).state

        def ranks() -> str:
            return subprocess.run(["pgrep", "-af", str(stage / ".distributed-args.json")], capture_output=True,
                                  text=True).stdout

        _wait(lambda: ranks() == "", 10, f"ranks left running: {ranks()}")
        _wait(lambda: _held(("a", "b")) == {}, 70, f"slots left held: {_held(('a', 'b'))}")


def _rank_of_node(stage: Path, node: int) -> int | None:
    """The pid of node `node`'s rank: the child of the torchrun launched with --node-rank=<node> on `stage`."""
    launchers = subprocess.run(["pgrep", "-f", "--", f"--node-rank={node} .*{stage}"], capture_output=True,
                               text=True).stdout.split()
    for launcher in launchers:
        children = subprocess.run(["pgrep", "-P", launcher], capture_output=True, text=True).stdout.split()
        if children:
            return int(children[0])
    return None


@pytest.mark.slow  # a 2-node training whose rank on host b is killed with kill -9, then the same run again
def test_a_rank_killed_across_hosts_resumes_from_the_last_checkpoint(two_hosts: dict[str, Any]) -> None:
    """kill -9 of node 1's rank fails the run (torchrun restarts nothing); the same run started again resumes from
    the newest complete checkpoint in the shared stage folder and ends with every step, as on one host."""
    import os
    import signal

    from prefect.settings import PREFECT_API_URL, temporary_settings

    from tasks.train_adapter.resume import damage

    def saved_steps(stage: Path) -> list[int]:  # read only: latest_checkpoint would delete the one being written
        return sorted(int(c.name.split("-")[-1]) for c in (stage / "checkpoints").glob("checkpoint-*")
                      if damage(c) is None)

    runs = two_hosts["logs"] / "node-runs"
    params = {"host": "a", "num_nodes": 2, "max_steps": 24, "save_steps": 4}
    with temporary_settings({PREFECT_API_URL: two_hosts["url"]}):
        first = _start(14, {**two_hosts, "runs": runs}, **params)
        _wait(lambda: (stage := _stage_of(first.id, runs)) is not None and saved_steps(stage), 240,
              "no checkpoint was written: " + _log(first.id)[-2000:])
        stage = _stage_of(first.id, runs)
        rank = _rank_of_node(stage, 1)
        assert rank is not None, subprocess.run(["ps", "-ef"], capture_output=True, text=True).stdout[-3000:]
        os.kill(rank, signal.SIGKILL)
        _wait(lambda: _run(first.id).state.type.value in FINAL, 120, "the run did not end after the kill")
        assert _run(first.id).state.type.value == "FAILED", _run(first.id).state
        assert read_manifest(stage) is None
        saved = saved_steps(stage)[-1]
        assert saved < 24

        again = _start(14, {**two_hosts, "runs": runs}, **params)
        _wait(lambda: _run(again.id).state.type.value in FINAL, 300, "the second run did not end")
        assert _run(again.id).state.type.value == "COMPLETED", _log(again.id)[-3000:]
        assert _held(("a", "b")) == {}
    made = read_manifest(stage)
    assert made.resumed_from_step is not None and made.resumed_from_step >= saved, made.resumed_from_step
    assert made.metrics.optimizer_steps == 24 and [n["host"] for n in made.metrics.nodes] == ["a", "b"]
