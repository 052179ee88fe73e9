"""evaluate_adapter: base vs base + adapter on the held-out split -> metrics.json, samples.jsonl.

Reads eval.parquet (prepare_data), the 4-bit checkpoint and tokenizer (prepare_model) and the adapter
(train_adapter). For the base model and then for the same model with the adapter, on the very same
batches and prompts:

- the token-weighted mean loss over label tokens, and its perplexity;
- greedy answers to the first eval.generation_samples prompts (the tokens before each example's first
  label token), scored against the reference answers (its label tokens): exact match and ROUGE-L;
- optionally lm-evaluation-harness tasks (eval.lm_eval_tasks) when lm_eval is installed.

Everything is deterministic (eval mode, greedy decoding, fixed batches): the same adapter and data give
the same numbers. Writes metrics.json, samples.jsonl (prompt, reference, base and tuned answers, their
scores), lm_eval.json when tasks ran, and manifest.json into runs_dir/evaluate_adapter/<key>/; the
samples also go to a Prefect table artifact.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from prefect import task

from tasks import artifacts
from tasks.caching import stage_task_options
from tasks.config import EvalArgs
from tasks.errors import UserError
from tasks.evaluate_adapter import preference
from tasks.evaluate_adapter.generation import exact_match, greedy_generate, rouge_l, score, split_prompt
from tasks.examples import ParquetExamples, pad_collator
from tasks.limits import cpu_share
from tasks.log import logger
from tasks.manifest import PREFERENCE_FORMATS, DataMetrics, StageSpec, open_stage, read_manifest
from tasks.runtime import load_quantized, load_tokenizer

VERSION = "2"  # 2: generation metrics, samples.jsonl, lm-evaluation-harness


def spec(args: EvalArgs, runs_dir: Path, data_dir: str, model_dir: str, adapter_dir: str) -> StageSpec:
    """Cache-key inputs: eval settings and the three upstream stages."""
    return StageSpec(stage="evaluate_adapter", version=VERSION, runs_dir=runs_dir,
                     params={"eval": args.model_dump()},
                     upstream={"prepare_data": Path(data_dir), "prepare_model": Path(model_dir),
                               "train_adapter": Path(adapter_dir)})


@task(name="evaluate_adapter", **stage_task_options(spec))
def evaluate_adapter(args: EvalArgs, runs_dir: Path, data_dir: str, model_dir: str, adapter_dir: str) -> str:
    """Eval loss, perplexity and generation metrics of the base model and of base + adapter."""
    # this run's share of the host's cores for torch (tasks/limits.py)
    with open_stage(spec(args, runs_dir, data_dir, model_dir, adapter_dir)) as stage, cpu_share("evaluate_adapter"):
        if stage.done:
            return str(stage.dir)
        from peft import PeftModel

        data = read_manifest(Path(data_dir))
        if isinstance(data.metrics, DataMetrics) and data.metrics.format in PREFERENCE_FORMATS:  # dpo / kto data
            metrics, refs, prompts, base, tuned = preference.evaluate(args, Path(data_dir), Path(model_dir),
                                                                      Path(adapter_dir))
            tokenizer = load_tokenizer(Path(model_dir))
            samples = _samples([tokenizer.decode(p, skip_special_tokens=True) for p in prompts], refs,
                               base["answers"], tuned["answers"])
            outputs = _write(stage.dir, metrics, samples, base, tuned, False)
            logger().info("evaluate_adapter: %s", json.dumps(metrics))
            artifacts.table("eval-samples", samples, f"{len(samples)} held-out prompts answered greedily by the "
                            "base model and by base + adapter, scored against the chosen answer")
            stage.finish(outputs, metrics)
            return str(stage.dir)
        examples = ParquetExamples(Path(data_dir) / "eval.parquet")
        count = len(examples) if args.max_samples is None else min(args.max_samples, len(examples))
        if count == 0:
            raise UserError("The eval split is empty: raise data.eval_fraction or add data.")
        tokenizer = load_tokenizer(Path(model_dir))
        model = load_quantized(Path(model_dir))
        batches = _batches(examples, count, args.per_device_eval_batch_size, model.config.pad_token_id or 0)
        prompts, references = _held_out(examples, count, args.generation_samples, Path(data_dir))
        run_lm_eval = _lm_eval_available(args.lm_eval_tasks)
        logger().info("evaluate_adapter: %d eval examples in %d batches, %d greedy answers, base model then "
                      "base + adapter", count, len(batches), len(prompts))
        base = _evaluate("base", model, tokenizer, batches, prompts, args, run_lm_eval)
        tuned = _evaluate("tuned", PeftModel.from_pretrained(model, Path(adapter_dir) / "adapter"), tokenizer,
                          batches, prompts, args, run_lm_eval)
        refs = [tokenizer.decode(r, skip_special_tokens=True) for r in references]
        samples = _samples([tokenizer.decode(p, skip_special_tokens=True) for p in prompts], refs,
                           base["answers"], tuned["answers"])
        metrics = _metrics(base, tuned, refs, count, args)
        outputs = _write(stage.dir, metrics, samples, base, tuned, run_lm_eval)
        logger().info("evaluate_adapter: %s", _readable(metrics))
        artifacts.table("eval-samples", samples, f"{len(samples)} held-out prompts answered greedily by the base "
                       f"model and by base + adapter (max {args.max_new_tokens} new tokens)")
        stage.finish(outputs, metrics)
        return str(stage.dir)


def _batches(examples: ParquetExamples, count: int, size: int, pad_id: int) -> list[dict[str, Any]]:
    collate = pad_collator(pad_id)
    return [collate([examples[i] for i in range(start, min(start + size, count))])
            for start in range(0, count, size)]


def _held_out(examples: ParquetExamples, count: int, wanted: int, data_dir: Path
              ) -> tuple[list[list[int]], list[list[int]]]:
    """Prompt and reference token ids of the first `wanted` eval examples that have a masked prompt."""
    data = read_manifest(data_dir)
    if wanted and isinstance(data.metrics, DataMetrics) and not data.metrics.completion_only_loss:
        logger().info("evaluate_adapter: no generation metrics: the data trains on whole texts, so examples "
                      "have no prompt/answer split (data.completion_only_loss is off)")
        return [], []
    pairs = [p for p in (split_prompt(**examples[i]) for i in range(count)) if p is not None][:wanted]
    return [p for p, _ in pairs], [r for _, r in pairs]


def _evaluate(label: str, model: Any, tokenizer: Any, batches: list[dict[str, Any]], prompts: list[list[int]],
              args: EvalArgs, run_lm_eval: bool) -> dict[str, Any]:
    start = time.perf_counter()
    loss, tokens = mean_loss(model, batches)
    logger().info("evaluate_adapter: %s model: eval loss %.4f over %d label tokens (%.0fs); generating %d answers "
                  "(at most %d new tokens each)", label, loss, tokens, time.perf_counter() - start, len(prompts),
                  args.max_new_tokens)
    start = time.perf_counter()
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    answers = greedy_generate(model, prompts, args.per_device_eval_batch_size, args.max_new_tokens,
                              tokenizer.pad_token_id, eos)
    if prompts:
        logger().info("evaluate_adapter: %s model: %d answers generated (%.0fs)", label, len(answers),
                      time.perf_counter() - start)
    return {"loss": loss, "tokens": tokens, "answers": [tokenizer.decode(a, skip_special_tokens=True)
                                                       for a in answers],
            "lm_eval": _lm_eval(model, tokenizer, args) if run_lm_eval else None}


def _samples(prompts: list[str], refs: list[str], base: list[str], tuned: list[str]) -> list[dict[str, Any]]:
    return [{"prompt": p, "reference": r, "base_output": b, "tuned_output": t,
             "base_exact_match": exact_match(b, r), "tuned_exact_match": exact_match(t, r),
             "base_rouge_l": round(rouge_l(b, r), 4), "tuned_rouge_l": round(rouge_l(t, r), 4)}
            for p, r, b, t in zip(prompts, refs, base, tuned, strict=True)]


def _metrics(base: dict[str, Any], tuned: dict[str, Any], refs: list[str], count: int, args: EvalArgs
             ) -> dict[str, Any]:
    b, t = score(base["answers"], refs), score(tuned["answers"], refs)
    metrics = {"base_eval_loss": base["loss"], "tuned_eval_loss": tuned["loss"],
               "base_perplexity": math.exp(base["loss"]), "tuned_perplexity": math.exp(tuned["loss"]),
               "eval_examples": count, "eval_tokens": base["tokens"],
               "relative_improvement": (base["loss"] - tuned["loss"]) / base["loss"],
               "base_exact_match": b["exact_match"], "tuned_exact_match": t["exact_match"],
               "base_rouge_l": b["rouge_l"], "tuned_rouge_l": t["rouge_l"],
               "generation_samples": len(refs), "max_new_tokens": args.max_new_tokens}
    if args.lm_eval_tasks:
        metrics["lm_eval"] = "lm_eval.json" if base["lm_eval"] is not None else "skipped: lm_eval not installed"
    return metrics


def _readable(m: dict[str, Any]) -> str:
    """The metrics as one sentence for the run log (metrics.json and the artifacts hold them all)."""
    text = (f"eval loss base {m['base_eval_loss']:.4f} -> tuned {m['tuned_eval_loss']:.4f} "
            f"({100 * m['relative_improvement']:.1f}% lower), perplexity {m['base_perplexity']:.2f} -> "
            f"{m['tuned_perplexity']:.2f} over {m['eval_examples']} examples ({m['eval_tokens']} label tokens)")
    if m["generation_samples"]:
        text += (f"; {m['generation_samples']} greedy answers: exact match {m['base_exact_match']:.3f} -> "
                 f"{m['tuned_exact_match']:.3f}, ROUGE-L {m['base_rouge_l']:.3f} -> {m['tuned_rouge_l']:.3f}")
    return text


def _write(folder: Path, metrics: dict[str, Any], samples: list[dict[str, Any]], base: dict[str, Any],
           tuned: dict[str, Any], run_lm_eval: bool) -> list[str]:
    (folder / "metrics.json").write_text(json.dumps(metrics, indent=2))
    (folder / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    if not run_lm_eval:
        return ["metrics.json", "samples.jsonl"]
    (folder / "lm_eval.json").write_text(json.dumps({"base": base["lm_eval"], "tuned": tuned["lm_eval"]},
                                                    indent=2, default=str))
    return ["metrics.json", "samples.jsonl", "lm_eval.json"]


def _lm_eval_available(tasks: list[str]) -> bool:
    if not tasks:
        return False
    try:
        import lm_eval  # noqa: F401 - optional dependency, only probed
    except ImportError:
        logger().warning("evaluate_adapter: eval.lm_eval_tasks=%s skipped: lm-evaluation-harness is not installed "
                         "(pip install lm-eval; its tasks' datasets must be reachable or cached)", tasks)
        return False
    return True


def _lm_eval(model: Any, tokenizer: Any, args: EvalArgs) -> dict[str, Any]:
    """lm-evaluation-harness results per task for an in-memory model (base, or base + adapter)."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=args.per_device_eval_batch_size)
    return lm_eval.simple_evaluate(model=lm, tasks=list(args.lm_eval_tasks), limit=args.limit)["results"]


def mean_loss(model: Any, batches: list[dict[str, Any]]) -> tuple[float, int]:
    """Token-weighted mean next-token loss over label tokens, and the number of those tokens."""
    import torch

    total, tokens = 0.0, 0
    model.eval()
    device = next(model.parameters()).device
    with torch.no_grad():
        for batch in batches:
            batch = {k: v.to(device) for k, v in batch.items()}
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            targets = batch["labels"][:, 1:]
            losses = torch.nn.functional.cross_entropy(
                logits[:, :-1].float().reshape(-1, logits.size(-1)), targets.reshape(-1),
                ignore_index=-100, reduction="sum")
            total += losses.item()
            tokens += int((targets != -100).sum())
    return total / tokens, tokens
