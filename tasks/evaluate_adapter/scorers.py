"""evaluate_adapter's scorers: one module per way of scoring (tasks/methods.py names a method's: its `score_with`),
one entry each in SCORERS. A scorer scores base and tuned for the stage (`stage`), and the registry's champion on
the same data for score_champion (`champion`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks import methods
from tasks.evaluate_adapter import preference, prompts, scores, sequences
from tasks.on_disk.manifest import read_manifest


@dataclass(frozen=True)
class Scorer:
    # (args, runs_dir, out, data_dir, model_dir, adapter_dir) -> (files written into out, metrics)
    stage: Callable[..., tuple[list[str], dict[str, Any]]]
    # (args, runs_dir, data_dir, model_dir, adapter_dir, eval_dir, champion folder, identity) -> champion_* metrics
    champion: Callable[..., dict[str, Any]]


SCORERS: dict[str, Scorer] = {
    "sequences": Scorer(sequences.evaluate, sequences.champion),  # loss, perplexity, greedy answers
    "preference": Scorer(preference.stage, preference.champion),  # reward accuracy against the base
    "prompts": Scorer(prompts.stage, prompts.champion),  # the run's rewards on greedy answers
    "scores": Scorer(scores.stage, scores.champion),  # a scorer's pairwise accuracy
}


def trained(adapter_dir: Path) -> methods.Method:
    """The method that trained the adapter in train_adapter folder `adapter_dir` (its manifest's train.method; the
    first row's for manifests from before methods were recorded)."""
    made = read_manifest(adapter_dir)
    if made is None:
        raise RuntimeError(f"{adapter_dir} has no valid manifest.json: its stage did not finish")
    return made.method()


def scorer_of(adapter_dir: Path) -> Scorer:
    """The scorer of the method that trained the adapter in `adapter_dir`."""
    return SCORERS[trained(adapter_dir).score_with]
