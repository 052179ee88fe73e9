"""The Prefect API a `qlora-pipeline run` or `sweep` without a server serves itself, from a thread of its process.

Prefect's own temporary server is a child process. SIGTERM (what systemd, Kubernetes and a pre-empted node send)
reached it too when sent to the process group, so the run could not record its crash (144 s of connection
retries, the run left Running, no failure hook), and SIGTERM to the CLI alone left it running, orphaned. Served
from a thread (uvicorn installs no signal handlers outside the main thread), the API lives exactly as long as
the run's process: it is there while the flow records its Crashed state and runs its hooks, and it ends with the
process however that ends, kill -9 included.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

# set while this process serves its own API: tasks.pool.leases.uses_server tells it from a shared server
TEMPORARY_API_ENV = "QLORA_TEMPORARY_API_URL"


@contextmanager
def temporary_server(startup_seconds: float) -> Iterator[str]:
    """Serve Prefect's API (no UI, no background services, as Prefect's temporary server) while in the block."""
    import uvicorn
    from prefect.server.api.server import create_app
    from prefect.settings import PREFECT_API_URL, PREFECT_UI_URL, temporary_settings

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))  # a free port, held from now on: no race with another run
    url = f"http://127.0.0.1:{listener.getsockname()[1]}/api"
    server = uvicorn.Server(uvicorn.Config(create_app(ephemeral=True, final=True), log_level="error",
                                           lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, name="prefect-api", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_seconds
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"Timed out while attempting to connect to ephemeral Prefect API server ({url})")
        time.sleep(0.05)
    os.environ[TEMPORARY_API_ENV] = url
    try:
        # no UI here, and the API ends with the command: Prefect would infer a UI address from the API's and print
        # "View at" links to it (and tracking would tag runs with them); "" says there is none
        with temporary_settings({PREFECT_API_URL: url, PREFECT_UI_URL: ""}):
            try:
                yield url
            finally:
                _send_queued()
    finally:
        os.environ.pop(TEMPORARY_API_ENV, None)
        server.should_exit = True
        thread.join(timeout=10)
        listener.close()


def _send_queued() -> None:
    """Send the logs and events still queued before the API goes (as prefect_test_harness does)."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        worker.drain_all(timeout=5)
