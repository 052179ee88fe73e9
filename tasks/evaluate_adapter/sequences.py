"""evaluate_adapter for sequences (the data kind of tasks/methods.py's sft row; evaluate_adapter.scorers maps kinds
to scorers): base and base + adapter on the held-out examples.

For the base model, then the same model with the adapter (the base dequantized when it fits, eval.dequantize, and the
adapter merged into it), on the very same batches and prompts:

- the token-weighted mean loss over label tokens, and its perplexity;
- greedy answers to the first eval.generation_samples prompts (the tokens before each example's first label token),
  scored against the reference answers (its label tokens): exact match and ROUGE-L;
- optionally lm-evaluation-harness tasks (eval.lm_eval_tasks), reported (the gated ones are eval.suites:
  suites.py).

The base model's results are kept in runs_dir/evaluate_adapter/.memo/ (_memo), where the next evaluation on the same
eval data, model and settings takes them instead of computing them again; score_champion keeps the champion's there
too (`champion`).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from tasks.config import EvalArgs
from tasks.errors import UserError
from tasks.evaluate_adapter import VERSION, keys, suites
from tasks.evaluate_adapter.generation import by_length, generation_tokens, greedy_generate, score, split_prompt
from tasks.evaluate_adapter.outputs import attached, samples, without_cudnn_attention, write
from tasks.hashing.keys import cache_key
from tasks.log import logger
from tasks.models.loading import load_for_evaluation, load_tokenizer
from tasks.models.memory import release_device_memory
from tasks.on_disk import disk
from tasks.on_disk.manifest import DataMetrics, read_manifest, upstream_key
from tasks.on_disk.parquet_dataset import ParquetExamples, pad_collator
from tasks.reporting import artifacts


def evaluate(args: EvalArgs, runs_dir: Path, out: Path, data_dir: Path, model_dir: Path, adapter_dir: Path
                  ) -> tuple[list[str], dict[str, Any]]:
    """Loss, perplexity and greedy answers of base and tuned on the held-out examples (the base's from the memo
    where an earlier evaluation left them), written into `out`; the files written and the metrics."""
    examples = ParquetExamples(data_dir / "eval.parquet")
    count = len(examples) if args.max_samples is None else min(args.max_samples, len(examples))
    if count == 0:
        raise UserError("The eval split is empty: raise data.eval_fraction or add data.")
    tokenizer = load_tokenizer(model_dir)
    base = _Base(partial(load_for_evaluation, model_dir, args.dequantize))
    batches = _batches(examples, count, args.per_device_eval_batch_size, base.model.config.pad_token_id or 0)
    prompts, references = _held_out(examples, count, args.generation_samples, data_dir)
    run_lm_eval = _lm_eval_available(args.lm_eval_tasks)
    logger().info("evaluate_adapter: %d eval examples in %d length-sorted batches, %d greedy answers, base "
                  "model then base + adapter", count, len(batches), len(prompts))
    memo = _memo(runs_dir, data_dir, model_dir, args, base.in_4bit)
    with without_cudnn_attention():
        results = _evaluate_all(base, adapter_dir / "adapter", tokenizer, batches, prompts, args, run_lm_eval, memo)
    base.model = None  # the dequantized copy (or the 4-bit model) is not needed past this point
    release_device_memory()
    refs = [tokenizer.decode(r, skip_special_tokens=True) for r in references]
    shown = samples([tokenizer.decode(p, skip_special_tokens=True) for p in prompts], refs, results)
    metrics = {**_metrics(results, refs, count, args), "memo": memo and memo.name}
    outputs = write(out, metrics, shown, results, run_lm_eval)
    logger().info("evaluate_adapter: %s", _readable(metrics))
    artifacts.eval_samples(shown, f"{len(shown)} held-out prompts answered greedily by the base model and "
                           f"by base + adapter (max {args.max_new_tokens} new tokens)" if shown else _NO_SAMPLES)
    return outputs, metrics


def _batches(examples: ParquetExamples, count: int, size: int, pad_id: int) -> list[dict[str, Any]]:
    """The first `count` examples, sorted by length, in padded batches of at most `size` times the longest
    example's tokens: as much memory as a batch of `size` longest examples, far fewer batches when most are short.
    The loss is a sum over label tokens, so the order of examples does not change it (beyond float rounding)."""
    collate = pad_collator(pad_id)
    rows = [examples[i] for i in range(count)]
    return [collate([rows[i] for i in group]) for group in by_length([len(r["input_ids"]) for r in rows], size)]


# what the eval-samples artifact says instead of "0 held-out prompts" above an empty table
_NO_SAMPLES = ("No held-out prompts answered: eval.generation_samples is 0, or the eval examples have no prompt/answer "
               "split (text data, or data.completion_only_loss off), so there is nothing to generate from.")


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


class _Base:
    """The base model under evaluation, and whether it is evaluated in 4 bits (part of the memo's key)."""

    def __init__(self, load: Callable[[], Any]) -> None:
        self.model = load()
        self.in_4bit = bool(getattr(self.model, "is_loaded_in_4bit", False))


def _evaluate_all(base: _Base, adapter: Path, tokenizer: Any, batches: list[dict[str, Any]],
                  prompts: list[list[int]], args: EvalArgs, run_lm_eval: bool, memo: Path | None
                  ) -> dict[str, dict[str, Any]]:
    """base and tuned results, the adapter attached to the base (attached); the base's taken from `memo` when an
    earlier evaluation left them there."""

    def evaluate(label: str, model: Any) -> dict[str, Any]:
        return _evaluate(label, model, tokenizer, batches, prompts, args, run_lm_eval)

    results = {"base": _remembered(memo, "base", lambda: evaluate("base", base.model))}
    results["tuned"] = evaluate("tuned", attached(base.model, adapter))
    return results


def _memo(runs_dir: Path, data_dir: Path, model_dir: Path, args: EvalArgs, in_4bit: bool) -> Path | None:
    """Where this evaluation's base and champion results are remembered: one folder per (eval.parquet's bytes, the
    4-bit model, the eval settings, whether it evaluates in 4 bits, this code's VERSION, the device), under
    runs_dir/evaluate_adapter/.memo.

    Why: a nightly run trains a new adapter, but on a fixed eval set (data.eval_source) the base model's and the
    champion's numbers are the same every night (evaluation is deterministic: the same batches and greedy prompts);
    only the tuned adapter needs computing (the base model's passes were about half of evaluate_adapter's time:
    docs/performance.md, "Evaluation"). The device is in the key: a GPU's
    kernels give other last digits than the CPU's, and a CPU's can change with its number of threads. None when
    prepare_data recorded no hash of eval.parquet."""
    import torch

    digest = (read_manifest(data_dir).hashes or {}).get("eval.parquet")
    if not digest:
        return None
    where = torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu, {torch.get_num_threads()} threads"
    inputs = {"version": VERSION, "eval_data": digest, "model": upstream_key(model_dir), "eval": keys.scored(args),
              "in_4bit": in_4bit, "device": where, "torch": torch.__version__}
    return runs_dir / "evaluate_adapter" / ".memo" / cache_key(inputs)


def _remembered(memo: Path | None, who: str, compute: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """`who`'s results from the memo folder, else computed and written there whole."""
    path = memo / f"{who}.json" if memo is not None else None
    if path is not None and path.is_file():
        results = json.loads(path.read_text())
        logger().info("evaluate_adapter: %s model: eval loss %.4f over %d label tokens and its %d answers, as an "
                      "earlier run computed them on the same eval data, model and settings (%s)", who.split("-")[0],
                      results["loss"], results["tokens"], len(results["answers"]), path)
        return results
    results = compute()
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        disk.write_whole(path, json.dumps(results, default=str))
    return results


def _evaluate(label: str, model: Any, tokenizer: Any, batches: list[dict[str, Any]], prompts: list[list[int]],
              args: EvalArgs, run_lm_eval: bool) -> dict[str, Any]:
    start = time.perf_counter()
    loss, tokens = mean_loss(model, batches)
    logger().info("evaluate_adapter: %s model: eval loss %.4f over %d label tokens (%.1fs); generating %d answers "
                  "(at most %d new tokens each)", label, loss, tokens, time.perf_counter() - start, len(prompts),
                  args.max_new_tokens)
    start = time.perf_counter()
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    # the largest loss batch's memory bounds a generation batch (generation_tokens)
    budget = generation_tokens(model, max(b["input_ids"].numel() for b in batches)) if batches else None
    answers = greedy_generate(model, prompts, args.per_device_eval_batch_size, args.max_new_tokens,
                              tokenizer.pad_token_id, eos, budget)
    if prompts:
        logger().info("evaluate_adapter: %s model: %d answers generated (%.1fs)", label, len(answers),
                      time.perf_counter() - start)
    return {"loss": loss, "tokens": tokens, "answers": [tokenizer.decode(a, skip_special_tokens=True)
                                                       for a in answers],
            "lm_eval": _lm_eval(model, tokenizer, args) if run_lm_eval else None}


def _metrics(results: dict[str, dict[str, Any]], refs: list[str], count: int, args: EvalArgs) -> dict[str, Any]:
    base, tuned = results["base"], results["tuned"]
    metrics = {f"{who}_eval_loss": r["loss"] for who, r in results.items()}
    metrics.update({f"{who}_perplexity": math.exp(r["loss"]) for who, r in results.items()})
    metrics.update(eval_examples=count, eval_tokens=base["tokens"],
                   relative_improvement=(base["loss"] - tuned["loss"]) / base["loss"])
    scored = {who: score(r["answers"], refs) for who, r in results.items()}
    metrics.update({f"{who}_exact_match": s["exact_match"] for who, s in scored.items()})
    metrics.update({f"{who}_rouge_l": s["rouge_l"] for who, s in scored.items()})
    metrics.update(generation_samples=len(refs), max_new_tokens=args.max_new_tokens)
    if args.lm_eval_tasks:
        metrics["lm_eval"] = "lm_eval.json"
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


def _lm_eval_available(tasks: list[str]) -> bool:
    """Whether eval.lm_eval_tasks asks for tasks; a UserError when lm-evaluation-harness is not installed (never a
    silent skip: the flow's check says so before any stage, this says it to a stage called alone)."""
    if not tasks:
        return False
    if suites.installed() is None:
        raise UserError(f"eval.lm_eval_tasks={tasks} is set, but {suites.NOT_INSTALLED}; or empty "
                        "eval.lm_eval_tasks.")
    return True


def _lm_eval(model: Any, tokenizer: Any, args: EvalArgs) -> dict[str, Any]:
    """lm-evaluation-harness results per task for an in-memory model (base, or base + adapter): built-in tasks by
    name, local task files as eval.suites takes them."""
    return suites.results(model, tokenizer, args.lm_eval_tasks, args.per_device_eval_batch_size, args.limit)


def mean_loss(model: Any, batches: list[dict[str, Any]]) -> tuple[float, int]:
    """Token-weighted mean next-token loss over label tokens, and the number of those tokens."""
    import torch

    model.eval()
    device = next(model.parameters()).device
    total = torch.zeros((), dtype=torch.float64, device=device)
    tokens = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)  # counted on the host's copies
    first = time.perf_counter()
    with torch.no_grad():
        for index, batch in enumerate(batches):
            if index == 1 and device.type == "cuda":  # one-time costs (a kernel's first use) show in the log
                torch.cuda.synchronize()
                if time.perf_counter() - first > 1:
                    logger().info("evaluate_adapter: the first loss batch took %.1fs", time.perf_counter() - first)
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            targets = batch["labels"][:, 1:]
            losses = torch.nn.functional.cross_entropy(
                logits[:, :-1].float().reshape(-1, logits.size(-1)), targets.reshape(-1),
                ignore_index=-100, reduction="none")
            # float64 running sum, kept on the device: no host sync per batch, and the sum hardly depends on
            # how examples are grouped into batches
            total += losses.double().sum()
    return total.item() / tokens, tokens


def champion(args: EvalArgs, runs_dir: Path, data_dir: Path, model_dir: Path, adapter_dir: Path, eval_dir: Path,
             folder: Path, identity: str | None) -> dict[str, Any]:
    """score_champion's numbers of the champion in `folder` (champion_eval_loss, _perplexity, _exact_match,
    _rouge_l): remembered beside this evaluation's base results, else computed on its batches and prompts (the
    model is loaded only then)."""
    examples = ParquetExamples(data_dir / "eval.parquet")
    count = len(examples) if args.max_samples is None else min(args.max_samples, len(examples))
    prompts, references = _held_out(examples, count, args.generation_samples, data_dir)
    memo = read_manifest(eval_dir).metrics.memo
    found = runs_dir / "evaluate_adapter" / ".memo" / memo / f"champion-{identity}.json" if memo else None
    if found is not None and found.is_file():
        results = json.loads(found.read_text())
        logger().info("score_champion: remembered from an earlier run on the same eval data, model and settings "
                      "(%s)", found)
    else:
        results = _champion_results(args, runs_dir, data_dir, model_dir, folder, identity, examples, count, prompts)
    tokenizer = load_tokenizer(model_dir)
    scored = score(results["answers"], [tokenizer.decode(r, skip_special_tokens=True) for r in references])
    return {"champion_eval_loss": results["loss"], "champion_perplexity": math.exp(results["loss"]),
            "champion_exact_match": scored["exact_match"], "champion_rouge_l": scored["rouge_l"]}


def champion_answers(runs_dir: Path, eval_dir: Path, identity: str | None) -> list[str] | None:
    """The champion's greedy answers to this evaluation's held-out prompts, as score_champion remembered them beside
    its base results (what the judge compares); None when they are not there."""
    memo = read_manifest(eval_dir).metrics.memo if identity else None
    path = runs_dir / "evaluate_adapter" / ".memo" / memo / f"champion-{identity}.json" if memo else None
    return json.loads(path.read_text())["answers"] if path is not None and path.is_file() else None


def _champion_results(args: EvalArgs, runs_dir: Path, data_dir: Path, model_dir: Path, folder: Path,
                      identity: str | None, examples: ParquetExamples, count: int, prompts: list[list[int]]
                      ) -> dict[str, Any]:
    """The champion's loss and answers, as the tuned adapter's are computed, into the memo."""
    tokenizer = load_tokenizer(model_dir)
    base = _Base(partial(load_for_evaluation, model_dir, args.dequantize))
    batches = _batches(examples, count, args.per_device_eval_batch_size, base.model.config.pad_token_id or 0)
    memo = _memo(runs_dir, data_dir, model_dir, args, base.in_4bit) if identity else None
    results = _remembered(memo, f"champion-{identity}", lambda: _evaluate(
        "champion", attached(base.model, folder), tokenizer, batches, prompts, args, False))
    base.model = None
    release_device_memory()
    return results
