"""Packed attention: flash varlen attention over the examples of a packed row on CUDA, sdpa elsewhere.

A micro-batch is one row of whole examples with per-example position ids. On a CUDA GPU attention runs as flash
varlen attention over the examples' boundaries (torch's varlen_attn); elsewhere transformers' sdpa builds a
block-diagonal causal mask from the position ids. Either way no example attends to another.
"""

from __future__ import annotations

import functools
import inspect
from typing import TYPE_CHECKING, Any

from tasks.config import SpeedArgs
from tasks.log import logger

if TYPE_CHECKING:
    import torch

VARLEN = "qlora_varlen"  # attention implementation name registered with transformers


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
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cu = kwargs.get("cu_seq_lens_q")
    if cu is None or query.shape[0] != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))  # (1, H, T, D) -> (T, H, D)
    fn = _varlen_fn() if q.is_cuda else None
    if fn is not None and q.dtype not in (torch.float16, torch.bfloat16):
        # flash kernels take half precision only; GPT-NeoX's partial rotary hands q/k over in float32
        q, k, v = (t.to(_half_dtype(module, value)) for t in (q, k, v))
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
    window = kwargs.get("sliding_window")
    if window and max_len > window:  # a sliding-window layer (Mistral, Gemma) over examples longer than it
        extra["window_size"] = (window - 1, 0)
    out = varlen(q, k, v, cu, cu, max_len, max_len, **extra)
    return out.to(query.dtype).unsqueeze(0), None


def _half_dtype(module: Any, value: torch.Tensor) -> torch.dtype:
    """The half-precision dtype attention runs in: the autocast dtype, else the value's or the weights' dtype."""
    import torch

    if torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda")
    if value.dtype in (torch.float16, torch.bfloat16):
        return value.dtype
    weight = next((p for p in module.parameters() if p.dtype in (torch.float16, torch.bfloat16)), None)
    return weight.dtype if weight is not None else torch.bfloat16


def apply(model: Any, speed: SpeedArgs) -> str | None:
    """speed.packing, before LoRA wraps the model: packed rows attend example by example; the implementation in use,
    for the log line."""
    return f"packed attention ({use_packed_attention(model)})" if speed.packing else None


def unsupported(model: Any) -> str | None:
    """Why the varlen kernel steps aside for this model (its packed rows then attend through a dense mask), or None."""
    return varlen_unsupported(model.config, type(model))


def varlen_unsupported(config: Any, model_class: type | None = None) -> str | None:
    """Why the flash varlen kernel cannot run this model's attention exactly, or None."""
    if model_class is not None and not getattr(model_class, "_supports_attention_backend", False):
        # Falcon: its attention calls sdpa itself under the name "sdpa" and computes eager scores under any other, one
        # T x T matrix per head; under "sdpa" it runs the dense mask, which the memory plan counts (dense_attention)
        return f"{model_class.__name__} runs its own attention code, not transformers' attention functions"
    if getattr(config, "attn_logit_softcapping", None):  # Gemma 2: the kernel has no soft-capping
        return f"attention logits soft-capped at {config.attn_logit_softcapping} ({config.model_type})"
    if getattr(config, "attention_dropout", 0) or getattr(config, "attn_pdrop", 0):  # GPT-2: the kernel has no dropout
        return "attention dropout (the varlen kernel has none)"
    return None


def dense_attention(model: Any) -> bool:
    """Whether packed rows attend through a T x T block-diagonal mask (sdpa or eager: the varlen kernel is not in
    use), so that attention's memory and time grow with the pack's square (the memory plan counts them)."""
    return model.config._attn_implementation != VARLEN


def use_packed_attention(model: Any) -> str:
    """Route the model's attention through packed_attention; returns the implementation now in use."""
    import torch

    if not (torch.cuda.is_available() and _varlen_fn() is not None):
        return model.config._attn_implementation  # sdpa masks packed rows block-diagonally from position ids
    reason = unsupported(model)
    if reason:
        logger().info("train_adapter: varlen attention steps aside: %s; packed rows are masked block-diagonally "
                      "by %s instead", reason, model.config._attn_implementation)
        return model.config._attn_implementation
    set_packed_attention(model)
    return VARLEN


def set_packed_attention(model: Any) -> None:
    """Register packed_attention with transformers under VARLEN and set it as the model's attention (on a CPU it
    runs sdpa per example: the tests use it there)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(VARLEN, packed_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(VARLEN, lambda *args, **kwargs: None)  # boundaries come from cu_seq_lens
    model.set_attn_implementation(VARLEN)
