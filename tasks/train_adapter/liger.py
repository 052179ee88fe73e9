"""Liger kernels (RMSNorm, SwiGLU, RoPE) when liger-kernel is installed and a GPU is present."""

from __future__ import annotations

from typing import Any

from tasks.log import logger


def apply_liger(model: Any, wanted: bool | None) -> bool:
    """Liger's RMSNorm, SwiGLU and RoPE kernels (the loss is ours); None = where installed and on a GPU."""
    import importlib.util

    import torch

    if wanted is False or not torch.cuda.is_available():
        return False
    if importlib.util.find_spec("liger_kernel") is None:
        if wanted:
            logger().warning("train_adapter: speed.use_liger_kernel is set but liger-kernel is not installed "
                             "(pip install 'qlora-pipeline[gpu]'); training without it")
        return False
    try:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

        if model.config.model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:  # GPT-2, GPT-NeoX, ...
            logger().info("train_adapter: Liger steps aside: it has no kernels for model type %r",
                          model.config.model_type)
            return False

        _apply_liger_kernel_to_instance(model=model, rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                        fused_linear_cross_entropy=False)
    except Exception as exc:  # an incompatible liger/transformers pair must not stop training
        logger().warning("train_adapter: Liger kernels not applied (%s: %s)", type(exc).__name__, exc)
        return False
    return True
