"""bench/build_4bit.py writes what prepare_model writes, without ever holding the bf16 model (issue 15, part B).

A tiny Llama in bf16 goes through the real prepare_model; build_4bit gets the same bf16 tensors one at a time.
The two folders must hold the same tensors bit for bit (quantization is deterministic), under the same keys,
dtypes and shapes, with the same config.json, modules.json and metrics; and the built folder must load through
load_quantized and train_adapter's model. Random weights (the 70B bench's case) must give the same layout.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.build_4bit import build_4bit_checkpoint
from tests.families import build_family_model, family_config

DIMS = {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 128, "vocab": 1024}


def _tensors(folder: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    out: dict[str, Any] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        out.update(load_file(shard))
    return out


def _json(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text())
    data.pop("transformers_version", None)
    return data


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """prepare_model's folder for a bf16 tiny Llama, build_4bit's from the same tensors, and a random-weight one."""
    import torch
    from safetensors import safe_open

    from tasks.config import ModelArgs
    from tasks.prepare_model.stage import prepare_model

    root = tmp_path_factory.mktemp("build4bit")
    source = build_family_model("llama", root / "bf16", dtype=torch.bfloat16, **DIMS)
    config = family_config("llama", **DIMS)
    with safe_open(str(source / "model.safetensors"), framework="pt") as f:
        def weights(key: str, shape: tuple[int, ...]) -> Any:  # one bf16 tensor at a time, as the loader reads
            tensor = f.get_tensor(key)
            assert tuple(tensor.shape) == shape, key
            return tensor

        built = build_4bit_checkpoint(config, root / "built", source, device="cpu", weights=weights)
    rand = build_4bit_checkpoint(config, root / "random", source, device="cpu", seed=1)
    return {"prepared": Path(prepare_model.fn(ModelArgs(base_model=str(source)), root / "prepared")),
            "built": Path(built["model_dir_4bit"]), "random": Path(rand["model_dir_4bit"]), "figures": built}


def test_built_tensors_equal_prepare_models_bit_for_bit(folders: dict[str, Any]) -> None:
    import torch

    want, got = _tensors(folders["prepared"]), _tensors(folders["built"])
    assert sorted(got) == sorted(want)
    assert any(k.endswith(".weight.quant_state.bitsandbytes__nf4") for k in want)  # double quant's packed state
    for key, tensor in want.items():
        assert (got[key].dtype, got[key].shape) == (tensor.dtype, tensor.shape), key
        assert torch.equal(got[key], tensor), key


def test_built_folder_has_prepare_models_config_modules_and_metrics(folders: dict[str, Any]) -> None:
    from tasks.models.loading import read_model_metrics

    prepared, built = folders["prepared"], folders["built"]
    assert _json(built / "config.json") == _json(prepared / "config.json")
    assert _json(built / "generation_config.json") == _json(prepared / "generation_config.json")
    assert _json(built / "modules.json") == _json(prepared / "modules.json")
    assert read_model_metrics(built) == read_model_metrics(prepared)
    assert (built / "tokenizer.json").read_bytes() == (prepared / "tokenizer.json").read_bytes()
    index = json.loads((built / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(_tensors(built))
    assert folders["figures"]["bytes_on_disk"] > 0 and folders["figures"]["peak_host_rss_gib"] > 0


def test_random_weights_have_the_same_layout_and_load_for_training(folders: dict[str, Any]) -> None:
    import torch

    from tasks.config import LoraArgs, SpeedArgs, TrainArgs
    from tasks.models.loading import load_quantized
    from tasks.train_adapter import builder
    from tasks.train_adapter.methods import sft

    want, got = _tensors(folders["prepared"]), _tensors(folders["random"])
    assert {k: (v.dtype, v.shape) for k, v in got.items() if "quant_state" not in k} == \
        {k: (v.dtype, v.shape) for k, v in want.items() if "quant_state" not in k}
    assert sorted(got) == sorted(want)
    model = load_quantized(folders["random"])
    logits = model(input_ids=torch.tensor([[1, 5, 9, 200]])).logits
    assert logits.shape == (1, 4, DIMS["vocab"]) and torch.isfinite(logits).all()
    peft = builder.adapted(sft.UNIT, folders["random"], LoraArgs(), TrainArgs(), SpeedArgs())[0]
    assert sum(p.numel() for p in peft.parameters() if p.requires_grad) > 0


def test_a_second_build_reuses_the_stage_folder(folders: dict[str, Any], tmp_path: Path) -> None:
    from bench.build_4bit import llama_config
    from tasks.config import EMBEDDED_MODEL

    first = build_4bit_checkpoint(llama_config("tiny"), tmp_path, EMBEDDED_MODEL, device="cpu")
    again = build_4bit_checkpoint(llama_config("tiny"), tmp_path, EMBEDDED_MODEL, device="cpu")
    assert again == {"model_dir_4bit": first["model_dir_4bit"], "reused": True}
