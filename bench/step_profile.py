"""Where the time of whole Trainer steps goes: a torch.profiler callback over a few optimizer steps.

bench_microstep.py times one forward + backward alone; this looks at the steps as the Trainer runs them, the
optimizer, the data loader and the callbacks included, and answers: how long is the GPU idle, and what was the
host doing while it was (the CPU op open on the main thread when each idle gap began)."""

from __future__ import annotations

import time
from typing import Any

from transformers import TrainerCallback

MIN_GAP_US = 200  # idle stretches shorter than this are launch latency, not a stall


class StepProfile(TrainerCallback):
    """Profiles optimizer steps first..first+count-1 (1-based), then summarises them into .report."""

    def __init__(self, first: int = 3, count: int = 3) -> None:
        self.first, self.count = first, count
        self.prof: Any = None
        self.report: dict[str, Any] = {}

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step + 1 == self.first:
            import torch
            from torch.profiler import ProfilerActivity, profile

            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            self.prof.__enter__()
            self.t0 = time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.prof is not None and state.global_step == self.first + self.count - 1:
            import torch

            if torch.cuda.is_available():
                torch.cuda.synchronize()
            wall = time.perf_counter() - self.t0
            self.prof.__exit__(None, None, None)
            self.report = summarize(self.prof, wall, self.count)
            self.prof = None


def summarize(prof: Any, wall_s: float, steps: int) -> dict[str, Any]:
    """Per step: wall, GPU busy (union of kernel and copy intervals), idle; the largest idle gaps with the host op
    under way; the ops that make the host wait; top kernels and top host ops."""
    events = list(prof.events())
    gpu = sorted((e.time_range.start, e.time_range.end) for e in events if _on_gpu(e))
    busy, gaps, end = 0.0, [], None
    for start, stop in gpu:
        if end is not None and start - end > MIN_GAP_US:
            gaps.append((start - end, end))
        if end is None or start > end:
            busy += stop - start
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    host = [e for e in events if not _on_gpu(e) and e.time_range.end > e.time_range.start]
    idle_ms = sum(g for g, _ in gaps) / 1e3
    waits = {}
    for e in host:
        if any(w in e.name for w in ("Synchronize", "cudaMemcpy", "item", "_local_scalar_dense")):
            n, t = waits.get(e.name, (0, 0.0))
            waits[e.name] = (n + 1, t + (e.time_range.end - e.time_range.start) / 1e3)
    ka = prof.key_averages()
    return {
        "steps": steps, "wall_ms_per_step": round(wall_s * 1e3 / steps, 1),
        "gpu_busy_ms_per_step": round(busy / 1e3 / steps, 1),
        "gpu_idle_in_gaps_ms_per_step": round(idle_ms / steps, 1),
        "largest_gaps": [{"ms": round(g / 1e3, 2), "host_op": _open_op(host, at)}
                         for g, at in sorted(gaps, reverse=True)[:15]],
        "host_waits_ms": {k: {"calls": n, "ms": round(t, 1)} for k, (n, t) in
                          sorted(waits.items(), key=lambda kv: -kv[1][1])[:10]},
        "top_gpu": ka.table(sort_by="self_device_time_total", row_limit=40, max_name_column_width=60),
        "top_host": ka.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60),
    }


def _on_gpu(e: Any) -> bool:
    return str(e.device_type).endswith("CUDA")


def _open_op(host: list[Any], at: float) -> str:
    """The innermost user-level op (ignoring aten/cuda runtime leaves) running on the host at time `at`."""
    open_ops = [e for e in host if e.time_range.start <= at <= e.time_range.end]
    named = [e for e in open_ops if not e.name.startswith(("aten::", "cuda", "cudnn"))] or open_ops
    if not named:
        return "(none)"
    inner = min(named, key=lambda e: e.time_range.end - e.time_range.start)
    outer = max(named, key=lambda e: e.time_range.end - e.time_range.start)
    return inner.name if inner is outer else f"{outer.name} > {inner.name}"
