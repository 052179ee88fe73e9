"""Recomputation skips the LoRA layers whose output it never reads (speed.recompute_skip).

A checkpointed layer runs its forward a second time in the backward pass for one purpose: to rebuild the tensors
its backward saved. Some results of that rerun are read by nothing. In a pre-norm decoder layer (Llama, Mistral,
Qwen 2 and 3, Phi-3) the MLP's output projection feeds only the residual add, and an add saves nothing for its
backward; in a layer with parallel attention and MLP (GPT-NeoX) the attention's output projection does too.
Their recomputed products go nowhere: for Llama-3.1-8B, down_proj is i / (3 i + 2 h + 2 kv) = 27% of a layer's
matmul FLOPs, redone for nothing in every whole-recomputed layer, and a third of what an MLP-only layer recomputes.
Here the fused LoRA layer (fused_lora.py) skips its base matmul and its LoRA product in such a recomputation and
returns uninitialised memory of the output's shape; it still computes and saves x @ A.T, which its backward
needs. Its backward reads only its saved tensors, so the gradients are bit for bit those of running it.

Which layers may skip is read from the autograd graph, not assumed per family: the first time a checkpoint of a
kind ("layer": a whole decoder layer; "mlp": an MLP, or a chunk of one) has a graph, `learn` walks it from the
checkpoint's outputs and finds each fused layer whose output reaches them only through nodes that save no tensor
(adds, casts, views, cat): no backward formula can read its value. Every other consumer counts as a use, custom
autograd Functions included, so a family that normalises the MLP's output (Gemma 2 and 3: post_feedforward_layernorm
saves its input; OLMo 2 likewise) keeps computing it in a whole-layer recomputation, and so does GPT-2 while its
residual dropout is on (the dropout saves its mask). The verdict is kept per kind on the base layer:
Gemma's down_proj is unused when only its MLP recomputes (the MLP's output is then the checkpoint's) and used when
the whole layer does. Until a verdict exists the layer computes, so an offloaded layer (whose forward runs without
a graph) learns in its first backward pass and skips from the second.

What the walk cannot see: a value read outside autograd (an .item(), a comparison that steers the forward). No
decoder layer of the families in tests/families.py does that with a LoRA layer's output.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator, Sequence
from typing import Any

VERDICTS = "_qlora_unused_in"  # attribute of a fused layer's base: {checkpoint kind: its output is unused}
SKIPPABLE = "skippable_base"  # attribute of a fused layer's backward node (its ctx): the base layer it ran


class _Scopes(threading.local):
    """The checkpoints entered on this thread, innermost last: (kind, recomputing, fused bases met without a
    verdict). Per thread: the autograd engine recomputes on its own threads."""

    def __init__(self) -> None:
        self.stack: list[tuple[str, bool, list[Any]]] = []


_scopes = _Scopes()


@contextlib.contextmanager
def scope(kind: str, recomputing: bool) -> Iterator[list[Any]]:
    """Inside: a checkpoint of `kind` runs its forward (recomputing False) or its recomputation. Yields the list of
    fused bases met there that have no verdict for `kind` yet, for `learn`."""
    seen: list[Any] = []
    _scopes.stack.append((kind, recomputing, seen))
    try:
        yield seen
    finally:
        _scopes.stack.pop()


def skips(base: Any) -> bool:
    """Whether the fused layer over `base`, called now with autograd recording, may skip its output: some enclosing
    recomputation does not use it. Notes the base for `learn` where a verdict is missing."""
    if not _scopes.stack:  # a layer that keeps its activations: no checkpoint around it
        return False
    skip = False
    verdicts = getattr(base, VERDICTS, None) or {}
    for kind, recomputing, seen in _scopes.stack:
        verdict = verdicts.get(kind)
        if verdict is None:
            seen.append(base)
        elif verdict and recomputing:
            skip = True
    return skip


def learn(kind: str, outputs: Any, inputs: Sequence[Any], seen: list[Any]) -> None:
    """After a checkpoint of `kind` ran with autograd recording: give each fused layer met in it (`seen`) its
    verdict, from the graph between the checkpoint's inputs and `outputs` (a tensor or a tuple of them)."""
    import torch

    if not seen:
        return
    outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    roots = [t.grad_fn for t in outputs if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    stops = {t.grad_fn for t in inputs if isinstance(t, torch.Tensor) and t.grad_fn is not None}
    # no closures over the graph here: a recursive nested function is a reference cycle, and one that holds autograd
    # nodes keeps a recomputed layer's saved activations alive until the cyclic collector runs (the first backward
    # pass then runs out of memory)
    consumers = _consumers(roots, stops)
    unused: dict[Any, bool] = {}
    for node in consumers:
        base = getattr(node, SKIPPABLE, None)
        if base is not None:
            _verdicts(base)[kind] = _unused(node, consumers, unused)
    for base in seen:  # met but not in the graph (its output needs no gradient): never skipped
        _verdicts(base).setdefault(kind, False)


def configure(model: Any, on: bool) -> None:
    """Before a training: drop the verdicts an earlier one left (it may have run other forwards over the same
    modules). Off: every LoRA layer's base gets "used" for every kind, so nothing skips and no graph is walked."""
    modules = list(model.modules())
    for module in modules:
        if VERDICTS in module.__dict__:
            delattr(module, VERDICTS)
    if not on:
        for module in modules:
            if hasattr(module, "get_base_layer") and hasattr(module, "lora_A"):
                setattr(module.get_base_layer(), VERDICTS, {"layer": False, "mlp": False})


def checkpoint(kind: str, function: Any, *args: Any, **kwargs: Any) -> Any:
    """torch.utils.checkpoint.checkpoint (non-reentrant) whose recomputation skips what it does not use."""
    import torch.utils.checkpoint

    if torch.compiler.is_compiling():  # a compiled checkpoint takes torch's dispatch modes only as its context_fn:
        # it recomputes everything, as it always did (bench/compile_layers.py; training does not compile)
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)
    with scope(kind, recomputing=False) as seen:
        out = torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False,
                                                context_fn=functools.partial(_contexts, kind), **kwargs)
    learn(kind, out, args, seen)
    return out


def _contexts(kind: str) -> tuple[Any, Any]:
    return contextlib.nullcontext(), scope(kind, recomputing=True)


def _consumers(roots: list[Any], stops: set[Any]) -> dict[Any, list[Any]]:
    """Every node from the roots down to the stops (not included), each with the nodes that take its output."""
    consumers: dict[Any, list[Any]] = {root: [] for root in roots}
    stack = list(roots)
    while stack:
        node = stack.pop()
        for child, _ in node.next_functions:
            if child is None or child in stops:
                continue
            if child not in consumers:
                consumers[child] = []
                stack.append(child)
            consumers[child].append(node)
    return consumers


def _unused(node: Any, consumers: dict[Any, list[Any]], memo: dict[Any, bool]) -> bool:
    """Whether the node's output reaches the roots only through nodes that save nothing."""
    if node not in memo:
        memo[node] = all(_saves_nothing(type(c)) and _unused(c, consumers, memo) for c in consumers.get(node, ()))
    return memo[node]


@functools.cache
def _saves_nothing(node_type: type) -> bool:
    """Whether a node of this type reads no tensor of the forward in its backward: torch's own nodes list what they
    save as _raw_saved_* attributes (tensors only); a custom Function's node has _raw_saved_tensors, so it always
    counts as reading."""
    return not any(name.startswith("_raw_saved_") for name in dir(node_type))


def _verdicts(base: Any) -> dict[str, bool]:
    verdicts = getattr(base, VERDICTS, None)
    if verdicts is None:
        verdicts = {}
        setattr(base, VERDICTS, verdicts)
    return verdicts
