"""The 4-bit model dequantized once for inference: whether it fits (eval.dequantize auto), and the conversion."""

from __future__ import annotations

from typing import Any

from tasks.models.memory import free_memory

DEQUANTIZE_MARGIN = 0.15  # share of the memory left free beside the dequantized copy: activations, logits, KV cache


def dequantized_extra_bytes(model: Any) -> int:
    """Bytes the 4-bit layers of `model` grow by when dequantized to their compute dtype."""
    import bitsandbytes as bnb

    extra = 0
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            state = module.weight.quant_state
            extra += module.in_features * module.out_features * state.dtype.itemsize - module.weight.nbytes
    return extra


def dequantize_decision(model: Any, choice: bool | str) -> tuple[bool, str]:
    """(whether to dequantize the 4-bit model for inference, why) for eval.dequantize true/false/auto."""
    extra = dequantized_extra_bytes(model)
    if extra <= 0:
        return False, "no 4-bit layers"
    # auto dequantizes on CPU too when the copy fits: the 4-bit layer dequantizes every weight on every forward
    # (docs/performance.md, "Evaluation", has the CPU figures)
    if choice is not True and choice is not False:  # auto: the copy must fit with a margin
        on = next(model.parameters()).device.type
        free, total = free_memory(on)
        fits = extra + DEQUANTIZE_MARGIN * total <= free
        where = "GPU" if on == "cuda" else "host"
        return fits, (f"auto: the dequantized copy adds {extra / 2**30:.2f} GiB, {free / 2**30:.1f} GiB of "
                       f"{total / 2**30:.1f} GiB {where} memory free ({'fits' if fits else 'does not fit'} with a "
                       f"{DEQUANTIZE_MARGIN:.0%} margin)")
    return bool(choice), f"eval.dequantize={str(choice).lower()}"


def dequantize_in_place(model: Any) -> Any:
    """Replace every bnb 4-bit Linear by a plain Linear holding its weight dequantized to the layer's compute dtype,
    one layer at a time (peak: the 4-bit model plus one layer). A 4-bit layer computes exactly this: it dequantizes
    the same NF4 weight to the compute dtype and runs the same matmul, on every forward. Not transformers'
    model.dequantize() (which export_adapter's merge uses): that one dequantizes each weight twice, casts to the
    config's dtype rather than each layer's compute dtype, and cannot tell a weight bnb repacked for its CPU kernel."""
    import bitsandbytes as bnb
    import torch

    for name, module in list(model.named_modules()):
        if not isinstance(module, bnb.nn.Linear4bit):
            continue
        if getattr(module.weight.quant_state, "packing_format_for_cpu", False):
            raise RuntimeError(f"{name}: bitsandbytes already repacked this weight for its CPU kernel; dequantize "
                               "before the model's first forward")
        linear = torch.nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                                 device="meta")
        linear.weight = torch.nn.Parameter(dequantized_weight(module), requires_grad=False)
        if module.bias is not None:
            linear.bias = module.bias
        model.set_submodule(name, linear)
    model.is_loaded_in_4bit = False  # peft then attaches LoRA to plain Linear layers
    return model


def dequantized_weight(module: Any) -> Any:
    """A bnb 4-bit Linear's weight dequantized to the layer's compute dtype: the matrix its forward multiplies by
    (bitsandbytes dequantizes the same NF4 weight to the compute dtype on every forward)."""
    import bitsandbytes as bnb

    weight = bnb.functional.dequantize_4bit(module.weight.data, module.weight.quant_state)
    return weight.to(module.compute_dtype or weight.dtype)
