"""The built-in reward functions (entries of REWARDS in tasks/rewards/__init__.py): TRL's signature, one float per
completion. They read the completion's text; chat completions (lists of messages) are read as their last message."""

from __future__ import annotations

import re
from typing import Any

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def answer_match(prompts: list[Any], completions: list[Any], answer: list[Any], **_: Any) -> list[float | None]:
    """1 where the completion, stripped, equals the answer column (case-insensitive), else 0; None without one."""
    return [None if a is None else float(text_of(c).strip().lower() == str(a).strip().lower())
            for c, a in zip(completions, answer, strict=True)]


def numeric_match(prompts: list[Any], completions: list[Any], answer: list[Any], **_: Any) -> list[float | None]:
    """1 where the completion's last number equals the answer's number, else 0; None where the answer has none."""
    out: list[float | None] = []
    for completion, expected in zip(completions, answer, strict=True):
        wanted = _NUMBER.findall(str(expected)) if expected is not None else []
        got = _NUMBER.findall(text_of(completion))
        out.append(None if not wanted else float(bool(got) and float(got[-1]) == float(wanted[-1])))
    return out


def format_match(prompts: list[Any], completions: list[Any], pattern: str, **_: Any) -> list[float | None]:
    """1 where train.reward_pattern occurs in the completion (re.search), else 0."""
    compiled = re.compile(pattern)
    return [float(compiled.search(text_of(c)) is not None) for c in completions]


def length_penalty(prompts: list[Any], completions: list[Any], completion_ids: list[list[int]], most: int,
                   **_: Any) -> list[float | None]:
    """Minus the share of train.max_completion_length the completion used: 0 for an empty answer, -1 for a full one."""
    return [-min(len(ids), most) / most for ids in completion_ids]


def text_of(completion: Any) -> str:
    """A completion (or prompt) as text: TRL's conversational form is read as its last message."""
    if isinstance(completion, list):  # TRL's conversational form: the assistant's messages
        return str(completion[-1].get("content", "")) if completion else ""
    return str(completion)
