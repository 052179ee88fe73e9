"""One logger for stage code (Prefect's run logger inside a run, so lines show in the UI), and which run this is."""

from __future__ import annotations

import logging


def logger() -> logging.Logger | logging.LoggerAdapter:
    """The current Prefect run logger, or the `qlora_pipeline` logger outside a run."""
    try:
        from prefect.exceptions import MissingContextError
        from prefect.logging import get_run_logger

        return get_run_logger()
    except (ImportError, MissingContextError):
        return logging.getLogger("qlora_pipeline")


def current_run_attempt() -> str | None:
    """flow-run id and attempt number, so a summary can tell computed-now from reused; None outside a run."""
    try:
        from prefect.runtime import flow_run

        run_id = flow_run.id
    except Exception:  # outside any flow run (a stage called through .fn())
        return None
    return f"{run_id}:{flow_run.run_count}" if run_id else None
