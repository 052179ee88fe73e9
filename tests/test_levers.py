"""The levers' one list (tasks/train_adapter/levers/__init__.py LEVERS): every speed setting steers a listed lever,
every choice of the memory plan prices one, the base and peft levers apply in the list's order, and each reason to
step aside is asked of a real model. What each lever keeps of the maths: tests/test_speed.py, test_families.py."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from tasks.config import SpeedArgs
from tasks.train_adapter.levers import LEVERS, NOT_LEVERS, PHASES
from tasks.train_adapter.memory_plan import Choices
from tests.families import family_config


def test_every_speed_setting_steers_a_listed_lever_and_every_plan_choice_prices_one() -> None:
    steered = {field for lever in LEVERS for field in lever.speed}
    assert steered | set(NOT_LEVERS) == set(SpeedArgs.model_fields), "a SpeedArgs field without its lever entry"
    assert not steered & set(NOT_LEVERS)
    priced = [choice for lever in LEVERS for choice in lever.plan]
    assert len(priced) == len(set(priced)), "a memory plan choice priced by two levers"
    # longest_example is the data's, not a lever's
    assert set(priced) == {f.name for f in dataclasses.fields(Choices)} - {"longest_example"}
    for lever in LEVERS:
        assert lever.phase in PHASES, lever.name
        assert (lever.apply is not None) == (lever.phase in ("base", "peft")), lever.name


def test_base_levers_apply_in_the_lists_order_and_say_what_they_did(caplog: pytest.LogCaptureFixture) -> None:
    from transformers import AutoModelForCausalLM

    from tasks.train_adapter import plan

    model = AutoModelForCausalLM.from_config(family_config("llama"))
    with caplog.at_level(logging.INFO, logger="qlora_pipeline"):
        applied = plan.prepare_base(model, SpeedArgs(mlp_chunk_tokens=8))
    # on a CPU Liger steps aside without a word (no GPU); the others, in LEVERS' order
    assert applied == ["MLP in chunks of 8 tokens", "packed attention (sdpa)", "fused cross-entropy"]
    order = [lever.name for lever in LEVERS if lever.phase == "base"]
    assert order == ["Liger kernels", "MLP in chunks", "packed attention", "fused cross-entropy"]
    applied = plan.prepare_base(AutoModelForCausalLM.from_config(family_config("llama")),
                                SpeedArgs(mlp_chunk_tokens=0, packing=False, fused_cross_entropy=False))
    assert applied == []


def test_each_reason_to_step_aside_is_asked_of_a_real_model() -> None:
    """Llama takes every lever here; GPT-2 (attention dropout, a tied output layer) is refused two, with the reason
    its log line gives; the output layer moves only where the fused loss is in use."""
    from transformers import AutoModelForCausalLM

    asked = {}
    for family in ("llama", "gpt2"):
        model = AutoModelForCausalLM.from_config(family_config(family)).requires_grad_(False)  # frozen, as under LoRA
        asked[family] = {f.__name__: f(model) for lever in LEVERS for f in lever.steps_aside}
    assert asked["llama"] == {"unsupported": None, "fused_loss_unsupported": None,
                              "embedding_offload_unsupported": None,
                              "output_layer_offload_unsupported": "the fused loss is not in use (transformers "
                                                                  "computes the loss from the output layer module)"}
    assert asked["gpt2"]["unsupported"] == "attention dropout (the varlen kernel has none)"
    assert asked["gpt2"]["embedding_offload_unsupported"] == "the input embedding is tied to the output layer"
