"""The promotion gate's rules: which numbers decide whether a new version of an adapter becomes champion.

Pure functions over version records and eval metrics; store.py reads the records and publishes, and the
sweep ranks its candidates with `gate` (margin 0). In order:

- **Same adapter**: the champion's own adapter (identical weights, same base model) exported again is judged by
  its formats: promoted when it adds formats (merged, GGUF files) and loses none, so the champion carries every
  format asked for; with nothing to add it is the champion already (the registry publishes no copy).
- **Like with like**: a challenger whose evaluation measures something else than the champion's did (another data
  format, loss mask or chat template: store.py `measure`) is not promoted on that comparison. The reason
  says how to adopt the new measure deliberately: export.accept_new_measure, or a new export.name.
- **First version**: with no champion yet, the base model, scored on the same eval data, takes the champion's place
  (the same rule and margin), so a diverged or useless first adapter never becomes champion.
- **Same-data rule**: the champion scored on this run's eval data (evaluate_adapter's score_champion) against the
  challenger, on the same batches and prompts.
- **Cross-night fallback**: a champion that cannot be scored here (another base model, no recorded hashes, damaged
  beyond repair, or one that changed after this run scored another) is compared by its own night's numbers, with
  the reason.
"""

from __future__ import annotations

from typing import Any

from tasks.hashing.keys import cache_key

WEIGHTS = "adapter_model.safetensors"
PREFERENCE_FORMATS = ("preference", "unpaired_preference")
PROMPT_FORMATS = ("prompts",)


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


def gate(metrics: dict[str, Any], current: dict[str, Any] | None, margin: float, eval_data: str,
         why_not_same_data: str = "") -> tuple[str, str]:
    """('promoted' | 'rejected', reason): promoted when the tuned eval loss beats the champion's (with no champion:
    the base model's) by the margin; for preference runs (their metrics have a tuned reward accuracy) when the
    reward accuracy does; for grpo runs (a tuned mean reward) when the mean held-out reward does. Same-data numbers
    when this run scored the champion itself (its metrics' champion_adapter is the champion's identity), else the
    champion's own night's, with `why_not_same_data`."""
    if current is None:
        return _first(metrics, margin)
    if rule(metrics, current) == "same-data":
        theirs, where = {k.removeprefix("champion_"): v for k, v in metrics.items()
                         if k.startswith("champion_")}, "on this run's eval data (same-data rule)"
    else:
        note = why_not_same_data or f"this run scored {metrics.get('judged_against') or 'no champion'} beside it"
        theirs = {k.removeprefix("tuned_"): v for k, v in current["metrics"].items() if k.startswith("tuned_")}
        other = "" if current.get("eval_data") == eval_data else ", on other eval data"
        where = f"on its own night's eval data (cross-night rule: {note}{other})"
    whose = f"champion {current['version']}'s"
    if metrics.get("tuned_mean_reward") is not None:
        if theirs.get("mean_reward") is None:
            return "promoted", (f"tuned mean reward {metrics['tuned_mean_reward']:.3f}; champion "
                                f"{current['version']} was not a grpo run (no mean reward to beat)")
        return _reward_gate(metrics["tuned_mean_reward"], theirs["mean_reward"], whose, margin, where)
    if metrics.get("tuned_reward_accuracy") is not None:
        if theirs.get("reward_accuracy") is None:
            return "promoted", (f"tuned reward accuracy {metrics['tuned_reward_accuracy']:.3f}; champion "
                                f"{current['version']} was not a preference run (no reward accuracy to beat)")
        return _preference_gate(metrics["tuned_reward_accuracy"], theirs["reward_accuracy"], whose, margin, where)
    return _loss_gate(metrics["tuned_eval_loss"], theirs["eval_loss"], whose, margin, where)


_FIRST = "first version (no champion yet): "


def _first(metrics: dict[str, Any], margin: float) -> tuple[str, str]:
    """The first-version rule: the rule a challenger meets, with the base model in the champion's place."""
    where = "on this run's eval data"
    if metrics.get("tuned_mean_reward") is not None:
        best, key = metrics.get("base_mean_reward"), "mean reward"
        verdict = best is not None and _reward_gate(metrics["tuned_mean_reward"], best, "the base model's", margin,
                                                    where)
    elif metrics.get("tuned_reward_accuracy") is not None:
        best, key = metrics.get("base_reward_accuracy"), "reward accuracy"
        verdict = best is not None and _preference_gate(metrics["tuned_reward_accuracy"], best, "the base model's",
                                                        margin, where)
    else:
        best, key = metrics.get("base_eval_loss"), "eval loss"
        verdict = best is not None and _loss_gate(metrics["tuned_eval_loss"], best, "the base model's", margin, where)
    if not verdict:
        return "rejected", f"{_FIRST}no base model {key} on this run's eval data to beat"
    promotion, reason = verdict
    tail = "" if promotion == "promoted" else "; a version becomes the first champion only when it beats its base model"
    return promotion, f"{_FIRST}{reason}{tail}"


def _loss_gate(loss: float, best: float, whose: str, margin: float, where: str) -> tuple[str, str]:
    needed = best * (1 - margin)  # relative margin: the same rule for losses of 0.5 and of 5
    verb = "beats" if loss < needed else "does not beat"  # a NaN loss is never below, so it is rejected
    return ("promoted" if verb == "beats" else "rejected"), (
        f"tuned eval loss {loss:.4f} {verb} {whose} {best:.4f} {where} by more than the {margin:.1%} margin "
        f"(needed < {needed:.4f})")


def _preference_gate(accuracy: float, best: float, whose: str, margin: float, where: str) -> tuple[str, str]:
    """Preference runs: the share of held-out pairs the adapter prefers the right way must beat the champion's (or
    the base model's) by more than `margin` (absolute: 0.01 is one point). The eval loss of a DPO/KTO adapter
    measures something it was not trained for, so it does not decide."""
    verb = "beats" if accuracy > best + margin else "does not beat"  # a NaN accuracy is never above
    return ("promoted" if verb == "beats" else "rejected"), (
        f"tuned reward accuracy {accuracy:.3f} {verb} {whose} {best:.3f} {where} by more than the "
        f"{margin:.2f} margin (needed > {best + margin:.3f})")


def _reward_gate(reward: float, best: float, whose: str, margin: float, where: str) -> tuple[str, str]:
    """GRPO runs: the mean held-out reward (the run's reward functions, summed, on greedy answers) must beat the
    champion's (or the base model's) by more than `margin` (absolute, in reward units); higher is better."""
    verb = "beats" if reward > best + margin else "does not beat"  # a NaN reward is never above
    return ("promoted" if verb == "beats" else "rejected"), (
        f"tuned mean reward {reward:.3f} {verb} {whose} {best:.3f} {where} by more than the {margin:.2f} margin "
        f"(needed > {best + margin:.3f})")


def verdict(record: dict[str, Any], current: dict[str, Any] | None, champion_formats: list[str],
            champion_measure: dict[str, Any] | None, why_not_same_data: str, accept_new_measure: bool
            ) -> tuple[str, str, str]:
    """(promotion, reason, rule) of a new version's record (its metrics, margin, eval_data, files, base_model,
    formats, measure) against champion `current` (with its formats and measure, None when unknown)."""
    metrics, margin, eval_data = record["metrics"], record["margin"], record["eval_data"]
    if current is not None and same_adapter(record["files"].get(WEIGHTS), record.get("base_model"), current):
        return (*_formats_verdict(record["formats"], champion_formats, current["version"]), "same-adapter")
    unlike = _unlike(record.get("measure"), champion_measure, current["version"]) if current is not None else ""
    if unlike and not accept_new_measure:
        return "rejected", f"not compared with champion {current['version']}: {unlike}{_HOW_TO_ACCEPT}", "unlike"
    accepted = f"new measure accepted (export.accept_new_measure): {unlike}; " if unlike else ""
    if unlike and rule(metrics, current) != "same-data":  # the champion's own numbers are of the old measure
        promotion, reason = _first(metrics, margin)
        return promotion, f"{accepted}judged against the base model instead: {reason.removeprefix(_FIRST)}", "first"
    promotion, reason = gate(metrics, current, margin, eval_data, why_not_same_data)
    return promotion, accepted + reason, rule(metrics, current)


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
    if measure.get("format") in PROMPT_FORMATS:
        return f"the mean reward on {measure['format']} data"
    if measure.get("format") in PREFERENCE_FORMATS:
        return f"reward accuracy on {measure['format']} data"
    tokens = "answers only" if measure.get("completion_only_loss") else "whole texts"
    template = f", chat template {measure['chat_template']}" if measure.get("chat_template") else ""
    return f"the loss on {tokens} ({measure.get('format')} data{template})"
