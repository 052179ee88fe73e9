"""What a model family or a CPU needs that transformers and bitsandbytes do not do for it: a family's nn.Linear
subclasses quantized as nn.Linear (SAME_AS_LINEAR), and bitsandbytes' CPU repacking kept to the shapes it takes.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

# transformers' bitsandbytes integration quantizes only layers whose type is exactly nn.Linear (replace_with_bnb_linear,
# transformers 5.24). Falcon builds its projections from FalconLinear, an nn.Linear subclass that computes the same
# input @ weight.T + bias, so its "4-bit" checkpoint kept every layer in bf16 (modules.json counted no 4-bit
# layer). While such a model is built, the subclass's name in its modeling module stands for nn.Linear itself. Other
# nn.Linear subclasses in transformers (routers, grouped or decoupled layers) compute something else and are not
# listed.
SAME_AS_LINEAR = {"falcon": ("transformers.models.falcon.modeling_falcon", "FalconLinear")}


@contextmanager
def plain_linear_layers(model_folder: Path) -> Iterator[None]:
    """While the model in `model_folder` is built: its family's nn.Linear subclasses of the same maths (SAME_AS_LINEAR)
    are built as nn.Linear, so bitsandbytes quantizes them and a 4-bit checkpoint of them loads."""
    import importlib

    import torch

    try:
        model_type = json.loads((Path(model_folder) / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError):
        model_type = None  # from_pretrained reports the folder's problem itself
    if model_type not in SAME_AS_LINEAR:
        yield
        return
    module_name, name = SAME_AS_LINEAR[model_type]
    module = importlib.import_module(module_name)
    original = getattr(module, name)
    setattr(module, name, torch.nn.Linear)
    try:
        yield
    finally:
        setattr(module, name, original)


CPU_PACK_ROWS = 32  # bitsandbytes' CPU inference layout packs the output rows in blocks of this many


def keep_cpu_repacking_to_fitting_shapes(model: Any) -> int:
    """Turn off bitsandbytes' CPU inference repacking for the 4-bit layers whose shapes it cannot take.

    On a CPU with AVX512-BF16, a Linear4bit in eval mode without gradients repacks its weight for a faster kernel
    on its first forward, asserting `N % block_n == 0` (bitsandbytes 0.50: output features in blocks of 32, input
    features in whole quantization blocks). stories260K's MLP (172 wide) failed there, in evaluation, and only on
    such CPUs. Those layers keep the plain 4-bit matmul, the others the fast path. Returns how many were turned off."""
    import bitsandbytes as bnb

    count = 0
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit) and getattr(module, "support_avx512bf16_for_cpu", False):
            state = getattr(module.weight, "quant_state", None)
            block = state.blocksize if state is not None else 64
            if module.out_features % CPU_PACK_ROWS or module.in_features % block:
                module.support_avx512bf16_for_cpu = False  # Linear4bit.forward reads it before repacking
                count += 1
    return count
