"""prepare_model: base model -> 4-bit checkpoint + tokenizer + module report.

Reads a local model folder or a hub model (at its resolved commit), quantizes it with bitsandbytes
(NF4 and double quantization by default, compute dtype chosen for the device) and writes into
runs_dir/prepare_model/<key>/ the 4-bit checkpoint (config.json, model*.safetensors), the tokenizer,
modules.json (the names of the Linear layers LoRA can target, with counts) and manifest.json
(memory footprint, compute dtype). Later stages load this folder directly.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from prefect import task

from tasks.config import ModelArgs
from tasks.hashing.files import prefetch_sha256
from tasks.log import logger
from tasks.models.loading import LOAD_KWARGS, compute_dtype, device, load_tokenizer
from tasks.models.quirks import plain_linear_layers
from tasks.models.sources import TOKENIZER_FILES, is_local, model_fingerprint, model_path
from tasks.on_disk import disk
from tasks.on_disk.caching import stage_task_options
from tasks.on_disk.folders import StageSpec, open_stage

VERSION = "3"  # 3: Falcon's FalconLinear layers quantized (they stayed bf16); 2: the attention implementation recorded
# safetensors gathers a whole shard in host memory before writing it, and transformers' default shard is 50 GB:
# a 70B model's 4-bit checkpoint (39.5 GB) would need ~37 GiB of host memory in one piece. 2 GB shards bound it,
# and let the manifest's sha256 run one thread per shard (one file's hash cannot be split; docs/performance.md,
# "Large models")
SHARD_SIZE = "2GB"


def spec(args: ModelArgs, runs_dir: Path) -> StageSpec:
    """Cache-key inputs: model settings and the base model's file bytes or hub commit."""
    return StageSpec(stage="prepare_model", version=VERSION, runs_dir=runs_dir,
                     params={"model": args.model_dump()}, located=("model.base_model",),  # the fingerprint has it
                     fingerprint=model_fingerprint(args.base_model, args.revision, runs_dir=runs_dir))


def prefetch_fingerprint(args: ModelArgs, runs_dir: Path) -> threading.Thread | None:
    """Start hashing a local base model's files for this stage's key while the stages before it run (the flows
    call it first; tasks/hashing/files.py prefetch_sha256 says why). A hub model's key is its commit: nothing to
    hash. The tokenizer's files are left out: prepare_data's key reads them at once, and on a host with few cores
    they would queue behind the weights."""
    folder = Path(args.base_model).expanduser()
    if not (is_local(args.base_model) and folder.is_dir()):
        return None  # a folder that is not there: the stage's own key says so
    return prefetch_sha256([p for p in folder.iterdir() if p.is_file() and p.name not in TOKENIZER_FILES], runs_dir)


@task(name="prepare_model", **stage_task_options(spec, retries=2))
def prepare_model(args: ModelArgs, runs_dir: Path) -> str:
    """Quantize the base model to 4 bits and save it with its tokenizer."""
    with open_stage(spec(args, runs_dir)) as stage:
        if stage.done:
            return str(stage.dir)
        source = model_path(args.base_model, args.revision)
        dtype = compute_dtype(args.bnb_4bit_compute_dtype)
        start = time.perf_counter()
        model = _load_4bit(source, args, dtype)
        tokenizer = load_tokenizer(source)
        loaded = time.perf_counter()
        # the checkpoint holds what the 4-bit model holds in memory; the tokenizer files are the source's own
        disk.require("prepare_model", runs_dir, stage.dir, model.get_memory_footprint() + _tokenizer_bytes(source),
                     "the 4-bit checkpoint and its tokenizer")
        model.save_pretrained(stage.dir, max_shard_size=SHARD_SIZE)
        tokenizer.save_pretrained(stage.dir)
        logger().info("prepare_model: loaded and quantized in %.1fs, saved in %.1fs", loaded - start,
                      time.perf_counter() - loaded)
        finish(stage, model, dtype, model.get_memory_footprint())
        return str(stage.dir)


def finish(stage: Any, model: Any, dtype: Any, footprint: int) -> dict[str, Any]:
    """After the checkpoint and tokenizer are written: modules.json, the metrics, the manifest. Also used by
    bench/build_4bit.py, which writes the same folder without the bf16 model. Returns the metrics."""
    modules = _module_report(model)
    (stage.dir / "modules.json").write_text(json.dumps(modules, indent=2))
    metrics = {"memory_footprint_bytes": footprint, "compute_dtype": str(dtype).removeprefix("torch."),
               "device": device(), "linear_4bit_layers": sum(modules["linear_4bit"].values()),
               "attn_implementation": model.config._attn_implementation}
    logger().info("prepare_model: %s; LoRA can target %s", metrics, ", ".join(modules["targetable"]))
    outputs = [p.name for p in stage.dir.iterdir() if p.is_file() and not p.name.startswith(".")]
    stage.finish(outputs, metrics)
    return metrics


def _tokenizer_bytes(source: Path) -> int:
    return sum(p.stat().st_size for p in Path(source).glob("*token*") if p.is_file())


def quantization_config(args: ModelArgs, dtype: Any) -> Any:
    """The BitsAndBytesConfig of these model settings."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=args.bnb_4bit_quant_type,
                              bnb_4bit_use_double_quant=args.bnb_4bit_use_double_quant,
                              bnb_4bit_compute_dtype=dtype, bnb_4bit_quant_storage=args.bnb_4bit_quant_storage)


def _load_4bit(source: Path, args: ModelArgs, dtype: Any) -> Any:
    from transformers import AutoModelForCausalLM

    with plain_linear_layers(source):  # Falcon's layers too (quirks.SAME_AS_LINEAR)
        return AutoModelForCausalLM.from_pretrained(
            source, quantization_config=quantization_config(args, dtype), dtype=dtype,
            attn_implementation=attention(source, args.attn_implementation),
            device_map={"": 0} if device() == "cuda" else "cpu", **LOAD_KWARGS,
        )


def attention(source: Path, requested: str) -> str | None:
    """The attention implementation to load with: None (transformers picks for the model) for 'auto', and for
    one the model's class does not support, which is logged with the ones it does."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if requested == "auto":
        return None
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(AutoConfig.from_pretrained(source)), None)
    if model_class is None:
        return requested  # an architecture transformers does not map: it checks the request at load
    flags = (("sdpa", "_supports_sdpa"), ("flex_attention", "_supports_flex_attn"),
             ("flash_attention_2", "_supports_flash_attn"))
    supported = ["eager"] + [name for name, flag in flags if getattr(model_class, flag, False)]
    if requested in supported:
        return requested
    logger().warning("prepare_model: model.attn_implementation=%s is not supported by %s (it supports %s); "
                     "loading with transformers' own choice for it", requested, model_class.__name__,
                     ", ".join(supported))
    return None


def _module_report(model: Any) -> dict[str, Any]:
    """Short names of the layers LoRA can wrap (Linear, 4-bit or not, and GPT-2's Conv1D)."""
    import bitsandbytes as bnb
    import torch

    linear4, other = Counter(), Counter()
    output_layer = model.get_output_embeddings()
    for name, module in model.named_modules():
        short = name.rsplit(".", 1)[-1]
        if isinstance(module, bnb.nn.Linear4bit):
            linear4[short] += 1
        elif module is not output_layer and (isinstance(module, torch.nn.Linear)
                                             or type(module).__name__ == "Conv1D"):
            other[short] += 1
    return {"targetable": sorted(set(linear4) | set(other)), "linear_4bit": dict(linear4),
            "linear_other": dict(other)}
