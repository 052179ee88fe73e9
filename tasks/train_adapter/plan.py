"""The training plan of train_adapter: which speed and memory levers apply on this device, and the micro-batches.

Each lever lives in its own module (attention, loss, checkpointing, mlp, liger, sizing, fused_lora) and is a
TrainArgs option (see its descriptions). Everything here also runs on CPU, where the GPU-only parts step aside,
so the CPU tests cover it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tasks.config import PIPELINE_TRAIN_FIELDS, PREFERENCE_TRAIN_FIELDS, SpeedArgs, TrainArgs
from tasks.errors import UserError
from tasks.examples import ParquetExamples, pad_collator
from tasks.log import logger
from tasks.train_adapter.attention import use_packed_attention
from tasks.train_adapter.checkpointing import enable_checkpointing, offload_embeddings
from tasks.train_adapter.liger import apply_liger
from tasks.train_adapter.loss import fused_loss_unsupported, offload_output_layer, use_fused_loss
from tasks.train_adapter.mlp import tile_mlp
from tasks.train_adapter.packs import PackedExamples, pack_collator
from tasks.train_adapter.parallel import several_processes
from tasks.train_adapter.sizing import micro_batch_tokens

# Tokens per packed micro-batch when none is set. Measured on an H200 with the 8B shape and the defaults (layer inputs,
# embeddings and output layer in host memory; bench/results/2026-12-01-h200-issue15-packs.json, one run): 6,144 tokens
# 9,144 tokens/s at 5.27 GiB peak, 8,192 9,394 at 5.57 GiB, 12,288 9,856 at 6.39 GiB. 8,192 keeps most of the gain
# with 0.8 GiB to spare under issue 15's 6.4 GiB cap (earlier, with the output layer on the GPU: 6,144
# tokens at 6.15 GiB, 8,192 at 6.55 GiB).
AUTO_MAX_TOKENS = 8192


@dataclass(frozen=True)
class MicroBatches:
    """What training_batches chose for this device: the out-of-memory back-off starts from it."""

    packing: bool
    offload_activations: bool
    offload_embeddings: bool
    max_tokens_per_batch: int | None  # tokens per packed micro-batch; None: packs of per_device_train_batch_size
    packs: int | None = None  # packed micro-batches per epoch
    offload_output_layer: bool = False  # the frozen output layer in host memory (with offload_embeddings)


def gpu_budget_gb(speed: SpeedArgs) -> float:
    """speed.gpu_memory_budget_gb, or the GPU's memory less 1 GiB. The budget only binds when the model itself
    is large: an 8B model's packs stop at AUTO_MAX_TOKENS long before a 16 GB card is full, while a 70B model
    (~37 GiB in 4 bits) needs to see the card it is on."""
    import torch

    if speed.gpu_memory_budget_gb is not None:
        return speed.gpu_memory_budget_gb
    return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 2**30 - 1.0


def trainer_settings(train: TrainArgs, speed: SpeedArgs) -> dict[str, Any]:
    """TrainArgs as TrainingArguments keywords, checkpointing left to enable_checkpointing."""
    settings = train.model_dump(exclude={*PIPELINE_TRAIN_FIELDS, *PREFERENCE_TRAIN_FIELDS})
    settings["optim"] = optimizer(train, speed)
    # the Trainer would replace our checkpoint function with its own; transformers 5 names it activation_checkpointing
    del settings["gradient_checkpointing"]
    settings["activation_checkpointing"] = False
    if speed.packing:
        settings["per_device_train_batch_size"] = 1  # one pack per micro-batch; its size is set in tokens
    return settings


def optimizer(train: TrainArgs, speed: SpeedArgs) -> str:
    """train.optim, or for None: torch's fused AdamW on a GPU, its plain AdamW under FSDP (which it shards),
    bitsandbytes' 8-bit AdamW elsewhere (what CPU runs always ran: the paged variant falls back to it on CPU).

    Why fused AdamW on a GPU: bitsandbytes' 8-bit optimizers call cuda.synchronize after every parameter (448
    LoRA tensors for an 8B model on all seven projections), so the host stops queueing work through the whole
    step; measured side by side on an H200 (bench/results/2026-12-01-h200-issue15-levers3.json, 8,192-token packs):
    paged_adamw_8bit 8,840 real tokens/s at 5.57 GiB peak, adamw_8bit 9,045 at 5.61, adamw_torch_fused 9,848 at
    5.85. Its fp32 moments of the LoRA weights (0.34 GB for 42M) are what the extra memory is."""
    import torch

    if speed.fsdp and several_processes():
        if train.optim not in (None, "adamw_torch"):
            # bitsandbytes' optimizers cannot update FSDP2's sharded (DTensor) parameters (measured: they fail at
            # the first step); torch's AdamW can, and its fp32 state is sharded over the GPUs like everything else
            logger().warning("train_adapter: speed.fsdp: optimizer adamw_torch instead of %s, which cannot update "
                             "sharded parameters", train.optim)
        return "adamw_torch"
    if train.optim is not None:
        logger().info("train_adapter: optimizer %s (train.optim)", train.optim)
        return train.optim
    if torch.cuda.is_available():
        logger().info("train_adapter: optimizer adamw_torch_fused (train.optim is None and a GPU is present: torch's "
                      "fused AdamW keeps the host queueing work, bitsandbytes' optimizers wait for the GPU)")
        return "adamw_torch_fused"
    # paged_adamw_8bit, the default here before, runs exactly this on CPU after warning "Paged optimizers are not
    # supported on CPU" on every run: the same maths, said without the warning
    logger().info("train_adapter: optimizer adamw_8bit (train.optim is None and no GPU: bitsandbytes' 8-bit AdamW, "
                  "what its paged variant falls back to on CPU)")
    return "adamw_8bit"


def prepare_base(model: Any, speed: SpeedArgs) -> list[str]:
    """Before LoRA wraps the model: Liger kernels, packed attention, fused loss. Returns what was applied; a lever
    that does not fit the model's family logs one line saying why and steps aside."""
    import torch

    applied = []
    model.config.use_cache = False  # with a cache, transformers ignores packed position ids when masking
    if torch.cuda.is_available():  # fewer half-empty segments: reserved memory stays near allocated
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    if apply_liger(model, speed.use_liger_kernel):
        applied.append("liger")
    if speed.mlp_chunk_tokens:
        if tile_mlp(model, speed.mlp_chunk_tokens):
            applied.append(f"MLP in chunks of {speed.mlp_chunk_tokens} tokens")
        else:
            logger().info("train_adapter: chunked MLP steps aside: %s has no decoder layers with an .mlp",
                          type(model).__name__)
    if speed.packing:
        applied.append(f"packed attention ({use_packed_attention(model)})")
    if speed.fused_cross_entropy:
        reason = fused_loss_unsupported(model)
        if reason is None and use_fused_loss(model):
            applied.append("fused cross-entropy")
        else:
            logger().info("train_adapter: fused cross-entropy steps aside: %s; transformers computes the loss",
                          reason)
    return applied


def prepare_peft(model: Any, speed: SpeedArgs) -> Any:
    """After get_peft_model: each LoRA layer as one autograd function (fused_lora.py). Returns the model."""
    import torch

    from tasks.train_adapter.fused_lora import fuse_lora_layers

    wanted = speed.fused_lora
    if wanted is None:  # FSDP shards the base weights that the fused backward reads back
        wanted = not speed.fsdp
    applied = [f"fused LoRA layers ({fuse_lora_layers(model)})"] if wanted else []
    dropout = [d.p for m in model.modules() for d in getattr(m, "lora_dropout", {}).values()
               if isinstance(d, torch.nn.Dropout) and d.p > 0]
    if applied and dropout:
        applied.append(f"except in training, where lora_dropout {max(dropout)} keeps peft's own path")
    logger().info("train_adapter: %s", ", ".join(applied) or "peft's own LoRA layers")
    return model


def smaller_packs(train: TrainArgs, speed: SpeedArgs, tokens: int, exc: BaseException
                  ) -> tuple[TrainArgs, SpeedArgs]:
    """After running out of memory with packs of `tokens`: half the tokens and twice the accumulation, about the
    same tokens per optimizer step."""
    if tokens <= 512:
        raise UserError(
            f"train_adapter ran out of GPU memory with packed micro-batches of {tokens} tokens. Lower "
            "data.max_seq_length, lora.r or the number of lora.target_modules, set speed.offload_activations, "
            f"or use a GPU with more memory. ({exc})"
        ) from exc
    smaller = max(512, tokens // 2 // 256 * 256)
    accumulation = train.gradient_accumulation_steps * 2
    logger().warning("train_adapter: out of memory with %d-token micro-batches; retrying from the latest "
                     "checkpoint with %d tokens x %d accumulation", tokens, smaller, accumulation)
    return (train.model_copy(update={"gradient_accumulation_steps": accumulation}),
            speed.model_copy(update={"max_tokens_per_batch": smaller}))


def training_batches(model: Any, examples: ParquetExamples, train: TrainArgs, speed: SpeedArgs
                     ) -> tuple[Any, Any, MicroBatches]:
    """The Trainer's dataset and collator, after choosing the packed micro-batch size and activation offload for
    this device, and enabling checkpointing. Returns them with the choice made."""
    import torch

    lengths = [len(ids) for ids in examples.input_ids]
    longest = max(lengths, default=1)
    cuda = torch.cuda.is_available()
    # by default only in single-process runs: with DDP or FSDP the offloaded checkpoint (recomputing inside its own
    # backward) is not measured on GPUs
    offload = train.gradient_checkpointing and (speed.offload_activations if speed.offload_activations is not None
                                                 else cuda and not several_processes())
    wanted = speed.offload_embeddings if speed.offload_embeddings is not None else offload
    embeddings = bool(wanted) and offload_embeddings(model)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = bool(wanted) and offload_output_layer(base)
    tokens = speed.max_tokens_per_batch
    if cuda and speed.packing and tokens is None:
        budget = micro_batch_tokens(gpu_budget_gb(speed), torch.cuda.memory_allocated(), model.config, offload, 0)
        tokens = max(min(budget, AUTO_MAX_TOKENS), min(longest, 1024))
    if train.gradient_checkpointing:
        enable_checkpointing(base, offload)
    if not speed.packing:
        batches = MicroBatches(False, offload, embeddings, None, offload_output_layer=head)
        return examples, pad_collator(model.config.pad_token_id or 0, multiple_of=8 if cuda else 1), batches
    per_pack = None if tokens is not None else train.per_device_train_batch_size
    packs = PackedExamples(examples, tokens, per_pack, train.seed)
    return packs, pack_collator(), MicroBatches(True, offload, embeddings, tokens, len(packs), head)
