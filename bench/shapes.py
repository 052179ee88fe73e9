"""Random-weight models of real shapes, for benchmarks: time and memory depend on a model's shape, not its values.

`make_model_dir(folder, shape)` writes a bf16 transformers folder of that shape (seed 0, initialised in float32 on
the GPU when there is one, then cast), skipped when the folder already holds a config.json. The 8B folder is what
every GPU benchmark trains; bench_train.py's build worker adds a 128,256-id tokenizer and quantizes it through
prepare_model.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
                     "max_position_embeddings": 8192, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
                     "tie_word_embeddings": False},
    "qwen2.5-7b": {"model_type": "qwen2", "hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28,
                   "num_key_value_heads": 4, "intermediate_size": 18944, "vocab_size": 152064,
                   "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                   "tie_word_embeddings": False},
    # CPU smoke tests of the scripts: the 8B shape's vocabulary (the bench tokenizer's ids), everything else tiny
    "tiny-llama": {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 128256,
                   "max_position_embeddings": 8192, "tie_word_embeddings": False},
    "tiny-qwen2": {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 1024},
}


def make_model_dir(folder: str | Path, shape: str = "llama-3.1-8b") -> dict[str, Any]:
    """Write a random-weight bf16 model of `shape` into folder (nothing when it is there); what was done."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(folder)
    if (folder / "config.json").exists():
        return {"model_dir": str(folder), "built": False}
    fields = dict(SHAPES[shape])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    start = time.time()
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(folder, max_shard_size="5GB")
    parameters = sum(p.numel() for p in model.parameters())
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"model_dir": str(folder), "built": True, "build_s": round(time.time() - start, 1),
            "parameters": parameters}
