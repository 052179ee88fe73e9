"""score_champion's pairwise judge (eval.judge): the challenger's and the incumbent's answers (the champion's, or the
base model's for a first version) to the first eval.judge.prompts held-out prompts, judged in both orders.

The answers are evaluation's greedy ones: this adapter's and the base model's in its samples.jsonl, the champion's in
the memo score_champion writes (sequences.py). The verdicts of a pair are kept in
runs_dir/evaluate_adapter/.judge/<key>/, the key holding what they depend on: the prompts, both answers, the judge
(model and endpoint), the rubric's text and how a verdict is asked. verdicts.jsonl is append-only, a line per
(prompt, order) written whole as soon as it is given, so a run killed while judging asks only what is missing when it
runs again; result.json is written once every verdict is in. A file lock keeps two runs from asking the same twice.
A judge that gives no verdict (judge.Endpoint's bounded retries spent) ends the judging with status unreachable and
what it was given kept: the gate then keeps the champion, and the next run resumes.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock

from tasks.config import EvalArgs
from tasks.evaluate_adapter import judge as judges
from tasks.hashing.keys import cache_key
from tasks.log import logger
from tasks.on_disk import disk
from tasks.reporting import artifacts

VERDICTS, RESULT = "verdicts.jsonl", "result.json"
SHOWN = 20  # verdicts in the UI's judge-verdicts table (all are in the file)
_VERSION = "1"  # of how a verdict is asked and kept: in the key


@dataclass(frozen=True)
class Pair:
    """What is judged: the prompts, the challenger's and the incumbent's answers to them, and who the incumbent is
    (a version, or base)."""

    prompts: list[str]
    challenger: list[str]
    incumbent: list[str]
    against: str


def pair_of(args: EvalArgs, eval_dir: Path, against: str, incumbent: list[str] | None) -> Pair | None:
    """The first judge.prompts held-out prompts with this adapter's answers and the incumbent's (`incumbent`: the
    champion's answers; None: the base model's, from the samples); None when the evaluation kept none."""
    path = eval_dir / "samples.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    rows = [r for r in rows if "tuned_output" in r][:args.judge.prompts]
    theirs = incumbent[:len(rows)] if incumbent is not None else [r.get("base_output", "") for r in rows]
    if not rows or len(theirs) < len(rows):
        return None
    return Pair([r["prompt"] for r in rows], [r["tuned_output"] for r in rows], theirs, against)


def folder(args: EvalArgs, runs_dir: Path, pair: Pair) -> Path:
    """Where this pair's verdicts are kept: keyed by what they depend on (not by retries or the gate's threshold)."""
    j = args.judge
    key = cache_key(["judge", _VERSION, pair.prompts, pair.challenger, pair.incumbent, judges.identity(j), j.api,
                     j.constrain, j.max_tokens, judges.rubric(j)])
    return Path(runs_dir).expanduser().resolve() / "evaluate_adapter" / ".judge" / key


def done(args: EvalArgs, runs_dir: Path, pair: Pair) -> bool:
    """Whether every verdict of the pair is in (its result.json is written)."""
    return (folder(args, runs_dir, pair) / RESULT).is_file()


def judged(args: EvalArgs, runs_dir: Path, pair: Pair) -> dict[str, Any]:
    """The judge's result on the pair (status judged: the counts, win rate and lower bound; status unreachable: why
    not, with the verdicts given so far kept), asking only the verdicts not yet kept."""
    where = folder(args, runs_dir, pair)
    where.mkdir(parents=True, exist_ok=True)
    with FileLock(str(where / ".lock")):
        result = _result_file(where)
        if result is None:
            result = _judge(args, runs_dir, pair, where)
        if result["status"] == "judged":
            _show(_kept(where / VERDICTS), pair)
    return {**result, "against": pair.against, "min_win_rate": args.judge.min_win_rate,
            "model": args.judge.model, "url": args.judge.url}


def _result_file(where: Path) -> dict[str, Any] | None:
    try:
        return json.loads((where / RESULT).read_text())
    except (OSError, ValueError):
        return None


def _judge(args: EvalArgs, runs_dir: Path, pair: Pair, where: Path) -> dict[str, Any]:
    kept = _kept(where / VERDICTS)
    template, asked = judges.rubric(args.judge), 0
    endpoint = judges.Endpoint(args.judge)
    try:
        for i in range(len(pair.prompts)):
            for order in judges.ORDERS:
                if (i, order) not in kept:
                    kept[(i, order)] = _append(where / VERDICTS, _verdict(endpoint, template, pair, i, order))
                    asked += 1
    except judges.NoVerdict as exc:
        logger().warning("judge: %s; %d of %d verdicts kept (%s): the next run asks the others", exc, len(kept),
                         2 * len(pair.prompts), where)
        return {"status": "unreachable", "reason": str(exc), "kept": len(kept), "verdicts": _relative(where, runs_dir)}
    finally:
        endpoint.close()
    outcomes = [judges.prompt_outcome(kept[(i, "ab")]["outcome"], kept[(i, "ba")]["outcome"])
                for i in range(len(pair.prompts))]
    result = {"status": "judged", **judges.summary(outcomes, args.judge.confidence),
              "verdicts": _relative(where, runs_dir)}
    disk.write_whole(where / RESULT, json.dumps(result, indent=2))
    logger().info("judge: %s against %s: %d verdicts kept from an earlier run, %d asked; win rate %.3f over %d "
                  "prompts (wins %d, ties %d, losses %d, unparseable %d), %.0f%% lower bound %.3f",
                  judges.identity(args.judge), pair.against, 2 * len(pair.prompts) - asked, asked,
                  result["win_rate"], result["prompts"], result["wins"], result["ties"], result["losses"],
                  result["unparseable"], 100 * args.judge.confidence, result["lower_bound"])
    return result


def _verdict(endpoint: judges.Endpoint, template: str, pair: Pair, i: int, order: str) -> dict[str, Any]:
    """One verdict, asked: prompt i with the challenger's answer as A (order ab) or as B (ba)."""
    mine, theirs = pair.challenger[i], pair.incumbent[i]
    a, b = (mine, theirs) if order == "ab" else (theirs, mine)
    text, label = endpoint.ask(judges.render(template, pair.prompts[i], a, b))
    return {"prompt": i, "order": order, "verdict": label, "outcome": judges.outcome(label, order),
            "judge_text": text, "prompt_text": pair.prompts[i], "answer_a": a, "answer_b": b,
            "challenger": "A" if order == "ab" else "B", "against": pair.against}


def _kept(path: Path) -> dict[tuple[int, str], dict[str, Any]]:
    """The verdicts already in the file, by (prompt, order); a line cut short by a kill is dropped (and cut off the
    file, so that the next line starts on a line of its own)."""
    if not path.is_file():
        return {}
    data = path.read_bytes()
    whole = data[:data.rfind(b"\n") + 1]
    if len(whole) != len(data):
        with path.open("r+b") as f:
            f.truncate(len(whole))
    kept = {}
    for line in whole.decode("utf-8", "replace").splitlines():
        try:
            row = json.loads(line)
            kept[(int(row["prompt"]), str(row["order"]))] = row
        except (ValueError, KeyError, TypeError):
            continue
    return kept


def _append(path: Path, row: dict[str, Any]) -> dict[str, Any]:
    """One verdict appended as one line, on disk before the next is asked."""
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return row


def _relative(where: Path, runs_dir: Path) -> str:
    """The verdicts file, relative to runs_dir (a moved runs_dir keeps finding it)."""
    return str((where / VERDICTS).relative_to(Path(runs_dir).expanduser().resolve()))


def _show(kept: dict[tuple[int, str], dict[str, Any]], pair: Pair) -> None:
    """The judge-verdicts table artifact: a sample of the prompts, both answers, both verdicts and the judge's text."""
    rows = []
    for i in range(min(SHOWN, len(pair.prompts))):
        ab, ba = kept[(i, "ab")], kept[(i, "ba")]
        rows.append({"outcome": judges.prompt_outcome(ab["outcome"], ba["outcome"]),
                     "challenger's answer": pair.challenger[i], f"{pair.against}'s answer": pair.incumbent[i],
                     "verdict, challenger as A": ab["verdict"] or "unparseable",
                     "verdict, challenger as B": ba["verdict"] or "unparseable",
                     "judge's text (challenger as A)": ab["judge_text"], "prompt": pair.prompts[i]})
    artifacts.table("judge-verdicts", rows, f"The judge's verdicts on {len(rows)} of {len(pair.prompts)} held-out "
                    f"prompts, each judged with the challenger's answer as A, then as B (all in the run's "
                    f"{VERDICTS})")
