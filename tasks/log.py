"""One logger for stage code (Prefect's run logger inside a run, so lines show in the UI), and which run this is (the
flow-run attempt; a sweep candidate's task run, whose artifacts are keyed by it)."""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

from tasks.errors import UserError


def logger() -> logging.Logger | logging.LoggerAdapter:
    """The current Prefect run logger, or the `qlora_pipeline` logger outside a run."""
    try:
        from prefect.exceptions import MissingContextError
        from prefect.logging import get_run_logger

        return get_run_logger()
    except (ImportError, MissingContextError):
        return logging.getLogger("qlora_pipeline")


@contextmanager
def warnings_to_terminal() -> Iterator[None]:
    """Outside a run (`qlora-pipeline history`, `promote`): the pipeline's warnings, the registry's repairs among them,
    printed to stderr as plain lines for the block, once (not again through whatever handlers the root logger has)."""
    import sys

    log = logging.getLogger("qlora_pipeline")
    handler, propagate = logging.StreamHandler(sys.stderr), log.propagate
    handler.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(handler)
    log.propagate = False
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.propagate = propagate


def current_run_attempt() -> str | None:
    """flow-run id and attempt number, so a summary can tell computed-now from reused; None outside a run."""
    try:
        from prefect.runtime import flow_run

        run_id = flow_run.id
    except Exception:  # outside any flow run (a stage called through .fn())
        return None
    return f"{run_id}:{flow_run.run_count}" if run_id else None


def candidate_run_name(stage: str, name: str, label: str) -> str:
    """The task run name of a sweep candidate's stage (the UI lists it); its artifacts are keyed from it."""
    return f"{stage}-{name} ({label})"


def for_candidate(key: str, description: str) -> tuple[str, str]:
    """An artifact's key and description, with the sweep candidate's name and overrides when the current task run
    is a candidate's (candidate_run_name): the candidates of a sweep share one flow run, and shared keys made
    every candidate's training update the first one's progress bar and loss curve."""
    from prefect.runtime import task_run

    found = re.fullmatch(r"\w+-(c\d+) \((.*)\)", task_run.name or "", flags=re.DOTALL)
    return (key, description) if found is None else (f"{key}-{found[1]}", f"{found[1]} ({found[2]}): {description}")


# the loggers that Prefect's engines and flows write run lines to
_PREFECT_LOGGERS = ("prefect.engine", "prefect.flows", "prefect.flow_runs", "prefect.task_runs")
_HOOK_LINE = re.compile(r"Running hook '.*' in response to entering state|Hook '.*' finished running successfully")
_PARAMETERS_REFUSED = "Parameter validation failed for flow "  # prefect.flows' dump of a refused config


def _user_error(record: logging.LogRecord) -> BaseException | None:
    """The user error a log line carries (as its exception or as an argument), or None."""
    found = [record.exc_info[1]] if record.exc_info else []
    found += [a for a in record.args if isinstance(a, BaseException)] if isinstance(record.args, tuple) else []
    if not found:
        return None
    from prefect.exceptions import ParameterTypeError  # a flow run's parameters that the config refuses

    return next((e for e in found if isinstance(e, UserError | ParameterTypeError)), None)


def _one_line(error: BaseException) -> str:
    """A user error as one log line; Prefect lists the fields of a refused config one per line."""
    if not isinstance(error, UserError):
        lines = str(error).splitlines()[1:]  # " - config.train.max_steps: Value error, 0 steps would ..."
        fields = [line.strip(" -").replace(": Value error, ", ": ") for line in lines if line.strip()]
        return (f"Invalid configuration: {'; '.join(fields)}. Fix these fields in the run's parameters and start "
                "a new run (a Retry would fail the same way).")
    return " ".join(str(error).split())


def _quotes_a_user_error(message: str) -> bool:
    """A failed state's line that quotes a user error ("Finished in state Failed('... UserError: ...')")."""
    names = ("ParameterTypeError", *(cls.__name__ for cls in (UserError, *UserError.__subclasses__())))
    return message.startswith("Finished in state Failed(") and any(f"{name}: " in message for name in names)


class _UserErrorOnce(logging.Filter):
    """A user error is logged once, as one line without a traceback. Prefect logs it where it is raised, again in
    the failed state of every task and flow it passes through, and in a flow-run process once more as the engine
    exits, each time with a traceback. The first line that carries the exception object stays, reworded to the
    error alone; later lines carrying the same object, and the lines quoting it, go. `printed_by_caller`: that
    line goes to the UI's run log only, not to this process's terminal (the command prints the error itself).
    Also drops Prefect's "Running hook ..." lines unless the logger is at DEBUG."""

    printed_by_caller = False

    def filter(self, record: logging.LogRecord) -> bool:
        if (error := _user_error(record)) is not None:
            # prefect.engine's lines stay out of the UI's run log: the run's own line about the error follows
            if getattr(error, "_logged_once", False) or record.name == "prefect.engine":
                return False
            error._logged_once = True  # on the object: the same error is met again as it propagates
            record.msg, record.args, record.exc_info, record.exc_text = _one_line(error), (), None, None
            if self.printed_by_caller:
                record.user_error = True
                _keep_out_of_terminal()
            return True
        message = record.getMessage()
        if _HOOK_LINE.match(message):
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return not (message.startswith(_PARAMETERS_REFUSED) or _quotes_a_user_error(message))


class _NotInTerminal(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(record, "user_error", False)


def _keep_out_of_terminal() -> None:
    """Filter marked lines out of the terminal's handlers as they are now: Prefect replaces its handlers when it
    configures logging again (a run does, after the command started), so this runs as such a line passes."""
    from prefect.logging.handlers import PrefectConsoleHandler

    for name in ("", "prefect", *_PREFECT_LOGGERS):
        for handler in logging.getLogger(name).handlers:
            if isinstance(handler, PrefectConsoleHandler) and not any(
                    isinstance(f, _NotInTerminal) for f in handler.filters):
                handler.addFilter(_NotInTerminal())


def log_user_errors_once(printed_by_caller: bool = False) -> None:
    """Install _UserErrorOnce on Prefect's run loggers (idempotent). A logger's filters outlive a reconfiguration
    of logging, which replaces only its handlers. `printed_by_caller`: for a command that prints a user error
    itself when the run ends (`qlora-pipeline run`, `sweep`)."""
    for name in _PREFECT_LOGGERS:
        target = logging.getLogger(name)
        once = next((f for f in target.filters if isinstance(f, _UserErrorOnce)), None)
        if once is None:
            target.addFilter(once := _UserErrorOnce())
        once.printed_by_caller = once.printed_by_caller or printed_by_caller


def quiet_user_errors(*_hook_args: object, **_hook_kwargs: object) -> None:
    """User errors once and without traceback in the terminal and the UI's run log, and the libraries' noise
    silenced (idempotent). Also a flow on_running hook, so it holds in flow-run processes that a worker starts."""
    log_user_errors_once()
    quiet_libraries()


class _DropMissingKernels(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "No module named 'kernels'" not in record.getMessage()


def quiet_libraries() -> None:
    """Silence the libraries' warnings that are not about our calls and that no user can act on (idempotent)."""
    # peft's PeftModel and TRL read model.is_gradient_checkpointing, which transformers 5 deprecates; our own
    # calls use the new names (activation_checkpointing), so what is left would print on every training run
    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
    # TRL keeps some trainers (ORPO's among them) under trl.experimental and warns at each import that its API may
    # change; the pipeline pins TRL's version (constraints.txt) and its tests cover the trainers it uses
    warnings.filterwarnings("ignore", message="You are importing from 'trl.experimental'")
    # bitsandbytes tries an optional CPU kernel package (`kernels`, from the hub: not on machines without network)
    # in every model-loading stage and uses its own CPU kernel instead; nothing is wrong
    ops = logging.getLogger("bitsandbytes.backends.cpu.ops")
    if not any(isinstance(f, _DropMissingKernels) for f in ops.filters):
        ops.addFilter(_DropMissingKernels())


# At import: a worker's flow-run process checks the run's parameters, and logs a refused config, before any hook of
# the flow runs; it has imported the flow module (and so this one) by then.
log_user_errors_once()
