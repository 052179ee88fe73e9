"""A sweep's candidates ranked: best first by the promotion gate's own comparison (tasks/registry/gate.py `gate`,
margin 0), so a sweep's winner is the one the gate would prefer; then those whose metric is not a number, then the
failed ones. Pure functions over the candidates' outcomes.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from tasks.methods import Measure
from tasks.registry.gate import gate
from tasks.sweep.grid import Candidate, Plan


@dataclass
class Outcome:
    """What became of one candidate."""

    candidate: Candidate
    status: Literal["finished", "unranked", "failed"]  # unranked: evaluated, but its metric is not a number
    adapter_dir: str | None = None
    eval_dir: str | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    user_error: bool = True
    rank: int | None = None


@dataclass
class Ranking:
    """The candidates best first (finished ones by the gate's rule, then unranked, then failed)."""

    plan: Plan
    outcomes: list[Outcome]
    eval_data: str  # prepare_data's key: the one eval split every candidate was scored on

    @property
    def winner(self) -> Outcome | None:
        return self.outcomes[0] if self.outcomes and self.outcomes[0].status == "finished" else None

    @property
    def failed(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status == "failed"]


def order(outcomes: list[Outcome], eval_data: str, measure: Measure) -> list[Outcome]:
    """Best first by the gate's rule on `measure` (the candidates' method's; ties keep candidate order), numbered;
    then the unranked, then the failed.

    A finished candidate whose value is not a finite number (a NaN loss) becomes unranked: the gate lets such a value
    beat nothing, and takes an incumbent's for damage (it would judge against the base model instead).
    """
    for outcome in outcomes:
        value = outcome.metrics.get(f"tuned_{measure.key}")
        if outcome.status == "finished" and not (isinstance(value, int | float) and math.isfinite(value)):
            outcome.status, outcome.error = "unranked", "its eval metric is not a number (training diverged?)"
    done = sorted((o for o in outcomes if o.status == "finished"),
                  key=functools.cmp_to_key(lambda a, b: _compare(a.metrics, b.metrics, eval_data, measure)))
    for number, outcome in enumerate(done, start=1):
        outcome.rank = number
    rest = {"unranked": 1, "failed": 2}
    return done + sorted((o for o in outcomes if o.status != "finished"), key=lambda o: rest[o.status])


def _compare(a: dict[str, Any], b: dict[str, Any], eval_data: str, measure: Measure) -> int:
    """-1 when the gate prefers a to b, 1 the other way round, 0 for a tie (the earlier candidate stays first)."""
    return -1 if _beats(a, b, eval_data, measure) else 1 if _beats(b, a, eval_data, measure) else 0


def _beats(challenger: dict[str, Any], incumbent: dict[str, Any], eval_data: str, measure: Measure) -> bool:
    """The promotion gate's verdict, margin 0, with `incumbent` in the champion's place."""
    record = {"version": "the other candidate", "metrics": _own(incumbent), "eval_data": eval_data}
    return gate(_own(challenger), record, 0.0, eval_data, measure)[0] == "promoted"


def _own(metrics: dict[str, Any]) -> dict[str, Any]:
    """A candidate's own metrics, without the registry champion's (champion_*): scored on the same data, they
    would make the gate compare each candidate with the champion instead of with the other candidate."""
    return {k: v for k, v in metrics.items() if not k.startswith("champion_")}
