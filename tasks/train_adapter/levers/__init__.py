"""train_adapter's speed and memory levers: one module each in this package, one entry each in LEVERS.

A lever changes how training runs, never what it computes. Its entry says which SpeedArgs fields steer it, when
it applies (PHASES), why a model cannot take it (it then steps aside with one log line naming that reason and
leaves the model as it was; it never fails a run) and which of the memory plan's choices price it
(memory_plan.Choices: its bytes in predicted_peak, its time in relative_time). plan.prepare_base and
plan.prepare_peft apply the levers of their phase in this list's order; the others are applied where their phase
says. A new lever is one module here, one entry below and its test (docs/contributing.md walks one through).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from tasks.config import SpeedArgs
from tasks.train_adapter.levers import attention, fused_lora, liger, loss, mlp, recompute

Phase = Literal["load", "base", "peft", "batches", "trl", "processes"]
PHASES: dict[str, str] = {
    "load": "as prepare_model's checkpoint is loaded, before the others (builder.adapted)",
    "base": "before LoRA wraps the model: plan.prepare_base calls `apply`, in LEVERS' order",
    "peft": "after LoRA wraps the model: plan.prepare_peft calls `apply`, in LEVERS' order",
    "batches": "with the micro-batches, which on a GPU with packing the memory plan chooses (plan.training_batches, "
               "methods/preference.py _micro_batches)",
    "trl": "around TRL's trainer, for the methods on pairs and rated answers (methods/preference.py)",
    "processes": "how many training processes there are, on how many hosts, and how they share the model (launch.py, "
                 "nodes.py, builder.trainer_for)",
    "generation": "around GRPOTrainer's sampling of each step's answers, for the methods that learn from rewards "
                  "(generation.install, from the GRPO unit)",
}


@dataclass(frozen=True)
class Lever:
    """One lever as train_adapter takes it."""

    name: str  # as the log lines call it
    speed: tuple[str, ...]  # the SpeedArgs fields that turn it on or off, or size it
    phase: Phase
    # base and peft levers: applies it to the model; what it applied, in words for the log line, or None where it is
    # off or stepped aside (having logged why)
    apply: Callable[[Any, SpeedArgs], str | None] | None = None
    # why a model cannot take it (None: it can); where it steps aside, its log line gives this reason
    steps_aside: tuple[Callable[[Any], str | None], ...] = ()
    plan: tuple[str, ...] = ()  # the memory_plan.Choices fields that price it


LEVERS: tuple[Lever, ...] = (
    Lever("float32 frozen weights", ("upcast_frozen_to_fp32",), "load"),
    Lever("Liger kernels", ("use_liger_kernel",), "base", apply=liger.apply),
    Lever("MLP in chunks", ("mlp_chunk_tokens",), "base", apply=mlp.apply_chunks, plan=("mlp_chunk",)),
    Lever("packed attention", ("packing",), "base", apply=attention.apply, steps_aside=(attention.unsupported,),
          plan=("dense_attention",)),
    Lever("fused cross-entropy", ("fused_cross_entropy",), "base", apply=loss.apply,
          steps_aside=(loss.fused_loss_unsupported,)),
    Lever("fused LoRA layers", ("fused_lora", "recompute_skip"), "peft", apply=fused_lora.apply,
          plan=("recompute_skip",)),
    Lever("packed micro-batches", ("packing", "max_tokens_per_batch"), "batches", plan=("tokens",)),
    Lever("recomputed layers", ("recompute_layers",), "batches", plan=("recompute_layers",)),
    Lever("MLP-only recomputation", ("recompute_mlp_layers",), "batches", plan=("recompute_mlp_layers",)),
    Lever("activation offload", ("offload_activations",), "batches", plan=("offload_activations",)),
    Lever("embedding and output layer offload", ("offload_embeddings",), "batches",
          steps_aside=(recompute.embedding_offload_unsupported, loss.output_layer_offload_unsupported),
          plan=("offload_embeddings",)),
    Lever("padding-free preference batches", ("packing",), "trl"),
    Lever("data parallelism", ("num_gpus", "num_nodes", "node_join_timeout_s", "fsdp"), "processes"),
    # no setting of their own: they change only how the same answers are computed, and step aside by themselves
    # where the copy does not fit speed.gpu_memory_budget_gb or the model or device cannot take them
    Lever("answers sampled on the dequantized base", (), "generation"),
    Lever("decoding steps replayed as CUDA graphs", (), "generation"),
)
# SpeedArgs fields that steer no lever of their own
NOT_LEVERS = {"gpu_memory_budget_gb": "the GPU memory the memory plan spends on the levers"}


def apply_phase(phase: Literal["base", "peft"], model: Any, speed: SpeedArgs) -> list[str]:
    """Apply the levers of `phase` to the model, in LEVERS' order; what each applied, for the log line."""
    return [done for lever in LEVERS if lever.phase == phase and lever.apply and (done := lever.apply(model, speed))]
