"""The GPU pool, on Prefect's global concurrency limits (nothing home-made; the host's CPU share: cpus.py).

GPU pool (`qlora-pipeline setup [--gpus N]` creates it; docs/operations.md, "The GPU pool"):

- `qlora-gpu`, N slots (one per GPU of the worker; 1 slot on a worker without GPUs): a training run takes as many
  slots as it uses GPUs, so it waits, shown as "Waiting for GPU", until that many are free;
- `qlora-gpu-0` ... `qlora-gpu-<N-1>`, 1 slot each: which GPU a run holds. Prefect's slots have no identity, so
  a run that was granted k slots of `qlora-gpu` takes k free device limits, under `qlora-gpu-placement` (1 slot)
  so that two runs never pick the same free device at once. Device slots are taken only while holding as many
  `qlora-gpu` slots and released before them: a run that holds k counting slots always finds k free devices.
  Device i is the i-th entry of the worker's visible GPUs (visible_gpus: CUDA_VISIBLE_DEVICES when set, which is
  also how tests simulate a 2-GPU worker on a CPU machine), and the run's training processes get exactly those
  in their CUDA_VISIBLE_DEVICES.

Several GPU hosts under one server (QLORA_HOST set in each host's worker, hosts.py) have a pool each: every name
above carries the host, `qlora-gpu@gpu-a`, `qlora-gpu@gpu-a-0`, `qlora-gpu@gpu-a-placement`, and a run takes the
slots of the host it runs on. A training across hosts (speed.num_nodes, tasks/train_adapter/nodes.py) takes the
counting slots of several hosts in one bulk acquisition (fleet_slot), and each of its nodes places itself on its own
host's devices (held_devices) while the run holds the counts.

A pool without device limits (0 GPUs, or a server set up before the pool existed) is today's single slot: one
training at a time, on whatever this process sees, and gpu_slot yields None.

The pool against a server restart (leases.py holds the mechanism): Prefect counts active slots in its
database and keeps the leases behind them in its lease storage, in memory by default, so a restart used to leave
every held slot counted for good (no lease left to renew, release or expire). Prefect's own answer is a lease
storage that survives restarts (prefect.server.concurrency.lease_storage.filesystem, usable with SQLite and
Postgres on one server host; `setup` says which one the server uses), but the default must hold too, Prefect's
`concurrency()` stops renewing after a few seconds of outage, and its API lists no leases of a global limit. So
slots are held through leases.py's `hold` (Prefect's lease endpoints, renewed for as long as the server is
away), and a sentinel lease tells whether the server still knows the pool's leases: when it does not, one process
sets the pool's counts to 0 and the trainings still running re-claim their own slots first. A training whose
lease is lost re-claims its GPUs (during the grace period nobody else can take them); only where another run has
taken them meanwhile (a server that kept its leases but let this one expire during a long outage) does it stop,
as a SIGTERM would, rather than share a GPU. We keep no record of holders beside Prefect's: Prefect 3.9 stores a
lease's holder (the train_adapter task run, passed here) but neither its API nor its Concurrency page shows the
holders of a global limit, so which run holds a GPU is in that run's log ("holds GPU(s) ...") and its manifest.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any
from uuid import UUID

from tasks.errors import UserError
from tasks.log import current_run_attempt, logger
from tasks.pool.cpus import host_cores
from tasks.pool.hosts import WAITING_STATE, on_host, this_host
from tasks.pool.leases import LEASE_SECONDS, check_server_leases, hold, hold_first, uses_server

GPU_LIMIT = "qlora-gpu"  # created by `qlora-pipeline setup` (and by `qlora-pipeline run` when missing)
PLACEMENT_LIMIT = "qlora-gpu-placement"


def gpu_limit(host: str | None = None) -> str:
    """The counting limit of `host`, by default this one: GPU_LIMIT, named for the host where it has a name
    (QLORA_HOST, hosts.py)."""
    return on_host(GPU_LIMIT, host or this_host())


def placement_limit() -> str:
    return f"{gpu_limit()}-placement"


def device_limit(index: int) -> str:
    """The 1-slot limit that stands for the index-th visible GPU of the worker (of this host)."""
    return f"{gpu_limit()}-{index}"


def visible_gpus() -> list[str]:
    """The worker's GPUs as CUDA_VISIBLE_DEVICES names them: its entries when it is set (ids or UUIDs; on a machine
    without CUDA this is how a test simulates GPUs), else 0 .. torch.cuda.device_count()-1."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    import torch

    count = torch.cuda.device_count()
    if listed is None:
        return [str(i) for i in range(count)]
    entries = [e.strip() for e in listed.split(",") if e.strip()]
    # CUDA stops at the first entry it cannot use; where CUDA runs, the pool hands out only what it sees
    return entries[:count] if torch.cuda.is_available() else entries


def num_gpus_problem(num_gpus: int | str) -> str | None:
    """Why speed.num_gpus cannot train here, or None: more processes than this machine has GPUs for, or, where runs
    go to a Prefect server with a GPU pool of devices, more than the pool's slots. 'auto' and 1 always fit."""
    if num_gpus == "auto" or int(num_gpus) <= 1:
        return None
    try:
        size, devices = _pool() if uses_server() else (0, False)
    except Exception:  # noqa: BLE001 - no server to ask now: the run itself checks the pool when it trains
        size, devices = 0, False
    if devices and int(num_gpus) > size:
        return _pool_too_small(int(num_gpus), size)
    have, what = gpu_capacity()
    if int(num_gpus) > have:
        return (f"speed.num_gpus={num_gpus}, but this machine has {what}. Set speed.num_gpus to {have} or less (or "
                f"'auto': every GPU it has).")
    return None


def gpu_capacity() -> tuple[int, str]:
    """How many training processes this machine gives a GPU each, and what they are, in words. Where CUDA runs,
    its visible GPUs. Without CUDA, speed.num_gpus > 1 starts that many CPU processes (gloo): as many as
    CUDA_VISIBLE_DEVICES lists where it is set (how a test or a CPU worker of a GPU pool stands for GPUs), else
    one per core, since more processes than cores only take turns on them, each with its own copy of the model."""
    import torch

    if torch.cuda.is_available():
        count = len(visible_gpus())
        return count, f"{count} GPU(s) visible to CUDA"
    if os.environ.get("CUDA_VISIBLE_DEVICES") is not None:
        count = len(visible_gpus())
        return count, f"no CUDA, and CUDA_VISIBLE_DEVICES lists {count} device(s) for its CPU processes"
    cores = host_cores()
    return cores, f"no CUDA: {cores} core(s), one CPU training process (gloo) each at most"


def _pool_too_small(gpus: int, size: int) -> str:
    return (f"speed.num_gpus={gpus}, but the GPU pool ({gpu_limit()!r}) has {size} slot(s), one per GPU of the "
            f"worker. Set speed.num_gpus to {size} or less, or size the pool with `qlora-pipeline setup --gpus "
            f"{gpus}` on a worker with that many GPUs.")


@contextmanager
def gpu_slot(gpus: int = 1) -> Iterator[list[str] | None]:
    """Hold `gpus` slots of the GPU pool while training; yields the GPUs held (CUDA_VISIBLE_DEVICES entries for
    the training processes), or None where there is no pool of devices (no server, outside a flow run, a pool
    without device limits: one slot, on whatever this process sees). Strict: a missing limit is an error.

    A run that has to wait says so, however the race for the slots falls: a log line, and the state "Waiting for
    GPU" (type Pending) on its train_adapter task run and on its flow run (unless another of its trainings runs)
    until the slots free, then Running again.
    """
    if gpus > 1 and (problem := num_gpus_problem(gpus)):  # a run from the form or a deployment is checked here
        raise UserError(problem)
    if current_run_attempt() is None or not uses_server():
        yield None
        return
    size, devices = _pool()
    wanted = gpus if devices else 1  # without devices, the one slot means one training at a time
    if devices and gpus > size:
        raise UserError(_pool_too_small(gpus, size))
    waiting = _Waiting(wanted)
    with ExitStack() as held:
        _take(held, gpu_limit(), wanted, waiting)
        if not devices:
            waiting.over()
            yield None
            return
        yield _devices(held, wanted, size, waiting)


@contextmanager
def held_devices(gpus: int) -> Iterator[list[str] | None]:
    """This host's GPUs for `gpus` slots of its counting limit that another process holds for this one: a node of a
    training across hosts, whose run took the slots of every host at once (fleet_slot). None where this host's pool
    has no device limits (a CPU host: its processes train on CPU)."""
    size, devices = _pool()
    if not devices:
        yield None
        return
    with ExitStack() as held:
        yield _devices(held, gpus, size, _Waiting(gpus))


def _devices(held: ExitStack, wanted: int, size: int, waiting: _Waiting) -> list[str]:
    """Place the run holding `wanted` counting slots on as many free GPUs of this host (their device limits, taken
    into `held`), and say which."""
    names = visible_gpus()
    if len(names) < size:
        raise UserError(f"The GPU pool ({gpu_limit()!r}) has {size} slots, but this worker sees {len(names)} "
                        f"GPU(s) ({', '.join(names) or 'none'}). Run `qlora-pipeline setup --gpus "
                        f"{len(names)}` (or start the worker where CUDA_VISIBLE_DEVICES lists {size} GPUs).")
    mine = [names[i] for i in _place(held, wanted, size, waiting)]
    waiting.over()
    logger().info("train_adapter: holds GPU(s) %s of the pool (%d of %d slots of %r; CUDA_VISIBLE_DEVICES=%s "
                  "for its training processes)", ", ".join(mine), wanted, size, gpu_limit(), ",".join(mine))
    return mine


def pool_devices(host: str) -> int:
    """The GPUs of `host`'s pool that a training across hosts can take: its size, 0 without device limits."""
    size, devices = _pool(host)
    return size if devices else 0


@contextmanager
def fleet_slot(hosts: list[str], nodes: int, gpus: int) -> Iterator[list[str]]:
    """Hold `gpus` counting slots on each of `nodes` hosts, this host and nodes-1 of the other `hosts`, all at once
    (hold_first: Prefect's bulk acquisition over their limits, all or nothing, so a run waiting for a full host
    holds no GPU of another meanwhile). Yields the hosts held, this one first; their nodes place themselves on
    their own GPUs (held_devices). Waits as gpu_slot does ("Waiting for GPU"). The caller checked that each host
    has `gpus` GPUs (pool_devices)."""
    from prefect.runtime import task_run

    here = this_host()
    others = [h for h in hosts if h != here]
    choices = [tuple(gpu_limit(h) for h in (here, *rest)) for rest in itertools.combinations(others, nodes - 1)]
    waiting = _Waiting(gpus, f"{gpu_limit(here)!r} and that of {nodes - 1} of the hosts {', '.join(others)}")
    holder = UUID(str(task_run.id)) if task_run.id else None
    with hold_first(choices, gpus, strict=True, critical=True, holder=holder, on_wait=waiting.start) as names:
        waiting.over()
        yield [here, *(name.split("@", 1)[1] for name in names[1:])]


def pool_gpus() -> int:
    """How many GPUs this flow run's trainings can hold at once: the pool's size where it has device limits, else 0
    (no server, outside a flow run, a CPU-only pool). Where it is not 0, gpu_slot gives every training its own
    devices and train_adapter trains in child processes that see only those (tasks/train_adapter/launch.py)."""
    if current_run_attempt() is None or not uses_server():
        return 0
    size, devices = _pool()
    return size if devices else 0


def _pool(host: str | None = None) -> tuple[int, bool]:
    """The pool's size and whether it has device limits, of `host` (by default this one); (1, False) when the limit
    is missing (the strict acquisition then says what to do)."""
    from prefect import get_client
    from prefect.exceptions import ObjectNotFound

    counting = gpu_limit(host)
    with get_client(sync_client=True) as client:
        try:
            size = client.read_global_concurrency_limit_by_name(counting).limit
        except ObjectNotFound:
            return 1, False
        try:
            for name in (f"{counting}-placement", *(f"{counting}-{i}" for i in range(size))):
                client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:  # a CPU-only pool, or one set up before devices had limits
            return size, False
    return size, size > 0


def _take(held: ExitStack, name: str, slots: int, waiting: _Waiting | None = None) -> None:
    """Take `slots` slots of `name` into `held` (leases.py keeps them through a server restart)."""
    from prefect.runtime import task_run

    holder = UUID(str(task_run.id)) if task_run.id else None
    held.enter_context(hold(name, slots, strict=True, critical=name != placement_limit(), holder=holder,
                            on_wait=waiting.start if waiting else None))


def _place(held: ExitStack, wanted: int, size: int, waiting: _Waiting) -> list[int]:
    """Take `wanted` free device limits into `held`; their indices. Runs place one at a time (placement_limit), so
    what is read free here stays free until taken."""
    from prefect import get_client

    with ExitStack() as placing:
        _take(placing, placement_limit(), 1, waiting)
        deadline = time.monotonic() + 2 * LEASE_SECONDS  # a killed run's device lease lapses within LEASE_SECONDS
        while True:
            with get_client(sync_client=True) as client:
                # after a repair of the pool, its running trainings re-claim their devices first (leases.py)
                if (grace := check_server_leases(client)) > 0:
                    waiting.start()
                    time.sleep(min(grace, 1.0))
                    deadline = time.monotonic() + 2 * LEASE_SECONDS
                    continue
                free = [i for i in range(size)
                        if client.read_global_concurrency_limit_by_name(device_limit(i)).active_slots == 0]
            if len(free) >= wanted:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"train_adapter holds {wanted} slot(s) of {gpu_limit()!r} but only {len(free)} "
                                   f"of its device limits are free: something other than train_adapter holds "
                                   f"{gpu_limit()}-<i> slots (see Concurrency in the Prefect UI)")
            time.sleep(1)
        for i in free[:wanted]:
            _take(held, device_limit(i), 1, waiting)
    return free[:wanted]


class _Waiting:
    """What a waiting training shows: said once when the wait starts, undone when it ends."""

    def __init__(self, wanted: int, limits: str | None = None) -> None:
        self.wanted = wanted
        self.limits = limits  # what it waits for, in words: this host's counting limit by default
        self.since: float | None = None

    def start(self) -> None:
        from prefect.states import Pending

        if self.since is not None:
            return
        self.since = time.monotonic()
        limits = self.limits or repr(gpu_limit())
        logger().info("train_adapter: waiting for the GPU: other runs hold the slots of the global concurrency "
                      "limit %s that it needs (%d); training starts when they end (or within %d s of them being "
                      "killed)", limits, self.wanted, LEASE_SECONDS)
        state = Pending(name=WAITING_STATE, message=f"Waiting for {self.wanted} slot(s) of {limits}")
        _set_task_state(state)
        _set_flow_state(state, only_if=_no_other_training)

    def over(self) -> None:
        from prefect.states import Running

        if self.since is None:
            return
        logger().info("train_adapter: took the GPU slot after waiting %.0f s", time.monotonic() - self.since)
        _set_task_state(Running())
        _set_flow_state(Running(), only_if=_flow_waits)


def _set_task_state(state: Any) -> None:
    from prefect import get_client
    from prefect.exceptions import ObjectNotFound, PrefectHTTPStatusError
    from prefect.runtime import task_run

    if not task_run.id:
        return
    deadline = time.monotonic() + 30  # the server records a new task run from its events, a moment later
    with get_client(sync_client=True) as client:
        while True:
            try:
                client.set_task_run_state(UUID(str(task_run.id)), state, force=True)
                return
            except (ObjectNotFound, PrefectHTTPStatusError) as exc:
                if getattr(getattr(exc, "response", None), "status_code", 404) != 404:
                    raise
                if time.monotonic() > deadline:
                    logger().warning("train_adapter: could not show the state %r in the UI", state.name)
                    return
                time.sleep(0.5)


def _set_flow_state(state: Any, only_if: Any) -> None:
    """Show `state` on this flow run too (the runs list shows flow runs), where only_if(client, flow run) holds."""
    from prefect import get_client
    from prefect.runtime import flow_run

    with get_client(sync_client=True) as client:
        run = client.read_flow_run(UUID(str(flow_run.id)))
        if only_if(client, run):
            client.set_flow_run_state(run.id, state, force=True)


def _no_other_training(client: Any, run: Any) -> bool:
    """True when no other train_adapter task run of this flow run (a sweep's candidate) is Running."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.runtime import task_run

    tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])))
    return not any(t.task_key.startswith("train_adapter") and str(t.id) != str(task_run.id)
                   and t.state is not None and t.state.name == "Running" for t in tasks)


def _flow_waits(_client: Any, run: Any) -> bool:
    return run.state is not None and run.state.name == WAITING_STATE
