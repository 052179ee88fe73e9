"""What every scorer of evaluate_adapter writes and shows: the samples' rows, metrics.json and samples.jsonl; the
attention kernels evaluation runs with on a GPU, and how an adapter is put on the base model it is scored on."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

from tasks.evaluate_adapter.generation import exact_match, rouge_l


def without_cudnn_attention() -> contextlib.AbstractContextManager[Any]:
    """On a GPU: scaled_dot_product_attention without its cuDNN backend (flash, memory-efficient and math stay).

    Why: evaluation's padded batches are masked bf16 calls, for which torch prefers cuDNN on sm90 and newer, and
    cuDNN builds a graph for every new problem shape (each loss-batch shape and a new key length per decoding step),
    which made the first pass several times slower (docs/performance.md, "Evaluation"). The memory-efficient kernel
    takes the same masks precompiled."""
    import torch

    if not torch.cuda.is_available():
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def samples(prompts: list[str], refs: list[str], results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per greedy prompt: the reference, then each model's answer (base, tuned), then their scores."""
    rows = []
    for i, (prompt, ref) in enumerate(zip(prompts, refs, strict=True)):
        answers = {who: r["answers"][i] for who, r in results.items()}
        rows.append({"prompt": prompt, "reference": ref, **{f"{w}_output": a for w, a in answers.items()},
                     **{f"{w}_exact_match": exact_match(a, ref) for w, a in answers.items()},
                     **{f"{w}_rouge_l": round(rouge_l(a, ref), 4) for w, a in answers.items()}})
    return rows


def write(folder: Path, metrics: dict[str, Any], samples: list[dict[str, Any]], results: dict[str, dict[str, Any]],
           run_lm_eval: bool) -> list[str]:
    (folder / "metrics.json").write_text(json.dumps(metrics, indent=2))
    (folder / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    if not run_lm_eval:
        return ["metrics.json", "samples.jsonl"]
    (folder / "lm_eval.json").write_text(json.dumps({who: r["lm_eval"] for who, r in results.items()},
                                                    indent=2, default=str))
    return ["metrics.json", "samples.jsonl", "lm_eval.json"]


def attached(model: Any, adapter: Path) -> Any:
    """base + the adapter in `adapter`: merged into the weights of a dequantized base, else peft's LoRA layers on
    the 4-bit one.

    Why merged: a merged layer is one matmul, where peft's LoRA adds two more in float32 (the adapter's dtype) and
    its casts, which made the tuned passes slower than the base model's (docs/performance.md, "Evaluation").
    The tuned numbers are then those of the merged weights, each rounded to the compute dtype once, as export.merge
    writes them."""
    from peft import PeftModel

    # peft's default load, not low_cpu_mem_usage: that one rounds the adapter's float32 weights to the base's bf16
    # on the way in (checked against the file, peft 0.21), which moved the 8B job's tuned eval loss by 1e-5
    attached = PeftModel.from_pretrained(model, adapter)
    if not getattr(model, "is_loaded_in_4bit", False):
        attached.merge_adapter()
    return attached
