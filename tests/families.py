"""Tiny random-weight models of the common decoder-only families, built from transformers' own config classes.

Each gets the project's tokenizer (data/tiny-llama: 1,024 tokens, <pad>=0, <s>=1, </s>=2), so every family
trains on the same tokenized data. Shapes are kept small (hidden 64, 2 layers) for CI's two cores, but
follow each family's own layout: fused qkv (phi3, gpt_neox, gpt2's Conv1D), GQA, q/k norms, soft-capping.
Also used by bench/bench_families.py with larger shapes on a GPU.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from tasks.config import EMBEDDED_MODEL

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "olmo2", "gpt2", "gpt_neox"]
TUPLE_LAYER_FAMILIES = ["falcon"]  # decoder layers that return a tuple: the lever tests cover them too
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
SPECIAL = {"vocab_size": 1024, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def family_config(family: str, hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                  intermediate: int | None = None, vocab: int = 1024) -> Any:
    """A transformers config of `family` with these dimensions (intermediate None = 2 x hidden)."""
    import transformers as tf

    ffn = intermediate or 2 * hidden
    special = {**SPECIAL, "vocab_size": vocab}
    common = {"hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
              "intermediate_size": ffn, "max_position_embeddings": 512, **special}
    gqa = {**common, "num_key_value_heads": kv_heads}
    head_dim = hidden // heads
    if family == "gpt2":  # n_inner None = 4 x n_embd; set here to keep the MLP small
        return tf.GPT2Config(n_embd=hidden, n_layer=layers, n_head=heads, n_inner=ffn, n_positions=512, **special)
    if family == "falcon":  # the 7B layout: one layer norm, parallel attention and MLP, one key/value head; its
        # decoder layer returns a tuple (hidden states, attention weights), not a tensor
        return tf.FalconConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                               new_decoder_architecture=False, multi_query=True, parallel_attn=True, bias=False,
                               max_position_embeddings=512, **special)
    if family == "gpt_neox":
        return tf.GPTNeoXConfig(**common, rotary_pct=0.25, tie_word_embeddings=False)
    if family == "gemma2":
        return tf.Gemma2Config(**gqa, head_dim=head_dim, query_pre_attn_scalar=head_dim, sliding_window=64)
    if family == "gemma3":
        return tf.Gemma3TextConfig(**gqa, head_dim=head_dim, query_pre_attn_scalar=head_dim, sliding_window=64)
    if family == "qwen3":
        return tf.Qwen3Config(**gqa, head_dim=head_dim, tie_word_embeddings=False)
    classes = {"llama": tf.LlamaConfig, "mistral": tf.MistralConfig, "qwen2": tf.Qwen2Config,
               "phi3": tf.Phi3Config, "olmo2": tf.Olmo2Config}
    return classes[family](**gqa, tie_word_embeddings=False)


def build_family_model(family: str, folder: Path, seed: int = 0, device: str = "cpu", dtype: Any = None,
                       **dims: Any) -> Path:
    """Save a random-weight `family` model with the project's tokenizer into folder; returns folder."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = family_config(family, **dims)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype or torch.float32)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copy2(EMBEDDED_MODEL / name, folder / name)
    return folder
