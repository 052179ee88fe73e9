"""The MLP in token chunks, for long sequences."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def tile_mlp(model: Any, chunk: int) -> int:
    """Run each decoder layer's MLP over at most `chunk` tokens at a time, each chunk checkpointed on its own:
    the (tokens x intermediate_size) activations of a long sequence never exist at once, for one more MLP
    forward in the backward pass. Returns how many MLPs were changed."""
    import types

    layers = decoder_layers(model)
    for layer in layers:
        # the MLP's forward function (Liger's, where Liger swapped it in), not the method bound to this MLP, and
        # the chunk as a plain int: torch.compile then sees the same function and constants in every layer
        untiled = layer.mlp.forward
        layer.mlp._qlora_untiled, layer.mlp._qlora_chunk = untiled.__func__, chunk
        layer.mlp.forward = types.MethodType(_tiled_mlp, layer.mlp)
    return len(layers)


def decoder_layers(model: Any) -> list[Any]:
    """The decoder layers that have an .mlp, wherever the family keeps them (model.layers, transformer.h,
    gpt_neox.layers): the first ModuleList of such layers."""
    import torch

    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) and all(hasattr(m, "mlp") for m in module):
            return list(module)
    return []


def _tiled_mlp(mlp: Any, x: torch.Tensor) -> torch.Tensor:
    import torch
    import torch.utils.checkpoint

    forward, chunk = functools.partial(mlp._qlora_untiled, mlp), mlp._qlora_chunk
    if x.shape[-2] <= chunk:
        return forward(x)
    parts = x.split(chunk, dim=-2)
    if torch.is_grad_enabled():
        outs = [torch.utils.checkpoint.checkpoint(forward, part, use_reentrant=False) for part in parts]
    else:
        outs = [forward(part) for part in parts]
    return torch.cat(outs, dim=-2)
