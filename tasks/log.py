"""One logger for stage code: Prefect's run logger inside a run (so lines show in the UI), else stdlib."""

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
