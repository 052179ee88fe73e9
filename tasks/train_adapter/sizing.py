"""The packed micro-batch size in tokens, from a GPU memory budget."""

from __future__ import annotations

from typing import Any

GIB = 2**30


def bytes_per_token(config: Any, offload: bool) -> int:
    """GPU bytes one micro-batch token costs in training, Llama-3.1-8B shape, bf16: 236 KiB with offload, 492
    without. On an H200 the peaks grew by 206 and 432 KiB per token (bench/results/2026-11-30-h200x2-microstep
    .json): the estimate keeps a margin of about 14%."""
    hidden = config.hidden_size
    layers = config.num_hidden_layers
    working = 2 * (12 * hidden + 5 * config.intermediate_size)  # one layer's recompute and backward, bf16
    saved = 0 if offload else 2 * hidden * layers  # checkpointed layer inputs, bf16
    return working + saved


def micro_batch_tokens(budget_gb: float, used_bytes: int, config: Any, offload: bool, floor: int) -> int:
    """Tokens per packed micro-batch that fit the GPU memory budget next to what is already allocated."""
    spare = budget_gb * GIB - used_bytes - 0.5 * GIB  # CUDA context, allocator slack, optimizer state
    tokens = int(spare // bytes_per_token(config, offload)) // 256 * 256
    return max(tokens, floor)
