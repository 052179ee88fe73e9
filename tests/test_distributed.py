"""Data-parallel train_adapter on CPU: 2 gloo processes through torchrun against 1 process; the FSDP option's
CPU-checkable parts (its configuration rules and the float storage of the 4-bit weights)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from tasks.config import EMBEDDED_DATA, DataArgs, LoraArgs, ModelArgs, SpeedArgs, TrainArgs, load_config
from tasks.errors import UserError
from tasks.on_disk.manifest import read_manifest
from tasks.prepare_data.stage import prepare_data
from tasks.prepare_model.stage import prepare_model
from tasks.train_adapter import launch
from tasks.train_adapter.levers import parallel
from tasks.train_adapter.stage import train_adapter


@pytest.mark.slow
def test_two_gloo_processes_match_one_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from safetensors.torch import load_file

    data = tmp_path / "d.jsonl"
    data.write_text("".join(EMBEDDED_DATA.read_text().splitlines(keepends=True)[:400]))
    runs = tmp_path / "runs"
    data_dir = prepare_data.fn(DataArgs(source=str(data)), ModelArgs(), runs)
    model_dir = prepare_model.fn(ModelArgs(), runs)
    monkeypatch.setenv(launch.DUMP_STACKS_EVERY, "3")  # the ranks' stacks, as for a stuck run
    results = {}
    for processes in (1, 2):
        train = TrainArgs(max_steps=12, save_steps=5, logging_steps=1, learning_rate=2e-3,
                          per_device_train_batch_size=8 // processes)  # same global batch
        speed = SpeedArgs(num_gpus=processes, packing=False)
        folder = Path(train_adapter.fn(LoraArgs(r=8, lora_alpha=16), train, speed, runs, data_dir, model_dir))
        manifest = read_manifest(folder)
        log = (folder / "loss.jsonl").read_text().splitlines()
        results[processes] = {"metrics": manifest.metrics.model_dump(), "losses": [json.loads(x)["loss"] for x in log],
                              "rank_log": (folder / launch.LOG).read_text() if processes > 1 else "",
                              "adapter": load_file(folder / "adapter" / "adapter_model.safetensors")}
    one, two = results[1], results[2]
    assert two["metrics"]["processes"] == 2 and one["metrics"]["processes"] == 1
    assert two["metrics"]["optimizer_steps"] == one["metrics"]["optimizer_steps"] == 12
    assert {k: v.shape for k, v in two["adapter"].items()} == {k: v.shape for k, v in one["adapter"].items()}
    assert len(two["losses"]) == 12  # rank 0 alone writes the loss log
    assert (one["metrics"]["sharding"], two["metrics"]["sharding"]) == ("none", "ddp")
    # periodic stack dumps
    assert "Thread 0x" in two["rank_log"] and "tasks/train_adapter/builder.py" in two["rank_log"]
    assert one["metrics"]["real_tokens_per_s"] > 0 and two["metrics"]["real_tokens_per_s"] > 0
    # same global batch of 8 (4 per rank), different example order: close, not identical
    assert abs(two["metrics"]["train_loss"] - one["metrics"]["train_loss"]) < 0.1 * one["metrics"]["train_loss"]


def test_fsdp_needs_the_4bit_weights_stored_in_the_compute_dtype() -> None:
    with pytest.raises(ValidationError, match="model.bnb_4bit_quant_storage=bfloat16"):
        load_config(None, ["speed.fsdp=true", "speed.num_gpus=2"])
    with pytest.raises(ValidationError, match="model.bnb_4bit_quant_storage=float16"):
        load_config(None, ["speed.fsdp=true", "model.bnb_4bit_compute_dtype=float16",
                           "model.bnb_4bit_quant_storage=bfloat16"])
    config = load_config(None, ["speed.fsdp=true", "model.bnb_4bit_quant_storage=bfloat16"])
    assert config.speed.fsdp and config.model.bnb_4bit_quant_storage == "bfloat16"


def test_float_storage_keeps_the_4bit_weights_and_fsdp_refuses_cpu(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Stored as float32 (the CPU compute dtype) the packed 4-bit weights are the same bits: same logits."""
    import torch

    from tasks.models.loading import load_quantized

    runs = tmp_path / "runs"
    packed = Path(prepare_model.fn(ModelArgs(), runs))
    as_float = Path(prepare_model.fn(ModelArgs(bnb_4bit_quant_storage="float32"), runs))
    assert packed != as_float  # a different checkpoint, under its own cache key
    ids = torch.tensor([[1, 5, 9, 200, 7, 42, 3]])
    logits = []
    for folder in (packed, as_float):
        model = load_quantized(folder)
        weight = model.model.layers[0].self_attn.q_proj.weight
        logits.append(model(input_ids=ids).logits)
    assert weight.dtype == torch.float32 and model.config.quantization_config.bnb_4bit_quant_storage == torch.float32
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=0)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UserError, match="needs GPUs"):
        parallel.fsdp_settings(SpeedArgs(fsdp=True, num_gpus=2), model)
    assert parallel.fsdp_settings(SpeedArgs(num_gpus=2), model) == {}


def _sharded_adapter_rank(rank: int, folder: str, port: int) -> None:
    """One of 2 gloo ranks: the tiny model with LoRA (seeded, so both ranks hold the same weights), FSDP2 over its
    decoder layers and the whole, then the adapter gathered and saved by rank 0."""
    import os

    import torch
    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(ModelArgs().base_model),
                           LoraConfig(r=4, target_modules=["q_proj", "down_proj"]))
    with torch.no_grad():  # LoRA's B starts at zero: give every adapter weight a distinct value
        for p in model.parameters():
            if p.requires_grad:
                p.normal_()
    if rank == 0:
        model.save_pretrained(Path(folder) / "unsharded")
    for layer in model.base_model.model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    parallel.save_sharded_adapter(model, Path(folder) / "sharded")
    dist.destroy_process_group()


@pytest.mark.slow  # two spawned training processes
def test_fsdp_adapter_is_gathered_whole_without_the_base(tmp_path: Path) -> None:
    """The adapter saved from FSDP2 shards equals the unsharded model's, key for key, and holds nothing else."""
    import socket

    import torch
    import torch.multiprocessing as mp
    from safetensors.torch import load_file
    from transformers import AutoConfig

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_sharded_adapter_rank, args=(str(tmp_path), port), nprocs=2, join=True)
    sharded = load_file(tmp_path / "sharded" / "adapter_model.safetensors")
    unsharded = load_file(tmp_path / "unsharded" / "adapter_model.safetensors")
    layers = AutoConfig.from_pretrained(ModelArgs().base_model).num_hidden_layers
    assert sorted(sharded) == sorted(unsharded) and len(sharded) == 2 * 2 * layers  # A and B of 2 targets
    for key, value in unsharded.items():
        assert torch.equal(sharded[key], value), key
