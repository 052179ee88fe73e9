"""Loading models on this machine: the device and compute dtype, the tokenizer, and prepare_model's 4-bit checkpoint
for training or for evaluation (dequantized where eval.dequantize says so).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from tasks.log import logger
from tasks.models.dequantize import dequantize_decision, dequantize_in_place
from tasks.models.memory import release_device_memory
from tasks.models.quirks import keep_cpu_repacking_to_fitting_shapes, plain_linear_layers
from tasks.on_disk.manifest import ModelMetrics, read_manifest

if TYPE_CHECKING:
    import torch


def load_tokenizer(path: Path) -> Any:
    """The model's tokenizer with a pad token (the eos token when it has none: pads are never labels)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    return tokenizer


def device() -> str:
    """'cuda' when a GPU is visible, else 'cpu'."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def compute_dtype(choice: str) -> torch.dtype:
    """The matmul dtype: the user's choice, or bf16 on GPUs that support it, fp16 on older GPUs, fp32 on CPU."""
    import torch

    if choice != "auto":
        return getattr(torch, choice)
    if not torch.cuda.is_available():
        reason, dtype = "no GPU: float32 on CPU (bf16 autocast is slower than fp32 on most CPUs)", torch.float32
    elif torch.cuda.is_bf16_supported():
        reason, dtype = "GPU supports bf16", torch.bfloat16
    else:
        reason, dtype = "GPU lacks bf16: float16", torch.float16
    logger().info("compute dtype %s (%s)", str(dtype).removeprefix("torch."), reason)
    return dtype


# Keyword arguments of every from_pretrained that builds the model to train or evaluate. transformers 5.25 turned
# `use_kernels` on by default: after loading, the model's layers are swapped for kernels downloaded from the Hub
# (kernels-community/rotary for Llama, so a machine without network fails to load). That is a network fetch at run
# time, and layers train_adapter did not choose beside the ones it does (the fused LoRA layers, Liger's kernels, the
# memory plan's recomputation); so they stay off.
LOAD_KWARGS = {"use_kernels": False}


def load_quantized(model_dir: Path, head: Literal["causal_lm", "score"] = "causal_lm") -> Any:
    """The 4-bit checkpoint written by prepare_model, on this machine's device, ready for training; with head "score"
    as a sequence scorer (a reward model): its language-model head left out, a new one-output score head in its
    place (drawn from torch's generator: seed it first), which reads the last token that is not padding."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    made = read_model_metrics(model_dir)
    kind, extra = ((AutoModelForCausalLM, {}) if head == "causal_lm" else
                   (AutoModelForSequenceClassification, {"num_labels": 1}))
    # bnb needs the non-quantized weights' dtype == the 4-bit layers' compute dtype
    with plain_linear_layers(model_dir), _quiet_new_head(head):
        model = kind.from_pretrained(
            model_dir, dtype=getattr(torch, made.compute_dtype),  # one GPU per data-parallel rank (LOCAL_RANK)
            device_map={"": int(os.environ.get("LOCAL_RANK", 0))} if device() == "cuda" else "cpu",
            attn_implementation=made.attn_implementation, **LOAD_KWARGS, **extra,
        )
    if head == "score":  # the scorer finds each row's last token by the pad id: the tokenizer's
        model.config.pad_token_id = load_tokenizer(model_dir).pad_token_id
    keep_cpu_repacking_to_fitting_shapes(model)
    return model


def _quiet_new_head(head: str) -> Any:
    """Loading a causal checkpoint as a scorer prints a report of the head it leaves out and the one it adds: that
    is the point, not a problem (TRL's own context for it)."""
    import contextlib

    if head == "causal_lm":
        return contextlib.nullcontext()
    from trl.trainer.reward_trainer import suppress_seqcls_warning

    return suppress_seqcls_warning()


def read_model_metrics(model_dir: Path) -> ModelMetrics:
    """How prepare_model made the 4-bit checkpoint in model_dir (compute dtype, attention implementation)."""
    manifest = read_manifest(model_dir)
    if manifest is None or not isinstance(manifest.metrics, ModelMetrics):
        raise RuntimeError(f"{model_dir} is not a finished prepare_model folder")
    return manifest.metrics


def load_for_evaluation(model_dir: Path, choice: bool | str) -> Any:
    """The prepare_model checkpoint for inference: dequantized once when eval.dequantize says so (true, or auto
    and it fits), else the 4-bit model; one log line says which, why, and the load's seconds."""
    import time

    start = time.perf_counter()
    # a stage that ran before in this process (train_adapter without the GPU pool's child process) leaves its
    # memory in torch's cache, which would make the dequantized copy look as if it did not fit
    release_device_memory()
    model = load_quantized(model_dir)
    dequantized, why = dequantize_decision(model, choice)
    if dequantized:
        dequantize_in_place(model)
    logger().info("evaluate_adapter: model loaded (%.1fs), evaluated %s (%s)", time.perf_counter() - start,
                  "dequantized to its compute dtype" if dequantized else "in 4 bits", why)
    return model
