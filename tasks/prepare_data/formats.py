"""Record formats and prompt templates: each record becomes a list of text segments, each in or out of the loss.

The instruction formats (dolly, alpaca) share one template; prompt_completion uses its two strings as
they are; chat renders `messages` with a Jinja chat template; text is all completion (continued
pre-training). Segments are tokenized separately and concatenated, so the boundary between masked
prompt tokens and trained completion tokens is exact. Imports nothing heavy: it runs in tokenizer workers.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from typing import Any

from tasks.errors import UserError

# format -> (required columns, optional column)
FORMATS: dict[str, tuple[tuple[str, ...], str | None]] = {
    # preference data (train.method dpo/kto) has its own tokenization: tasks/prepare_data/preference.py
    "preference": (("prompt", "chosen", "rejected"), None),
    "unpaired_preference": (("prompt", "completion", "label"), None),
    "dolly": (("instruction", "response"), "context"),
    "alpaca": (("instruction", "output"), "input"),
    "prompt_completion": (("prompt", "completion"), None),
    "chat": (("messages",), None),
    "text": (("text",), None),
    # prompts to answer (train.method grpo), checked by reward functions: last, so any format above wins (prompts.py)
    "prompts": (("prompt",), None),
}
INSTRUCTION_TEMPLATE = "### Instruction:\n{instruction}\n\n"
CONTEXT_TEMPLATE = "### Context:\n{context}\n\n"
RESPONSE_HEADER = "### Response:\n"

# Named chat templates for tokenizers that ship none (data.chat_template). Their markers are plain text
# to a tokenizer that lacks them as special tokens: the model learns them like any other text.
CHAT_TEMPLATES: dict[str, str] = {
    "chatml": (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
        "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    ),
    # Meta-Llama-3-8B-Instruct's template, verbatim
    "llama3": (
        "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
        "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}"
        "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
    ),
}

# A chat template may refuse a system role (Gemma's raises "System role not supported"). For those the rule is
# Gemma 3's own: each system message is put before the next user message, separated by a blank line.
SYSTEM_SEPARATOR = "\n\n"

Segments = list[tuple[str, bool]]  # (text, counts in the loss)
RenderChat = Callable[[list[dict[str, str]], bool], str]  # (messages, add_generation_prompt) -> text

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # from JSON escapes like "\\ud800"


def detect_format(columns: Iterable[str], requested: str, where: str = "the data") -> str:
    """The requested format, or the first whose required columns are all present; lists all problems. `where` names
    the source the columns are from (data.source or data.eval_source, and its value)."""
    cols = set(columns)
    if requested != "auto":
        missing = [c for c in FORMATS[requested][0] if c not in cols]
        if missing:
            raise UserError(
                f"data.format={requested!r} needs column(s) {', '.join(missing)}, which {where} lacks. "
                f"Columns found: {', '.join(sorted(cols)) or 'none'}. {_matches(cols)} Rename columns with "
                f"data.column_mapping, e.g. {{{sorted(cols)[0] if cols else 'question'}: {missing[0]}}}."
            )
        return requested
    for name, (required, _) in FORMATS.items():
        if all(c in cols for c in required):
            return name
    raise UserError(
        f"Cannot tell the format of {where} from its columns: {', '.join(sorted(cols)) or 'none'}. "
        + "Known formats and their columns: "
        + "; ".join(f"{n}: {', '.join(r)}" + (f" (+ optional {o})" if o else "") for n, (r, o) in FORMATS.items())
        + ". Rename columns with data.column_mapping (e.g. {question: instruction, answer: response}), "
        "or set data.format."
    )


def _matches(cols: set[str]) -> str:
    fits = [n for n, (req, _) in FORMATS.items() if all(c in cols for c in req)]
    return f"They would match: {', '.join(fits)}." if fits else "They match no known format."


def to_segments(record: dict[str, Any], fmt: str, completion_only: bool, render_chat: RenderChat | None = None
                ) -> Segments | None:
    """The record as text segments, or None when its response (or text) is empty; KeyError names a missing column."""
    if fmt == "chat":
        return _chat_segments(record["messages"], completion_only, render_chat)
    if fmt == "text":
        text = _text(record["text"])
        return [(text, True)] if text.strip() else None
    if fmt == "prompt_completion":
        prompt, completion = _text(record["prompt"]), _text(record["completion"])
    else:
        (instruction_col, response_col), context_col = FORMATS[fmt]
        prompt = INSTRUCTION_TEMPLATE.format(instruction=_text(record[instruction_col]).strip())
        context = _text(record.get(context_col)).strip()
        if context:
            prompt += CONTEXT_TEMPLATE.format(context=context)
        prompt, completion = prompt + RESPONSE_HEADER, _text(record[response_col]).strip()
    if not completion.strip():
        return None
    return [(prompt, not completion_only), (completion, True)]


def _text(value: Any) -> str:
    """A field as text: strings, and integers or finite numbers as written; anything else is a bad row."""
    if value is None:
        return ""
    if isinstance(value, str):
        if _LONE_SURROGATE.search(value):
            raise ValueError("a value holds a lone surrogate escape such as \\ud800, which is not Unicode text "
                             "(fix or drop those escapes)")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"a value is {type(value).__name__ if not isinstance(value, float) else value}, not text "
                         "(give prompts and responses as strings)")
    return str(value)


def fold_system(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """Each system message moved into the next user message (system text, blank line, user text), for chat
    templates without a system role. A system message with no user message after it is an error."""
    out: list[dict[str, str]] = []
    pending: list[str] = []
    for message in messages:
        if message["role"] == "system":
            pending.append(message["content"])
        elif message["role"] == "user" and pending:
            out.append({"role": "user", "content": SYSTEM_SEPARATOR.join([*pending, message["content"]])})
            pending = []
        else:
            out.append(message)
    if pending:
        raise ValueError("a system message is not followed by a user message, and this chat template has no "
                         "system role to put it in")
    return out


def _chat_segments(messages: Any, completion_only: bool, render: RenderChat | None) -> Segments | None:
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m and "content" in m
                                                 for m in messages):
        raise ValueError("messages must be a list of {role, content} objects")
    messages = [{"role": str(m["role"]), "content": _text(m["content"])} for m in messages]
    if not any(m["role"] == "assistant" and m["content"].strip() for m in messages):
        return None
    if not completion_only:
        return [(render(messages, False), True)]
    # Render each prefix of the conversation: the text an assistant turn adds is trained, the rest masked.
    segments: Segments = []
    done = ""
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt, full = render(messages[:i], True), render(messages[: i + 1], False)
        if not (prompt.startswith(done) and full.startswith(prompt)):
            raise ValueError("the chat template renders a conversation differently from its prefixes, so the "
                             "assistant turns cannot be located; set data.completion_only_loss=false or pick "
                             "another data.chat_template")
        segments += [(prompt[len(done):], False), (full[len(prompt):], True)]
        done = full
    rest = render(messages, False)[len(done):]
    return segments + [(rest, False)] if rest else segments
