"""The MLP of each decoder layer: in token chunks for long sequences, and recomputed on its own (selective
recomputation: the layer keeps its attention's activations, the MLP recomputes its own in the backward pass).

Why torch.utils.checkpoint around the MLP module and not torch's selective activation checkpointing
(create_selective_checkpoint_contexts with a policy over aten ops): a policy sees ops, not modules, so telling the
MLP's matmuls from attention's would mean matching shapes or op order, and the MLP's ops here are not plain aten
ops (bitsandbytes' 4-bit matmul, the fused LoRA autograd.Function, Liger's SwiGLU kernel); the policy would also
have to run inside a checkpoint of the whole layer, which the offloaded checkpoint (recompute.py) replaces. A
checkpoint around `mlp.forward` is the same function every family calls (`self.mlp(...)`), whatever runs inside
it, and it is the mechanism the chunked MLP already uses: a chunk is a checkpoint, so recomputing the MLP and
chunking it are one wrapper with two settings per layer.
"""

from __future__ import annotations

import functools
import types
from typing import TYPE_CHECKING, Any

import tasks.train_adapter.levers.recompute_skip as recompute_skip
from tasks.config import SpeedArgs
from tasks.log import logger

if TYPE_CHECKING:
    import torch

UNWRAPPED = "_qlora_untiled"  # attribute of a wrapped MLP: the forward function it replaced
CHUNK = "_qlora_chunk"  # tokens per checkpointed chunk (0: never chunk)
RECOMPUTE = "_qlora_recompute"  # True: the MLP recomputes its activations even when it runs whole


def apply_chunks(model: Any, speed: SpeedArgs) -> str | None:
    """speed.mlp_chunk_tokens, before LoRA wraps the model: what it applied, for the log line; a family whose decoder
    layers have no .mlp steps aside with one log line."""
    if not speed.mlp_chunk_tokens:
        return None
    if tile_mlp(model, speed.mlp_chunk_tokens):
        return f"MLP in chunks of {speed.mlp_chunk_tokens} tokens"
    logger().info("train_adapter: chunked MLP steps aside: %s has no decoder layers with an .mlp", type(model).__name__)
    return None


def tile_mlp(model: Any, chunk: int) -> int:
    """Run each decoder layer's MLP over at most `chunk` tokens at a time, each chunk checkpointed on its own:
    the (tokens x intermediate_size) activations of a long sequence never exist at once, for one more MLP
    forward in the backward pass. Returns how many MLPs were changed."""
    layers = decoder_layers(model)
    for layer in layers:
        _wrap(layer.mlp)
        setattr(layer.mlp, CHUNK, chunk)
    return len(layers)


def recompute_mlps(model: Any, first: int, count: int, chunks: list[int] | None = None) -> int:
    """Decoder layers first .. first + count - 1 recompute their MLP's activations in the backward pass (the
    rest of each layer keeps its own); the others do not (their whole layer may, see recompute.py). `chunks`
    (one per layer, where the memory plan chose) sets each layer's MLP chunk; None leaves tile_mlp's. Returns how
    many MLPs recompute; a family whose decoder layers have no `.mlp` steps aside with one log line."""
    layers = decoder_layers(model)
    if not layers:
        if count:
            logger().info("train_adapter: MLP-only recomputation steps aside: %s has no decoder layers with an "
                          ".mlp; those layers keep their activations", type(model).__name__)
        return 0
    recomputed = 0
    for index, layer in enumerate(layers):
        wanted = first <= index < first + count
        chunk = chunks[index] if chunks is not None and index < len(chunks) else None
        if wanted or chunk or hasattr(layer.mlp, UNWRAPPED):
            _wrap(layer.mlp)
            setattr(layer.mlp, RECOMPUTE, wanted)
            if chunks is not None:
                setattr(layer.mlp, CHUNK, chunk or 0)
        recomputed += wanted
    return recomputed


def decoder_layers(model: Any) -> list[Any]:
    """The decoder layers that have an .mlp, wherever the family keeps them (model.layers, transformer.h,
    gpt_neox.layers): the first ModuleList of such layers."""
    import torch

    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) and all(hasattr(m, "mlp") for m in module):
            return list(module)
    return []


def _wrap(mlp: Any) -> None:
    """Route the MLP's forward through _mlp_forward (once). The MLP's forward function (Liger's, where Liger
    swapped it in), not the method bound to this MLP, and plain int/bool settings: torch.compile then sees the same
    function in every layer, and at most three combinations of the settings (kept, MLP-only, whole)."""
    if hasattr(mlp, UNWRAPPED):
        return
    setattr(mlp, UNWRAPPED, mlp.forward.__func__)
    setattr(mlp, CHUNK, 0)
    setattr(mlp, RECOMPUTE, False)
    mlp.forward = types.MethodType(_mlp_forward, mlp)


def _mlp_forward(mlp: Any, x: torch.Tensor) -> torch.Tensor:
    import torch

    forward, chunk = functools.partial(getattr(mlp, UNWRAPPED), mlp), getattr(mlp, CHUNK)
    chunked = bool(chunk) and x.shape[-2] > chunk
    if not (chunked or getattr(mlp, RECOMPUTE)):
        return forward(x)
    parts = x.split(chunk, dim=-2) if chunked else (x,)
    if torch.is_grad_enabled():
        outs = [recompute_skip.checkpoint("mlp", forward, part) for part in parts]
    else:  # evaluation: the chunks still bound the memory, nothing to recompute
        outs = [forward(part) for part in parts]
    return torch.cat(outs, dim=-2) if chunked else outs[0]
