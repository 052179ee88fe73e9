"""Decoder layers that keep their activations in pinned host memory instead of recomputing them
(speed.offload_layers; the memory plan chooses how many and which).

A layer that keeps its activations on the GPU costs memory (156 KB per token for Llama-3.1-8B); one that recomputes
them costs a third more of its compute. An offloaded layer costs neither: what autograd saves in its forward pass is
copied to pinned host memory on a side stream while the layers above compute, and copied back, one offloaded layer
ahead, while the layers above it run their backward pass. What it costs is the host link's time, which the compute
of the layers in between must cover: the plan spreads offloaded layers over the model (memory_plan.layer_modes) and
takes no more than the link can carry in the forward pass's time (memory_plan.link_layers).

Why autograd's saved-tensor hooks and not torch.autograd.graph.save_on_cpu: save_on_cpu copies on the compute
stream, so the GPU waits for every copy; here the copies run on their own stream, the compute stream waits only
when more than two layers' copies are still queued (which bounds the GPU memory they hold), and the copies back
are issued ahead of the backward pass that needs them.

Only tensors of at least MIN_BYTES move (the layer's activations); parameters (the 4-bit weights, LoRA's) and
small tensors (sequence offsets, normalisation statistics) stay where they are. A tensor saved twice in one layer
(a projection's input, read by q, k and v's LoRA) is copied once.
"""

from __future__ import annotations

import types
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

MIN_BYTES = 1 << 20
IN_FLIGHT = 2  # offloaded layers whose copies may be queued, or fetched ahead, at once (the plan counts them)
UNWRAPPED = "_qlora_offload_forward"  # attribute of a wrapped layer: the forward method it replaced
HOOKED = "_qlora_offload_hook"  # attribute of every decoder layer: its prefetching forward hook


@dataclass(eq=False)
class _Saved:
    """One tensor saved by an offloaded layer: its host copy, and its copy back once fetched. Autograd holds it
    (the nodes that saved it); the layer's record holds only a weak reference, so it goes when they do."""

    host: torch.Tensor
    copied: Any  # torch.cuda.Event: the host copy is complete (None on a CPU: the copy is made at once)
    device: torch.device
    gpu: torch.Tensor | None = None
    fetched: Any = None  # torch.cuda.Event: the copy back is complete


@dataclass(eq=False)
class _Layer:
    """What one offloaded layer saved in its latest forward pass."""

    saved: list[weakref.ref[_Saved]] = field(default_factory=list)
    copied: Any = None  # the event after its last host copy
    # during its forward pass only: each tensor saved so far, with its copy. Holding the tensor keeps its memory from
    # being reused by a later tensor of the same shape in this forward pass, which would then look like the same one
    seen: dict[tuple[Any, ...], tuple[torch.Tensor, _Saved]] = field(default_factory=dict)


class Offloader:
    """The offloaded layers of one model: their saved tensors, a side stream for copies, and the prefetching."""

    def __init__(self, indices: list[int], parameters: set[int]) -> None:
        self.indices = sorted(indices)
        self.parameters = parameters  # storages of the layers' parameters: a view of a weight stays (a transpose)
        self.layers: dict[int, _Layer] = {}
        self.stream: Any = None

    def forward(self, index: int, run: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run layer `index`'s forward with its saved tensors sent to the host."""
        import torch

        if not torch.is_grad_enabled():
            return run(*args, **kwargs)
        self._throttle(index)
        layer = self.layers[index] = _Layer()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(layer, t), self._unpack):
            out = run(*args, **kwargs)
        layer.seen.clear()
        if layer.saved and self.stream is not None:
            layer.copied = torch.cuda.Event()
            layer.copied.record(self.stream)
        return out

    def _throttle(self, index: int) -> None:
        """Make the compute stream wait for the copies of the offloaded layer IN_FLIGHT places below, so that at
        most IN_FLIGHT layers' activations are on the GPU waiting for the link."""
        import torch

        below = [i for i in self.indices if i < index]
        done = self.layers.get(below[-IN_FLIGHT]) if len(below) >= IN_FLIGHT else None
        if done is not None and done.copied is not None:
            torch.cuda.current_stream().wait_event(done.copied)

    def _pack(self, layer: _Layer, tensor: torch.Tensor) -> Any:
        import torch

        if (isinstance(tensor, torch.nn.Parameter) or tensor.numel() * tensor.element_size() < MIN_BYTES
                or tensor.untyped_storage().data_ptr() in self.parameters):
            return tensor
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.stride(),
               tensor.dtype, tensor.device)
        if key in layer.seen:
            return layer.seen[key][1]
        if not tensor.is_cuda:  # a CPU: a copy, so that the same code path (hooks, sharing) runs in the tests
            saved = _Saved(tensor.detach().clone(), None, tensor.device)
        else:
            saved = self._copy_out(tensor)
        layer.seen[key] = tensor, saved
        layer.saved.append(weakref.ref(saved))
        return saved

    def _copy_out(self, tensor: torch.Tensor) -> _Saved:
        import torch

        if self.stream is None:
            self.stream = torch.cuda.Stream(tensor.device)
        self.stream.wait_stream(torch.cuda.current_stream(tensor.device))
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        with torch.cuda.stream(self.stream):
            host.copy_(tensor, non_blocking=True)
        tensor.record_stream(self.stream)  # its memory is reused only after the copy
        copied = torch.cuda.Event()
        copied.record(self.stream)
        return _Saved(host, copied, tensor.device)

    def _unpack(self, saved: Any) -> torch.Tensor:
        import torch

        if not isinstance(saved, _Saved):
            return saved
        if saved.copied is None:
            return saved.host
        if saved.gpu is None:
            self._fetch(saved)
        stream = torch.cuda.current_stream(saved.device)
        stream.wait_event(saved.fetched)
        saved.gpu.record_stream(stream)  # allocated on the side stream, used (and freed) on this one
        return saved.gpu

    def _fetch(self, saved: _Saved) -> None:
        import torch

        with torch.cuda.stream(self.stream):
            saved.gpu = saved.host.to(saved.device, non_blocking=True)
            saved.fetched = torch.cuda.Event()
            saved.fetched.record(self.stream)

    def prefetch(self, index: int) -> None:
        """Start copying back what the highest offloaded layer at or below layer `index` saved: called when the
        gradient of layer `index`'s output arrives, just before its backward pass, so the copy overlaps the backward
        passes of the layers between (at most IN_FLIGHT offloaded layers on the GPU: this one and the one in use)."""
        for i in [i for i in self.indices if i <= index][-1:]:
            layer = self.layers.get(i)
            for ref in layer.saved if layer is not None else ():
                saved = ref()
                if saved is not None and saved.copied is not None and saved.gpu is None:
                    self._fetch(saved)


def offload_layers(layers: list[Any], indices: list[int]) -> int:
    """Offload the saved activations of `layers[i]` for each i in `indices`; the others keep theirs, or recompute
    them as checkpointing.py and mlp.py set (an offloaded layer must do neither). Layers an earlier call offloaded
    and this one does not name are restored. Returns how many layers are offloaded."""
    parameters = {p.untyped_storage().data_ptr() for i in indices for p in layers[i].parameters()}
    offloader = Offloader(list(indices), parameters)
    for index, layer in enumerate(layers):
        if hasattr(layer, UNWRAPPED):  # an earlier Trainer's choice on the same model
            layer.forward = getattr(layer, UNWRAPPED)
            delattr(layer, UNWRAPPED)
        if hasattr(layer, HOOKED):
            getattr(layer, HOOKED).remove()
            delattr(layer, HOOKED)
        if not indices:
            continue
        if index in offloader.indices:
            setattr(layer, UNWRAPPED, layer.forward)
            layer.forward = types.MethodType(_forward(offloader, index, layer.forward), layer)
        setattr(layer, HOOKED, layer.register_forward_hook(_prefetching(offloader, index)))
    return len(offloader.indices)


def _forward(offloader: Offloader, index: int, run: Any) -> Any:
    def forward(_layer: Any, *args: Any, **kwargs: Any) -> Any:
        return offloader.forward(index, run, args, kwargs)

    return forward


def _prefetching(offloader: Offloader, index: int) -> Any:
    """A forward hook: the gradient of the layer's output arrives just before its backward pass; then fetch the
    offloaded layers below, so that their copies back overlap the backward passes in between."""
    import torch

    def hook(_layer: Any, _args: Any, out: Any) -> None:
        hidden = out[0] if isinstance(out, tuple) else out
        if isinstance(hidden, torch.Tensor) and hidden.requires_grad and torch.is_grad_enabled():
            hidden.register_hook(lambda grad: offloader.prefetch(index))

    return hook
