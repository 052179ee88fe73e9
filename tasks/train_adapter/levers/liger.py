"""Liger kernels (RMSNorm, SwiGLU, RoPE) when liger-kernel is installed and a GPU is present."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from tasks.config import SpeedArgs
from tasks.log import logger

# (module, attribute, value before Liger) for every module-level name Liger replaced in this process
_REPLACED: list[tuple[Any, str, Any]] = []


def apply(model: Any, speed: SpeedArgs) -> str | None:
    """speed.use_liger_kernel, before LoRA wraps the model: what it applied, for the log line (apply_liger says why
    it steps aside)."""
    return "liger" if apply_liger(model, speed.use_liger_kernel) else None


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

        recorded(lambda: _apply_liger_kernel_to_instance(
            model=model, rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False))
    except Exception as exc:  # an incompatible liger/transformers pair must not stop training
        logger().warning("train_adapter: Liger kernels not applied (%s: %s)", type(exc).__name__, exc)
        return False
    return True


def recorded(patch: Callable[[], Any]) -> None:
    """Run `patch`, noting every module-level name of transformers' modeling modules it replaced (patches_undone)."""
    before = _modeling_modules()
    patch()
    _REPLACED.extend((sys.modules[name], key, value) for name, saved in before.items()
                     for key, value in saved.items() if vars(sys.modules[name]).get(key) is not value)


def _modeling_modules() -> dict[str, dict[str, Any]]:
    """A shallow copy of the namespace of every transformers modeling module loaded now."""
    return {name: dict(vars(module)) for name, module in list(sys.modules.items())
            if name.startswith("transformers.models.") and ".modeling_" in name and module is not None}


@contextmanager
def patches_undone() -> Iterator[None]:
    """Train inside; afterwards the modeling modules are as before Liger patched them.

    Why: given a model instance, Liger still replaces module-level names (Llama's LlamaRMSNorm, LlamaMLP and
    apply_rotary_pos_emb in modeling_llama), so every model of that family loaded later in the process is built
    with Liger's Triton modules. In a run without the GPU pool, evaluate_adapter and export_adapter load the model in
    the training process: they then evaluated with other kernels than a run whose training was cached (numbers that
    depend on the cache), and new batch shapes met Triton's compiles (docs/performance.md, "Evaluation")."""
    try:
        yield
    finally:
        while _REPLACED:
            module, key, value = _REPLACED.pop()  # the latest first: a name patched twice gets its first value
            setattr(module, key, value)
