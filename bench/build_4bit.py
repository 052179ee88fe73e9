"""A random-weight 4-bit checkpoint of any size, written layer by layer: never the bf16 model, in memory or on disk.

bench_train builds its 8B model in bf16 and runs prepare_model on it; a 70B model would need 141 GB of bf16
weights first. Here the model is a skeleton on the meta device, turned into 4-bit modules by transformers' own
bitsandbytes quantizer (the same preprocess_model from_pretrained calls), so every key and module is known without
any weights. Then each part (the embeddings, each decoder layer, the final norm, the output layer) is made on the
device in the compute dtype, initialised (normal(0, initializer_range), norms 1), its Linear weights quantized as
from_pretrained does on load (bnb Params4bit -> quantize_4bit), its state dict taken the way bnb's
Linear4bit._save_to_state_dict writes it, and saved as its own safetensors shard before the next part is made.

The folder is a finished prepare_model stage (runs_dir/prepare_model/<key>/, manifest.json, modules.json, metrics)
written through the stage's own helpers, so load_quantized, read_model_metrics and train_adapter take it as is.
The one difference from prepare_model's folder: one shard per part plus model.safetensors.index.json, where
prepare_model writes 2 GB shards (the keys, dtypes, shapes and bytes are the same).

usage: python bench/build_4bit.py --shape 70b --runs-dir /tmp/qlora-70b/runs --tokenizer FOLDER
(bench/bench_70b.py builds it this way, with a 128,256-id tokenizer.)
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

VERSION = "1"  # of this builder; part of the stage key, beside prepare_model's own version
GIB = 2**30

# Llama-3.1-70B's shape; "tiny" runs the whole bench on a CPU in minutes
SHAPES: dict[str, dict[str, Any]] = {
    "70b": {"hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
            "intermediate_size": 28672, "vocab_size": 128256, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
            "max_position_embeddings": 131072, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
            "pad_token_id": 0},
    "tiny": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "intermediate_size": 128, "vocab_size": 1024, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
             "max_position_embeddings": 8192, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
             "pad_token_id": 0},
}

Weights = Callable[[str, tuple[int, ...]], Any]  # key, shape -> the tensor (any dtype, any device)


def llama_config(shape: str) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**SHAPES[shape])


def build_4bit_checkpoint(config: Any, runs_dir: Path, tokenizer: Path, args: Any = None, *, device: str = "cuda",
                          seed: int = 0, weights: Weights | None = None) -> dict[str, Any]:
    """Write the 4-bit checkpoint prepare_model would write for a model of `config` into a prepare_model stage folder
    under runs_dir (reused when already there). `tokenizer`: a folder to take the tokenizer from. `weights`: the
    bf16 source tensors by key (tests); None = random, seeded by `seed`. Returns the folder and what it cost."""
    import torch

    import tasks.prepare_model.stage as pm
    from tasks.config import ModelArgs
    from tasks.hashing.keys import hash_json
    from tasks.models.loading import compute_dtype, load_tokenizer
    from tasks.on_disk.folders import StageSpec, open_stage

    args = args or ModelArgs()
    fingerprint = {"built": hash_json([VERSION, config.to_dict(), seed, weights is None])}
    spec = StageSpec(stage="prepare_model", version=pm.VERSION, runs_dir=runs_dir,
                     params={"model": args.model_dump()}, fingerprint=fingerprint)
    started = time.time()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    with open_stage(spec) as stage:
        if stage.done:
            return {"model_dir_4bit": str(stage.dir), "reused": True}
        dtype = compute_dtype(args.bnb_4bit_compute_dtype)
        config.save_pretrained(stage.dir)  # for pm.attention, which reads the architecture from a folder
        model = _skeleton(config, args, dtype, pm.attention(stage.dir, args.attn_implementation))
        footprint = _write_parts(model, stage.dir, device, seed, weights)
        model.config.save_pretrained(stage.dir)  # save_pretrained sets dtype and architectures first (_skeleton)
        if model.can_generate():
            model.generation_config.save_pretrained(stage.dir)
        load_tokenizer(tokenizer).save_pretrained(stage.dir)
        metrics = pm.finish(stage, model, dtype, footprint)
    return {"model_dir_4bit": str(stage.dir), "reused": False, "build_s": round(time.time() - started, 1),
            "bytes_on_disk": sum(p.stat().st_size for p in stage.dir.iterdir() if p.is_file()),
            "peak_gpu_allocated_gib": round(torch.cuda.max_memory_allocated() / GIB, 2) if device == "cuda" else None,
            "peak_host_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB, 2),
            "metrics": metrics}


def _skeleton(config: Any, args: Any, dtype: Any, attn: str | None) -> Any:
    """The model on the meta device with transformers' 4-bit modules in place, as from_pretrained makes it before
    it loads weights (get_hf_quantizer, then preprocess_model), with the config fields save_pretrained sets."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.quantizers import AutoHfQuantizer

    from tasks.prepare_model.stage import quantization_config

    quant = quantization_config(args, dtype)
    config = type(config).from_dict(config.to_dict())  # a copy: the caller's config stays unquantized
    config.quantization_config = quant
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
    quantizer = AutoHfQuantizer.from_config(quant, pre_quantized=False)
    quantizer.preprocess_model(model=model, dtype=dtype, device_map={"": "cpu"}, checkpoint_files=None,
                               use_kernels=False)
    model.hf_quantizer = quantizer
    model.config.dtype = str(dtype).split(".")[1]
    model.config.architectures = [type(model).__name__]
    return model


def part_of(key: str) -> str:
    """The shard a state-dict key goes to: its decoder layer, or the top module holding it."""
    layer = re.match(r"(.*\.layers\.\d+)\.", key)
    return layer.group(1) if layer else key.rsplit(".", 1)[0]


def _write_parts(model: Any, folder: Path, device: str, seed: int, weights: Weights | None) -> int:
    """Each part made, quantized and saved in turn; writes the index. Returns get_memory_footprint's figure for the
    loaded model (its parameters as loaded plus its buffers)."""
    import gc

    import torch
    from safetensors.torch import save_file

    params = dict(model.named_parameters())
    parts: dict[str, list[str]] = {}
    for key in params:
        parts.setdefault(part_of(key), []).append(key)
    footprint = sum(b.nelement() * b.element_size() for b in model.buffers())
    weight_map: dict[str, str] = {}
    total_size = 0
    for n, keys in enumerate(parts.values(), 1):
        shard = f"model-{n:05d}-of-{len(parts):05d}.safetensors"
        tensors: dict[str, Any] = {}
        for key in keys:
            value = _value(model, key, params[key], device, seed, weights)
            footprint += value.nelement() * value.element_size()
            tensors.update(_entries(model, key, value))
        tensors = {k: v.to("cpu").contiguous() for k, v in tensors.items()}
        save_file(tensors, folder / shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, shard))
        total_size += sum(v.nelement() * v.element_size() for v in tensors.values())
        del tensors
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    index = {"metadata": {"total_parameters": model.num_parameters(), "total_size": total_size},
             "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return footprint


def _value(model: Any, key: str, meta: Any, device: str, seed: int, weights: Weights | None) -> Any:
    """One parameter as from_pretrained leaves it: cast to the compute dtype on the device, and quantized there
    (Bnb4bitQuantize.convert: Params4bit with the module's settings, moved to the device) if its module is 4-bit."""
    import bitsandbytes as bnb

    module = model.get_submodule(key.rsplit(".", 1)[0])
    source = (weights(key, tuple(meta.shape)) if weights
              else _random(module, key, meta, model.config.initializer_range, device, seed))
    quantized = isinstance(module, bnb.nn.Linear4bit) and key.endswith(".weight")
    compute = model.config.quantization_config.bnb_4bit_compute_dtype  # the loader's dtype for what it quantizes
    value = source.to(device=device, dtype=compute if quantized else meta.dtype)
    if quantized:
        settings = {k: v for k, v in meta.__dict__.items() if k != "module"}  # module: would keep each quant state
        value = bnb.nn.Params4bit(value, requires_grad=False, **settings).to(device)
    return value


def _random(module: Any, key: str, meta: Any, std: float, device: str, seed: int) -> Any:
    """Llama's _init_weights: Linear and Embedding normal(0, initializer_range) (the padding row 0), biases 0,
    norms 1. Seeded by key, so a tensor does not depend on which were made before it."""
    import hashlib

    import torch

    out = torch.empty(meta.shape, dtype=torch.bfloat16, device=device)
    if key.endswith(".bias"):
        return out.zero_()
    if meta.dim() == 1:
        return out.fill_(1.0)
    salt = int(hashlib.sha256(key.encode()).hexdigest()[:8], 16)
    out.normal_(0.0, std, generator=torch.Generator(device).manual_seed(seed * 2**32 + salt))
    if isinstance(module, torch.nn.Embedding) and module.padding_idx is not None:
        out[module.padding_idx].zero_()
    return out


def _entries(model: Any, key: str, value: Any) -> dict[str, Any]:
    """The state-dict entries of one loaded parameter, as bnb's Linear4bit._save_to_state_dict writes them: the
    packed weight plus `weight.` + each item of its quant state, packed (absmax, quant_map, nested_*, the json)."""
    import bitsandbytes as bnb

    if not isinstance(value, bnb.nn.Params4bit):
        return {key: value.detach()}
    return {key: value.data, **{f"{key}.{k}": v.detach() for k, v in value.quant_state.as_dict(packed=True).items()}}


def main() -> None:
    from tasks.config import EMBEDDED_MODEL

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="70b", choices=sorted(SHAPES))
    ap.add_argument("--runs-dir", required=True, help="the stage folder goes to RUNS_DIR/prepare_model/<key>/")
    ap.add_argument("--tokenizer", default=str(EMBEDDED_MODEL), help="a folder holding the tokenizer to save")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    print(json.dumps(build_4bit_checkpoint(llama_config(a.shape), Path(a.runs_dir), Path(a.tokenizer),
                                           device=a.device, seed=a.seed), indent=1))


if __name__ == "__main__":
    main()
