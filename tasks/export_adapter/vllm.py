"""The exported adapter folder as vLLM's LoRA loader takes it (`vllm serve BASE --enable-lora --lora-modules ...`)."""

from __future__ import annotations

import json
from pathlib import Path


def point_at_base_model(adapter_config: Path, base_model: str) -> None:
    """Name the user's base model in adapter_config.json: training recorded the run's 4-bit checkpoint folder,
    which is neither what vLLM should serve nor a path that exists on the serving machine."""
    config = json.loads(adapter_config.read_text())
    config["base_model_name_or_path"] = base_model
    adapter_config.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
