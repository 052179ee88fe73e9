"""evaluate_adapter for prompts (the data kind of the methods that learn from rewards; tasks/methods.py).

On the held-out prompts (at most eval.max_samples), the base model and base + adapter (this run's, or the registry's
champion scored by score_champion) answer each prompt greedily, up to train.max_completion_length new tokens (what
training sampled), and the run's own reward functions (train.rewards, as train_adapter's manifest records them)
score the answers:

- mean reward per function (None answers, "no opinion", left out of its mean) and in total (per answer the sum over
  the functions, as TRL sums them in training; the mean over answers): the promotion gate compares the total;
- exact match and ROUGE-L against the prompts' `answer` column where they have one;
- eval loss and perplexity of the held-out prompts' own tokens: how far the adapter moved the model's language
  modelling of the prompts (a drift check; grpo is not trained on it and the gate does not read it).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from tasks import rewards
from tasks.config import EvalArgs, TrainArgs
from tasks.errors import UserError
from tasks.evaluate_adapter.generation import greedy_generate, score
from tasks.evaluate_adapter.outputs import samples, without_cudnn_attention, write
from tasks.evaluate_adapter.preference import answer_logps, as_champion
from tasks.log import logger
from tasks.on_disk.manifest import read_manifest
from tasks.reporting import artifacts


def stage(args: EvalArgs, runs_dir: Path, out: Path, data_dir: Path, model_dir: Path, adapter_dir: Path
          ) -> tuple[list[str], dict[str, Any]]:
    """The run's reward functions on base's and tuned's greedy answers to the held-out prompts, written into `out`;
    the files written and the metrics."""
    from tasks.models.loading import load_tokenizer

    train = train_args(adapter_dir)
    with without_cudnn_attention():
        metrics, refs, prompts, results = evaluate(args, train, runs_dir, data_dir, model_dir,
                                                   adapter_dir / "adapter")
    tokenizer = load_tokenizer(model_dir)
    count = min(args.generation_samples, len(prompts))
    texts = [tokenizer.decode(p, skip_special_tokens=True) for p in prompts[:count]]
    shown = samples(texts, (refs or [""] * len(prompts))[:count], results)
    for i, row in enumerate(shown):  # each answer's rewards, beside its text
        row.update({f"{who}_rewards": {f: xs[i] for f, xs in r["rewards"].items()} for who, r in results.items()})
    outputs = write(out, metrics, shown, results, False)
    logger().info("evaluate_adapter: mean reward on %d held-out prompts: base %.4f -> tuned %.4f (%s)",
                  metrics["eval_prompts"], metrics["base_mean_reward"], metrics["tuned_mean_reward"],
                  ", ".join(f"{f} {metrics['base_rewards'][f]} -> {metrics['tuned_rewards'][f]}"
                            for f in metrics["tuned_rewards"]))
    artifacts.eval_samples(shown, f"{len(shown)} held-out prompts answered greedily by the base model and by "
                           f"base + adapter, with their rewards ({', '.join(train.rewards)})")
    return outputs, metrics


def champion(args: EvalArgs, runs_dir: Path, data_dir: Path, model_dir: Path, adapter_dir: Path, eval_dir: Path,
             folder: Path, identity: str | None) -> dict[str, Any]:
    """This run's reward functions on the champion's greedy answers to this run's held-out prompts: its
    champion_* metrics."""
    return as_champion(evaluate(args, train_args(adapter_dir), runs_dir, data_dir, model_dir, folder)[0])


def train_args(adapter_dir: Path) -> TrainArgs:
    """The train section that trained the adapter in train_adapter folder `adapter_dir`, with the rewards it trained
    on (its metrics hold them with each reward model pinned to its version)."""
    made = read_manifest(adapter_dir)
    if made is None:
        raise RuntimeError(f"{adapter_dir} has no valid manifest.json: its stage did not finish")
    train = TrainArgs.model_validate(made.params["train"])
    return train.model_copy(update={"rewards": made.metrics.rewards}) if made.metrics.rewards else train


def evaluate(args: EvalArgs, train: TrainArgs, runs_dir: Path, data_dir: Path, model_dir: Path, adapter: Path
             ) -> tuple[dict[str, Any], list[str], list[list[int]], dict[str, dict[str, Any]]]:
    """(metrics, reference answers, prompts, results by model) on the held-out prompts: base and tuned (the adapter
    in folder `adapter`)."""
    import pyarrow.parquet as pq
    from peft import PeftModel

    from tasks.models.loading import load_for_evaluation, load_tokenizer

    rows = pq.read_table(data_dir / "eval.parquet").to_pylist()[:args.max_samples]
    if not rows:
        raise UserError("The eval split is empty: raise data.eval_fraction or add data.")
    funcs = rewards.load(train, runs_dir, model_dir)
    prompts = [r["prompt_ids"] for r in rows]
    texts = [r["prompt"] for r in rows]
    columns = [r["columns"] for r in rows]
    answers = rewards.columns_of(columns).get("answer")
    refs = [str(a) for a in answers] if answers and all(a is not None for a in answers) else []
    tokenizer = load_tokenizer(model_dir)
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    pad = tokenizer.pad_token_id or 0
    model = load_for_evaluation(model_dir, args.dequantize)
    results = {}
    for name in ("base", "tuned"):
        if name == "tuned":
            model = PeftModel.from_pretrained(model, adapter, adapter_name="tuned")
        generated = greedy_generate(model, prompts, args.per_device_eval_batch_size, train.max_completion_length,
                                    pad, eos)
        said = [tokenizer.decode(g, skip_special_tokens=True) for g in generated]
        logps, _ = answer_logps(model, [(p[:1], p[1:]) for p in prompts], args.per_device_eval_batch_size, pad)
        results[name] = {"answers": said, "logps": logps,
                         "rewards": rewards.score(funcs, texts, said, generated, columns)}
    return _metrics(results, prompts, refs, train), refs, prompts, results


def _metrics(results: dict[str, dict[str, Any]], prompts: list[list[int]], refs: list[str], train: TrainArgs
             ) -> dict[str, Any]:
    tokens = sum(len(p) - 1 for p in prompts)
    m: dict[str, Any] = {"eval_examples": len(prompts), "eval_prompts": len(prompts), "eval_tokens": tokens,
                         "generation_samples": len(prompts), "max_new_tokens": train.max_completion_length}
    for name, r in results.items():
        m[f"{name}_rewards"] = {f: _mean([x for x in xs if x is not None]) for f, xs in r["rewards"].items()}
        m[f"{name}_mean_reward"] = mean_reward(r["rewards"])
        loss = -sum(r["logps"]) / max(tokens, 1)
        m[f"{name}_eval_loss"], m[f"{name}_perplexity"] = loss, math.exp(loss)
        scored = score(r["answers"], refs)
        m[f"{name}_exact_match"], m[f"{name}_rouge_l"] = scored["exact_match"], scored["rouge_l"]
    m["relative_improvement"] = (m["base_eval_loss"] - m["tuned_eval_loss"]) / m["base_eval_loss"]  # as for sft
    return {k: round(v, 6) if isinstance(v, float) else v for k, v in m.items()}


def mean_reward(by_function: dict[str, list[float | None]]) -> float:
    """The mean over answers of each answer's summed rewards (None counts 0, as TRL's nansum)."""
    columns = list(by_function.values())
    if not columns or not columns[0]:
        return 0.0
    totals = [sum(x for x in row if x is not None) for row in zip(*columns, strict=True)]
    return sum(totals) / len(totals)


def _mean(xs: list[float]) -> float | None:
    return round(sum(xs) / len(xs), 6) if xs else None
