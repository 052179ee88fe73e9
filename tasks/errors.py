"""Errors the user can fix: bad config, bad data, unknown module names."""

from __future__ import annotations


class UserError(Exception):
    """A deterministic problem in the user's input; its message says what is wrong and how to fix it.

    The CLI prints it as one paragraph without a traceback, and stages never retry it.
    """
