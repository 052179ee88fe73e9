"""The reward functions of the methods that learn from rewards (tasks/methods.py): the built-ins in REWARDS, reward
models of the exports registry (reward_model.py: registry:NAME), and the user's own from allowed modules.

A reward function takes TRL's keywords, prompts, completions (texts), completion_ids, and the prompt rows' other
columns (`answer`, ...) as lists, and returns one finite float per completion (None: no opinion, NaN to TRL); each
call is bounded by train.reward_timeout_s, and a NaN or infinite reward is refused with the function's name. The same
functions score training's sampled answers (train_adapter) and the held-out greedy answers of base, tuned and
champion (evaluate_adapter), so a run is judged on what it learned from.

A built-in is one function in builtin.py and one entry in REWARDS. A user's function is named `module:function` and
loads only from a module the deployment's operator allows in the environment variable QLORA_REWARD_MODULES of the
process that runs the flow (comma-separated module names; `pkg` allows pkg and its submodules): a run form cannot set
it, nor a run's job variables (tasks/allowed.py), so a UI user cannot make the worker run code by typing a module
path. `check` refuses anything else before any stage runs. The functions' source is part of train_adapter's cache
key (`fingerprint`), so editing one retrains; a reward model's adapter files are, likewise.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks import allowed, methods
from tasks.config import TrainArgs
from tasks.errors import UserError
from tasks.rewards import builtin, reward_model

ALLOW_VARIABLE = allowed.REWARD_MODULES


@dataclass(frozen=True)
class Reward:
    """One built-in as train.rewards names it; `make` binds its settings (train.reward_pattern, ...)."""

    name: str
    make: Callable[[TrainArgs], Callable[..., list[float | None]]]
    needs: tuple[str, ...] = ()  # data columns it reads


REWARDS: tuple[Reward, ...] = (
    Reward("answer_match", lambda _: builtin.answer_match, needs=("answer",)),
    Reward("numeric_match", lambda _: builtin.numeric_match, needs=("answer",)),
    Reward("format", lambda train: functools.partial(builtin.format_match, pattern=train.reward_pattern)),
    Reward("length_penalty", lambda train: functools.partial(builtin.length_penalty,
                                                             most=train.max_completion_length)),
)
BUILT_IN = {r.name: r for r in REWARDS}


def allowed_modules() -> list[str]:
    """The modules the deployment allows user reward functions from (QLORA_REWARD_MODULES)."""
    return allowed.listed(ALLOW_VARIABLE)


def check(train: TrainArgs, runs_dir: Path) -> None:
    """Before any stage: every name in train.rewards is a built-in, a reward model of runs_dir's registry or an
    allowed module's function that loads; one UserError listing every problem."""
    if not methods.method(train.method).rewards:
        return
    problems = []
    for name in train.rewards:
        try:
            reward_model.check(name, runs_dir) if reward_model.is_reward_model(name) else _function(name, train)
        except UserError as exc:
            problems.append(str(exc))
    if problems:
        raise UserError("train.rewards cannot be used: " + " ".join(problems))


def pinned(train: TrainArgs, runs_dir: Path) -> TrainArgs:
    """train with each reward model pinned to its version (registry:NAME -> registry:NAME/vNNNN, the champion's
    now), so the training and the evaluation of a run score with the same one."""
    return train.model_copy(update={"rewards": [reward_model.pin(n, runs_dir) if reward_model.is_reward_model(n)
                                                else n for n in train.rewards]})


def load(train: TrainArgs, runs_dir: Path, model_dir: Path) -> list[Callable[..., list[float | None]]]:
    """train.rewards as callables, each named for its entry (TRL logs rewards/<name>/mean); reward models score
    with prepare_model folder `model_dir`'s base."""
    return [_named(reward_model.make(name, runs_dir, model_dir) if reward_model.is_reward_model(name)
                   else _function(name, train), name, train.reward_timeout_s) for name in train.rewards]


def fingerprint(train: TrainArgs, runs_dir: Path) -> dict[str, str]:
    """{reward name: sha256 of its function's source, or of a reward model's version and files} for the functions
    outside this package (the built-ins are the pipeline's code, versioned with it); editing one changes
    train_adapter's key."""
    return {name: reward_model.fingerprint(name, runs_dir) if reward_model.is_reward_model(name)
            else hashlib.sha256(_source(_function(name, train)).encode()).hexdigest()
            for name in train.rewards if name not in BUILT_IN}


def needs(train: TrainArgs) -> set[str]:
    """The data columns the built-ins in train.rewards read."""
    return {column for name in train.rewards if name in BUILT_IN for column in BUILT_IN[name].needs}


def _function(name: str, train: TrainArgs) -> Callable[..., list[float | None]]:
    if name in BUILT_IN:
        return BUILT_IN[name].make(train)
    module, sep, attr = name.partition(":")
    if not sep or not module or not attr:
        raise UserError(f"{name!r} is neither a built-in reward ({', '.join(BUILT_IN)}), a reward model "
                        f"({reward_model.PREFIX}NAME) nor module:function.")
    allowed = allowed_modules()
    if not any(module == a or module.startswith(a + ".") for a in allowed):
        raise UserError(
            f"{name!r} is from module {module}, which the deployment does not allow (allowed: "
            f"{', '.join(allowed) or 'none'}). The operator allows a module in the environment variable "
            f"{ALLOW_VARIABLE} of the worker that runs the flow (comma-separated module names, e.g. "
            f"{ALLOW_VARIABLE}={module}); a run form cannot, so that a UI user cannot make the worker run code.")
    try:
        found = getattr(importlib.import_module(module), attr)
    except ImportError as exc:
        raise UserError(f"{name!r}: module {module} does not import ({exc}); put it on the worker's "
                        "PYTHONPATH.") from None
    except AttributeError:
        raise UserError(f"{name!r}: module {module} has no {attr}.") from None
    if not callable(found):
        raise UserError(f"{name!r}: {module}.{attr} is not a function.")
    return found


def _source(func: Callable[..., Any]) -> str:
    """The code of a user's reward function: its whole module's source (helpers it calls are part of it)."""
    try:
        return inspect.getsource(inspect.getmodule(func) or func)
    except (OSError, TypeError):
        return repr(func)


def _named(func: Callable[..., list[float | None]], name: str, timeout: float) -> Callable[..., list[float | None]]:
    """`func` checked as it is called: an exception, a call that takes more than `timeout` seconds (it runs in a
    thread of its own, which a function that never returns is left in), a wrong number of rewards or a reward that
    is not a finite number is one UserError naming it."""

    def call(prompts: list[Any], completions: list[Any], **columns: Any) -> list[float | None]:
        out = _within(timeout, name, len(completions), lambda: list(func(prompts=prompts, completions=completions,
                                                                         **columns)))
        bad = [r for r in out if r is not None and not isinstance(r, (int, float))]
        if len(out) != len(completions) or bad:
            got = f"{len(out)} values" if len(out) != len(completions) else f"values such as {bad[0]!r}"
            raise UserError(f"The reward function {name} returned {got} for {len(completions)} answers: it must "
                            "return one number (or None) per answer, in order. Fix it and run again.")
        if unfinite := [r for r in out if r is not None and not math.isfinite(r)]:
            raise UserError(f"The reward function {name} returned {len(unfinite)} value(s) that are not finite "
                            f"numbers (such as {unfinite[0]!r}) for {len(completions)} answers: a NaN or infinite "
                            "reward gives no direction to learn from, and the gate cannot compare it. Return a finite "
                            "number per answer, or None where it has no opinion; training resumes from its latest "
                            "checkpoint once it is fixed.")
        return [None if r is None else float(r) for r in out]

    call.__name__ = name.replace(":", ".").replace("/", ".")
    return call


def _within(timeout: float, name: str, answers: int, work: Callable[[], list[Any]]) -> list[Any]:
    """work() run in a daemon thread, its result; a UserError when it raises or takes more than `timeout` seconds
    (the thread is then left to itself: Python cannot stop it, and it does not keep the process alive)."""
    done: dict[str, Any] = {}

    def run() -> None:
        try:
            done["out"] = work()
        except BaseException as exc:  # noqa: BLE001 - the user's code: any error is theirs, said once below
            done["error"] = exc

    thread = threading.Thread(target=run, name=f"reward {name}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise UserError(f"The reward function {name} did not return within train.reward_timeout_s={timeout:g} s for "
                        f"{answers} answers, so the run stopped rather than wait for ever. Make it faster (or find "
                        "where it waits), or raise train.reward_timeout_s; training resumes from its latest "
                        "checkpoint.")
    if "error" in done:
        exc = done["error"]
        raise UserError(f"The reward function {name} raised {type(exc).__name__}: {exc}. Fix the function (it "
                        "gets prompts, completions, completion_ids and the data's other columns as keyword "
                        "lists) and run again; training resumes from its latest checkpoint.") from None
    return done["out"]


def columns_of(rows: list[str]) -> dict[str, list[Any]]:
    """prepare_data's `columns` (one JSON object per prompt row) as keyword lists, a missing key None."""
    import json

    decoded = [json.loads(r) for r in rows]
    names = sorted({k for d in decoded for k in d})
    return {name: [d.get(name) for d in decoded] for name in names}


def for_trl(func: Callable[..., list[float | None]]) -> Callable[..., list[float | None]]:
    """A reward function as GRPOTrainer calls it: the rows' `columns` JSON decoded into keyword lists; TRL's own
    extras (trainer_state, log_extra, log_metric) left out, so a function sees in training what it sees in
    evaluation."""

    def call(prompts: list[Any], completions: list[Any], completion_ids: list[list[int]], columns: list[str],
             **_: Any) -> list[float | None]:
        return func(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns_of(columns))

    call.__name__ = func.__name__
    return call


def score(funcs: list[Callable[..., list[float | None]]], prompts: list[str], completions: list[str],
          completion_ids: list[list[int]], columns: list[str]) -> dict[str, list[float | None]]:
    """Each function's rewards for (prompt, completion) rows, by name (evaluate_adapter)."""
    keywords = columns_of(columns)
    return {f.__name__: f(prompts=prompts, completions=completions, completion_ids=completion_ids, **keywords)
            for f in funcs}
