"""Cancelling a run works after a Prefect server restart: the flow-run process watches its own run's state.

Prefect 3.9's process worker watches each flow run it started for Cancelling (prefect/_internal/observers.py,
FlowRunCancellingObserver): the events websocket, and while that is down a poll of the API every 10 s. Its poller
gives up after three failed polls in a row (prefect/utilities/services.py critical_service_loop), so a server that is
away for about half a minute (a restart on a busy host, a database that takes that long to open) ends the watching
for good: the worker logs "Cancellation observer failed. Flow run cancellation disabled." and a Cancel pressed later
in the UI leaves the run Cancelling while it trains on. A `qlora-pipeline run` in a terminal against a server has no
such observer at all.

So each flow run watches itself: a daemon thread (watch_for_cancel, an on_running hook; stop_watching, on the final
states' hooks, ends it) asks the API for the run's state every POLL_S seconds, however long the API is away (a failed
poll is tried again at the next, for as long as the run lasts). A run that stays Cancelling for GRACE_S seconds
(Prefect's own observer, when it works, stops it within a few) is stopped the way Prefect's runner stops it: its
state set Cancelled, Prefect's engine told that the SIGTERM that follows is a cancellation (its control intent,
prefect/_internal/control_listener.py, which the runner's control channel sets the same way), then SIGTERM to this
process. The engine then cancels the task runs, the training child follows the run (tasks/train_adapter/launch.py
stop), stage locks and GPU slots are released as after any SIGTERM, and the run ends Cancelled, not Crashed. Where
Prefect's private intent is not there (another Prefect version), the run is still stopped, and ends Crashed.
"""

from __future__ import annotations

import contextvars
import os
import signal
import threading
import time
from typing import Any

POLL_S = 5.0
# a worker's runner cancels within a few seconds while its observer works; without a runner (a terminal's run against
# a server) nothing else will
GRACE_S = 20.0
_RUNNER_OWNS = "PREFECT__ENABLE_CANCELLATION_AND_CRASHED_HOOKS"  # "false" in flow-run processes a runner started


# the watchers of the flow runs this process runs now, by run id: set to stop one (stop_watching)
_WATCHING: dict[Any, threading.Event] = {}


def watch_for_cancel(_flow: Any, flow_run: Any, _state: Any) -> None:
    """on_running hook: start the watcher of this flow run, a daemon thread in a copy of the hook's context (the same
    Prefect settings: its API), until stop_watching (the run's final-state hooks) or a final state it reads."""
    grace = GRACE_S if os.environ.get(_RUNNER_OWNS, "true").lower() == "false" else 0.0
    stop = _WATCHING.setdefault(flow_run.id, threading.Event())
    context = contextvars.copy_context()
    threading.Thread(target=context.run, args=(_watch, flow_run, grace, stop), name=f"cancel-watch {flow_run.id}",
                     daemon=True).start()


def stop_watching(_flow: Any, flow_run: Any, _state: Any) -> None:
    """on_completion, on_failure, on_crashed and on_cancellation hook: the run ended here; its watcher stops."""
    stop = _WATCHING.pop(flow_run.id, None)
    if stop is not None:
        stop.set()


def _watch(flow_run: Any, grace: float, stop: threading.Event) -> None:
    from prefect import get_client
    from prefect.client.schemas.objects import StateType
    from prefect.exceptions import ObjectNotFound
    from prefect.logging.loggers import flow_run_logger

    log = flow_run_logger(flow_run)
    cancelling_since: float | None = None
    away_since: float | None = None
    while not stop.wait(POLL_S):
        try:
            with get_client(sync_client=True) as client:
                state = client.read_flow_run(flow_run.id).state
        except ObjectNotFound:  # the run was deleted: nothing to watch
            return
        except Exception as exc:  # noqa: BLE001 - an outage of any kind: asked again at the next poll
            if away_since is None:
                away_since = time.monotonic()
                log.warning("The Prefect API does not answer (%s); this run keeps asking for its state every %g s, so "
                            "a Cancel still reaches it once the server is back", type(exc).__name__, POLL_S)
            continue
        if away_since is not None:
            log.info("The Prefect API answers again after %.0f s", time.monotonic() - away_since)
            away_since = None
        if state is None:
            continue
        if state.is_final():
            _WATCHING.pop(flow_run.id, None)
            return
        cancelling = state.type == StateType.CANCELLING or state.name == "Cancelling"
        cancelling_since = (cancelling_since or time.monotonic()) if cancelling else None
        if cancelling_since is not None and time.monotonic() - cancelling_since >= grace and not stop.is_set():
            _stop(flow_run, log, grace)
            return


def _stop(flow_run: Any, log: Any, grace: float) -> None:
    """End this run as cancelled: state Cancelled, Prefect's engine told the SIGTERM is a cancellation, SIGTERM."""
    from prefect import get_client
    from prefect.states import Cancelled

    why = (f"cancelled: Cancelling for {grace:.0f} s with the process still running (the worker's cancellation "
           "observer had lost the server), so the run stopped itself" if grace else "cancelled")
    log.warning("This run was %s", why)
    try:
        with get_client(sync_client=True) as client:
            client.set_flow_run_state(flow_run.id, Cancelled(message=f"Flow run was {why}."))
    except Exception as exc:  # noqa: BLE001 - the engine sets it itself where it owns cancellation
        log.warning("Could not set the state Cancelled (%s); stopping the run anyway", exc)
    if not _intend_cancel():
        log.warning("Prefect's engine could not be told this is a cancellation: it will record a crash")
    os.kill(os.getpid(), signal.SIGTERM)


def _intend_cancel() -> bool:
    """Mark the coming SIGTERM as a cancellation for Prefect's engine (its runner's control intent), as the runner's
    control channel does; False where this Prefect version has no such intent."""
    try:
        from prefect._internal import control_listener
        from prefect.utilities.engine import commit_control_intent_and_ack
    except ImportError:
        return False
    commit = getattr(control_listener, "_set_intent", None)
    clear = getattr(control_listener, "_clear_intent", None)
    if commit is None or clear is None:
        return False
    return bool(commit_control_intent_and_ack(commit_intent=lambda: commit("cancel"), clear_intent=clear,
                                              send_ack=lambda: None))
