"""The training plan of train_adapter: which speed and memory levers apply on this device, and the micro-batches.

Each lever lives in its own module of levers/ and is registered in levers.LEVERS with the SpeedArgs options that
steer it (see their descriptions); memory_plan.py chooses, for a GPU memory budget, the pack size, the layers that
recompute their activations and the offloads. Everything here also runs on CPU, where the GPU-only parts step aside,
so the CPU tests cover it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tasks import methods
from tasks.config import PIPELINE_TRAIN_FIELDS, SpeedArgs, TrainArgs
from tasks.errors import UserError
from tasks.log import logger
from tasks.models.dims import model_dims
from tasks.models.memory import set_expandable_segments
from tasks.on_disk.parquet_dataset import ParquetExamples, pad_collator
from tasks.train_adapter import levers
from tasks.train_adapter.levers.attention import dense_attention
from tasks.train_adapter.levers.fused_lora import fuses_lora
from tasks.train_adapter.levers.loss import offload_output_layer, output_layer_offload_unsupported
from tasks.train_adapter.levers.mlp import decoder_layers, recompute_mlps
from tasks.train_adapter.levers.packs import PackedExamples, pack_collator
from tasks.train_adapter.levers.parallel import several_processes
from tasks.train_adapter.levers.recompute import embedding_offload_unsupported, enable_checkpointing, offload_embeddings
from tasks.train_adapter.memory_plan import GIB, Choices, Fixed, MemoryPlan, choose_plan, smallest_peak_gib


@dataclass(frozen=True)
class MicroBatches:
    """What training_batches chose for this device: the out-of-memory back-off starts from it."""

    packing: bool
    offload_activations: bool
    offload_embeddings: bool
    max_tokens_per_batch: int | None  # tokens per packed micro-batch; None: packs of per_device_train_batch_size
    packs: int | None = None  # packed micro-batches per epoch
    offload_output_layer: bool = False  # the frozen output layer in host memory (with offload_embeddings)
    recompute_layers: int | None = None  # decoder layers recomputed in the backward pass (None: no checkpointing)
    recompute_mlp_layers: int = 0  # the next decoder layers, which recompute only their MLP
    memory_plan: dict[str, Any] | None = None  # MemoryPlan.as_dict() where the plan chose (GPU, packing)
    padding_free: bool = False  # preference runs: TRL's padded rows run as one packed row (levers/padding_free.py)


def gpu_budget_gb(speed: SpeedArgs) -> float:
    """speed.gpu_memory_budget_gb, or the GPU's memory less 1 GiB (the CUDA context and other processes' share):
    the memory plan spends what the user gives it."""
    import torch

    if speed.gpu_memory_budget_gb is not None:
        return speed.gpu_memory_budget_gb
    return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 2**30 - 1.0


def trainer_settings(train: TrainArgs, speed: SpeedArgs) -> dict[str, Any]:
    """TrainArgs as TrainingArguments keywords (not the pipeline's fields, nor the methods' own: each method's module
    hands those to its TRL config), checkpointing left to enable_checkpointing."""
    settings = train.model_dump(exclude={*PIPELINE_TRAIN_FIELDS, *methods.method_fields()})
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
    step (docs/performance.md, "Speed levers", has the side-by-side figures). Its fp32 moments of the LoRA weights
    (0.34 GB for 42M) are what the extra memory is."""
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
    """Before LoRA wraps the model: the levers of phase "base" (Liger kernels, MLP chunks, packed attention, fused
    loss), in levers.LEVERS' order. Returns what was applied; a lever that does not fit the model's family logs one
    line saying why and steps aside."""
    import torch

    model.config.use_cache = False  # with a cache, transformers ignores packed position ids when masking
    if torch.cuda.is_available():  # fewer half-empty segments: reserved memory stays near allocated
        set_expandable_segments(True)
    return levers.apply_phase("base", model, speed)


def prepare_peft(model: Any, speed: SpeedArgs) -> Any:
    """After get_peft_model: the levers of phase "peft" (each LoRA layer as one autograd function,
    levers/fused_lora.py). Returns the model."""
    import torch

    applied = levers.apply_phase("peft", model, speed)
    dropout = [d.p for m in model.modules() for d in getattr(m, "lora_dropout", {}).values()
               if isinstance(d, torch.nn.Dropout) and d.p > 0]
    if applied and dropout:
        applied.append(f"except in training, where lora_dropout {max(dropout)} keeps peft's own path")
    logger().info("train_adapter: %s", ", ".join(applied) or "peft's own LoRA layers")
    return model


def smaller_packs(train: TrainArgs, speed: SpeedArgs, batches: MicroBatches, exc: BaseException
                  ) -> tuple[TrainArgs, SpeedArgs]:
    """After running out of memory with `batches`: where the memory plan chose, the same plan's choice for a budget
    15% under the peak it predicted (it fails with the numbers when nothing fits); with packs of a pinned size, half
    the tokens and twice the accumulation, about the same tokens per optimizer step."""
    if batches.memory_plan is not None and speed.max_tokens_per_batch is None:
        budget = round(0.85 * batches.memory_plan["predicted_peak_gib"], 2)
        logger().warning("train_adapter: out of memory with the plan predicted to peak at %.2f GiB; planning again "
                         "for %.2f GiB and retrying from the latest checkpoint", batches.memory_plan[
                             "predicted_peak_gib"], budget)
        return train, speed.model_copy(update={"gpu_memory_budget_gb": budget})
    tokens = batches.max_tokens_per_batch or 0
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
    """The Trainer's dataset and collator, after choosing (on a GPU, with packing: through the memory plan) the
    packed micro-batch size, the layers to recompute and the offloads, and applying them. Returns them with the
    choice made."""
    import torch

    lengths = [len(ids) for ids in examples.input_ids]
    longest = max(lengths, default=1)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = len(decoder_layers(base)) or model_dims(model.config).layers
    memory = memory_plan(model, base, train, speed, longest) if torch.cuda.is_available() and speed.packing else None
    if memory is not None:
        logger().info("train_adapter: %s", memory.describe())
        recompute, offload, wanted, tokens = (memory.recompute_layers, memory.offload_activations,
                                              memory.offload_embeddings, memory.tokens)
        mlp_only, chunks = memory.recompute_mlp_layers, memory.mlp_chunks()
    else:  # CPU, or unpacked: checkpointing recomputes every layer (or speed.recompute_layers), as always
        recompute = 0 if not train.gradient_checkpointing else (
            speed.recompute_layers if speed.recompute_layers is not None else layers)
        # by default only in single-process runs: with DDP or FSDP the offloaded checkpoint (recomputing inside its
        # own backward) is not measured on GPUs
        offload = bool(recompute) and (speed.offload_activations if speed.offload_activations is not None
                                       else torch.cuda.is_available() and not several_processes())
        wanted = speed.offload_embeddings if speed.offload_embeddings is not None else offload
        tokens = speed.max_tokens_per_batch
        mlp_only = min(speed.recompute_mlp_layers or 0, layers - recompute) if train.gradient_checkpointing else 0
        chunks = None  # tile_mlp's chunks stay
    embeddings = bool(wanted) and offload_embeddings(model)
    head = bool(wanted) and offload_output_layer(base)
    enable_checkpointing(base, offload, recompute)
    mlp_only = recompute_mlps(base, recompute, mlp_only, chunks)
    if mlp_only and memory is None:  # the plan's log line names the modes it chose
        logger().info("train_adapter: decoder layers %d-%d recompute only their MLP (speed.recompute_mlp_layers)",
                      recompute, recompute + mlp_only - 1)
    plan_fields = {"recompute_layers": recompute if train.gradient_checkpointing or recompute else None,
                   "recompute_mlp_layers": mlp_only,
                   "memory_plan": memory.as_dict() if memory is not None else None}
    if not speed.packing:
        batches = MicroBatches(False, offload, embeddings, None, offload_output_layer=head, **plan_fields)
        multiple = 8 if torch.cuda.is_available() else 1
        return examples, pad_collator(model.config.pad_token_id or 0, multiple_of=multiple), batches
    per_pack = None if tokens is not None else train.per_device_train_batch_size
    packs = PackedExamples(examples, tokens, per_pack, train.seed)
    return packs, pack_collator(), MicroBatches(True, offload, embeddings, tokens, len(packs), head, **plan_fields)


def memory_plan(model: Any, base: Any, train: TrainArgs, speed: SpeedArgs, longest: int, tokens: int | None = None,
                output_layer_movable: bool = True) -> MemoryPlan:
    """The fastest plan that fits speed.gpu_memory_budget_gb, within what the settings pin; fails with the numbers
    when even the smallest one does not fit. `tokens` pins the micro-batch size where the caller sets it (KTO's
    micro-batch of answers), else speed.max_tokens_per_batch does; `output_layer_movable` False keeps the output
    layer on the GPU (TRL's fused LM head reads it there)."""
    import torch

    several = several_processes()  # offloads are single-process only (DDP broadcasts GPU tensors)
    mlps = bool(decoder_layers(base))
    choices = Choices(
        tokens=tokens or speed.max_tokens_per_batch,
        recompute_layers=speed.recompute_layers if train.gradient_checkpointing else 0,
        # a family whose layers have no .mlp can neither recompute nor chunk it: the plan must not count on either
        recompute_mlp_layers=speed.recompute_mlp_layers if train.gradient_checkpointing and mlps else 0,
        offload_activations=speed.offload_activations if speed.offload_activations is not None or not several
        else False,
        offload_embeddings=speed.offload_embeddings if speed.offload_embeddings is not None or not several
        else False,
        longest_example=longest, mlp_chunk=speed.mlp_chunk_tokens if mlps else 0,
        recompute_skip=speed.recompute_skip and fuses_lora(speed), dense_attention=dense_attention(base))
    emb, head = model.get_input_embeddings(), base.get_output_embeddings()
    movable = embedding_offload_unsupported(model) is None and emb.weight.is_cuda
    head_movable = (output_layer_movable and head is not None and output_layer_offload_unsupported(base) is None
                    and head.weight.is_cuda)
    fixed = Fixed(torch.cuda.memory_allocated(), sum(p.numel() for p in model.parameters() if p.requires_grad),
                  emb.weight.nbytes if movable else 0, head.weight.nbytes if head_movable else 0)
    dims, budget = model_dims(model.config), gpu_budget_gb(speed)
    plan = choose_plan(dims, fixed, budget, choices)
    if plan is None:
        raise UserError(
            f"train_adapter: no memory plan fits the GPU memory budget of {budget:.2f} GiB "
            f"(speed.gpu_memory_budget_gb): the model and its LoRA weights already take {fixed.allocated / GIB:.2f} "
            f"GiB, and the smallest plan the settings allow needs about {smallest_peak_gib(dims, fixed, choices):.2f}"
            f" GiB (the longest example has {longest:,} tokens). Raise speed.gpu_memory_budget_gb, lower "
            "data.max_seq_length, lora.r or the number of lora.target_modules, or unpin speed.max_tokens_per_batch, "
            "speed.recompute_layers, speed.recompute_mlp_layers and the offloads so the plan can use them.")
    return plan
