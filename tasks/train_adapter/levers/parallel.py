"""Data parallelism inside a rank: how many processes, DDP or FSDP2 settings, the sharded adapter's gathering."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tasks.config import SpeedArgs
from tasks.errors import UserError


def world_size(speed: SpeedArgs) -> int:
    """Processes to train with: speed.num_gpus, with 'auto' = every visible GPU (1 on a CPU machine)."""
    if speed.num_gpus != "auto":
        return int(speed.num_gpus)
    import torch

    return max(torch.cuda.device_count(), 1)


def several_processes() -> bool:
    """True in a rank of a group of more than one process (torchrun sets WORLD_SIZE)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def fsdp_settings(speed: SpeedArgs, model: Any) -> dict[str, Any]:
    """TrainingArguments keywords for speed.fsdp under torchrun: FSDP2 over the decoder layers (the model's
    _no_split_modules), sharded checkpoints of the trainable weights only. {} when not sharding."""
    if not speed.fsdp or not several_processes():
        return {}
    import torch

    if not torch.cuda.is_available():
        raise UserError("speed.fsdp needs GPUs (FSDP shards over NCCL); on CPU, leave it off: num_gpus > 1 then "
                        "trains data-parallel with gloo.")
    quant = getattr(model.config, "quantization_config", None)
    storage, compute = (_dtype_name(getattr(quant, f"bnb_4bit_{k}", None)) for k in ("quant_storage", "compute_dtype"))
    if quant is not None and storage != compute:
        raise UserError(f"speed.fsdp: the 4-bit checkpoint stores its weights as {storage}, but FSDP can only "
                        f"shard them with the rest of each layer when that is the compute dtype ({compute}). Set "
                        f"model.bnb_4bit_quant_storage={compute} (prepare_model then writes a new checkpoint).")
    # Sharded state dicts: each rank writes its shard of the LoRA weights and optimizer state into checkpoints
    # (accelerate's adapter_only path). A full state dict gathers the whole 4-bit base onto rank 0 at every
    # checkpoint, which stalled the first checkpoint for minutes (docs/multi-gpu.md). The adapter itself is gathered
    # alone, by save_sharded_adapter. Our own activation checkpointing stays (FSDP's would wrap the layers again).
    settings: dict[str, Any] = {"fsdp": True, "fsdp_config": {
        "version": 2, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "reshard_after_forward": True,
        "state_dict_type": "SHARDED_STATE_DICT"}}
    return settings  # the optimizer, adamw_torch under FSDP, is plan.optimizer's choice


def save_sharded_adapter(model: Any, folder: Path) -> None:
    """Under FSDP: gather the trainable (LoRA) weights alone onto rank 0, in CPU memory, and save them there in
    PEFT format; every rank must call this. The frozen base stays sharded."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    state = get_model_state_dict(model, options=options)
    if dist.get_rank() == 0:
        model.save_pretrained(folder, state_dict=state)


def _dtype_name(dtype: Any) -> str:
    """'bfloat16' for torch.bfloat16 or 'bfloat16' (quantization configs hold either)."""
    return str(dtype).removeprefix("torch.")
