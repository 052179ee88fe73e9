"""One logger for stage code (Prefect's run logger inside a run, so lines show in the UI), and which run this is."""

from __future__ import annotations

import logging
import warnings


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


class _DropUserErrorTraceback(logging.Filter):
    """Prefect logs a failed task with its traceback; for a user error the message alone is the help."""

    def filter(self, record: logging.LogRecord) -> bool:
        from tasks.errors import UserError

        if record.exc_info and isinstance(record.exc_info[1], UserError):
            record.exc_info, record.exc_text = None, None
        return True


def quiet_user_errors(*_hook_args: object, **_hook_kwargs: object) -> None:
    """Drop the traceback from log lines about a UserError, in the terminal and in the UI's run log (idempotent).

    Also a flow on_running hook, so it holds in flow-run processes that a worker starts.
    """
    from prefect.logging.configuration import setup_logging

    if not logging.getLogger("prefect.flow_runs").handlers:  # Prefect's logging is not configured yet
        setup_logging()
    for name in ("", "prefect", "prefect.flow_runs", "prefect.task_runs", "prefect.engine"):
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, _DropUserErrorTraceback) for f in handler.filters):
                handler.addFilter(_DropUserErrorTraceback())
    quiet_libraries()


class _DropMissingKernels(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "No module named 'kernels'" not in record.getMessage()


def quiet_libraries() -> None:
    """Silence the libraries' warnings that are not about our calls and that no user can act on (idempotent)."""
    # peft's PeftModel and TRL read model.is_gradient_checkpointing, which transformers 5 deprecates; our own
    # calls use the new names (activation_checkpointing), so what is left would print on every training run
    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
    # bitsandbytes tries an optional CPU kernel package (`kernels`, from the hub: not on machines without network)
    # in every model-loading stage and uses its own CPU kernel instead; nothing is wrong
    ops = logging.getLogger("bitsandbytes.backends.cpu.ops")
    if not any(isinstance(f, _DropMissingKernels) for f in ops.filters):
        ops.addFilter(_DropMissingKernels())
