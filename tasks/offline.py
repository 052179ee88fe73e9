"""bitsandbytes loads without asking the Hub for a kernel (README: a run reaches the network only for a hub id you
give it).

bitsandbytes 0.50 decides at import (backends/cpu/ops.py), on a CPU with AVX512-BF16 (`has_avx512bf16()`), to fetch
`kernels-community/quantization-bitsandbytes` through the `kernels` package, whose `get_kernel` asks the Hub's API;
it has no setting for that, and falls back to its own CPU kernel when `import kernels` fails. transformers requires
`kernels`, and importing its Trainer (or peft) imports bitsandbytes, so every stage that loads a model met it: a
name lookup of huggingface.co at each start, and a warning. Here bitsandbytes is imported with `kernels` made
unimportable (None in sys.modules, the import system's own "not importable" mark) for the length of its import only;
other code imports `kernels` as before (transformers' Hub kernels are off by tasks/models/loading.py LOAD_KWARGS).

The finder is put in place by importing the `tasks` package, before anything of the pipeline can import
bitsandbytes. Imports the standard library only (the UI form imports `tasks` without torch).
"""

from __future__ import annotations

import importlib.abc
import logging
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

HUB_KERNELS = "kernels"  # the package bitsandbytes' CPU backend fetches a Hub kernel with
_ABSENT = object()


class _WithoutHubKernels(importlib.abc.MetaPathFinder):
    """Finds bitsandbytes as the other finders do, and runs its import without `kernels`."""

    def find_spec(self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
                  ) -> ModuleSpec | None:
        if name != "bitsandbytes":
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Loader(spec.loader)
                return spec
        return None


class _Loader(importlib.abc.Loader):
    """bitsandbytes' own loader, its module executed while `kernels` cannot be imported."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        with _hub_kernels_unimportable():
            self._loader.exec_module(module)

    def __getattr__(self, name: str) -> Any:  # get_resource_reader, get_filename, is_package: the loader's own
        return getattr(self._loader, name)


class _DropHubKernelWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "kernels-community" not in record.getMessage()  # the fallback bitsandbytes then takes is ours to choose


@contextmanager
def _hub_kernels_unimportable() -> Iterator[None]:
    saved = sys.modules.get(HUB_KERNELS, _ABSENT)
    sys.modules[HUB_KERNELS] = None  # type: ignore[assignment]  # `import kernels` raises ImportError
    quiet, ops = _DropHubKernelWarning(), logging.getLogger("bitsandbytes.backends.cpu.ops")
    ops.addFilter(quiet)
    try:
        yield
    finally:
        ops.removeFilter(quiet)
        if saved is _ABSENT:
            sys.modules.pop(HUB_KERNELS, None)
        else:
            sys.modules[HUB_KERNELS] = saved


def keep_bitsandbytes_offline() -> None:
    """Put the finder first on sys.meta_path (idempotent). Where bitsandbytes was imported already, it is too late for
    this process: say so once."""
    if any(isinstance(finder, _WithoutHubKernels) for finder in sys.meta_path):
        return
    sys.meta_path.insert(0, _WithoutHubKernels())
    if "bitsandbytes" in sys.modules:
        logging.getLogger(__name__).warning(
            "bitsandbytes was imported before the pipeline's `tasks` package: on a CPU with AVX512-BF16 it may have "
            "asked the Hub for a kernel. Import `tasks` first.")
