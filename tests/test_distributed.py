"""Data-parallel train_adapter on CPU: 2 gloo processes through torchrun against 1 process."""

from __future__ import annotations

import json
from pathlib import Path

from tasks.config import EMBEDDED_DATA, DataArgs, LoraArgs, ModelArgs, TrainArgs
from tasks.manifest import read_manifest
from tasks.prepare_data import prepare_data
from tasks.prepare_model import prepare_model
from tasks.train_adapter import train_adapter


def test_two_gloo_processes_match_one_process(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    data = tmp_path / "d.jsonl"
    data.write_text("".join(EMBEDDED_DATA.read_text().splitlines(keepends=True)[:400]))
    runs = tmp_path / "runs"
    data_dir = prepare_data.fn(DataArgs(source=str(data)), ModelArgs(), runs)
    model_dir = prepare_model.fn(ModelArgs(), runs)
    results = {}
    for processes in (1, 2):
        train = TrainArgs(num_gpus=processes, max_steps=12, save_steps=5, logging_steps=1, learning_rate=2e-3,
                          packing=False, per_device_train_batch_size=8 // processes)  # same global batch
        folder = Path(train_adapter.fn(LoraArgs(r=8, lora_alpha=16), train, runs, data_dir, model_dir))
        manifest = read_manifest(folder)
        log = (folder / "loss.jsonl").read_text().splitlines()
        results[processes] = {"metrics": manifest["metrics"], "losses": [json.loads(x)["loss"] for x in log],
                              "adapter": load_file(folder / "adapter" / "adapter_model.safetensors")}
    one, two = results[1], results[2]
    assert two["metrics"]["processes"] == 2 and one["metrics"]["processes"] == 1
    assert two["metrics"]["optimizer_steps"] == one["metrics"]["optimizer_steps"] == 12
    assert {k: v.shape for k, v in two["adapter"].items()} == {k: v.shape for k, v in one["adapter"].items()}
    assert len(two["losses"]) == 12  # rank 0 alone writes the loss log
    # same global batch of 8 (4 per rank), different example order: close, not identical
    assert abs(two["metrics"]["train_loss"] - one["metrics"]["train_loss"]) < 0.1 * one["metrics"]["train_loss"]
