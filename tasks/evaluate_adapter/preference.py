"""evaluate_adapter for preference data (prepare_data formats preference and unpaired_preference).

On the held-out pairs, for the base model and base + adapter (this run's, or the registry's champion scored by
score_champion), each answer's log-probability given its prompt (summed over the answer's tokens). The reward of an
answer is the model's log-probability minus the base model's (TRL's implicit DPO reward with the base as reference,
without beta):

- reward accuracy: the share of pairs where reward(chosen) > reward(rejected) (ties count half, so the base
  model, whose rewards are all 0, scores exactly 0.5); for rated single answers, the share whose reward has the
  sign of its label;
- reward margin: the mean of reward(chosen) - reward(rejected) (desirable minus undesirable answers);
- chosen / rejected log-prob means, and the preference accuracy (log p(chosen) > log p(rejected), no reference);
- eval loss and perplexity on the chosen (desirable) answers, and greedy answers to the first prompts scored
  against the chosen answer, as for SFT.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from tasks.config import EvalArgs
from tasks.errors import UserError
from tasks.evaluate_adapter.generation import greedy_generate, score
from tasks.evaluate_adapter.outputs import samples, without_cudnn_attention, write
from tasks.log import logger
from tasks.reporting import artifacts


def stage(args: EvalArgs, runs_dir: Path, out: Path, data_dir: Path, model_dir: Path, adapter_dir: Path
          ) -> tuple[list[str], dict[str, Any]]:
    """Reward accuracy and margin of base and tuned on the held-out pairs, and greedy answers, written into `out`;
    the files written and the metrics."""
    import json

    from tasks.models.loading import load_tokenizer

    with without_cudnn_attention():  # its answer batches are padded and masked too
        metrics, refs, prompts, results = evaluate(args, data_dir, model_dir, adapter_dir / "adapter")
    tokenizer = load_tokenizer(model_dir)
    shown = samples([tokenizer.decode(p, skip_special_tokens=True) for p in prompts], refs, results)
    outputs = write(out, metrics, shown, results, False)
    logger().info("evaluate_adapter: %s", json.dumps(metrics))
    artifacts.eval_samples(shown, f"{len(shown)} held-out prompts answered greedily by the base model "
                           "and by base + adapter, scored against the chosen answer")
    return outputs, metrics


def champion(args: EvalArgs, runs_dir: Path, data_dir: Path, model_dir: Path, adapter_dir: Path, eval_dir: Path,
             folder: Path, identity: str | None) -> dict[str, Any]:
    """The champion in `folder` scored as `evaluate` scores the tuned adapter: its champion_* metrics."""
    return as_champion(evaluate(args, data_dir, model_dir, folder)[0])


def as_champion(metrics: dict[str, Any]) -> dict[str, Any]:
    """The tuned_* entries of an evaluation's metrics as the champion's (champion_*)."""
    return {f"champion_{k.removeprefix('tuned_')}": v for k, v in metrics.items() if k.startswith("tuned_")}


def evaluate(args: EvalArgs, data_dir: Path, model_dir: Path, adapter: Path
             ) -> tuple[dict[str, Any], list[str], list[list[int]], dict[str, dict[str, Any]]]:
    """(metrics, reference answers, prompts, results by model) on the eval split: base and tuned (the adapter in
    folder `adapter`, its rewards against the base log-probabilities)."""
    import pyarrow.parquet as pq
    from peft import PeftModel

    from tasks.models.loading import load_for_evaluation, load_tokenizer

    rows = pq.read_table(data_dir / "eval.parquet").to_pylist()[:args.max_samples]
    if not rows:
        raise UserError("The eval split is empty: raise data.eval_fraction or add data.")
    paired = "chosen_ids" in rows[0]
    good = [r["chosen_ids"] if paired else r["completion_ids"] for r in rows]
    bad = [r["rejected_ids"] for r in rows] if paired else []
    answers = [(r["prompt_ids"], a) for r, a in zip(rows, good, strict=True)] + [
        (r["prompt_ids"], a) for r, a in zip(rows, bad, strict=False)]
    tokenizer = load_tokenizer(model_dir)
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    wanted = [r for r in rows if not paired and r["label"] or paired][:args.generation_samples]
    prompts = [r["prompt_ids"] for r in wanted]
    refs = [(r["chosen_ids"] if paired else r["completion_ids"]) for r in wanted]
    refs = [tokenizer.decode([t for t in ids if t not in eos], skip_special_tokens=True) for ids in refs]
    model = load_for_evaluation(model_dir, args.dequantize)
    pad = tokenizer.pad_token_id or 0
    results = {}
    for name in ("base", "tuned"):
        if name == "tuned":
            model = PeftModel.from_pretrained(model, adapter, adapter_name="tuned")
        logps, counts = answer_logps(model, answers, args.per_device_eval_batch_size, pad)
        generated = greedy_generate(model, prompts, args.per_device_eval_batch_size, args.max_new_tokens, pad, eos)
        results[name] = {"logps": logps, "counts": counts,
                         "answers": [tokenizer.decode(a, skip_special_tokens=True) for a in generated]}
    labels = None if paired else [bool(r["label"]) for r in rows]
    return _metrics(results, len(rows), labels, refs, args), refs, prompts, results


def answer_logps(model: Any, answers: list[tuple[list[int], list[int]]], batch_size: int, pad_id: int
                 ) -> tuple[list[float], list[int]]:
    """Summed log-probability of each (prompt, answer)'s answer tokens, and the answer's token count."""
    import torch

    model.eval()
    device = next(model.parameters()).device
    out: list[float] = []
    for start in range(0, len(answers), batch_size):
        batch = answers[start:start + batch_size]
        width = max(len(p) + len(a) for p, a in batch)
        ids = torch.tensor([p + a + [pad_id] * (width - len(p) - len(a)) for p, a in batch], device=device)
        mask = torch.tensor([[1] * (len(p) + len(a)) + [0] * (width - len(p) - len(a)) for p, a in batch],
                            device=device)
        scored = torch.tensor([[0] * len(p) + [1] * len(a) + [0] * (width - len(p) - len(a)) for p, a in batch],
                              device=device)[:, 1:]
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
            picked = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            out += (picked * scored).sum(-1).tolist()
    return out, [len(a) for _, a in answers]


def _metrics(results: dict[str, dict[str, Any]], n: int, labels: list[bool] | None, refs: list[str],
             args: EvalArgs) -> dict[str, Any]:
    base_logps = results["base"]["logps"]
    m: dict[str, Any] = {"eval_examples": n, "eval_pairs": n if labels is None else None,
                         "generation_samples": len(refs), "max_new_tokens": args.max_new_tokens}
    counts = results["base"]["counts"]
    for name, r in results.items():
        logps = r["logps"]
        rewards = [a - b for a, b in zip(logps, base_logps, strict=True)]
        if labels is None:  # pairs: chosen first, then rejected
            good, bad, good_r, bad_r = logps[:n], logps[n:], rewards[:n], rewards[n:]
            m[f"{name}_reward_accuracy"] = _share(list(zip(good_r, bad_r, strict=True)))
            m[f"{name}_preference_accuracy"] = _share(list(zip(good, bad, strict=True)))
        else:
            good = [x for x, y in zip(logps, labels, strict=True) if y]
            bad = [x for x, y in zip(logps, labels, strict=True) if not y]
            good_r = [x for x, y in zip(rewards, labels, strict=True) if y]
            bad_r = [x for x, y in zip(rewards, labels, strict=True) if not y]
            m[f"{name}_reward_accuracy"] = _share([(x, 0.0) for x in good_r] + [(0.0, x) for x in bad_r])
        m[f"{name}_reward_margin"] = _mean(good_r) - _mean(bad_r)
        m[f"{name}_chosen_logps"], m[f"{name}_rejected_logps"] = _mean(good), _mean(bad)
        good_tokens = sum(c for c, y in zip(counts, labels or [True] * n + [False] * n, strict=False) if y)
        loss = -sum(good) / max(good_tokens, 1)  # token-weighted NLL of the chosen (desirable) answers
        m[f"{name}_eval_loss"], m[f"{name}_perplexity"] = loss, math.exp(loss)
        scored = score(r["answers"], refs)
        m[f"{name}_exact_match"], m[f"{name}_rouge_l"] = scored["exact_match"], scored["rouge_l"]
    m["eval_tokens"] = sum(counts)
    m["relative_improvement"] = (m["base_eval_loss"] - m["tuned_eval_loss"]) / m["base_eval_loss"]
    return {k: round(v, 6) if isinstance(v, float) else v for k, v in m.items()}


def _share(pairs: list[tuple[float, float]]) -> float:
    """Share of (a, b) with a > b, ties counting half."""
    return sum(1.0 if a > b else 0.5 if a == b else 0.0 for a, b in pairs) / max(len(pairs), 1)


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0
