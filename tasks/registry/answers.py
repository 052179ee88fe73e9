"""The promotion gate's rules on what users judge besides the method's measure (gate.py applies them after it):

- **suites**: on every regression suite (eval.suites: lm-evaluation-harness tasks), the challenger scores no worse
  than the incumbent by more than the suite's tolerance. The incumbent is whom the measure's rule compared with:
  the base model (first), the champion scored on this run (same-data), or the champion's own night's score of the
  same suite content (cross-night); a suite without such a score cannot be checked, and keeps the champion.
- **judge**: the lower confidence bound of the challenger's win rate against the incumbent, judged by an LLM in both
  orders (eval.judge), is at least judge.min_win_rate. A judge that could not be reached, that judged another
  incumbent, or whose verdict is missing keeps the champion: never a promotion without its say.

Pure functions over the gate's metrics (evaluate_adapter's, score_champion's).
"""

from __future__ import annotations

from typing import Any

SUITES, JUDGE = "suites", "judge"  # the rules' names, as a record's rule holds them
Check = tuple[bool, str, str]  # (passed, the sentence that says so, the rule)


def judged(metrics: dict[str, Any], current: dict[str, Any] | None, promotion: str, reason: str, decided_by: str
           ) -> tuple[str, str, str]:
    """(promotion, reason, rule) once the suites and the judge have had their say on the measure's verdict: a
    version the measure promotes is rejected by the first of them it fails, the reason naming that rule and every
    failure; a passed one adds its sentence to the reason."""
    checks = [c for c in (_suites(metrics, current, decided_by), _judge(metrics, current)) if c is not None]
    if not checks:
        return promotion, reason, decided_by
    if promotion != "promoted":
        return promotion, "; ".join([reason, *(c[1] for c in checks)]), decided_by
    failed = [c for c in checks if not c[0]]
    if failed:
        return "rejected", (f"not promoted: {'; '.join(c[1] for c in failed)} (the {decided_by} rule alone would "
                            f"promote: {reason})"), failed[0][2]
    return "promoted", "; ".join([reason, *(c[1] for c in checks)]), decided_by


def _suites(metrics: dict[str, Any], current: dict[str, Any] | None, decided_by: str) -> Check | None:
    """Each suite's score against the incumbent's, within its tolerance; None without suites."""
    suites = metrics.get("suites") or {}
    if not suites:
        return None
    theirs, whose = _incumbent_scores(metrics, current, decided_by)
    mine = metrics.get("tuned_suites") or {}
    fell, held = [], []
    for name, suite in suites.items():
        value, best = mine.get(name), theirs(name, suite)
        if value is None or best is None:
            fell.append(f"suite {name} cannot be checked: no {suite['metric']} of "
                        f"{'this adapter' if value is None else whose} on its content")
            continue
        worse = (best - value) if suite["higher_is_better"] else (value - best)
        said = (f"{name} {suite['metric']} {value:.4f} against {whose} {best:.4f} (tolerance "
                f"{suite['tolerance']:g})")
        (held if worse <= suite["tolerance"] + 1e-12 else fell).append(said)  # 1e-12: the same score is no loss
    if fell:
        return False, "a regression suite fell by more than its tolerance: " + "; ".join(fell), SUITES
    return True, "regression suites within tolerance: " + "; ".join(held), SUITES


def _incumbent_scores(metrics: dict[str, Any], current: dict[str, Any] | None, decided_by: str) -> tuple[Any, str]:
    """(suite name, suite -> the incumbent's score or None, whose score it is) for the rule that decided."""
    if decided_by == "first" or current is None:
        base = metrics.get("base_suites") or {}
        return (lambda name, suite: base.get(name)), "the base model's"
    if decided_by == "same-data":
        scored = metrics.get("champion_suites") or {}
        return (lambda name, suite: scored.get(name)), f"champion {current['version']}'s"
    own = current.get("metrics", {})  # cross-night: its own night's score, of a suite with the same content

    def same_content(name: str, suite: dict[str, Any]) -> float | None:
        kept = (own.get("suites") or {}).get(name) or {}
        return (own.get("tuned_suites") or {}).get(name) if kept.get("content") == suite.get("content") else None

    return same_content, f"champion {current['version']}'s (its own night's)"


def _judge(metrics: dict[str, Any], current: dict[str, Any] | None) -> Check | None:
    """The judge's verdict against the incumbent; None when the run has no judge."""
    judge = metrics.get("judge")
    if judge is None:
        if metrics.get("judged_by"):  # configured, but its verdict did not reach the gate
            return False, f"the judge's verdict ({metrics['judged_by']}) is missing, so the champion stays", JUDGE
        return None
    status, against = judge.get("status"), current["version"] if current else "base"
    if status == "unreachable":
        return False, (f"the judge could not be reached ({judge.get('reason')}); the verdicts it gave are kept, and "
                       "the next run asks only the others"), JUDGE
    if status != "judged":
        return False, f"the judge did not judge ({judge.get('reason')})", JUDGE
    if judge.get("against") != against:
        return False, f"the judge compared with {judge.get('against')}, but the champion is now {against}", JUDGE
    whom = "the base model" if against == "base" else against
    if judge["prompts"] and judge["unparseable"] == judge["prompts"]:  # whatever min_win_rate allows
        return False, (f"the judge gave no readable verdict ({judge['unparseable']} unparseable of {judge['prompts']} "
                       f"prompts against {whom}): an answer other than A, B or tie is never a win"), JUDGE
    passed = judge["lower_bound"] >= judge["min_win_rate"]
    return passed, (
        f"judge {judge['model']}: win rate {judge['win_rate']:.3f} against {whom} "
        f"over {judge['prompts']} prompts judged in both orders ({judge['wins']} won, {judge['ties']} tied, "
        f"{judge['losses']} lost, {judge['unparseable']} unparseable), its {judge['confidence']:.0%} lower bound "
        f"{judge['lower_bound']:.3f} {'reaches' if passed else 'is below'} eval.judge.min_win_rate "
        f"{judge['min_win_rate']:g}"), JUDGE
