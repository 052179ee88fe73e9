"""Activation checkpointing whose saved layer inputs can live in pinned CPU memory (offload), and the frozen
input-embedding table in CPU memory: on a single GPU both by default, since from ~6k tokens per micro-batch the
GPU, not these copies, sets the pace.

Why not torch.autograd.graph.save_on_cpu: it moves every tensor autograd saves, at the moment it is saved, on
the compute stream; here only each checkpointed layer's input leaves the GPU (the recomputation rebuilds the
rest), copied on a side stream that overlaps the next layer's forward. The two have not been measured against
each other on a GPU."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import tasks.train_adapter.levers.recompute_skip as recompute_skip
from tasks.log import logger
from tasks.train_adapter.levers.parallel import several_processes

if TYPE_CHECKING:
    import torch


@functools.cache
def _offload_function() -> Any:
    import torch

    class _OffloadedCheckpoint(torch.autograd.Function):
        """Runs a layer without keeping its activations; keeps only its input, in pinned CPU memory on a GPU."""

        @staticmethod
        def forward(ctx: Any, run: Any, hidden: torch.Tensor) -> torch.Tensor:
            ctx.run, ctx.device, ctx.fetched = run, hidden.device, None
            # the layer below, when this layer's input is its output: its input is fetched back to the device
            # while this layer recomputes (see backward)
            below = hidden.grad_fn
            ctx.below = below if isinstance(below, _OffloadedCheckpoint._backward_cls) else None
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
            return run(hidden)

        @staticmethod
        def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
            hidden = _fetched(ctx).detach().requires_grad_(True)
            if ctx.below is not None:  # its copy overlaps this layer's recomputation and backward
                _fetch(ctx.below)
                ctx.below = None
            cpu_rng, cuda_rng = ctx.rng
            devices = [ctx.device] if cuda_rng is not None else []
            with torch.random.fork_rng(devices=devices, device_type=ctx.device.type):
                torch.set_rng_state(cpu_rng)
                if cuda_rng is not None:
                    torch.cuda.set_rng_state(cuda_rng, ctx.device)
                with recompute_skip.scope("layer", recomputing=True) as seen, torch.enable_grad(), torch.autocast(
                        ctx.device.type, enabled=ctx.autocast[0], dtype=ctx.autocast[1]):
                    out = ctx.run(hidden)
            recompute_skip.learn("layer", out, [hidden], seen)
            torch.autograd.backward(out, grad_out)
            return None, hidden.grad

    return _OffloadedCheckpoint


def _fetch(ctx: Any) -> None:
    """Start copying a checkpointed layer's saved input back to its device (once), on the side stream.

    The copy gets its memory from the side stream's own pool, so it need not wait for the compute stream; stream
    order puts it after the forward's copy to the host. Issued one layer ahead, it no longer holds up the compute
    stream, as a copy at the start of each layer's backward would."""
    import torch

    if ctx.fetched is not None or ctx.saved is None:
        return
    if ctx.copied is None:  # CPU: the input never left
        ctx.fetched, ctx.saved = ctx.saved, None
        return
    stream = _copy_stream(ctx.device)
    with torch.cuda.stream(stream):
        ctx.fetched = ctx.saved.to(ctx.device, non_blocking=True)
        ctx.copied.record(stream)
    ctx.saved = None


def _fetched(ctx: Any) -> torch.Tensor:
    """A checkpointed layer's input on its device, ready for use on the compute stream."""
    import torch

    _fetch(ctx)
    hidden, ctx.fetched = ctx.fetched, None
    if ctx.copied is not None:
        stream = torch.cuda.current_stream(ctx.device)
        stream.wait_event(ctx.copied)
        hidden.record_stream(stream)  # allocated on the side stream, used (and freed) on this one
    return hidden


@functools.cache
def _copy_stream(device: Any) -> Any:
    import torch

    return torch.cuda.Stream(device)


def offloaded_checkpoint(function: Any, *args: Any, **_: Any) -> Any:
    """A drop-in for torch.utils.checkpoint.checkpoint over a decoder layer's forward(hidden_states).

    A layer that returns a tuple (Falcon's: hidden states and attention weights) trains on its first element; the
    others come back as the layer made them in the forward pass, outside autograd (no loss reads them)."""
    hidden, *rest = args
    extras: list[Any] = []
    run = functools.partial(_call_with_rest, function, rest, extras)
    out = _offload_function().apply(run, hidden)
    return (out, *extras[0]) if extras and extras[0] is not None else out


def _call_with_rest(function: Any, rest: list[Any], extras: list[Any], hidden: Any) -> Any:
    out = function(hidden, *rest)
    if isinstance(out, tuple):  # keep the forward's extras once; the backward's recomputation drops its own
        if not extras:
            extras.append(tuple(x.detach() if hasattr(x, "detach") else x for x in out[1:]))
        return out[0]
    if not extras:
        extras.append(None)
    return out


def enable_checkpointing(model: Any, offload: bool, recompute_layers: int | None = None) -> None:
    """Checkpoint the first `recompute_layers` decoder layers (None: all, 0: none): they recompute their
    activations in the backward pass, the others keep them. With offload, the checkpointed layers' saved inputs
    live in pinned CPU memory. The first layers, so that the checkpointed ones are neighbours and each fetches
    the input of the one below ahead of time."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    if recompute_layers == 0:
        if getattr(model, "is_activation_checkpointing", False):  # an earlier Trainer on the same model enabled it
            model._set_gradient_checkpointing(enable=False)
        return
    func = offloaded_checkpoint if offload else functools.partial(recompute_skip.checkpoint, "layer")
    model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=func)
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    for index, layer in enumerate(layers):
        layer.gradient_checkpointing = recompute_layers is None or index < recompute_layers
    model.enable_input_require_grads()  # frozen embeddings: the first layer's input must carry a gradient


def offload_embeddings(model: Any) -> bool:
    """Move the frozen input-embedding table to CPU memory (HostEmbedding). A lookup needs no arithmetic, so the
    table (vocabulary x hidden: 1 GiB for Llama 3's 128k tokens in bf16) need not hold GPU memory. False where
    not possible: a trainable, tied or non-standard embedding, or several processes (DDP broadcasts every
    parameter from rank 0 over NCCL, which takes GPU tensors only)."""
    if isinstance(model.get_input_embeddings(), _host_embedding_type()):  # done by an earlier Trainer
        return True
    reason = embedding_offload_unsupported(model)
    if reason:
        logger().info("train_adapter: embedding offload steps aside: %s", reason)
        return False
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.set_input_embeddings(_host_embedding_type()(model.get_input_embeddings()))
    return True


def embedding_offload_unsupported(model: Any) -> str | None:
    """Why the input embeddings cannot move to CPU memory, or None."""
    import torch

    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    if type(emb) is not torch.nn.Embedding:  # Gemma 3's scaled embedding multiplies inside its forward
        return f"the input embedding is a {type(emb).__name__}, not a plain nn.Embedding"
    if head is not None and head.weight is emb.weight:  # GPT-2, Gemma: the head needs the table on the GPU
        return "the input embedding is tied to the output layer"
    if emb.weight.requires_grad or emb.max_norm is not None:
        return "the input embedding is trained or renormalized"
    if several_processes():
        return "several processes (DDP broadcasts parameters over NCCL, GPU tensors only)"
    return None


@functools.cache
def _host_embedding_type() -> type:
    import torch

    class HostEmbedding(torch.nn.Module):
        """An nn.Embedding whose table stays in CPU memory: a plain attribute, not a parameter or buffer, so
        that moving the model (model.to, the Trainer's device placement) leaves it where it is. Each forward
        copies the ids to the host, which waits for the GPU's queued work, looks the rows up there into pinned
        memory and copies them (tokens x hidden) to the ids' device without waiting.

        Why not look the rows up in the pack collator, one batch ahead, and skip that wait: it trained slower
        (docs/performance.md, "Tried and not kept"): the host sets the pace at these micro-batch sizes, and the
        lookup then runs on the DataLoader's path, with one more copy of the rows."""

        def __init__(self, emb: torch.nn.Embedding) -> None:
            super().__init__()
            self.table = emb.weight.detach().to("cpu")
            self.padding_idx = emb.padding_idx
            self.num_embeddings, self.embedding_dim = self.table.shape

        @property
        def weight(self) -> torch.Tensor:  # for code that reads the embedding's dtype or shape
            return self.table

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            rows = torch.empty((ids.numel(), self.embedding_dim), dtype=self.table.dtype,
                               pin_memory=torch.cuda.is_available())  # pinned: the copy back need not wait
            torch.index_select(self.table, 0, ids.to("cpu").reshape(-1), out=rows)
            return rows.view(*ids.shape, self.embedding_dim).to(ids.device, non_blocking=True)

    return HostEmbedding
