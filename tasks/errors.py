"""Errors the user can fix: bad config, bad data, unknown module names."""

from __future__ import annotations


class UserError(Exception):
    """A deterministic problem in the user's input; its message says what is wrong and how to fix it.

    The CLI prints it as one paragraph without a traceback, and stages never retry it.
    """


class TrainingDiverged(UserError):
    """The training loss stopped being a finite number (tasks/train_adapter/divergence.py).

    Not bad input in the usual sense: a learning rate too high for the model and data, float16 overflow or a damaged
    starting adapter cause it. But the same settings diverge the same way again, and what fixes it is a change of
    settings: so, like a UserError, it is one paragraph saying what to change, exit status 2, never retried.
    """
