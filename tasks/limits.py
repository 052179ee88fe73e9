"""The global concurrency limit that lets only one training use the GPU at a time."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any
from uuid import UUID

from tasks.errors import UserError
from tasks.log import current_run_attempt, logger

GPU_LIMIT = "qlora-gpu"  # created by `qlora-pipeline setup` (and by `qlora-pipeline run` when missing)
LEASE_SECONDS = 60  # the shortest lease Prefect's server accepts
WAITING_STATE = "Waiting for GPU"


def uses_server() -> bool:
    """True when runs go to a Prefect server (PREFECT_API_URL), where several runs can compete for the GPU.

    A run without one gets a temporary server of its own, which no other run shares; taking the slot there
    guards nothing, and on that SQLite-backed temporary server it was seen to block the run indefinitely.
    """
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    # the API `qlora-pipeline run` serves itself (deployments/temporary_server.py) is as temporary as Prefect's own
    return bool(url) and url != os.environ.get("QLORA_TEMPORARY_API_URL")


@contextmanager
def gpu_slot() -> Iterator[None]:
    """Hold the one GPU-training slot while training; strict, so a missing limit is an error.

    A run that has to wait says so: a log line, and its train_adapter task run shows the state "Waiting for GPU"
    (type Pending) until the slot frees, then Running again. Outside a flow run (a stage called through .fn()),
    or without a Prefect server, there is nothing to hold.
    """
    if current_run_attempt() is None or not uses_server():
        yield
        return
    from prefect.concurrency.sync import concurrency

    # A short lease, renewed in the background while training runs: a run killed with -9 frees the slot
    # within LEASE_SECONDS instead of blocking the next run; a renewal hiccup does not kill the training.
    options = {"occupy": 1, "strict": True, "lease_duration": LEASE_SECONDS, "raise_on_lease_renewal_failure": False}
    with ExitStack() as held:
        try:
            started = _say_waiting() if _slot_taken() else None
            held.enter_context(concurrency(GPU_LIMIT, **options))
            if started is not None:
                _say_running(started)
        except Exception as exc:
            if type(exc).__name__ != "ConcurrencySlotAcquisitionError":  # not exported publicly by prefect
                raise
            raise UserError(f"Training could not take the GPU slot of the global concurrency limit {GPU_LIMIT!r}: "
                            f"{exc}. If the limit does not exist on this Prefect server, run `qlora-pipeline "
                            "setup` once.") from exc
        yield


def _slot_taken() -> bool:
    """True when another run holds the slot now (a timed acquire instead would log an ERROR when it times out)."""
    from prefect import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            limit = client.read_global_concurrency_limit_by_name(GPU_LIMIT)
        except ObjectNotFound:  # the strict acquisition says what to do
            return False
    return limit.active_slots >= limit.limit


def _say_waiting() -> float:
    """Log that this run waits for the slot and show it as the task run's state; when the wait began."""
    from prefect.states import Pending

    logger().info("train_adapter: waiting for the GPU: another run holds the slot of the global concurrency limit "
                  "%r; training starts when it ends (or within %d s of it being killed)", GPU_LIMIT, LEASE_SECONDS)
    _set_task_state(Pending(name=WAITING_STATE, message=f"Waiting for the {GPU_LIMIT!r} slot"))
    return time.monotonic()


def _say_running(started: float) -> None:
    from prefect.states import Running

    logger().info("train_adapter: took the GPU slot after waiting %.0f s", time.monotonic() - started)
    _set_task_state(Running())


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
