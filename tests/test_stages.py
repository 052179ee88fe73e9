"""Each stage alone, through .fn(), on the real tiny models: outputs, module report, errors, hub code path."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tasks.config import EMBEDDED_MODEL, LoraArgs, ModelArgs, SpeedArgs, TrainArgs
from tasks.errors import UserError
from tasks.on_disk.manifest import read_manifest
from tasks.prepare_model.stage import prepare_model
from tasks.train_adapter.stage import train_adapter

PROJECTIONS = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


def test_prepare_model_writes_a_4bit_checkpoint_and_module_report(stages: dict[str, str]) -> None:
    folder = Path(stages["model"])
    manifest = read_manifest(folder)
    assert manifest.stage == "prepare_model" and manifest.key == folder.name
    modules = json.loads((folder / "modules.json").read_text())
    assert modules["targetable"] == PROJECTIONS
    assert modules["linear_4bit"] == dict.fromkeys(PROJECTIONS, 4)  # 4 layers, lm_head stays unquantized
    config = json.loads((folder / "config.json").read_text())
    assert config["quantization_config"]["bnb_4bit_quant_type"] == "nf4"
    assert config["quantization_config"]["bnb_4bit_use_double_quant"] is True
    assert manifest.metrics.compute_dtype == "float32"  # CPU
    assert manifest.metrics.attn_implementation == "sdpa"
    assert 0 < manifest.metrics.memory_footprint_bytes < (EMBEDDED_MODEL / "model.safetensors").stat().st_size


def test_prepare_data_masks_prompts_and_splits_by_content(stages: dict[str, str]) -> None:
    import pyarrow.parquet as pq

    folder = Path(stages["data"])
    train = pq.read_table(folder / "train.parquet").to_pylist()
    evals = pq.read_table(folder / "eval.parquet").to_pylist()
    metrics = read_manifest(folder).metrics.model_dump()
    assert len(train) + len(evals) == metrics["rows_in"] == 200
    assert metrics["format"] == "dolly" and metrics["completion_only_loss"] is True
    row = train[0]
    first_label = next(i for i, label in enumerate(row["labels"]) if label != -100)
    assert row["labels"][first_label:] == row["input_ids"][first_label:]
    assert first_label > 3  # the prompt is masked


def test_train_adapter_alone_writes_a_loadable_adapter(stages: dict[str, str]) -> None:
    from peft import PeftConfig

    train = TrainArgs(max_steps=3, save_steps=2, logging_steps=1)
    folder = Path(train_adapter.fn(LoraArgs(r=4, lora_alpha=8), train, SpeedArgs(), stages["runs"],
                                   stages["data"], stages["model"]))
    config = PeftConfig.from_pretrained(folder / "adapter")
    assert config.r == 4 and sorted(config.target_modules) == PROJECTIONS
    assert not (folder / "checkpoints").exists()  # removed once the adapter is saved
    losses = [json.loads(line) for line in (folder / "loss.jsonl").read_text().splitlines()]
    assert [entry["step"] for entry in losses] == [1, 2, 3]
    assert read_manifest(folder).metrics.model_dump()["optimizer_steps"] == 3


def test_unknown_target_modules_fail_before_training_and_list_the_real_ones(stages: dict[str, str],
                                                                             tmp_path: Path) -> None:
    with pytest.raises(UserError) as err:
        train_adapter.fn(LoraArgs(target_modules=["q_proj", "c_attn", "qkv"]), TrainArgs(max_steps=1), SpeedArgs(),
                         tmp_path, stages["data"], stages["model"])
    message = str(err.value)
    assert "lora.target_modules names c_attn, qkv, which" in message
    assert "Its layers LoRA can target are: " + ", ".join(PROJECTIONS) in message
    assert not list((tmp_path / "train_adapter").glob("*/manifest.json"))


def test_gpt2_tutorial_targets_are_refused_with_c_attn_listed(tmp_path: Path) -> None:
    """The well-known GPT-2 tutorial targets q_proj/v_proj; GPT-2's attention is c_attn."""
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = tmp_path / "tiny-gpt2"
    GPT2LMHeadModel(GPT2Config(vocab_size=1024, n_positions=128, n_embd=64, n_layer=2, n_head=2)).save_pretrained(gpt2)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(EMBEDDED_MODEL / name, gpt2 / name)
    model_dir = prepare_model.fn(ModelArgs(base_model=str(gpt2)), tmp_path / "runs")
    assert json.loads((Path(model_dir) / "modules.json").read_text())["targetable"] == [
        "c_attn", "c_fc", "c_proj"]
    with pytest.raises(UserError, match="names q_proj, v_proj, which .* does not have. Its layers LoRA can target "
                                        "are: c_attn, c_fc, c_proj"):
        train_adapter.fn(LoraArgs(target_modules=["q_proj", "v_proj"]), TrainArgs(max_steps=1), SpeedArgs(),
                         tmp_path / "runs", "unused", model_dir)


def test_missing_model_folder_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="is not a model folder \\(no config.json there\\)"):
        prepare_model.fn(ModelArgs(base_model=str(tmp_path / "nowhere")), tmp_path / "runs")


def test_hub_model_id_resolves_through_the_hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real hub code path (repo id -> resolved commit -> snapshot), offline, from a hub-layout cache."""
    import huggingface_hub

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--tiny-org--tiny-llama"
    shutil.copytree(EMBEDDED_MODEL, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    from tasks.prepare_model.stage import spec

    args = ModelArgs(base_model="tiny-org/tiny-llama")
    assert spec(args, tmp_path / "runs").fingerprint == {"hub_repo": "tiny-org/tiny-llama", "hub_commit": commit}
    folder = Path(prepare_model.fn(args, tmp_path / "runs"))
    assert json.loads((folder / "modules.json").read_text())["targetable"] == PROJECTIONS


def test_loaded_models_keep_their_own_layers_without_hub_kernels(stages: dict[str, str]) -> None:
    """transformers 5.25 kernelizes every from_pretrained by default, fetching kernels from the Hub (on a GPU: a
    network call, and offline a failed prepare_model); both loaders turn that off. On a CPU nothing is fetched, so
    the model's own flag is what shows it."""
    import torch

    from tasks.models.loading import load_quantized
    from tasks.prepare_model.stage import _load_4bit

    for model in (_load_4bit(EMBEDDED_MODEL, ModelArgs(), torch.float32), load_quantized(Path(stages["model"]))):
        assert model.use_kernels is False and getattr(model, "_kernels_mode", None) is None


def test_prepare_model_writes_shards_that_load_and_verify(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint larger than SHARD_SIZE is written in several shards (a 70B one would otherwise sit whole in
    host memory while saving); the manifest lists every shard, training loads them, a re-run reuses them."""
    import torch

    import tasks.prepare_model.stage as stage
    from tasks.models.loading import load_quantized

    monkeypatch.setattr(stage, "SHARD_SIZE", "200KB")
    folder = Path(prepare_model.fn(ModelArgs(), tmp_path / "runs"))
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    assert len(shards) > 1 and (folder / "model.safetensors.index.json").exists()
    assert set(shards) <= set(read_manifest(folder).outputs)
    model = load_quantized(folder)
    assert torch.isfinite(model(input_ids=torch.tensor([[1, 5, 9, 13]])).logits).all()
    mtime = (folder / shards[0]).stat().st_mtime_ns
    assert prepare_model.fn(ModelArgs(), tmp_path / "runs") == str(folder)
    assert (folder / shards[0]).stat().st_mtime_ns == mtime
