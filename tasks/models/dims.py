"""A decoder-only model's dimensions from its config, whatever its family calls them: the memory plan sizes
training with them (train_adapter), evaluation sizes its generation batches (evaluate_adapter)."""

from __future__ import annotations

from typing import Any, NamedTuple


class Dims(NamedTuple):
    hidden: int
    intermediate: int
    layers: int
    vocab: int
    kv: int = 0  # key/value width (heads x head dim); 0 = hidden (no grouped-query attention)
    heads: int = 0  # query heads (attention scores per token pair); 0 = unknown


# each family's names for the same sizes, first match wins: Llama/Qwen/Gemma/Mistral/Phi/GPT-NeoX, GPT-2, OPT,
# Falcon, MPT/T5-style
HIDDEN_NAMES = ("hidden_size", "n_embd", "d_model")
INTERMEDIATE_NAMES = ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size", "d_ff")
LAYER_NAMES = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
HEAD_NAMES = ("num_attention_heads", "n_head", "num_heads")


def model_dims(config: Any) -> Dims:
    """Hidden size, MLP width, layer count, vocabulary and key/value width of any decoder-only config, whatever
    its field names. A missing or None MLP width means the transformer default of 4 x hidden (GPT-2's n_inner,
    Falcon); a missing key/value head count means as many as query heads."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = _first(config, HIDDEN_NAMES)
    layers = _first(config, LAYER_NAMES)
    if hidden is None or layers is None:
        raise ValueError(f"{type(config).__name__} names its hidden size or layer count none of "
                         f"{HIDDEN_NAMES + LAYER_NAMES}")
    intermediate = _first(config, INTERMEDIATE_NAMES) or 4 * hidden
    heads, kv_heads = _first(config, HEAD_NAMES), getattr(config, "num_key_value_heads", None)
    head_dim = getattr(config, "head_dim", None) or (hidden // heads if heads else None)
    kv = kv_heads * head_dim if kv_heads and head_dim else hidden
    return Dims(hidden, intermediate, layers, config.vocab_size, kv, heads or 0)


def _first(config: Any, names: tuple[str, ...]) -> int | None:
    return next((v for v in (getattr(config, n, None) for n in names) if v is not None), None)
