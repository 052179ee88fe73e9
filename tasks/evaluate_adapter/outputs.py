"""What every scorer of evaluate_adapter writes and shows: the samples' rows, metrics.json and samples.jsonl, and the
attention kernels evaluation runs with on a GPU."""

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
