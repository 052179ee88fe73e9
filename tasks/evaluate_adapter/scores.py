"""evaluate_adapter for a scorer (a reward model: tasks/methods.py's row whose head is "score"): how it ranks the
held-out pairs.

The tuned model (the 4-bit base as a sequence scorer with the adapter and its score head) scores prompt + chosen and
prompt + rejected of each held-out pair:

- pairwise accuracy: the share of pairs whose chosen answer scores higher (ties count half); the promotion gate
  compares it;
- score margin: the mean of score(chosen) - score(rejected);
- eval loss: the mean Bradley-Terry loss, -log sigmoid(score(chosen) - score(rejected)), what training minimizes.

The base model has no score head, so it has no opinion: every pair a tie (accuracy 0.5, margin 0, loss ln 2). A
first version must beat that by export.promotion_margin. samples.jsonl holds the first eval.generation_samples
pairs with their scores.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from tasks.config import EvalArgs
from tasks.errors import UserError
from tasks.evaluate_adapter.preference import as_champion
from tasks.log import logger
from tasks.models.scorer import load_scorer, score_batches
from tasks.reporting import artifacts

TIE = {"pairwise_accuracy": 0.5, "score_margin": 0.0, "eval_loss": math.log(2)}  # no score head: no opinion


def stage(args: EvalArgs, runs_dir: Path, out: Path, data_dir: Path, model_dir: Path, adapter_dir: Path
          ) -> tuple[list[str], dict[str, Any]]:
    """The adapter's ranking of the held-out pairs beside the base's tie, written into `out`; files and metrics."""
    import json

    metrics, rows = evaluate(args, data_dir, model_dir, adapter_dir / "adapter")
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    (out / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    logger().info("evaluate_adapter: pairwise accuracy on %d held-out pairs: base %.3f -> tuned %.3f, score margin "
                  "%.3f", metrics["eval_pairs"], metrics["base_pairwise_accuracy"],
                  metrics["tuned_pairwise_accuracy"], metrics["tuned_score_margin"])
    artifacts.eval_samples(rows, f"{len(rows)} held-out pairs scored by the reward model (the chosen answer should "
                           "score higher)")
    return ["metrics.json", "samples.jsonl"], metrics


def champion(args: EvalArgs, runs_dir: Path, data_dir: Path, model_dir: Path, adapter_dir: Path, eval_dir: Path,
             folder: Path, identity: str | None) -> dict[str, Any]:
    """The champion in `folder` scored on this run's held-out pairs: its champion_* metrics."""
    return as_champion(evaluate(args, data_dir, model_dir, folder)[0])


def evaluate(args: EvalArgs, data_dir: Path, model_dir: Path, adapter: Path) -> tuple[dict[str, Any],
                                                                                      list[dict[str, Any]]]:
    """(metrics, sample rows) of the scorer in folder `adapter` on the held-out pairs."""
    import pyarrow.parquet as pq

    from tasks.models.loading import load_tokenizer

    rows = pq.read_table(data_dir / "eval.parquet").to_pylist()[:args.max_samples]
    if not rows or "chosen_ids" not in rows[0]:
        raise UserError("The eval split holds no preference pairs (prompt, chosen, rejected): a reward model is "
                        "judged on held-out pairs. Raise data.eval_fraction, or point data.eval_source at pairs.")
    pairs = [(r["prompt_ids"] + r["chosen_ids"], r["prompt_ids"] + r["rejected_ids"]) for r in rows]
    chosen, rejected = score_rows(model_dir, adapter, [c for c, _ in pairs] + [r for _, r in pairs],
                                  args.per_device_eval_batch_size, len(pairs))
    margins = [c - r for c, r in zip(chosen, rejected, strict=True)]
    tuned = {"pairwise_accuracy": _share(chosen, rejected), "score_margin": _mean(margins),
             "eval_loss": _mean([_bt_loss(margin) for margin in margins])}
    metrics = {"eval_examples": len(pairs), "eval_pairs": len(pairs), "eval_tokens": sum(map(len, sum(pairs, ()))),
               "generation_samples": 0, "max_new_tokens": 0, **{f"base_{k}": v for k, v in TIE.items()},
               **{f"tuned_{k}": v for k, v in tuned.items()},
               **dict.fromkeys(f"{who}_{key}" for who in ("base", "tuned")  # no language model, no answers
                               for key in ("perplexity", "exact_match", "rouge_l")),
               "relative_improvement": (TIE["eval_loss"] - tuned["eval_loss"]) / TIE["eval_loss"]}
    tokenizer = load_tokenizer(model_dir)
    shown = [{"prompt": tokenizer.decode(r["prompt_ids"], skip_special_tokens=True),
              "chosen": tokenizer.decode(r["chosen_ids"], skip_special_tokens=True),
              "rejected": tokenizer.decode(r["rejected_ids"], skip_special_tokens=True),
              "tuned_chosen_score": round(c, 4), "tuned_rejected_score": round(j, 4)}
             for r, c, j in zip(rows[:args.generation_samples], chosen, rejected, strict=False)]
    return {k: round(v, 6) if isinstance(v, float) else v for k, v in metrics.items()}, shown


def score_rows(model_dir: Path, adapter: Path, rows: list[list[int]], batch_size: int, split: int
               ) -> tuple[list[float], list[float]]:
    """The scorer's score of each row of token ids, batch by batch; the first `split` scores and the rest."""
    scores = score_batches(load_scorer(model_dir, adapter), rows, batch_size)
    return scores[:split], scores[split:]


def _bt_loss(margin: float) -> float:
    """-log sigmoid(margin), computed without overflow."""
    return max(-margin, 0.0) + math.log1p(math.exp(-abs(margin)))


def _share(chosen: list[float], rejected: list[float]) -> float:
    return sum(1.0 if c > r else 0.5 if c == r else 0.0 for c, r in zip(chosen, rejected, strict=True)) / len(chosen)


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0
