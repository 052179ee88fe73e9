"""GRPO's answers sampled on the dequantized base (tasks/train_adapter/levers/generation.py, decode_graphs.py): the
same tokens as TRL's own path from the same seed, the adapter as it is at the step, the layers as they were after
each generation, the memory it needs, where it steps aside, and which forward calls a CUDA graph would replay."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from tasks.config import PROJECT_ROOT, DataArgs, ModelArgs, load_config

PROMPTS = PROJECT_ROOT / "data" / "sample" / "prompts.jsonl"


@pytest.fixture(scope="module")
def stages(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from tasks.prepare_data.stage import prepare_data
    from tasks.prepare_model.stage import prepare_model

    runs = tmp_path_factory.mktemp("generation-runs")
    return {"data": prepare_data.fn(DataArgs(source=str(PROMPTS)), ModelArgs(), runs),
            "model": prepare_model.fn(ModelArgs(), runs)}


def _trainer(stages: dict[str, str], tmp_path: Path, *sets: str) -> Any:
    """The pipeline's GRPO trainer on the tiny 4-bit Llama, its adapter moved off zero (an adapter mid-training)."""
    import torch

    from tasks.train_adapter import builder
    from tasks.train_adapter.methods import grpo

    config = load_config(None, ["train.method=grpo", "train.rewards=[format]", "train.max_steps=1", *sets])
    dataset = grpo.UNIT.dataset(Path(stages["data"]), config.train)
    trainer = builder.build(grpo.UNIT, config.lora, config.train, config.speed, dataset, tmp_path,
                            Path(stages["model"]))[0]
    torch.manual_seed(1)
    for name, param in trainer.model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.5)
    return trainer


def _prompt_ids(trainer: Any, prompts: int = 2, answers: int = 4) -> list[list[int]]:
    texts = [trainer.train_dataset[i]["prompt"] for i in range(prompts) for _ in range(answers)]
    return trainer.processing_class(text=texts)["input_ids"]


def _sample(generate: Any, ids: list[list[int]], seed: int = 0) -> list[list[int]]:
    import torch

    torch.manual_seed(seed)
    return generate(ids, None, {}, 4)[0]


@pytest.mark.parametrize("sets", [("train.max_completion_length=12",),
                                  ("train.max_completion_length=6", "train.temperature=0.7")])
def test_the_dense_path_samples_trls_own_tokens_from_the_same_seed(stages: dict[str, str], tmp_path: Path,
                                                                    sets: tuple[str, ...]) -> None:
    from trl import GRPOTrainer

    trainer = _trainer(stages, tmp_path, *sets)
    ids = _prompt_ids(trainer)
    trls = lambda *a: GRPOTrainer._generate_single_turn(trainer, *a)  # noqa: E731 - TRL's own path
    assert trainer._generate_single_turn.__name__ == "generate_single_turn"  # the GRPO unit installed the lever
    for seed in (0, 1):
        assert _sample(trainer._generate_single_turn, ids, seed) == _sample(trls, ids, seed)
    # the policy is base + the adapter as it is: without the adapter (the reference) other tokens come
    with_adapter = _sample(trls, ids)
    with trainer.model.disable_adapter():
        without = _sample(trainer._generate_single_turn, ids)
        assert without == _sample(trls, ids)
    assert without != with_adapter
    moved = _sample(trainer._generate_single_turn, ids)
    for name, param in trainer.model.named_parameters():
        if "lora_B" in name:
            param.data.mul_(-1)  # an optimizer step, in place
    assert _sample(trainer._generate_single_turn, ids) == _sample(trls, ids) != moved


def test_dense_layers_compute_the_4bit_products_and_leave_the_layers_as_they_were(stages: dict[str, str],
                                                                                  tmp_path: Path) -> None:
    import torch

    from tasks.train_adapter.levers import generation

    trainer = _trainer(stages, tmp_path)
    model = trainer.model
    ids = torch.tensor(_prompt_ids(trainer, 2, 1)[0])[None]
    forwards = {name: m.__dict__.get("forward") for name, m in model.named_modules()}
    with torch.no_grad():
        policy, reference = model(input_ids=ids).logits, None
        with model.disable_adapter():
            reference = model(input_ids=ids).logits
        with generation.dense_layers(model):
            assert sum(hasattr(m, generation.DENSE) for m in model.modules()) == 4 * 7  # 4 layers x 7 projections
            dense_policy = model(input_ids=ids).logits
            with model.disable_adapter():
                dense_reference = model(input_ids=ids).logits
        after = model(input_ids=ids).logits
    assert not torch.equal(policy, reference)  # the adapter counts
    torch.testing.assert_close(dense_policy, policy, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dense_reference, reference, rtol=1e-5, atol=1e-5)
    assert torch.equal(after, policy)
    assert not any(hasattr(m, generation.DENSE) for m in model.modules())
    assert {name: m.__dict__.get("forward") for name, m in model.named_modules()} == forwards


def test_the_memory_a_generation_needs_and_the_verdict(stages: dict[str, str], tmp_path: Path) -> None:
    from tasks.models.dims import model_dims
    from tasks.train_adapter.levers import generation

    trainer = _trainer(stages, tmp_path)
    model = trainer.model
    dims = model_dims(model.config)
    copy, cache, logits = generation.generation_bytes(model, rows=8, tokens=100)
    layers = list(generation._four_bit_layers(model))
    assert len(layers) == 28 and copy == sum(m.in_features * m.out_features * 4 for m in layers)  # float32 on CPU
    assert cache == 2 * dims.layers * 8 * 100 * dims.kv * 4 and logits == 8 * dims.vocab * 8
    fits, why = generation.fits_budget(model, _speed(), 8, 100)
    assert fits and why.startswith("answers sampled on the dequantized base: the copy and KV cache of 8 answers x "
                                   "100 tokens need") and "host memory free" in why


def _speed() -> Any:
    from tasks.config import SpeedArgs

    return SpeedArgs()


def test_it_steps_aside_with_its_reason_where_trl_generates_otherwise(stages: dict[str, str], tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    from tasks.train_adapter.levers import generation

    trainer = _trainer(stages, tmp_path)
    del trainer._generate_single_turn  # TRL's own again
    trainer.use_vllm = True
    with caplog.at_level(logging.INFO, logger="qlora_pipeline"):
        assert generation.install(trainer, _speed()) is None
    assert "answers sampled by TRL's own path (vLLM or continuous batching generates)" in caplog.text
    assert "_generate_single_turn" not in trainer.__dict__
    trainer.use_vllm = False
    with caplog.at_level(logging.INFO, logger="qlora_pipeline"):
        done = generation.install(trainer, _speed())
    assert done is not None and "eager decoding steps (no GPU)" in done


def test_only_static_cache_decoding_steps_are_taken_for_a_graph(stages: dict[str, str]) -> None:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    from tasks.train_adapter.levers import decode_graphs

    model = AutoModelForCausalLM.from_pretrained(PROJECT_ROOT / "data" / "tiny-llama")
    seen: list[bool] = []
    forward = model.forward

    def recording(*args: Any, **kwargs: Any) -> Any:
        seen.append(not args and decode_graphs._decoding_step(kwargs))
        return forward(*args, **kwargs)

    model.forward = recording
    ids = torch.tensor([[0, 0, 5, 6, 7], [3, 4, 5, 6, 7]])
    for cache, expected in (("static", [False, True, True, True]), (None, [False] * 4)):
        seen.clear()
        model.generate(input_ids=ids, attention_mask=(ids != 0).long(), generation_config=GenerationConfig(
            max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=[2], cache_implementation=cache))
        assert seen[:4] == expected, cache
    assert decode_graphs.unsupported(model) == "no GPU"
