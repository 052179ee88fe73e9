"""Record formats and prompt templates: each record becomes a (prompt, completion) pair of strings.

The instruction formats share one template; the completion is the response, and by default only its
tokens count in the loss. Plain text is all completion (continued pre-training).
"""

from __future__ import annotations

from collections.abc import Iterable

from tasks.errors import UserError

# format -> (required columns, optional context column)
FORMATS: dict[str, tuple[tuple[str, ...], str | None]] = {
    "dolly": (("instruction", "response"), "context"),
    "alpaca": (("instruction", "output"), "input"),
    "prompt_completion": (("prompt", "completion"), None),
    "text": (("text",), None),
}
INSTRUCTION_TEMPLATE = "### Instruction:\n{instruction}\n\n"
CONTEXT_TEMPLATE = "### Context:\n{context}\n\n"
RESPONSE_HEADER = "### Response:\n"


def detect_format(columns: Iterable[str], requested: str) -> str:
    """The requested format, or the first whose required columns are all present; lists all problems."""
    cols = set(columns)
    if requested != "auto":
        missing = [c for c in FORMATS[requested][0] if c not in cols]
        if missing:
            raise UserError(
                f"data.format={requested!r} needs columns {', '.join(missing)}, which the data lacks. "
                f"Columns found: {', '.join(sorted(cols)) or 'none'}. {_matches(cols)}"
            )
        return requested
    for name, (required, _) in FORMATS.items():
        if all(c in cols for c in required):
            return name
    raise UserError(
        f"Cannot tell the data's format from its columns: {', '.join(sorted(cols)) or 'none'}. "
        + "Known formats and their columns: "
        + "; ".join(f"{n}: {', '.join(r)}" + (f" (+ optional {o})" if o else "") for n, (r, o) in FORMATS.items())
        + ". Rename the columns, or set data.format."
    )


def _matches(cols: set[str]) -> str:
    fits = [n for n, (req, _) in FORMATS.items() if all(c in cols for c in req)]
    return f"They would match: {', '.join(fits)}." if fits else "They match no known format."


def to_prompt_completion(record: dict, fmt: str) -> tuple[str, str]:
    """The prompt and the completion text of one record in format `fmt`."""
    if fmt == "text":
        return "", str(record["text"])
    if fmt == "prompt_completion":
        return str(record["prompt"]), str(record["completion"])
    (instruction_col, response_col), context_col = FORMATS[fmt]
    prompt = INSTRUCTION_TEMPLATE.format(instruction=str(record[instruction_col]).strip())
    context = str(record.get(context_col) or "").strip()
    if context:
        prompt += CONTEXT_TEMPLATE.format(context=context)
    return prompt + RESPONSE_HEADER, str(record[response_col]).strip()
