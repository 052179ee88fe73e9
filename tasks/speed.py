"""Speed and memory levers of train_adapter, each a TrainArgs option (see its descriptions).

- Padding-free packing: a micro-batch is one row of whole examples with per-example position ids. On a
  CUDA GPU attention runs as flash varlen attention over the examples' boundaries (torch's varlen_attn);
  elsewhere transformers' sdpa builds a block-diagonal causal mask from the position ids. Either way no
  example attends to another.
- A fused, chunked linear + cross-entropy: the loss and its gradient are computed from the hidden states
  a few hundred rows at a time, so the (tokens x vocabulary) float32 logits never exist at once.
- Activation checkpointing whose saved layer inputs can live in pinned CPU memory (offload), and the frozen
  input-embedding table in CPU memory: on a single GPU both by default, since from ~6k tokens per micro-batch
  the GPU, not these copies, sets the pace.
- Liger kernels (RMSNorm, SwiGLU, RoPE) when liger-kernel is installed and a GPU is present.
- A micro-batch size in tokens from a GPU memory budget, at most AUTO_MAX_TOKENS.
Everything here also runs on CPU, where the GPU-only parts step aside, so the CPU tests cover it.
"""

from __future__ import annotations

import functools
import inspect
from typing import TYPE_CHECKING, Any

from tasks.log import logger

if TYPE_CHECKING:
    import torch

VARLEN = "qlora_varlen"  # attention implementation name registered with transformers
GIB = 2**30


# ---------------------------------------------------------------------------------------------------------------
# Packed attention
# ---------------------------------------------------------------------------------------------------------------

@functools.cache
def _varlen_fn() -> Any:
    """torch's flash varlen attention with causal masking, or None where this torch lacks it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    return functools.partial(varlen_attn, **causal), "enable_gqa" in params, "scale" in params


def _segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: list[int], scale: float | None
                       ) -> torch.Tensor:
    """(T, H, D) attention, causal within each [cu[i], cu[i+1]) segment: the portable path."""
    import torch.nn.functional as F  # noqa: N812

    out = []
    for start, end in zip(cu[:-1], cu[1:], strict=True):
        qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))
        out.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale).transpose(0, 1))
    return __import__("torch").cat(out)


def packed_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """A transformers attention function: varlen attention over cu_seq_lens_q when given, else sdpa."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cu = kwargs.get("cu_seq_lens_q")
    if cu is None or query.shape[0] != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))  # (1, H, T, D) -> (T, H, D)
    fn = _varlen_fn() if q.is_cuda else None
    default_scale = scaling is None or abs(scaling - q.shape[-1] ** -0.5) < 1e-6
    if fn is None or not (fn[2] or default_scale):
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return _segment_attention(q, k, v, cu.tolist(), scaling).unsqueeze(0), None
    varlen, gqa, has_scale = fn
    extra: dict[str, Any] = {"scale": scaling} if has_scale else {}
    if k.shape[1] != q.shape[1]:
        if gqa:
            extra["enable_gqa"] = True
        else:
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    max_len = int(kwargs.get("max_length_q") or q.shape[0])
    out = varlen(q, k, v, cu, cu, max_len, max_len, **extra)
    return out.unsqueeze(0), None


def use_packed_attention(model: Any) -> str:
    """Route the model's attention through packed_attention; returns the implementation now in use."""
    import torch
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    if not (torch.cuda.is_available() and _varlen_fn() is not None):
        return model.config._attn_implementation  # sdpa masks packed rows block-diagonally from position ids
    AttentionInterface.register(VARLEN, packed_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(VARLEN, lambda *args, **kwargs: None)  # boundaries come from cu_seq_lens
    model.set_attn_implementation(VARLEN)
    return VARLEN


# ---------------------------------------------------------------------------------------------------------------
# Fused linear + cross-entropy
# ---------------------------------------------------------------------------------------------------------------

def _chunk_rows(rows: int, hidden: int, vocab: int) -> int:
    """Rows per chunk: logits about the size of all the hidden states, within 256..512 rows (a 512 x 128,256
    chunk holds 0.4 GB of logits at once)."""
    return max(256, min(512, -(-rows * hidden // vocab)))


def _linear_ce_forward(hidden: torch.Tensor, head: torch.nn.Linear, labels: torch.Tensor, want_grad: bool
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Summed cross-entropy of head(hidden) against labels (all valid), and its gradient w.r.t. hidden.

    The logits come from calling the head module, not from its weight alone: under FSDP2 the head's parameters
    are gathered by the hooks of that call (reading head.weight without one finds a shard)."""
    import torch

    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    grad = torch.empty_like(hidden) if want_grad else None
    chunk = _chunk_rows(hidden.shape[0], hidden.shape[1], head.out_features)
    for start in range(0, hidden.shape[0], chunk):
        h, y = hidden[start:start + chunk], labels[start:start + chunk]
        logits = head(h).float()
        lse = torch.logsumexp(logits, dim=-1)
        total += (lse - logits.gather(1, y[:, None]).squeeze(1)).sum()
        if grad is not None:
            probs = logits.sub_(lse[:, None]).exp_()  # softmax, in place
            probs.scatter_add_(1, y[:, None], torch.full_like(lse, -1.0)[:, None])
            grad[start:start + chunk] = probs.to(head.weight.dtype) @ head.weight
    return total, grad


class LinearCrossEntropy:
    """loss = sum over labelled rows of CE(head(hidden), label) / divisor; head is a frozen bias-free Linear."""

    @staticmethod
    def apply(hidden: torch.Tensor, head: torch.nn.Linear, labels: torch.Tensor, divisor: Any) -> torch.Tensor:
        return _function().apply(hidden, head, labels, divisor)


@functools.cache
def _function() -> Any:
    import torch

    class _LinearCrossEntropy(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, hidden: torch.Tensor, head: torch.nn.Linear, labels: torch.Tensor, divisor: Any
                    ) -> torch.Tensor:
            rows = (labels != -100).nonzero().squeeze(1)
            picked = hidden if rows.numel() == hidden.shape[0] else hidden.index_select(0, rows)
            if picked.dtype != head.weight.dtype:  # autocast does not reach inside a custom Function's matmuls
                picked = picked.to(head.weight.dtype)
            total, grad = _linear_ce_forward(picked, head, labels.index_select(0, rows), hidden.requires_grad)
            ctx.shape, ctx.dtype, ctx.divisor = hidden.shape, hidden.dtype, divisor
            ctx.save_for_backward(rows, grad if grad is not None else rows.new_empty(0))
            return total / divisor

        @staticmethod
        def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
            rows, grad = ctx.saved_tensors
            grad = (grad * (grad_out / ctx.divisor)).to(ctx.dtype)
            if rows.numel() == ctx.shape[0]:
                return grad, None, None, None
            full = torch.zeros(ctx.shape, dtype=ctx.dtype, device=grad.device)
            return full.index_copy_(0, rows, grad), None, None, None

    return _LinearCrossEntropy


def use_fused_loss(causal_lm: Any) -> bool:
    """Replace a causal LM's forward (with labels) by hidden states + LinearCrossEntropy; False if not possible."""
    import torch

    head = causal_lm.get_output_embeddings()
    if type(head) is not torch.nn.Linear or getattr(head, "bias", None) is not None or not hasattr(causal_lm, "model"):
        return False  # a LoRA-wrapped or biased lm_head keeps transformers' own loss
    original = causal_lm.forward

    def forward(input_ids: Any = None, attention_mask: Any = None, position_ids: Any = None, labels: Any = None,
                num_items_in_batch: Any = None, **kwargs: Any) -> Any:
        from transformers.modeling_outputs import CausalLMOutputWithPast

        if labels is None:
            return original(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
        kwargs.pop("use_cache", None)
        out = causal_lm.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              use_cache=False, **kwargs)
        hidden = out.last_hidden_state[:, :-1].reshape(-1, out.last_hidden_state.shape[-1])
        targets = labels[:, 1:].reshape(-1).to(hidden.device)
        divisor = num_items_in_batch if num_items_in_batch is not None else (targets != -100).sum().clamp(min=1)
        if isinstance(divisor, torch.Tensor):
            divisor = divisor.to(hidden.device)
        loss = LinearCrossEntropy.apply(hidden, head, targets, divisor)
        return CausalLMOutputWithPast(loss=loss, logits=None)

    causal_lm.forward = forward
    return True


# ---------------------------------------------------------------------------------------------------------------
# Activation checkpointing, optionally offloaded to pinned CPU memory
# ---------------------------------------------------------------------------------------------------------------

@functools.cache
def _offload_function() -> Any:
    import torch

    class _OffloadedCheckpoint(torch.autograd.Function):
        """Runs a layer without keeping its activations; keeps only its input, in pinned CPU memory on a GPU."""

        @staticmethod
        def forward(ctx: Any, run: Any, hidden: torch.Tensor) -> torch.Tensor:
            ctx.run, ctx.device = run, hidden.device
            ctx.autocast = (torch.is_autocast_enabled(hidden.device.type),
                            torch.get_autocast_dtype(hidden.device.type))
            ctx.rng = torch.get_rng_state(), (torch.cuda.get_rng_state(hidden.device) if hidden.is_cuda else None)
            if hidden.is_cuda:
                stream = _copy_stream(hidden.device)
                stream.wait_stream(torch.cuda.current_stream(hidden.device))
                saved = torch.empty(hidden.shape, dtype=hidden.dtype, pin_memory=True)
                with torch.cuda.stream(stream):
                    saved.copy_(hidden, non_blocking=True)
                hidden.record_stream(stream)
                ctx.copied = torch.cuda.Event()
                ctx.copied.record(stream)
            else:
                saved, ctx.copied = hidden.detach(), None
            ctx.saved = saved
            out = run(hidden)
            if not isinstance(out, torch.Tensor):
                raise TypeError(f"offloaded checkpointing needs a layer that returns a tensor, got {type(out)}")
            return out

        @staticmethod
        def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
            if ctx.copied is not None:
                torch.cuda.current_stream(ctx.device).wait_event(ctx.copied)
            hidden = ctx.saved.to(ctx.device, non_blocking=True).detach().requires_grad_(True)
            ctx.saved = None
            cpu_rng, cuda_rng = ctx.rng
            devices = [ctx.device] if cuda_rng is not None else []
            with torch.random.fork_rng(devices=devices, device_type=ctx.device.type):
                torch.set_rng_state(cpu_rng)
                if cuda_rng is not None:
                    torch.cuda.set_rng_state(cuda_rng, ctx.device)
                with torch.enable_grad(), torch.autocast(ctx.device.type, enabled=ctx.autocast[0],
                                                         dtype=ctx.autocast[1]):
                    out = ctx.run(hidden)
            torch.autograd.backward(out, grad_out)
            return None, hidden.grad

    return _OffloadedCheckpoint


@functools.cache
def _copy_stream(device: Any) -> Any:
    import torch

    return torch.cuda.Stream(device)


def offloaded_checkpoint(function: Any, *args: Any, **_: Any) -> Any:
    """A drop-in for torch.utils.checkpoint.checkpoint over a decoder layer's forward(hidden_states)."""
    hidden, *rest = args
    run = functools.partial(_call_with_rest, function, rest) if rest else function
    return _offload_function().apply(run, hidden)


def _call_with_rest(function: Any, rest: list[Any], hidden: Any) -> Any:
    return function(hidden, *rest)


def enable_checkpointing(model: Any, offload: bool) -> None:
    """Checkpoint every decoder layer; with offload, keep the saved inputs in pinned CPU memory."""
    import torch.utils.checkpoint

    if offload:
        func = offloaded_checkpoint
    else:
        func = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
    model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=func)
    model.enable_input_require_grads()  # frozen embeddings: the first layer's input must carry a gradient


def offload_embeddings(model: Any) -> bool:
    """Move the frozen input-embedding table to CPU memory (HostEmbedding). A lookup needs no arithmetic, so the
    table (vocabulary x hidden: 1 GiB for Llama 3's 128k tokens in bf16) need not hold GPU memory. False where
    not possible: a trainable, tied or non-standard embedding, or several processes (DDP broadcasts every
    parameter from rank 0 over NCCL, which takes GPU tensors only)."""
    import torch

    from tasks.distributed import several_processes

    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    if (type(emb) is not torch.nn.Embedding or emb.weight.requires_grad or emb.max_norm is not None
            or (head is not None and head.weight is emb.weight) or several_processes()):
        return False
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.set_input_embeddings(_host_embedding_type()(emb))
    return True


@functools.cache
def _host_embedding_type() -> type:
    import torch

    class HostEmbedding(torch.nn.Module):
        """An nn.Embedding whose table stays in CPU memory: a plain attribute, not a parameter or buffer, so
        that moving the model (model.to, the Trainer's device placement) leaves it where it is. Each forward
        copies the ids to the host, which waits for the GPU's queued work, looks the rows up there and copies
        them (tokens x hidden) to the ids' device."""

        def __init__(self, emb: torch.nn.Embedding) -> None:
            super().__init__()
            self.table = emb.weight.detach().to("cpu")
            self.padding_idx = emb.padding_idx
            self.num_embeddings, self.embedding_dim = self.table.shape

        @property
        def weight(self) -> torch.Tensor:  # for code that reads the embedding's dtype or shape
            return self.table

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            rows = torch.nn.functional.embedding(ids.to("cpu"), self.table, self.padding_idx)
            return rows.to(ids.device)

    return HostEmbedding


# ---------------------------------------------------------------------------------------------------------------
# The MLP in token chunks, for long sequences
# ---------------------------------------------------------------------------------------------------------------

def tile_mlp(model: Any, chunk: int) -> int:
    """Run each decoder layer's MLP over at most `chunk` tokens at a time, each chunk checkpointed on its own:
    the (tokens x intermediate_size) activations of a long sequence never exist at once, for one more MLP
    forward in the backward pass. Returns how many MLPs were changed."""
    layers = getattr(getattr(model, "model", None), "layers", [])
    for layer in layers:
        layer.mlp.forward = functools.partial(_tiled_mlp, layer.mlp.forward, chunk)
    return len(layers)


def _tiled_mlp(forward: Any, chunk: int, x: torch.Tensor) -> torch.Tensor:
    import torch
    import torch.utils.checkpoint

    if x.shape[-2] <= chunk:
        return forward(x)
    parts = x.split(chunk, dim=-2)
    if torch.is_grad_enabled():
        outs = [torch.utils.checkpoint.checkpoint(forward, part, use_reentrant=False) for part in parts]
    else:
        outs = [forward(part) for part in parts]
    return torch.cat(outs, dim=-2)


# ---------------------------------------------------------------------------------------------------------------
# Liger kernels and the micro-batch size
# ---------------------------------------------------------------------------------------------------------------

def apply_liger(model: Any, wanted: bool | None) -> bool:
    """Liger's RMSNorm, SwiGLU and RoPE kernels (the loss is ours); None = where installed and on a GPU."""
    import importlib.util

    import torch

    if wanted is False or not torch.cuda.is_available():
        return False
    if importlib.util.find_spec("liger_kernel") is None:
        if wanted:
            logger().warning("train_adapter: train.use_liger_kernel is set but liger-kernel is not installed "
                             "(pip install 'qlora-pipeline[gpu]'); training without it")
        return False
    try:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        _apply_liger_kernel_to_instance(model=model, rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                        fused_linear_cross_entropy=False)
    except Exception as exc:  # an incompatible liger/transformers pair must not stop training
        logger().warning("train_adapter: Liger kernels not applied (%s: %s)", type(exc).__name__, exc)
        return False
    return True


def bytes_per_token(config: Any, offload: bool) -> int:
    """GPU bytes one micro-batch token costs in training, Llama-3.1-8B shape, bf16: 236 KiB with offload, 492
    without. On an H200 the peaks grew by 206 and 432 KiB per token (bench/results/2026-11-30-h200x2-microstep
    .json): the estimate keeps a margin of about 14%."""
    hidden = config.hidden_size
    layers = config.num_hidden_layers
    working = 2 * (12 * hidden + 5 * config.intermediate_size)  # one layer's recompute and backward, bf16
    saved = 0 if offload else 2 * hidden * layers  # checkpointed layer inputs, bf16
    return working + saved


def micro_batch_tokens(budget_gb: float, used_bytes: int, config: Any, offload: bool, floor: int) -> int:
    """Tokens per packed micro-batch that fit the GPU memory budget next to what is already allocated."""
    spare = budget_gb * GIB - used_bytes - 0.5 * GIB  # CUDA context, allocator slack, optimizer state
    tokens = int(spare // bytes_per_token(config, offload)) // 256 * 256
    return max(tokens, floor)


# ---------------------------------------------------------------------------------------------------------------
# What train_adapter calls
# ---------------------------------------------------------------------------------------------------------------

# TrainArgs fields that are not the Trainer's (train.fsdp becomes the Trainer's fsdp settings in
# distributed.fsdp_settings, and only when sharding over several GPUs)
OWN_FIELDS = ("packing", "max_tokens_per_batch", "gpu_memory_budget_gb", "offload_activations",
              "offload_embeddings", "upcast_frozen_to_fp32", "fused_cross_entropy", "use_liger_kernel",
              "mlp_chunk_tokens", "num_gpus", "fused_lora", "fsdp")
# Tokens per packed micro-batch when none is set. Measured on an H200 with the 8B shape (bench/results/
# 2026-11-30-h200x2-microstep.json, activations and embeddings offloaded): 5,546 tokens 10,079 tokens/s at 5.88 GiB,
# 7,981 tokens 10,254 at 6.35 GiB, 16,133 tokens 10,757 at 7.91 GiB: past ~6k tokens the GPU is busy, and more
# tokens buy a few per cent for more memory.
AUTO_MAX_TOKENS = 6144


def trainer_settings(train: Any) -> dict[str, Any]:
    """TrainArgs as TrainingArguments keywords: our own fields out, checkpointing left to enable_checkpointing."""
    settings = train.model_dump(exclude=set(OWN_FIELDS))
    settings["gradient_checkpointing"] = False  # the Trainer would replace our checkpoint function with its own
    if train.packing:
        settings["per_device_train_batch_size"] = 1  # one pack per micro-batch; its size is set in tokens
    return settings


def prepare_base(model: Any, train: Any) -> list[str]:
    """Before LoRA wraps the model: Liger kernels, packed attention, fused loss. Returns what was applied."""
    import torch

    applied = []
    model.config.use_cache = False  # with a cache, transformers ignores packed position ids when masking
    if torch.cuda.is_available():  # fewer half-empty segments: reserved memory stays near allocated
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    if apply_liger(model, train.use_liger_kernel):
        applied.append("liger")
    if train.mlp_chunk_tokens and tile_mlp(model, train.mlp_chunk_tokens):
        applied.append(f"MLP in chunks of {train.mlp_chunk_tokens} tokens")
    if train.packing:
        applied.append(f"packed attention ({use_packed_attention(model)})")
    if train.fused_cross_entropy and use_fused_loss(model):
        applied.append("fused cross-entropy")
    return applied


def prepare_peft(model: Any, train: Any) -> Any:
    """After get_peft_model: each LoRA layer as one autograd function (tasks/fused_lora.py). Returns the model."""
    import torch

    from tasks.fused_lora import fuse_lora_layers

    wanted = train.fused_lora
    if wanted is None:  # FSDP shards the base weights that the fused backward reads back
        wanted = not train.fsdp
    applied = [f"fused LoRA layers ({fuse_lora_layers(model)})"] if wanted else []
    dropout = [d.p for m in model.modules() for d in getattr(m, "lora_dropout", {}).values()
               if isinstance(d, torch.nn.Dropout) and d.p > 0]
    if applied and dropout:
        applied.append(f"except in training, where lora_dropout {max(dropout)} keeps peft's own path")
    logger().info("train_adapter: %s", ", ".join(applied) or "peft's own LoRA layers")
    return model


LAST_CHOICE: dict[str, Any] = {}  # the latest training_batches choice, for the out-of-memory back-off


def smaller_packs(train: Any, exc: BaseException) -> Any:
    """Half the packed micro-batch's tokens and twice the accumulation: about the same tokens per step."""
    from tasks.errors import UserError

    tokens = train.max_tokens_per_batch or LAST_CHOICE.get("max_tokens_per_batch")
    if not tokens or tokens <= 512:
        raise UserError(
            f"train_adapter ran out of GPU memory with packed micro-batches of {tokens} tokens. Lower "
            "data.max_seq_length, lora.r or the number of lora.target_modules, set train.offload_activations, "
            f"or use a GPU with more memory. ({exc})"
        ) from exc
    smaller = max(512, tokens // 2 // 256 * 256)
    logger().warning("train_adapter: out of memory with %d-token micro-batches; retrying from the latest "
                     "checkpoint with %d tokens x %d accumulation", tokens, smaller,
                     train.gradient_accumulation_steps * 2)
    return train.model_copy(update={"max_tokens_per_batch": smaller,
                                    "gradient_accumulation_steps": train.gradient_accumulation_steps * 2})


def training_batches(model: Any, examples: Any, train: Any) -> tuple[Any, Any, dict[str, Any]]:
    """The Trainer's dataset and collator, after choosing the packed micro-batch size and activation offload for
    this device, and enabling checkpointing. Returns them with a record of the choices."""
    import torch

    from tasks.batches import PackedExamples, pack_collator, pad_collator
    from tasks.distributed import several_processes

    lengths = [len(ids) for ids in examples.input_ids]
    longest = max(lengths, default=1)
    cuda = torch.cuda.is_available()
    # by default only in single-process runs: with DDP or FSDP the offloaded checkpoint (recomputing inside its own
    # backward) is not measured on GPUs
    offload = train.gradient_checkpointing and (train.offload_activations if train.offload_activations is not None
                                                 else cuda and not several_processes())
    wanted = train.offload_embeddings if train.offload_embeddings is not None else offload
    embeddings = bool(wanted) and offload_embeddings(model)
    tokens = train.max_tokens_per_batch
    if cuda and train.packing and tokens is None:
        budget = micro_batch_tokens(train.gpu_memory_budget_gb, torch.cuda.memory_allocated(), model.config,
                                    offload, 0)
        tokens = max(min(budget, AUTO_MAX_TOKENS), min(longest, 1024))
    choice = {"packing": train.packing, "offload_activations": offload,
              "max_tokens_per_batch": tokens if train.packing else None, "offload_embeddings": embeddings}
    if train.gradient_checkpointing:
        enable_checkpointing(model.get_base_model() if hasattr(model, "get_base_model") else model, offload)
    if not train.packing:
        collator = pad_collator(model.config.pad_token_id or 0, multiple_of=8 if cuda else 1)
        collator.choice = choice
        return examples, collator, choice
    per_pack = None if tokens is not None else train.per_device_train_batch_size
    packs = PackedExamples(examples, tokens, per_pack, train.seed)
    choice["packs"] = len(packs)
    LAST_CHOICE.clear()
    LAST_CHOICE.update(choice)
    collator = pack_collator()
    collator.choice = choice
    return packs, collator, choice
