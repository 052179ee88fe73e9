"""Which GPU host this process belongs to, and the names of that host's pool limits and work queue.

Several GPU hosts share one Prefect server (docs/operations.md, "Several GPU hosts"): each host has its own GPU pool
and CPU counter, named for it (`qlora-gpu@gpu-a`, `qlora-gpu@gpu-a-0`, `qlora-cpu@gpu-a`), because Prefect's global
concurrency limits are global to the server: one `qlora-gpu-1` would mean "GPU 1 of any host", and runs on two
hosts that drew the same index would wait for each other while the other host's GPU idles. The host's name comes
from HOST_VARIABLE in the worker's environment, which its flow runs inherit. Unset (a single host): the names are
the unsuffixed ones a single-host server has always had, so such a server needs no change.

Runs reach a host through Prefect's work queues: each host's worker polls the pool's shared queue (SHARED_QUEUE, the
deployments' own) and its host's queue (host_queue), with `--limit` set to its GPUs, so a run waits in the shared
queue until some host has a free GPU and is taken by that host; a run pinned to a host goes to its queue only.
"""

from __future__ import annotations

import os
import re
from typing import Any

HOST_VARIABLE = "QLORA_HOST"
SHARED_QUEUE = "default"  # the deployments' queue (prefect.yaml sets none): every host's worker polls it
HOST_QUEUE_PREFIX = "host-"
WAITING_STATE = "Waiting for GPU"  # a run's state while it waits for GPUs: of its host's pool, or for a host
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")


def this_host() -> str | None:
    """This process's host name (HOST_VARIABLE), or None on a single host without one."""
    return os.environ.get(HOST_VARIABLE, "").strip() or None


def host_problem(host: str) -> str | None:
    """Why `host` cannot name a host's limits and queue, or None."""
    if _NAME.fullmatch(host):
        return None
    return (f"{HOST_VARIABLE}={host!r} cannot name a GPU host: use 1 to 63 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit (e.g. the short hostname, gpu-a).")


def on_host(limit: str, host: str | None) -> str:
    """`limit` as the limit of `host` ('qlora-gpu' -> 'qlora-gpu@gpu-a'); unchanged without a host."""
    return f"{limit}@{host}" if host else limit


def host_queue(host: str) -> str:
    """The work queue that only `host`'s worker polls (runs pinned to that host)."""
    return HOST_QUEUE_PREFIX + host


def hosts_of(client: Any, pool: str | None) -> list[str]:
    """The hosts of work pool `pool`: those whose queue exists (their `setup` or worker created it)."""
    from prefect.exceptions import ObjectNotFound

    if not pool:
        return []
    try:
        queues = client.read_work_queues(work_pool_name=pool)
    except ObjectNotFound:  # no such pool (yet): no hosts
        return []
    return sorted(q.name.removeprefix(HOST_QUEUE_PREFIX) for q in queues if q.name.startswith(HOST_QUEUE_PREFIX))


def placement(client: Any, pool: str | None, host: str | None) -> dict[str, Any]:
    """Where a new run of a deployment of work pool `pool` waits, as create_flow_run_from_deployment's arguments: on
    `host`'s work queue when pinned, and, where the pool has hosts, in a Scheduled state named "Waiting for GPU" that
    says for which host: the workers take it as any scheduled run (they select by state type) once a host has a free
    GPU, and Prefect does not rename it Late meanwhile. {} on a single host: as before."""
    from prefect.states import Scheduled

    from tasks.errors import UserError

    hosts = hosts_of(client, pool)
    if host is not None and host not in hosts:
        known = ", ".join(hosts) or "none"
        raise UserError(f"--host {host}: work pool {pool!r} has no host of that name (hosts: {known}). Run "
                        f"`qlora-pipeline setup --host {host}` and `qlora-pipeline worker --host {host}` on that "
                        "host, or give one of the hosts listed.")
    if not hosts:
        return {}
    if host is not None:
        why = f"pinned to host {host!r}: waits until its worker has a free GPU (work queue {host_queue(host)!r})"
        return {"work_queue_name": host_queue(host), "tags": [f"host:{host}"],
                "state": Scheduled(name=WAITING_STATE, message=why)}
    why = f"waits for a host with a free GPU (hosts: {', '.join(hosts)}); the first one free takes it"
    return {"state": Scheduled(name=WAITING_STATE, message=why)}
