"""The host's CPU share, on Prefect's global concurrency limits (nothing home-made; the GPU pool: gpus.py).

CPU share (cpu_share, cpu_threads): `qlora-cpu` is a counter, not a gate (CPU_COUNTER_SLOTS): every process that
trains or evaluates holds one slot while it computes, so its active slots are the runs computing on this host now,
and each takes cores // runs threads. QLORA_CPU_THREADS (or OMP_NUM_THREADS) set by the user overrides the share.
The 1-minute load average over the cores counts as well (load 4 on 2 cores: 2 runs' worth, so 1 thread each), with a
server or without one (then it is all there is to count): work that is not a run takes cores too.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

from tasks.log import current_run_attempt, logger
from tasks.pool.hosts import on_host, this_host
from tasks.pool.leases import hold, uses_server

CPU_LIMIT = "qlora-cpu"  # named for the host where QLORA_HOST is set (cpu_limit): each host counts its own runs
CPU_COUNTER_SLOTS = 10_000  # a counter: never reached, so nobody waits for it
THREADS_VARIABLE = "QLORA_CPU_THREADS"  # an explicit thread count per process, over the share


def cpu_limit() -> str:
    """This host's CPU counter: CPU_LIMIT, or `qlora-cpu@HOST` where several hosts share the server (hosts.py)."""
    return on_host(CPU_LIMIT, this_host())


def host_cores() -> int:
    """Cores this process may run on (its affinity, which a container or taskset narrows)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def cpu_threads(stage: str, processes: int = 1, holding: bool = False) -> int:
    """Threads for each of this run's `processes` on this host (cpu_share_threads), said in one log line."""
    threads, why = cpu_share_threads(processes, holding)
    logger().info("%s: %s", stage, why)
    return threads


def cpu_share_threads(processes: int = 1, holding: bool = False) -> tuple[int, str]:
    """Threads for each of this run's `processes` on this host, and why: an explicit QLORA_CPU_THREADS /
    OMP_NUM_THREADS, else the run's share of the cores, cores // (runs computing now x processes), at least 1.
    `holding`: this run already holds its `qlora-cpu` slot (cpu_share), so it is among the runs counted."""
    for variable in (THREADS_VARIABLE, "OMP_NUM_THREADS"):
        if (value := os.environ.get(variable, "").strip()).isdigit() and int(value) > 0:
            return int(value), f"{value} thread(s) per process ({variable} is set)"
    cores = host_cores()
    runs, measured = _runs_computing(cores, holding)
    threads = max(1, cores // (runs * processes))
    each = f"{threads} thread(s)" + (f" for each of {processes} processes" if processes > 1 else "")
    return threads, f"{measured}: {each} (set {THREADS_VARIABLE} to choose)"


def _runs_computing(cores: int, holding: bool) -> tuple[int, str]:
    """How many runs' worth of work compete for this host's cores now, this run included, and what was measured to
    say so: the runs the server counts (active slots of `qlora-cpu`) or the host's load, whichever is more.

    The load counts too where there is a server: a run started by a worker on a host busy with other work (a load of
    11 on 2 cores) took both cores while the server counted it alone, and its two threads waited for each other (27 to
    155 tokens/s, against about 600 with the one thread a terminal's run took on the same host). A load of twice the
    cores counts as two runs' worth of work, whoever makes it."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    busy = max(1, round(load / cores))
    measured = f"load average {load:.1f} on {cores} cores"
    if not uses_server():  # the runs cannot see each other, only how busy the host is
        return busy, measured
    from prefect import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            active = client.read_global_concurrency_limit_by_name(cpu_limit()).active_slots
        except ObjectNotFound:
            return busy, (f"{measured}, other runs not counted (no {cpu_limit()!r} limit on the server: "
                          "`qlora-pipeline setup` creates it)")
    runs = max(1, active + (0 if holding else 1))
    counted = f"{runs} run(s) computing on {cores} cores (active slots of {cpu_limit()!r}, this run included)"
    return max(runs, busy), f"{counted}; {measured}"


@contextmanager
def cpu_share(stage: str, processes: int = 1) -> Iterator[int]:
    """Count this run among those computing on the host while the block runs (a slot of `qlora-cpu`, where there is
    a server and a flow run) and set torch's intra-op threads to its share; yields threads per process."""
    import torch

    with ExitStack() as held:
        holding = current_run_attempt() is not None and uses_server()
        if holding:  # not strict: a server set up before this limit existed just shares less well
            holding = held.enter_context(hold(cpu_limit(), 1, strict=False, critical=False))
        threads = cpu_threads(stage, processes, holding)
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            yield threads
        finally:
            torch.set_num_threads(before)
