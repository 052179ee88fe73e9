"""What of the eval section keys evaluate_adapter's folder and its memo of base and champion results.

The regression suites (eval.suites) and the pairwise judge (eval.judge) came after many runs_dirs were made: they are
in the stage's key only when set, so the key of an evaluation without them is the one it had before they existed (an
old runs_dir stays Cached). The memo of the base model's and the champion's loss and answers never holds them: those
numbers do not depend on either.
"""

from __future__ import annotations

from typing import Any

from tasks.config import EvalArgs

_GATE_ONLY = ("suites", "judge")  # the fields of the gate's other measures


def settings(args: EvalArgs) -> dict[str, Any]:
    """The eval section as evaluate_adapter's key holds it: suites only when some are set, the judge only when it has
    a URL."""
    dumped = args.model_dump()
    if not args.suites:
        dumped.pop("suites")
    if args.judge.url is None:
        dumped.pop("judge")
    return dumped


def scored(args: EvalArgs) -> dict[str, Any]:
    """The eval section as the memo of base and champion results holds it (loss and greedy answers)."""
    return {k: v for k, v in args.model_dump().items() if k not in _GATE_ONLY}
