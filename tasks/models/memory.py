"""Device memory between stages: what is free, handing torch's cache back, the allocator setting training changes,
and the garbage collector's start-up freeze (a flow hook).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def free_memory(on: str) -> tuple[int, int]:
    """(free, total) bytes of the GPU, or of the host's memory on CPU (MemAvailable, MemTotal)."""
    import torch

    if on == "cuda":
        return torch.cuda.mem_get_info()
    pages = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in
             Path("/proc/meminfo").read_text().splitlines() if line.startswith(("MemAvailable", "MemTotal"))}
    return pages.get("MemAvailable", 0), pages.get("MemTotal", 0)


@contextmanager
def allocator_restored() -> Iterator[None]:
    """Run training, then put back the CUDA allocator setting it changed: training turns on expandable segments
    (train_adapter/plan.py prepare_base: reserved memory stays near allocated), a process-wide setting that
    evaluate_adapter and export_adapter, in the same process in a run without the GPU pool, did not choose (in a
    fresh process neither setting changes evaluation's time: docs/performance.md, "Evaluation")."""
    try:
        yield
    finally:
        import torch

        if torch.cuda.is_available():
            release_device_memory()  # the segments are unmapped before the allocator changes mode
            conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", os.environ.get("PYTORCH_ALLOC_CONF", ""))
            set_expandable_segments("expandable_segments:True" in conf)


def set_expandable_segments(on: bool) -> None:
    """Turn the CUDA caching allocator's expandable segments on or off for this process (new segments only)."""
    import torch

    # torch 2.10 moved the setter (the old name warns, FutureWarning, on every call)
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or torch.cuda.memory._set_allocator_settings
    setter(f"expandable_segments:{on}")


def freeze_startup_objects(*_hook_args: object, **_hook_kwargs: object) -> None:
    """A flow on_running hook: every object alive when the flow starts (the imported modules, their classes and
    functions) leaves the garbage collector's reach (gc.freeze), once per process.

    Why: release_device_memory's gc.collect(), which frees a model held in reference cycles, scanned them all at
    every call, three to four calls per run (docs/performance.md, "Evaluation", has the seconds). Frozen objects
    that later become garbage in a cycle are never freed: harmless for what exists at a flow's start, unless a
    GPU already holds tensors (a notebook with a model loaded), and then the freeze steps aside."""
    import gc
    import sys

    torch = sys.modules.get("torch")
    if gc.get_freeze_count() or (torch is not None and torch.cuda.is_initialized()
                                 and torch.cuda.memory_allocated() > 0):
        return
    gc.freeze()


def release_device_memory() -> None:
    """Hand the GPU memory torch cached for freed tensors back (no-op on CPU), so later stages see it free."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
