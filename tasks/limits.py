"""The global concurrency limit that lets only one training use the GPU at a time."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from tasks.errors import UserError
from tasks.log import current_run_attempt

GPU_LIMIT = "qlora-gpu"  # created by `qlora-pipeline setup` (and by `qlora-pipeline run` when missing)
LEASE_SECONDS = 60  # the shortest lease Prefect's server accepts


def uses_server() -> bool:
    """True when runs go to a Prefect server (PREFECT_API_URL), where several runs can compete for the GPU.

    A run without one gets a temporary server of its own, which no other run shares; taking the slot there
    guards nothing, and on that SQLite-backed temporary server it was seen to block the run indefinitely.
    """
    from prefect.settings import PREFECT_API_URL

    return bool(PREFECT_API_URL.value())


@contextmanager
def gpu_slot() -> Iterator[None]:
    """Hold the one GPU-training slot while training; strict, so a missing limit is an error.

    Outside a flow run (a stage called through .fn()), or without a Prefect server, there is nothing to hold.
    """
    if current_run_attempt() is None or not uses_server():
        yield
        return
    from prefect.concurrency.sync import concurrency

    try:
        # A short lease, renewed in the background while training runs: a run killed with -9 frees the slot
        # within LEASE_SECONDS instead of blocking the next run; a renewal hiccup does not kill the training.
        with concurrency(GPU_LIMIT, occupy=1, strict=True, lease_duration=LEASE_SECONDS,
                         raise_on_lease_renewal_failure=False):
            yield
    except Exception as exc:
        if type(exc).__name__ != "ConcurrencySlotAcquisitionError":  # not exported publicly by prefect
            raise
        raise UserError(f"Training could not take the GPU slot of the global concurrency limit {GPU_LIMIT!r}: "
                        f"{exc}. If the limit does not exist on this Prefect server, run `qlora-pipeline setup` "
                        "once.") from exc
