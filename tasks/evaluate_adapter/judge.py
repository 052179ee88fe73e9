"""The pairwise judge (eval.judge): its prompt (the rubric), one verdict asked of an OpenAI-compatible endpoint and
held to A, B or tie where the server can, the strict reading of the answer, and the win rate with its lower bound.

judging.py runs it over the held-out prompts for score_champion; the gate reads its result (tasks/registry/gate.py).
A verdict is asked with temperature 0. Held to a fixed choice, it is json_schema (OpenAI's response_format: vLLM,
OpenAI and llama.cpp's server take it) or choice (vLLM's structured_outputs); without, the answer must be the bare
word. Whatever the server sends, `read` accepts only one of JUDGE_LABELS, bare or as {"verdict": ...}: anything else
is unparseable, and an unparseable verdict is never a win.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import time
from pathlib import Path
from statistics import NormalDist
from typing import Any

from tasks.config import JUDGE_LABELS, JudgeArgs
from tasks.errors import UserError

DEFAULT_RUBRIC = """\
Two assistants answered the same request. Decide which answer is better: correct, helpful and to the point. Judge \
the content only, not the length, the style or which answer comes first.

[Request]
{prompt}

[Answer A]
{answer_a}

[Answer B]
{answer_b}

Reply with one word: A if answer A is better, B if answer B is better, tie if they are equally good or equally bad.
"""
PLACEHOLDERS = ("prompt", "answer_a", "answer_b")
_PLACEHOLDER = re.compile(r"\{(" + "|".join(PLACEHOLDERS) + r")\}")
# the verdict as a JSON object: what constrain=json_schema asks the server to hold the answer to
VERDICT_SCHEMA = {"type": "object", "properties": {"verdict": {"type": "string", "enum": list(JUDGE_LABELS)}},
                  "required": ["verdict"], "additionalProperties": False}
ORDERS = ("ab", "ba")  # ab: the challenger's answer is A; ba: it is B (the position swap)
PAUSE_S = 0.5  # before the first retry; doubles each time


class NoVerdict(Exception):
    """The judge gave no verdict (down, timed out, refused the request or the key); the message says why."""


def identity(judge: JudgeArgs) -> str:
    """Who judges: the model at the endpoint (what verdicts are kept under, with the rubric)."""
    return f"{judge.model} at {judge.url}"


# --- the rubric ---------------------------------------------------------------------------------------------------

def rubric(judge: JudgeArgs) -> str:
    """The rubric's template: judge.rubric's file, else DEFAULT_RUBRIC; a UserError when the file cannot be read."""
    if judge.rubric is None:
        return DEFAULT_RUBRIC
    try:
        return Path(judge.rubric).expanduser().read_text(encoding="utf-8")
    except (OSError, ValueError) as exc:
        raise UserError(f"eval.judge.rubric={judge.rubric} cannot be read ({type(exc).__name__}: {exc}): give a "
                        "text file with {prompt}, {answer_a} and {answer_b} in it, or leave it empty for the "
                        "built-in rubric.") from None


def rubric_fingerprint(judge: JudgeArgs) -> str:
    """The rubric's content, for the evaluation's key."""
    return hashlib.sha256(rubric(judge).encode()).hexdigest()


def rubric_problem(text: str) -> str:
    """'' when the template holds every placeholder, else which it lacks."""
    missing = [f"{{{p}}}" for p in PLACEHOLDERS if f"{{{p}}}" not in text]
    return f"eval.judge.rubric lacks {', '.join(missing)}: the judge would not see both answers" if missing else ""


def render(template: str, prompt: str, answer_a: str, answer_b: str) -> str:
    """The judge's prompt: the placeholders replaced in one pass (an answer that holds "{answer_b}" stays as it is)."""
    values = {"prompt": prompt, "answer_a": answer_a, "answer_b": answer_b}
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], template)


# --- reading a verdict ---------------------------------------------------------------------------------------------

def read(text: str) -> str | None:
    """The label the judge's text gives (one of JUDGE_LABELS), or None: the text must be the label alone (case and a
    final full stop aside) or a JSON object whose only field is verdict, holding one."""
    text = text.strip()
    if text.startswith("{"):
        try:
            found = json.loads(text)
        except ValueError:
            return None
        text = found.get("verdict") if isinstance(found, dict) and set(found) == {"verdict"} else None
        return text if text in JUDGE_LABELS else None
    word = text.removesuffix(".").strip()
    return next((label for label in JUDGE_LABELS if word.lower() == label.lower()), None)


def outcome(label: str | None, order: str) -> str:
    """The challenger's outcome of one verdict: win, loss, tie, or unparseable."""
    if label is None:
        return "unparseable"
    if label == "tie":
        return "tie"
    challenger = "A" if order == "ab" else "B"
    return "win" if label == challenger else "loss"


def prompt_outcome(first: str, second: str) -> str:
    """One prompt's outcome from its two verdicts (both orders): the mean of their points (a win 1, a tie 1/2, a loss
    0), a win above 1/2, a loss below, else a tie (a judge that picks the same position both times ties); unparseable
    when either verdict is."""
    if "unparseable" in (first, second):
        return "unparseable"
    points = (_POINTS[first] + _POINTS[second]) / 2
    return "win" if points > 0.5 else "loss" if points < 0.5 else "tie"


_POINTS = {"win": 1.0, "tie": 0.5, "loss": 0.0}


def wilson_lower(successes: float, n: int, confidence: float) -> float:
    """The lower bound of the Wilson score interval of a share successes/n at one-sided `confidence` (0 for n=0)."""
    if n == 0:
        return 0.0
    z, p = NormalDist().inv_cdf(confidence), successes / n
    centre, spread = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, (centre - spread) / (1 + z * z / n))


def summary(outcomes: list[str], confidence: float) -> dict[str, Any]:
    """The prompts' outcomes counted: the win rate (ties count half; an unparseable prompt counts as no win) and the
    lower bound of its confidence interval."""
    counts = {k: outcomes.count(k) for k in ("win", "tie", "loss", "unparseable")}
    n, won = len(outcomes), counts["win"] + counts["tie"] / 2
    return {"prompts": n, "wins": counts["win"], "ties": counts["tie"], "losses": counts["loss"],
            "unparseable": counts["unparseable"], "win_rate": won / n if n else 0.0,
            "lower_bound": wilson_lower(won, n, confidence), "confidence": confidence}


# --- the endpoint ------------------------------------------------------------------------------------------------

class Endpoint:
    """The judge's OpenAI-compatible API, each call waiting at most judge.timeout_s; the key from the environment
    variable judge.api_key_env names."""

    def __init__(self, judge: JudgeArgs) -> None:
        import httpx

        self.judge = judge
        key = os.environ.get(judge.api_key_env) if judge.api_key_env else None
        self.client = httpx.Client(base_url=judge.url or "", timeout=judge.timeout_s,
                                   headers={"Authorization": f"Bearer {key}"} if key else {})

    def close(self) -> None:
        self.client.close()

    def models(self) -> list[str] | None:
        """The model names it serves (None: it does not list them), or NoVerdict when it cannot be reached."""
        response = self._retried("GET", "/models")
        if response.status_code == 404:
            return None
        try:
            return [m["id"] for m in response.json()["data"]]
        except (ValueError, KeyError, TypeError):
            raise NoVerdict(f"{self.judge.url}/models answered {response.text[:200]!r}, not an OpenAI-compatible "
                            "API's list of models") from None

    def ask(self, prompt: str) -> tuple[str, str | None]:
        """(the judge's text, the label it gives or None): retried while the answer is unreadable, up to
        judge.retries times; NoVerdict when the judge gives no answer at all."""
        path, body = request(self.judge, prompt)
        text = ""
        for attempt in range(self.judge.retries + 1):
            text = _text(self._retried("POST", path, body), self.judge.api)
            if (label := read(text)) is not None:
                return text, label
            if attempt < self.judge.retries:
                time.sleep(PAUSE_S * 2 ** attempt)
        return text, None

    def _retried(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        """The response to one call, retried (judge.retries times, a pause that doubles) while the endpoint is down,
        times out, or answers 408, 429 or 5xx; NoVerdict when it still does, or refuses the call."""
        import httpx

        why = ""
        for attempt in range(self.judge.retries + 1):
            if attempt:
                time.sleep(PAUSE_S * 2 ** (attempt - 1))
            try:
                response = self.client.request(method, path, json=body)
            except httpx.TimeoutException:
                why = f"no answer within {self.judge.timeout_s:g} s (eval.judge.timeout_s)"
                continue
            except httpx.HTTPError as exc:
                why = f"it cannot be reached ({type(exc).__name__}: {exc})"
                continue
            if response.status_code in (408, 429) or response.status_code >= 500:
                why = f"it answered {response.status_code}: {_error_text(response)}"
                continue
            if response.status_code in (401, 403):
                raise NoVerdict(f"the judge at {self.judge.url} refused the API key "
                                f"({'from ' + self.judge.api_key_env if self.judge.api_key_env else 'none given'}: "
                                "name the variable that holds its key in eval.judge.api_key_env)")
            if response.status_code >= 400 and not (path == "/models" and response.status_code == 404):
                raise NoVerdict(f"the judge at {self.judge.url} refused {method} {path} with "
                                f"{response.status_code}: {_error_text(response)}")
            return response
        tries = self.judge.retries + 1
        raise NoVerdict(f"the judge at {self.judge.url} gave no answer after {tries} "
                        f"{'try' if tries == 1 else 'tries'}: {why}")


def request(judge: JudgeArgs, prompt: str) -> tuple[str, dict[str, Any]]:
    """(route, body) of one verdict's request: the rubric as the user's message (api chat) or as the prompt
    (completions), greedy, held to JUDGE_LABELS as judge.constrain says."""
    body: dict[str, Any] = {"model": judge.model, "max_tokens": judge.max_tokens, "temperature": 0}
    if judge.api == "chat":
        path, body["messages"] = "/chat/completions", [{"role": "user", "content": prompt}]
    else:
        path, body["prompt"] = "/completions", prompt
    if judge.constrain == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "verdict", "strict": True,
                                                                          "schema": VERDICT_SCHEMA}}
    elif judge.constrain == "choice":
        body["structured_outputs"] = {"choice": list(JUDGE_LABELS)}
    return path, body


def _text(response: Any, api: str) -> str:
    """The answer's text; '' for a body of another shape (counted as an unreadable answer, and retried)."""
    try:
        choice = response.json()["choices"][0]
        text = choice["message"]["content"] if api == "chat" else choice["text"]
    except (ValueError, KeyError, IndexError, TypeError):
        return ""
    return text if isinstance(text, str) else ""


def _error_text(response: Any) -> str:
    """The endpoint's error message ({"error": {"message": ...}}), else the body's start."""
    try:
        return str(response.json()["error"]["message"])[:300]
    except (ValueError, KeyError, TypeError):
        return response.text[:300]


def problems(judge: JudgeArgs) -> list[str]:
    """Before any stage: why the judge cannot give verdicts ([] when it can): its key's variable unset, its rubric
    unreadable or lacking a placeholder, its endpoint unreachable, refusing the key or not serving the model."""
    if judge.url is None:
        return []
    found = []
    if judge.api_key_env and not os.environ.get(judge.api_key_env):
        found.append(f"eval.judge.api_key_env names {judge.api_key_env}, which is not set in this process's "
                     "environment: set it to the judge endpoint's key")
    try:
        found += [p for p in [rubric_problem(rubric(judge))] if p]
    except UserError as exc:
        found.append(str(exc))
    endpoint = Endpoint(judge)
    try:
        served = endpoint.models()
    except NoVerdict as exc:
        return [*found, f"eval.judge.url: {exc}"]
    finally:
        endpoint.close()
    if served is not None and judge.model not in served:
        found.append(f"the judge at {judge.url} does not serve eval.judge.model={judge.model!r} (it serves: "
                     f"{', '.join(served[:20]) or 'nothing'})")
    return found
