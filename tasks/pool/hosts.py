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

HOST_VARIABLE = "QLORA_HOST"
SHARED_QUEUE = "default"  # the deployments' queue (prefect.yaml sets none): every host's worker polls it
HOST_QUEUE_PREFIX = "host-"
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
