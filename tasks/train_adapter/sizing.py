"""The packed micro-batch size in tokens, from a GPU memory budget."""

from __future__ import annotations

from typing import Any, NamedTuple

GIB = 2**30


def bytes_per_token(config: Any, offload: bool) -> int:
    """GPU bytes one micro-batch token costs in training, Llama-3.1-8B shape, bf16: 236 KiB with offload, 492
    without. On an H200 the peaks grew by 206 and 432 KiB per token (bench/results/2026-11-30-h200x2-microstep
    .json): the estimate keeps a margin of about 14%."""
    dims = model_dims(config)
    working = 2 * (12 * dims.hidden + 5 * dims.intermediate)  # one layer's recompute and backward, bf16
    saved = 0 if offload else 2 * dims.hidden * dims.layers  # checkpointed layer inputs, bf16
    return working + saved


class Dims(NamedTuple):
    hidden: int
    intermediate: int
    layers: int
    vocab: int


# each family's names for the same sizes, first match wins: Llama/Qwen/Gemma/Mistral/Phi/GPT-NeoX, GPT-2, OPT,
# Falcon, MPT/T5-style
HIDDEN_NAMES = ("hidden_size", "n_embd", "d_model")
INTERMEDIATE_NAMES = ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size", "d_ff")
LAYER_NAMES = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")


def model_dims(config: Any) -> Dims:
    """Hidden size, MLP width, layer count and vocabulary of any decoder-only config, whatever its field names.
    A missing or None MLP width means the transformer default of 4 x hidden (GPT-2's n_inner, Falcon)."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = _first(config, HIDDEN_NAMES)
    layers = _first(config, LAYER_NAMES)
    if hidden is None or layers is None:
        raise ValueError(f"{type(config).__name__} names its hidden size or layer count none of "
                         f"{HIDDEN_NAMES + LAYER_NAMES}")
    intermediate = _first(config, INTERMEDIATE_NAMES) or 4 * hidden
    return Dims(hidden, intermediate, layers, config.vocab_size)


def _first(config: Any, names: tuple[str, ...]) -> int | None:
    return next((v for v in (getattr(config, n, None) for n in names) if v is not None), None)


def micro_batch_tokens(budget_gb: float, used_bytes: int, config: Any, offload: bool, floor: int) -> int:
    """Tokens per packed micro-batch that fit the GPU memory budget next to what is already allocated."""
    spare = budget_gb * GIB - used_bytes - 0.5 * GIB  # CUDA context, allocator slack, optimizer state
    tokens = int(spare // bytes_per_token(config, offload)) // 256 * 256
    return max(tokens, floor)
