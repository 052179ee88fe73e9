"""Decoding steps of a static-cache generation replayed as a CUDA graph (GRPO's sampling: levers/generation.py).

A decoding step runs the whole model over one new token per answer: for Llama-3.1-8B about two thousand small
kernels, each launched from Python, while the GPU needs a few milliseconds for the step's weights; the host sets the
pace. With transformers' StaticCache (preallocated keys and values, written in place at a position the cache holds
on the GPU) every decoding step of a generation runs the same kernels on the same addresses. So the first decoding
step is captured once as a CUDA graph and every step, that one included, copies its token ids and attention mask
into the graph's inputs and replays it: one launch for the whole model. The prompts' prefill runs as before, and so
does everything transformers' generate does between steps (logits processors, sampling, stopping).

What a step computes is unchanged: the same modules and weights, the LoRA weights read where the optimizer updates
them in place. Steps aside (eager steps, the same results): on a CPU, a cache other than plain StaticCache layers
(sliding windows), active dropout (its random draws would be replayed), any step whose inputs are not a decoding
step's; a capture that fails is logged once and the trainer's later generations stay eager.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from tasks.log import logger


class Decoder:
    """Graphed decoding for one trainer: remembers a failed capture, so that it is tried and logged only once."""

    def __init__(self) -> None:
        self.failed: str | None = None

    @contextmanager
    def graphed(self, model: Any, config: Any) -> Iterator[None]:
        """While inside: generation with `config` (a GenerationConfig) keeps a static KV cache (unless the run chose
        its own cache) and the decoding steps of `model` (a peft model or a transformers causal LM) replay a CUDA
        graph captured at the first one; nothing changes where unsupported(model) says why not, or a capture failed
        before (eager, a static cache measured no faster than the dynamic one: docs/performance.md, "GRPO")."""
        if self.failed is not None or unsupported(model) is not None:
            yield
            return
        lm = model.get_base_model() if hasattr(model, "get_base_model") else model
        own, chosen = lm.__dict__.get("forward"), config.cache_implementation
        runner = _Runner(lm.forward, self)
        lm.forward, config.cache_implementation = runner, chosen or "static"
        try:
            yield
        finally:
            config.cache_implementation = chosen
            if own is None:
                del lm.forward
            else:
                lm.forward = own
            runner.release()


def unsupported(model: Any) -> str | None:
    """Why decoding steps of `model` cannot replay a graph, or None."""
    import torch

    if not torch.cuda.is_available():
        return "no GPU"
    if any(isinstance(m, torch.nn.Dropout) and m.p > 0 and m.training for m in model.modules()):
        return "dropout is active while answers are sampled (train.lora_dropout > 0)"
    return None


class _Runner:
    """A causal LM's forward for one generation: eager for the prefill, a replayed graph for decoding steps."""

    def __init__(self, forward: Callable[..., Any], decoder: Decoder) -> None:
        self.forward, self.decoder = forward, decoder
        self.key: tuple[Any, ...] | None = None
        self.graph: Any = None
        self.inputs: dict[str, Any] = {}
        self.output: Any = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if args or self.decoder.failed is not None or not _decoding_step(kwargs):
            return self.forward(*args, **kwargs)
        key = _key(kwargs)
        if key != self.key:
            try:
                self._capture(kwargs, key)
            except RuntimeError as exc:  # a step that syncs with the host or allocates pinned memory: stay eager
                self.release()
                self.decoder.failed = f"{type(exc).__name__}: {str(exc)[:300]}"
                logger().warning("train_adapter (generation): decoding steps stay eager: capturing one as a CUDA graph "
                                 "failed (%s)", self.decoder.failed)
                return self.forward(**kwargs)
        for name, buffer in self.inputs.items():
            buffer.copy_(kwargs[name])
        self.graph.replay()
        return self.output

    def _capture(self, kwargs: dict[str, Any], key: tuple[Any, ...]) -> None:
        import torch

        self.release()
        self.inputs = {k: v.clone() for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
        static = {**kwargs, **self.inputs}
        positions = [(layer, layer.cumulative_length.clone()) for layer in kwargs["cache"].layers]
        try:
            # a warm-up step on a side stream first: cuBLAS creates its handles and workspaces outside the capture
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self.forward(**static)
                _restore(positions)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # thread_local: CUDA calls of other threads (a data loader's pinning thread) do not void the capture
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                self.output = self.forward(**static)
        finally:
            _restore(positions)  # the warm-up wrote this step's keys and values: the replay writes them again
        self.graph, self.key = graph, key

    def release(self) -> None:
        """Free the graph and its memory pool."""
        if self.graph is not None:
            self.graph.reset()
        self.graph, self.key, self.inputs, self.output = None, None, {}, None


def _decoding_step(kwargs: dict[str, Any]) -> bool:
    """Whether a forward call is a decoding step a graph can replay: one new token per row, a static cache of plain
    StaticCache layers that the prefill filled, tensors and plain values only."""
    import torch
    from transformers.cache_utils import StaticLayer

    ids, cache = kwargs.get("input_ids"), kwargs.get("cache")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[1] != 1 or "inputs_embeds" in kwargs:
        return False
    layers = getattr(cache, "layers", None)
    if not layers or any(type(layer) is not StaticLayer or not layer.is_initialized for layer in layers):
        return False
    return all(isinstance(v, torch.Tensor | bool | int | float | str | None) for k, v in kwargs.items()
               if k != "cache")


def _key(kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """What a captured graph holds fixed: the inputs' shapes, dtypes and devices, the plain values, the cache."""
    import torch

    return tuple(sorted((k, (tuple(v.shape), v.dtype, v.device) if isinstance(v, torch.Tensor) else
                         id(v) if k == "cache" else v) for k, v in kwargs.items()))


def _restore(positions: list[tuple[Any, Any]]) -> None:
    for layer, position in positions:
        layer.cumulative_length.copy_(position)
