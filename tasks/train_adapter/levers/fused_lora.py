"""A LoRA-wrapped linear layer as one autograd Function: fewer ops, autograd nodes and Python calls per step.

peft runs each LoRA layer as a base-layer module call (bitsandbytes' Linear4bit -> MatMul4Bit), a clone,
dropout, lora_A and lora_B module calls with their dtype casts, a scale and an add: about a dozen ops and
half a dozen autograd nodes per projection, three times per micro-step with checkpointing (forward,
recompute, backward). On a GPU with small micro-batches that host-side work, not the GPU, sets the speed.
Here the same maths runs as

    y = x @ W.T + scale * (x @ A.T) @ B.T        (W: the frozen base weight, 4-bit or not)

in one compute dtype inside one torch.autograd.Function, whose backward dequantizes W again rather than
keeping it (memory) and returns grad_x, grad_A, grad_B. Only forward and backward change: the parameters,
their names and the saved adapter stay peft's own. A layer falls back to peft's forward whenever the fused
maths would differ: dropout > 0 in training, merged or disabled adapters, several active adapters, DoRA
and other variants, extra forward arguments, a trainable base weight or bias.
"""

from __future__ import annotations

import functools
import types
from typing import TYPE_CHECKING, Any

import tasks.train_adapter.levers.recompute_skip as recompute_skip
from tasks.config import SpeedArgs

if TYPE_CHECKING:
    import torch

PATCHED = "_qlora_fused_forward"  # attribute marking a layer whose forward is ours: the plain function it replaced
CAST = "_qlora_cast"  # attribute of a LoRA weight holding its cast to the compute dtype: (key, tensor)
_optimizer_steps = [0]  # optimizer steps taken in this process (any optimizer), for CAST's key


def fuses_lora(speed: SpeedArgs) -> bool:
    """speed.fused_lora, or for None: on, except with FSDP, which shards the base weights the fused backward reads."""
    return speed.fused_lora if speed.fused_lora is not None else not speed.fsdp


def apply(model: Any, speed: SpeedArgs) -> str | None:
    """speed.fused_lora and speed.recompute_skip, after LoRA wraps the model: what they applied, for the log line.
    Recomputation skips only inside fused layers (recompute_skip.py); its verdicts are reset either way."""
    applied = [f"fused LoRA layers ({fuse_lora_layers(model)})"] if fuses_lora(speed) else []
    recompute_skip.configure(model, speed.recompute_skip)
    if applied and speed.recompute_skip:
        applied.append("recomputation skipping the LoRA outputs it never reads, where the autograd graph shows so")
    return ", ".join(applied) or None


def fuse_lora_layers(model: Any) -> int:
    """Give every peft LoRA linear layer over an nn.Linear or bitsandbytes Linear4bit the fused forward.
    Returns how many layers got it."""
    _count_optimizer_steps()
    _function()  # built here, outside any compiled region
    count = 0
    for module in model.modules():
        if type(module) in lora_types() and _base_kind(module.get_base_layer()) and not hasattr(module, PATCHED):
            # the function, not the method bound to this layer: torch.compile then sees the same function in every
            # layer (a per-layer object in the traced code makes it compile each layer anew, past its limit of 8)
            setattr(module, PATCHED, module.forward.__func__)
            module.forward = types.MethodType(_forward, module)
            count += 1
    return count


def unfuse_lora_layers(model: Any) -> int:
    """Undo fuse_lora_layers; returns how many layers were restored."""
    count = 0
    for module in model.modules():
        if hasattr(module, PATCHED):
            del module.forward  # the instance attribute; the class's forward shows again
            delattr(module, PATCHED)
            count += 1
    return count


@functools.cache
def _count_optimizer_steps() -> None:
    """Count every optimizer step in this process (a hook on all torch optimizers, bitsandbytes' included)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    def count(*_: Any) -> None:
        _optimizer_steps[0] += 1

    register_optimizer_step_post_hook(count)


@functools.cache
def lora_types() -> tuple[type, ...]:
    """peft's LoRA linear layer classes: over nn.Linear, and over bitsandbytes' Linear4bit where peft has it."""
    from peft.tuners.lora import Linear as LoraLinear

    types_: list[type] = [LoraLinear]
    try:
        from peft.tuners.lora.bnb import Linear4bit as LoraLinear4bit

        types_.append(LoraLinear4bit)
    except ImportError:  # peft without bitsandbytes support
        pass
    return tuple(types_)


def _base_kind(base: Any) -> str | None:
    """'4bit' for bitsandbytes' Linear4bit, 'linear' for a plain nn.Linear, 'conv1d' for GPT-2's Conv1D (a
    Linear with its weight stored transposed, in x out), else None (not fused)."""
    import torch
    from transformers.pytorch_utils import Conv1D

    try:
        import bitsandbytes as bnb

        if isinstance(base, bnb.nn.Linear4bit):
            return "4bit"
    except ImportError:
        pass
    if type(base) is Conv1D:
        return "conv1d"
    return "linear" if type(base) is torch.nn.Linear else None


def _dropout_free(dropout: Any) -> bool:
    import torch

    return type(dropout) is torch.nn.Identity or (isinstance(dropout, torch.nn.Dropout)
                                                   and (dropout.p == 0 or not dropout.training))


def _forward(self: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """The fused forward of a peft LoRA layer, or peft's own where the fused maths would differ."""
    import torch

    original = functools.partial(getattr(self, PATCHED), self)  # peft's forward

    if args or kwargs or self.disable_adapters or self.merged:
        return original(x, *args, **kwargs)
    active = self.active_adapters
    if len(active) != 1 or active[0] not in self.lora_A or active[0] in self.lora_variant:
        return original(x, *args, **kwargs)
    name = active[0]
    base = self.get_base_layer()
    if not _dropout_free(self.lora_dropout[name]) or base.weight.requires_grad or (
            base.bias is not None and base.bias.requires_grad):
        return original(x, *args, **kwargs)
    a, b = self.lora_A[name].weight, self.lora_B[name].weight
    kind = _base_kind(base)
    autocast = torch.is_autocast_enabled(x.device.type)
    if kind == "4bit":
        if getattr(base.weight, "quant_state", None) is None or getattr(
                base.weight.quant_state, "packing_format_for_cpu", False):
            return original(x, *args, **kwargs)  # bnb's CPU inference layout: its own kernel
        if not base.compute_type_is_set:
            base.set_compute_type(x)
            base.compute_type_is_set = True
        base_dtype = base.compute_dtype or x.dtype
    else:
        base_dtype = base.weight.dtype
    if autocast:
        # peft's lora_A/lora_B run in the autocast dtype; bnb's matmul does too where it falls back to F.linear
        dtype = torch.get_autocast_dtype(x.device.type)
        out_dtype = torch.promote_types(x.dtype, dtype) if kind == "4bit" else dtype
    elif x.dtype == base_dtype == a.dtype == b.dtype:
        dtype = out_dtype = x.dtype
    else:
        return original(x, *args, **kwargs)  # peft casts between dtypes here; keep its exact rounding
    # a recomputation that never reads this layer's output skips it (recompute_skip.py); not inside a compiled
    # region, whose graph cannot hold the per-thread scopes (the layer then computes, as it always did)
    skip = torch.is_grad_enabled() and not torch.compiler.is_compiling() and recompute_skip.skips(base)
    out = _function().apply(x, a, b, base, kind, float(self.scaling[name]), dtype, out_dtype, skip)
    # shaped outside the Function: a view made inside one may not be modified in place, and Falcon adds to its
    # MLP's output in place (`mlp_output += attention_output`)
    return out.view(*x.shape[:-1], out.shape[-1])


def _base_matmul(base: Any, kind: str, x: torch.Tensor) -> torch.Tensor:
    """x @ W.T (+ frozen bias) in x's dtype, without autograd (called inside the Function)."""
    import torch

    if kind == "4bit":
        import bitsandbytes as bnb

        bias = None if base.bias is None else _cast(base.bias, x.dtype)
        # grad mode is off in a Function's forward: bnb calls its gemm_4bit op directly, as MatMul4Bit does
        return bnb.matmul_4bit(x, base.weight, bias=bias, quant_state=base.weight.quant_state)
    bias = None if base.bias is None else _cast(base.bias, x.dtype)
    weight = _cast(base.weight, x.dtype)
    return torch.nn.functional.linear(x, weight.t() if kind == "conv1d" else weight, bias)


def _base_weight(base: Any, kind: str, dtype: torch.dtype) -> torch.Tensor:
    """W (out x in) in dtype: dequantized again for the backward pass, never kept between passes."""
    if kind == "4bit":
        import bitsandbytes.functional as bnb_f

        return _cast(bnb_f.dequantize_4bit(base.weight.data.view(-1, 1), base.weight.quant_state), dtype)
    return _cast(base.weight.t() if kind == "conv1d" else base.weight, dtype)


def _weight(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A LoRA weight in the compute dtype, cast once per optimizer step instead of in every forward,
    recomputation and backward (4 fewer kernel launches per layer per micro-step; launches are what the host
    spends its time on at small micro-batches). The cast is the same; it is made again after any optimizer step
    (the optimizers' hook) or in-place change (the version counter: a loaded checkpoint). Both are needed:
    bitsandbytes' 8-bit optimizers write the weights without moving the version counter."""
    import torch

    if p.dtype == dtype:
        return p
    if torch.compiler.is_compiling():
        # a compiled graph cannot hold this cache (Dynamo cannot guard on data_ptr or _version: a graph break
        # at every LoRA layer on a GPU), and needs none: the cast is one node that inductor fuses
        return p.detach().to(dtype)
    key = (_optimizer_steps[0], p._version, p.data_ptr(), dtype)  # data_ptr: new storage put in by `p.data =`
    cached = getattr(p, CAST, None)
    if cached is not None and cached[0] == key:
        return cached[1]
    value = p.detach().to(dtype)
    setattr(p, CAST, (key, value))
    return value


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)  # no dispatcher call when there is nothing to do


_FUNCTION: Any = None  # the autograd Function class, once built


def _function() -> Any:
    """The autograd Function class, built on first use (fuse_lora_layers) and then read from a module global:
    to torch.compile (Dynamo) that read is a constant, where a class definition, or a functools.cache wrapper
    that Dynamo traces through to one, breaks the graph at every LoRA layer (26 breaks in the tiny 4-bit Llama's
    four layers; with the global, none: bench/probe_compile.py)."""
    global _FUNCTION
    if _FUNCTION is None:
        _FUNCTION = _build_function()
    return _FUNCTION


def _build_function() -> Any:
    import torch

    class _FusedLoraLinear(torch.autograd.Function):
        """y = x @ W.T + scale * (x @ A.T) @ B.T; gradients for x, A and B."""

        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, base: Any, kind: str,
                    scale: float, dtype: torch.dtype, out_dtype: torch.dtype, skip: bool = False) -> torch.Tensor:
            shape = x.shape
            x2 = _cast(x.reshape(-1, shape[-1]), dtype)
            a_c, b_c = _weight(a, dtype), _weight(b, dtype)
            xa = torch.mm(x2, a_c.t())  # (tokens, r)
            setattr(ctx, recompute_skip.SKIPPABLE, base)
            if skip:  # nothing reads the output (recompute_skip.py): its shape, not its values
                out = x2.new_empty((x2.shape[0], b.shape[0]), dtype=out_dtype)
            else:
                out = _base_matmul(base, kind, x2)
                if out.dtype == dtype:
                    out = out.addmm_(xa, b_c.t(), alpha=scale)
                else:
                    out = out + scale * torch.mm(xa, b_c.t())
            ctx.base, ctx.kind, ctx.scale, ctx.dtype, ctx.x_dtype, ctx.shape = base, kind, scale, dtype, x.dtype, shape
            ctx.save_for_backward(x2 if ctx.needs_input_grad[1] else None, xa if ctx.needs_input_grad[2] else None,
                                  a, b)
            return _cast(out, out_dtype)  # (tokens, out features): the caller shapes it

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
            x2, xa, a, b = ctx.saved_tensors
            dtype, scale = ctx.dtype, ctx.scale
            g = _cast(grad.reshape(-1, grad.shape[-1]), dtype)
            grad_x = grad_a = grad_b = None
            g_xa = torch.mm(g, _weight(b, dtype)).mul_(scale)  # gradient at x @ A.T, (tokens, r)
            if ctx.needs_input_grad[0]:
                grad_x = torch.mm(g, _base_weight(ctx.base, ctx.kind, dtype)).addmm_(g_xa, _weight(a, dtype))
                grad_x = _cast(grad_x.view(ctx.shape), ctx.x_dtype)
            if ctx.needs_input_grad[1]:
                grad_a = _cast(torch.mm(g_xa.t(), x2), a.dtype)
            if ctx.needs_input_grad[2]:
                grad_b = _cast(torch.mm(g.t(), xa).mul_(scale), b.dtype)
            return grad_x, grad_a, grad_b, None, None, None, None, None, None

    return _FusedLoraLinear
