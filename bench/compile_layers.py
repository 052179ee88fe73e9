"""torch.compile over the decoder layers, for the benches: a host-side lever, kept out of the config because on a
GPU it gained no more than the run-to-run spread (docs/performance.md, "Tried and not kept").

Two ways in, by checkpointing:
- "layers": `layer.compile()`, around the checkpoint (torch's, as in the speed-first preset);
- "inside": the layer's forward compiled inside the checkpoint. The defaults' offloaded checkpoint needs this:
  transformers 5.24 calls the checkpoint function from inside the layer call, and Dynamo cannot trace that
  checkpoint's autograd Function. The forward is compiled once for all layers (same code, layers as inputs).
"""

from __future__ import annotations

import functools
from typing import Any

HOWS = ("layers", "inside")
_COMPILED: dict[tuple[Any, str], Any] = {}  # (forward function, backend) -> its compiled wrapper


def compile_layers(model: Any, how: str, backend: str = "inductor") -> int:
    """Compile every decoder layer of model (a peft or transformers causal LM) one of the HOWS; again after
    the checkpoint function was reset (a new Trainer) is a no-op for layers already done. Returns the layer
    count."""
    from tasks.train_adapter.levers.mlp import decoder_layers

    if how not in HOWS:
        raise ValueError(f"compile {how!r}: one of {HOWS}")
    layers = decoder_layers(model)
    for layer in layers:
        if how == "layers" and layer._compiled_call_impl is None:
            layer.compile(backend=backend)
        elif how == "inside" and not isinstance(layer._gradient_checkpointing_func, _Inside):
            if not getattr(layer, "gradient_checkpointing", False):
                raise ValueError("compile 'inside' runs inside the checkpoint: checkpointing is off")
            layer._gradient_checkpointing_func = _Inside(layer._gradient_checkpointing_func, backend)
    return len(layers)


class _Inside:
    """A checkpoint function that runs the compiled forward: transformers hands the checkpoint function
    partial(forward, layer, **kwargs)."""

    def __init__(self, checkpoint: Any, backend: str) -> None:
        self.checkpoint, self.backend = checkpoint, backend

    def __call__(self, function: Any, *args: Any, **kwargs: Any) -> Any:
        inner = functools.partial(_compiled(function.func, self.backend), *function.args, **function.keywords)
        return self.checkpoint(inner, *args, **kwargs)


def _compiled(func: Any, backend: str) -> Any:
    import torch

    if (func, backend) not in _COMPILED:
        _COMPILED[func, backend] = torch.compile(func, backend=backend)
    return _COMPILED[func, backend]


def dynamo_counts() -> dict[str, int]:
    """Graph breaks and compiled graphs since the process started (or torch._dynamo.utils.counters.clear())."""
    import torch._dynamo

    counters = torch._dynamo.utils.counters
    return {"graph_breaks": sum(counters["graph_break"].values()),
            "compiled_graphs": counters["stats"]["unique_graphs"]}
