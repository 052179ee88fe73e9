"""train_adapter across GPU hosts (speed.num_nodes): one adapter trained by torchrun on K hosts of one Prefect server.

Prefect stays the orchestrator and torchrun the engine. The run's train_adapter task (on the host whose worker took
the run, node 0) takes speed.num_gpus slots of the GPU pool of K hosts in one all-or-nothing acquisition (fleet: the
pool's fleet_slot), writes the ranks' arguments and this plan (PLAN) into the stage folder, on the runs_dir every
host shares, and starts one flow run of NODE_DEPLOYMENT per other host, on that host's work queue. Each host, node 0
included, then runs torchrun with a c10d rendezvous at node 0 (rendezvous id: the run's) over its own GPUs of the
pool (held_devices). The task waits for every node and writes the manifest from rank 0's result (RESULT), with the
nodes and their devices.

Why node 0 trains in the run's own process rather than in a node run of its own: the host's worker runs at most
as many flow runs as the host has GPUs (`--limit`), and the run itself holds one of them; on a host of one GPU, a
node run there would wait for the run that waits for it.

Failure: a node that has not started within speed.node_join_timeout_s (its host's worker busy or down), or whose
run ends early, stops node 0's torchrun and fails the run naming its host; every unfinished node run is cancelled
and every slot freed. A node run stops its ranks when its parent run ends (cancelled, crashed, failed): nothing is
left training on a GPU. A rank killed with kill -9 fails every node; the next attempt resumes from rank 0's latest
complete checkpoint in the shared stage folder, as on one host.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from uuid import UUID

from tasks.config import LoraArgs, SpeedArgs, TrainArgs
from tasks.errors import UserError
from tasks.log import current_run_attempt, logger
from tasks.pool.cpus import cpu_share
from tasks.pool.gpus import fleet_slot, held_devices, pool_devices
from tasks.pool.hosts import HOST_VARIABLE, host_queue, hosts_of, this_host
from tasks.pool.leases import uses_server
from tasks.train_adapter import launch

NODE_DEPLOYMENT = "qlora-node/train"  # flows/train_node.py, deployed by deployments/prefect.yaml
PLAN = ".nodes.json"  # the rendezvous, the hosts in node order, processes per node; read by every node
ADDRESS_VARIABLE = "QLORA_NODE_ADDRESS"  # the address other hosts reach this one at (default: its FQDN)
WATCH_SECONDS = 2.0
_FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


def node_marker(out: Path, node: int) -> Path:
    """Written by node `node` as it starts its ranks: its host and devices (the manifest's nodes)."""
    return out / f".node-{node}.json"


@contextmanager
def fleet(speed: SpeedArgs) -> Iterator[list[str]]:
    """Hold speed.num_gpus GPUs on each of speed.num_nodes hosts (this one first) while in the block; a user error
    where this run cannot train across hosts."""
    nodes, gpus = speed.num_nodes, int(speed.num_gpus)
    with fleet_slot(_hosts(nodes, gpus), nodes, gpus) as hosts:
        logger().info("train_adapter: %d nodes of %d process(es) on the hosts %s (node 0: this one)", nodes, gpus,
                      ", ".join(hosts))
        yield hosts


def nodes_problem(nodes: int) -> str | None:
    """Why speed.num_nodes cannot train from this process, or None: checked before any stage by the command line too.
    It needs runs on a Prefect server and a host name for this host (QLORA_HOST)."""
    what = f"speed.num_nodes={nodes} trains across GPU hosts of one Prefect server"
    if nodes <= 1:
        return None
    if not uses_server():
        return (f"{what}, and there is none here (PREFECT_API_URL): start it as a deployment run "
                "(`qlora-pipeline start DEPLOYMENT --set speed.num_nodes=...`, or the UI), which a host's worker runs.")
    if this_host() is None:
        return (f"{what}, but this process has no host name ({HOST_VARIABLE}): start each host's worker with "
                "`qlora-pipeline worker --host NAME` (docs/multi-gpu.md, \"Several hosts\"), or set it here.")
    return None


def _hosts(nodes: int, gpus: int) -> list[str]:
    """The hosts this run may train on: those of the node deployment's work pool with `gpus` GPUs in their pool."""
    from prefect import get_client
    from prefect.exceptions import ObjectNotFound

    what = f"speed.num_nodes={nodes} trains across GPU hosts of one Prefect server"
    if problem := nodes_problem(nodes) or (current_run_attempt() is None and f"{what}: run it in a flow run."):
        raise UserError(problem)
    here = this_host()
    with get_client(sync_client=True) as client:
        try:
            pool = client.read_deployment_by_name(NODE_DEPLOYMENT).work_pool_name
        except ObjectNotFound:
            raise UserError(f"{what}, through the deployment {NODE_DEPLOYMENT!r}, which this server does not "
                            "have: run `qlora-pipeline deploy`.") from None
        hosts = hosts_of(client, pool)
    sizes = {host: pool_devices(host) for host in hosts}
    able = [host for host in hosts if sizes[host] >= gpus]
    if here not in able or len(able) < nodes:
        listed = ", ".join(f"{h} ({sizes[h]})" for h in hosts) or "none"
        raise UserError(f"{what}, each with speed.num_gpus={gpus} GPU(s) in its pool, this host ({here}) one of "
                        f"them; the hosts of work pool {pool!r} and their GPUs: {listed}. Set speed.num_nodes or "
                        "speed.num_gpus lower, or set up more hosts (`qlora-pipeline setup --gpus N --host NAME`).")
    return able


def train(lora: LoraArgs, train: TrainArgs, speed: SpeedArgs, data_dir: str, model_dir: str, out: Path,
          hosts: list[str], devices: list[str] | None, threads: int) -> dict[str, Any]:
    """Node 0's part: the ranks' arguments and the plan in the stage folder, a node run per other host, this host's
    ranks; rank 0's metrics with the nodes."""
    from prefect.runtime import flow_run, task_run

    launch.write_args(lora, train, speed, data_dir, model_dir, out)

    attempt = current_run_attempt() or "run"
    for stale in out.glob(".node-*.json"):  # an earlier attempt's
        stale.unlink()
    address = os.environ.get(ADDRESS_VARIABLE, "").strip() or socket.getfqdn()
    plan = {"rendezvous": attempt.replace(":", "-"), "endpoint": f"{address}:{_free_port()}", "hosts": hosts,
            "processes": int(speed.num_gpus), "join_timeout": speed.node_join_timeout_s, "parent": str(flow_run.id)}
    (out / PLAN).write_text(json.dumps(plan))
    _mark(out, 0, devices)
    runs: list[Any] = []  # filled as they are created: a failure half-way still cancels those
    try:
        _start_node_runs(out, hosts, UUID(str(task_run.id)) if task_run.id else None, runs)
        started = time.monotonic()
        _run_watched(lambda ended: _node_problem(out, plan, runs, started, ended), out, 0, plan, devices, threads)
        _wait_completed(runs, plan)
    finally:
        _cancel_unfinished(runs)
    metrics = json.loads((out / launch.RESULT).read_text())
    metrics["nodes"] = [json.loads(node_marker(out, i).read_text()) for i in range(len(hosts))]
    return metrics


def run_node(out: Path, node: int) -> str:
    """Node `node`'s part, in a node run on its host: its GPUs of the host's pool (the parent run holds their
    slots), its share of the host's cores, its ranks, stopped if the parent run ends first."""
    plan = json.loads((out / PLAN).read_text())
    here = this_host()
    if here != plan["hosts"][node]:
        raise RuntimeError(f"node {node} of {out} is for host {plan['hosts'][node]!r}, but this worker is {here!r} "
                           f"({HOST_VARIABLE}): the node run was taken from another host's queue")
    processes = plan["processes"]
    with held_devices(processes) as devices, cpu_share("train_adapter", processes) as threads:
        _mark(out, node, devices)
        _run_watched(lambda _ended: _parent_problem(plan["parent"]), out, node, plan, devices, threads)
    return str(out)


def _run_watched(problem: Callable[[bool], str | None], out: Path, node: int, plan: dict[str, Any],
                 devices: list[str] | None, threads: int) -> None:
    """This node's ranks under torchrun, stopped as soon as problem(False) names one (checked every WATCH_SECONDS);
    where the ranks fail first (torchrun's own rendezvous timeout, say), problem(True) may say why better."""
    hosts = plan["hosts"]
    rendezvous = [f"--nnodes={len(hosts)}", f"--node-rank={node}", "--rdzv_backend=c10d",
                  f"--rdzv_endpoint={plan['endpoint']}", f"--rdzv_id={plan['rendezvous']}",
                  f"--rdzv_conf=join_timeout={plan['join_timeout']},is_host={int(node == 0)}", "--max_restarts=0"]
    if address := os.environ.get(ADDRESS_VARIABLE, "").strip():  # what the other hosts reach this one at
        rendezvous.append(f"--local-addr={address}")
    watch = _Watch(problem)
    try:
        launch.run_ranks(out / launch.ARGS_FILE, plan["processes"], devices, threads, rendezvous=rendezvous,
                         log_name=f"distributed-node{node}.log", started=watch.start)
    except (launch.RanksFailed, UserError) as exc:
        if reason := watch.reason or (isinstance(exc, launch.RanksFailed) and problem(True)):
            raise RuntimeError(f"train_adapter: node {node} on host {hosts[node]!r} stopped: {reason}") from exc
        raise
    finally:
        watch.stop()
    if watch.reason:  # the ranks had ended already
        raise RuntimeError(f"train_adapter: node {node} on host {hosts[node]!r}: {watch.reason}")


class _Watch:
    """Polls problem() from a thread while the ranks run; where it names one, keeps it and stops the ranks (SIGTERM
    to torchrun, which ends its ranks; each rank also ends itself within a second of torchrun)."""

    def __init__(self, problem: Callable[[bool], str | None]) -> None:
        self.problem, self.reason = problem, None
        self.done = threading.Event()

    def start(self, proc: subprocess.Popen) -> None:
        import contextvars

        context = contextvars.copy_context()  # the run's logger and client settings in the thread
        threading.Thread(target=context.run, args=(self._watch, proc), daemon=True, name="node-watch").start()

    def _watch(self, proc: subprocess.Popen) -> None:
        while not self.done.wait(WATCH_SECONDS) and proc.poll() is None:
            try:
                self.reason = self.problem(False)
            except Exception as exc:  # noqa: BLE001 - the server away for a moment: the ranks go on, ask again
                logger().debug("train_adapter: could not check the other nodes (%s)", exc)
                continue
            if self.reason:
                logger().error("train_adapter: %s; stopping this node's ranks", self.reason)
                proc.terminate()
                return

    def stop(self) -> None:
        self.done.set()


def _node_problem(out: Path, plan: dict[str, Any], runs: list[Any], started: float, ended: bool) -> str | None:
    """Node 0's check of the others: a node run that ended other than Completed before training did, or that has not
    started within the join timeout (or at all, once node 0's ranks have `ended` in failure). A Completed node run is
    no problem: its ranks left the training's last collective, and rank 0 here may still be saving the adapter (on a
    busy host that took long enough for this check to stop a finished training)."""
    states = _states(runs)
    for node, (run, state) in enumerate(zip(runs, states, strict=True), start=1):
        if state.type.value in _FINAL - {"COMPLETED"}:
            return (f"node {node} on host {plan['hosts'][node]!r} ended {state.name} (flow run {run.name}): "
                    f"{state.message or 'see its log'}")
    late = [(node, run, state) for node, (run, state) in enumerate(zip(runs, states, strict=True), start=1)
            if not node_marker(out, node).exists()]
    if late and (ended or time.monotonic() - started > plan["join_timeout"]):
        said = "; ".join(f"host {plan['hosts'][node]!r} (node {node}, flow run {run.name}, {state.name})"
                         for node, run, state in late)
        return (f"the training's nodes did not all join within speed.node_join_timeout_s={plan['join_timeout']}: "
                f"not started on {said}. Is each host's worker running (`qlora-pipeline worker --host NAME`), "
                "with a free slot?")
    return None


def _parent_problem(parent: str) -> str | None:
    """A node run's check of the run it trains for: stop once that run is over or being cancelled."""
    from prefect import get_client

    with get_client(sync_client=True) as client:
        state = client.read_flow_run(UUID(parent)).state
    if state is not None and (state.type.value in _FINAL or state.name == "Cancelling"):
        return f"the run it trains for ({parent}) is {state.name}"
    return None


def _mark(out: Path, node: int, devices: list[str] | None) -> None:
    node_marker(out, node).write_text(json.dumps({"node": node, "host": this_host(), "devices": devices}))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _start_node_runs(out: Path, hosts: list[str], parent_task: UUID | None, runs: list[Any]) -> None:
    """A flow run of NODE_DEPLOYMENT for each host but this one, on that host's work queue, appended to `runs`;
    shown in the UI under this run's train_adapter."""
    from prefect import get_client
    from prefect.runtime import flow_run

    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name(NODE_DEPLOYMENT)
        for node, host in enumerate(hosts[1:], start=1):
            runs.append(client.create_flow_run_from_deployment(
                deployment.id, parameters={"stage_dir": str(out), "node": node}, work_queue_name=host_queue(host),
                name=f"{flow_run.name}-node{node}"[:120], tags=[f"host:{host}", f"node-of:{flow_run.id}"],
                parent_task_run_id=parent_task))
    logger().info("train_adapter: started the node runs %s", ", ".join(
        f"{run.name} (host {host})" for run, host in zip(runs, hosts[1:], strict=True)))


def _states(runs: list[Any]) -> list[Any]:
    from prefect import get_client

    with get_client(sync_client=True) as client:
        return [client.read_flow_run(run.id).state for run in runs]


def _wait_completed(runs: list[Any], plan: dict[str, Any]) -> None:
    """Node 0's ranks are done: wait for the node runs to end (their ranks end with the same last step), and fail
    unless every one completed."""
    deadline = time.monotonic() + plan["join_timeout"]
    states = _states(runs)
    while not all(s.type.value in _FINAL for s in states) and time.monotonic() < deadline:
        time.sleep(WATCH_SECONDS)
        states = _states(runs)
    failed = [f"node {node} on host {plan['hosts'][node]!r}: {state.name} ({state.message or run.name})"
              for node, (run, state) in enumerate(zip(runs, states, strict=True), start=1)
              if state.type.value != "COMPLETED"]
    if failed:
        raise RuntimeError("train_adapter: node 0 finished, but not every node did: " + "; ".join(failed))


def _cancel_unfinished(runs: list[Any]) -> None:
    """Cancel the node runs that have not ended: a scheduled one never starts, a running one is stopped by its
    worker."""
    from prefect import get_client
    from prefect.states import Cancelled, Cancelling

    try:
        with get_client(sync_client=True) as client:
            for run in runs:
                state = client.read_flow_run(run.id).state
                if state is None or state.type.value in _FINAL:
                    continue
                ended = Cancelling if state.type.value == "RUNNING" else Cancelled
                client.set_flow_run_state(run.id, ended(message="the run it trained for ended"), force=True)
    except Exception as exc:  # noqa: BLE001 - the server away: each node run stops itself on its parent's end
        logger().warning("train_adapter: could not cancel the node runs (%s); each stops when it sees this run end",
                         exc)
