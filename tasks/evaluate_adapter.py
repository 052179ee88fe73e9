"""evaluate_adapter: base vs base + adapter on the held-out split -> metrics.json.

Reads eval.parquet (prepare_data), the 4-bit checkpoint (prepare_model) and the adapter
(train_adapter). Computes the token-weighted mean loss over label tokens, and its perplexity, for the
base model and then for the same model with the adapter, on the very same batches. Writes
metrics.json and manifest.json into runs_dir/evaluate_adapter/<key>/.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from prefect import task

from tasks.batches import ParquetExamples, pad_collator
from tasks.caching import stage_task_options
from tasks.config import EvalArgs
from tasks.errors import UserError
from tasks.log import logger
from tasks.manifest import StageSpec, open_stage
from tasks.runtime import load_quantized

VERSION = "1"


def spec(args: EvalArgs, runs_dir: Path, data_dir: str, model_dir: str, adapter_dir: str) -> StageSpec:
    """Cache-key inputs: eval settings and the three upstream stages."""
    return StageSpec(stage="evaluate_adapter", version=VERSION, runs_dir=runs_dir,
                     params={"eval": args.model_dump()},
                     upstream={"prepare_data": Path(data_dir), "prepare_model": Path(model_dir),
                               "train_adapter": Path(adapter_dir)})


@task(name="evaluate_adapter", **stage_task_options(spec))
def evaluate_adapter(args: EvalArgs, runs_dir: Path, data_dir: str, model_dir: str, adapter_dir: str) -> str:
    """Eval loss and perplexity of the base model and of base + adapter."""
    with open_stage(spec(args, runs_dir, data_dir, model_dir, adapter_dir)) as stage:
        if stage.done:
            return str(stage.dir)
        from peft import PeftModel

        examples = ParquetExamples(Path(data_dir) / "eval.parquet")
        count = len(examples) if args.max_samples is None else min(args.max_samples, len(examples))
        if count == 0:
            raise UserError("The eval split is empty: raise data.eval_fraction or add data.")
        model = load_quantized(Path(model_dir))
        batches = _batches(examples, count, args.per_device_eval_batch_size, model.config.pad_token_id or 0)
        base_loss, tokens = mean_loss(model, batches)
        tuned = PeftModel.from_pretrained(model, Path(adapter_dir) / "adapter")
        tuned_loss, _ = mean_loss(tuned, batches)
        metrics = {"base_eval_loss": base_loss, "tuned_eval_loss": tuned_loss,
                   "base_perplexity": math.exp(base_loss), "tuned_perplexity": math.exp(tuned_loss),
                   "eval_examples": count, "eval_tokens": tokens,
                   "relative_improvement": (base_loss - tuned_loss) / base_loss}
        (stage.dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
        logger().info("evaluate_adapter: %s", json.dumps(metrics))
        stage.finish(["metrics.json"], metrics)
        return str(stage.dir)


def _batches(examples: ParquetExamples, count: int, size: int, pad_id: int) -> list[dict[str, Any]]:
    collate = pad_collator(pad_id)
    return [collate([examples[i] for i in range(start, min(start + size, count))])
            for start in range(0, count, size)]


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
