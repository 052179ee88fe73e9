"""Anatomy of one train_adapter micro-step on a GPU: where small micro-batches lose their speed.

For each setting (a set of TrainArgs overrides, each in a fresh process so that patches and memory peaks are its
own) and each micro-batch size in tokens, times forward + backward of one packed micro-batch of bench_train's
synthetic examples through train_adapter's own model and Trainer set-up (no optimizer step):

  host_ms   time until backward() returns, before waiting for the GPU: the CPU's share (launches, Python)
  wall_ms   time until the GPU is done
  peak_gib  peak allocated GPU memory of the micro-step, model included

host close to wall means the CPU sets the pace (the GPU waits for launches, or for a synchronizing call); then
each setting also records every synchronizing CUDA call of one micro-step (torch.cuda.set_sync_debug_mode) and
a profile of the CPU side (self CPU time by op).

usage (after bench_train's build, which leaves the 4-bit model; see bench/README.md for the wheels):
  python3 bench/bench_microstep.py --model-dir-4bit DIR --settings '[{"name": "defaults", "train": {},
      "tokens": [2048, 4096, 8192]}]' --out $OUT/microstep.json
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import bench_train as bt  # noqa: E402

GIB = 2**30


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    from tasks.config import LoraArgs
    from tasks.on_disk.parquet_dataset import ParquetExamples
    from tasks.train_adapter import builder
    from tasks.train_adapter.methods import sft

    model_dir = Path(spec["model_dir_4bit"])
    train, speed = bt.settings({"logging_steps": 1, "save_steps": 10**6, **spec["train"]})
    data = Path(spec["work"]) / "microstep" / "train.parquet"
    if not data.exists():
        bt.write_examples(data, bt.token_rows(bt.lengths(4000, 2048), spec.get("vocab", bt.VOCAB)))
    examples = ParquetExamples(data)
    model = builder.adapted(sft.UNIT, model_dir, LoraArgs(), train, speed)[0]
    trainer, chosen = builder.trainer_for(sft.UNIT, model, None, train, speed, examples, data.parent / spec["name"],
                                          model_dir)
    collator = trainer.data_collator
    out: dict[str, Any] = {"name": spec["name"], "train": spec["train"], "choice": dataclasses.asdict(chosen),
                           "model_allocated_gib": round(torch.cuda.memory_allocated() / GIB, 3)
                           if torch.cuda.is_available() else None, "sizes": []}
    model.train()
    for tokens in spec["tokens"]:
        batch = bt._batch(collator, examples, bt.first_examples(examples, tokens))
        real = int(batch["input_ids"].numel())
        try:
            out["sizes"].append({"tokens": real, **time_steps(model, batch)})
        except torch.OutOfMemoryError as exc:
            out["sizes"].append({"tokens": real, "oom": str(exc).splitlines()[0][:160]})
        print("SIZE " + json.dumps(out["sizes"][-1]), flush=True)
    if spec.get("inspect_tokens"):
        batch = bt._batch(collator, examples, bt.first_examples(examples, spec["inspect_tokens"]))
        out["syncs"] = sync_sites(model, batch)
        out["profile"] = profile(model, batch)
    return out


def step(model: Any, batch: dict[str, Any]) -> None:
    with bt._autocast():
        loss = model(**batch).loss
    loss.backward()


def time_steps(model: Any, batch: dict[str, Any], warm: int = 2, timed: int = 4) -> dict[str, Any]:
    import torch

    for _ in range(warm):
        step(model, batch)
    bt._sync()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    host, wall = [], []
    for _ in range(timed):
        t = time.perf_counter()
        step(model, batch)
        host.append(time.perf_counter() - t)
        bt._sync()
        wall.append(time.perf_counter() - t)
    model.zero_grad(set_to_none=True)
    med = sorted(wall)[len(wall) // 2]
    return {"host_ms": round(1e3 * sorted(host)[len(host) // 2], 1), "wall_ms": round(1e3 * med, 1),
            "tokens_per_s": round(int(batch["input_ids"].numel()) / med), **bt._peaks()}


def sync_sites(model: Any, batch: dict[str, Any]) -> dict[str, int]:
    """Every call that makes the CPU wait for the GPU during one micro-step, by where it was made."""
    import torch

    if not torch.cuda.is_available():
        return {}
    sites: collections.Counter[str] = collections.Counter()

    def record(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        frames = [f for f in traceback.extract_stack()[:-1] if "warnings" not in f.filename]
        where = " < ".join(f"{Path(f.filename).name}:{f.lineno}:{f.name}" for f in reversed(frames[-5:]))
        sites[f"{str(message)[:60]} @ {where}"] += 1

    with warnings.catch_warnings():  # restores warnings.showwarning on the way out
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode(1)
        try:
            step(model, batch)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    model.zero_grad(set_to_none=True)
    return dict(sites.most_common(30))


def profile(model: Any, batch: dict[str, Any]) -> str:
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    step(model, batch)
    bt._sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with torch_profile(activities=activities) as prof:
        step(model, batch)
        bt._sync()
    model.zero_grad(set_to_none=True)
    ka = prof.key_averages()
    return (ka.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60)
            + ka.table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=60))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir-4bit", help="prepare_model's output folder for the 8B-shaped model")
    ap.add_argument("--work", default="/tmp/qlora-bench")
    ap.add_argument("--settings", help="JSON list of {name, train: TrainArgs overrides, tokens: [..], "
                    "inspect_tokens: N (optional: sync sites and a profile at this size)}")
    ap.add_argument("--vocab", type=int, default=bt.VOCAB, help=argparse.SUPPRESS)  # CPU smoke test: tiny model
    ap.add_argument("--timeout", type=int, default=600, help="seconds per setting")
    ap.add_argument("--out", default="/tmp/microstep.json")
    a = ap.parse_args()
    if a.worker:
        print("RESULT " + json.dumps(worker(json.loads(a.worker))), flush=True)
        return
    results = []
    for setting in json.loads(a.settings):
        spec = {**setting, "model_dir_4bit": a.model_dir_4bit, "work": a.work, "vocab": a.vocab}
        t = time.time()
        try:
            proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], capture_output=True,
                                  text=True, timeout=a.timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})
            lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            res = json.loads(lines[-1][7:]) if lines else {"name": setting["name"], "error": proc.stderr[-3000:]}
        except subprocess.TimeoutExpired as exc:
            res = {"name": setting["name"], "error": f"timeout; {str(exc.stdout)[-2000:]}"}
        res["wall_s"] = round(time.time() - t, 1)
        results.append(res)
        Path(a.out).write_text(json.dumps(results, indent=1) + "\n")
        for size in res.get("sizes", []):
            print(f"{res['name']:28s} {json.dumps(size)}", flush=True)
        if res.get("error"):
            print(f"{res['name']}: {res['error'][-800:]}", flush=True)


if __name__ == "__main__":
    main()
