"""The promotion gate's rules: which numbers decide whether a new version of an adapter becomes champion.

Pure functions over version records and eval metrics; store.py reads the records and publishes, and the
sweep ranks its candidates with `gate` (margin 0). In order:

- **Same adapter**: the champion's own adapter (identical weights, same base model) exported again is judged by
  its formats: promoted when it adds formats (merged, GGUF files) and loses none, so the champion carries every
  format asked for; with nothing to add it is the champion already (the registry publishes no copy).
- **Like with like**: a challenger whose evaluation measures something else than the champion's did (another data
  format, loss mask or chat template: store.py `measure`; or a training method judged on another measure:
  tasks/methods.py) is not promoted on that comparison. The reason
  says how to adopt the new measure deliberately: export.accept_new_measure, or a new export.name.
- **First version**: with no champion yet, the base model, scored on the same eval data, takes the champion's place
  (the same rule and margin), so a diverged or useless first adapter never becomes champion.
- **Same-data rule**: the champion scored on this run's eval data (evaluate_adapter's score_champion) against the
  challenger, on the same batches and prompts.
- **Cross-night fallback**: a champion that cannot be scored here (another base model, no recorded hashes, damaged
  beyond repair, or one that changed after this run scored another) is compared by its own night's numbers, with
  the reason.

Where the run has them, the rules of answers.py come after whichever of the last three decided: no regression suite
may fall by more than its tolerance, and the pairwise judge's lower bound must reach its min_win_rate; a version that
passes the measure's rule but not one of those is rejected by it (rule suites or judge), and one whose judge gave no
verdict keeps the champion.
"""

from __future__ import annotations

import math
from typing import Any

from tasks import methods
from tasks.hashing.keys import cache_key
from tasks.methods import Measure
from tasks.registry import answers

WEIGHTS = "adapter_model.safetensors"


def identity(record: dict[str, Any] | None) -> str | None:
    """A version's adapter identity (its files' content, not its path); None for records without hashes."""
    files = record and record.get("files")
    return cache_key(files) if files else None


def same_adapter(weights_sha256: str | None, base_model: str | None, record: dict[str, Any]) -> bool:
    """Whether a version holds these adapter weights (their sha256) on the same base model. The weights, not the
    identity: export rewrites adapter_config.json's base model name, the weights are copied as trained."""
    return bool(weights_sha256 and base_model and record.get("base_model") == base_model
                and record.get("files", {}).get(WEIGHTS) == weights_sha256)


def rule(metrics: dict[str, Any], current: dict[str, Any] | None) -> str:
    """Which gate rule decides: 'first', 'same-data' (the champion scored in this run) or 'cross-night'."""
    if current is None:
        return "first"
    scored = metrics.get("champion_adapter")
    return "same-data" if scored is not None and scored == identity(current) else "cross-night"


def gate(metrics: dict[str, Any], current: dict[str, Any] | None, margin: float, eval_data: str, measure: Measure,
         why_not_same_data: str = "") -> tuple[str, str]:
    """('promoted' | 'rejected', reason): promoted when the tuned value of `measure` (the training method's:
    tasks/methods.py) beats the champion's (with no champion: the base model's) by the margin. Same-data numbers
    when this run scored the champion itself (its metrics' champion_adapter is the champion's identity), else the
    champion's own night's, with `why_not_same_data`."""
    if current is None:
        return _first(metrics, margin, measure)
    if rule(metrics, current) == "same-data":
        theirs, where = {k.removeprefix("champion_"): v for k, v in metrics.items()
                         if k.startswith("champion_")}, "on this run's eval data (same-data rule)"
    else:
        note = why_not_same_data or f"this run scored {metrics.get('judged_against') or 'no champion'} beside it"
        theirs = {k.removeprefix("tuned_"): v for k, v in current["metrics"].items() if k.startswith("tuned_")}
        other = "" if current.get("eval_data") == eval_data else ", on other eval data"
        where = f"on its own night's eval data (cross-night rule: {note}{other})"
    mine = metrics.get(f"tuned_{measure.key}")
    if theirs.get(measure.key) is None:
        return "promoted", (f"tuned {measure.label} {_number(mine, measure)}; champion {current['version']} has no "
                            f"{measure.label} to beat (another method trained it)")
    if not math.isfinite(theirs[measure.key]):  # a damaged champion (NaN weights): never the bar to clear
        promotion, reason = _first(metrics, margin, measure)
        return promotion, (f"champion {current['version']}'s {measure.label} is {theirs[measure.key]} {where}: it is "
                           "damaged, so it is not compared against; judged against the base model instead: "
                           f"{reason.removeprefix(_FIRST)}")
    return _judged(mine, theirs[measure.key], f"champion {current['version']}'s", margin, where, measure)


_FIRST = "first version (no champion yet): "


def _first(metrics: dict[str, Any], margin: float, measure: Measure) -> tuple[str, str]:
    """The first-version rule: the rule a challenger meets, with the base model in the champion's place."""
    best = metrics.get(f"base_{measure.key}")
    if best is None:
        return "rejected", f"{_FIRST}no base model {measure.label} on this run's eval data to beat"
    promotion, reason = _judged(metrics.get(f"tuned_{measure.key}"), best, "the base model's", margin,
                                "on this run's eval data", measure)
    tail = "" if promotion == "promoted" else "; a version becomes the first champion only when it beats its base model"
    return promotion, f"{_FIRST}{reason}{tail}"


def _judged(value: float | None, best: float, whose: str, margin: float, where: str, measure: Measure
            ) -> tuple[str, str]:
    """Whether `value` beats `best` by `margin` as `measure` counts it (a relative margin for a loss, so the same rule
    holds for losses of 0.5 and of 5; an absolute one for accuracies and rewards), and the sentence that says so. A
    NaN or missing value never beats anything."""
    beats = value is not None and measure.beats(value, best, margin)
    verb = "beats" if beats else "does not beat"
    shown = f"{margin:.1%}" if measure.margin == "relative" else f"{margin:.2f}"
    return ("promoted" if beats else "rejected"), (
        f"tuned {measure.label} {_number(value, measure)} {verb} {whose} {_number(best, measure)} {where} by more "
        f"than the {shown} margin (needed {'>' if measure.higher_wins else '<'} "
        f"{_number(measure.needed(best, margin), measure)})")


def _number(value: float | None, measure: Measure) -> str:
    return "n/a" if value is None else f"{value:.{measure.digits}f}"


def verdict(record: dict[str, Any], current: dict[str, Any] | None, champion_formats: list[str],
            champion_measure: dict[str, Any] | None, why_not_same_data: str, accept_new_measure: bool,
            champion_method: methods.Method | None = None) -> tuple[str, str, str]:
    """(promotion, reason, rule) of a new version's record (its metrics, margin, eval_data, files, base_model,
    formats, measure, method) against champion `current` (with its formats, measure and method, None when
    unknown)."""
    metrics, margin, eval_data = record["metrics"], record["margin"], record["eval_data"]
    method = methods.method(record.get("method", methods.METHODS[0].name))
    if current is not None and same_adapter(record["files"].get(WEIGHTS), record.get("base_model"), current):
        return (*_formats_verdict(record["formats"], champion_formats, current["version"]), "same-adapter")
    unlike = _unlike(record.get("measure"), champion_measure, current["version"]) if current is not None else ""
    if current is not None and champion_method is not None and champion_method.measure != method.measure:
        unlike = (f"this run is judged on {method.measure.label} ({method.name}), champion {current['version']} on "
                  f"{champion_method.measure.label} ({champion_method.name})")
    if unlike and not accept_new_measure:
        return "rejected", f"not compared with champion {current['version']}: {unlike}{_HOW_TO_ACCEPT}", "unlike"
    accepted = f"new measure accepted (export.accept_new_measure): {unlike}; " if unlike else ""
    if unlike and rule(metrics, current) != "same-data":  # the champion's own numbers are of the old measure
        promotion, reason = _first(metrics, margin, method.measure)
        return answers.judged(metrics, current, promotion,
                              f"{accepted}judged against the base model instead: {reason.removeprefix(_FIRST)}",
                              "first")
    promotion, reason = gate(metrics, current, margin, eval_data, method.measure, why_not_same_data)
    return answers.judged(metrics, current, promotion, accepted + reason, rule(metrics, current))


_HOW_TO_ACCEPT = (
    "; its numbers do not rank the two adapters, so the champion stays. To adopt the new measure deliberately, run "
    "again with export.accept_new_measure=true (the champion is then scored the new way on this run's eval data "
    "and the better one wins; later versions are measured this way), or publish under a new export.name")


def _formats_verdict(mine: list[str], theirs: list[str], version: str) -> tuple[str, str]:
    """The same adapter as champion `version` exported again: promoted when it adds formats and loses none."""
    added, lacking = sorted(set(mine) - set(theirs)), sorted(set(theirs) - set(mine))
    same = f"same adapter as champion {version} (identical weights, same base model)"
    if lacking:
        return "rejected", f"{same}; not promoted: it lacks the champion's {', '.join(lacking)}"
    if not added:
        return "rejected", f"{same}, with the same formats: nothing to add"
    return "promoted", f"{same}, with formats added ({', '.join(added)}): promoted, so that the champion carries them"


def nothing_to_add(reason: str) -> bool:
    """Whether a same-adapter verdict found nothing to add (the registry then publishes no copy)."""
    return reason.endswith("nothing to add")


def _unlike(mine: dict[str, Any] | None, theirs: dict[str, Any] | None, version: str) -> str:
    """'' when both evaluations measure the same (or either is unknown: a record from before this was kept),
    else the sentence that says how they differ."""
    if mine is None or theirs is None or mine == theirs:
        return ""
    return f"this run's evaluation measures {_describe(mine)}, champion {version}'s measured {_describe(theirs)}"


def _describe(measure: dict[str, Any]) -> str:
    kind = methods.data_kind(measure.get("format") or "")
    if kind != "sequences":
        return f"{kind} data ({measure['format']})"
    tokens = "answers only" if measure.get("completion_only_loss") else "whole texts"
    template = f", chat template {measure['chat_template']}" if measure.get("chat_template") else ""
    return f"the loss on {tokens} ({measure.get('format')} data{template})"
