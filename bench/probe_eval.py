"""Where evaluate_adapter's and export_adapter's seconds go on a GPU: the allocator, repeated passes, shard writes.

Three probes, each in a child process of its own (a fresh CUDA allocator), results as one JSON:

- `eval`: on a finished job's runs_dir (bench_job.py --keep), evaluate_adapter's own pieces (load_for_evaluation,
  its batches, mean_loss, greedy_generate) timed with the device synchronised: the base model's loss pass twice,
  its answers twice, then base + adapter once each; once with the allocator training leaves behind in a run
  without the GPU pool (expandable segments) and once with torch's default. If the first base pass is slow under
  both, the cost is first use (kernels, shapes), not the allocator.
- `alloc`: the allocator alone, both ways: tensors of growing size (0.25 to 24 GiB in 96 steps), each freed
  before the next, as length-sorted evaluation batches allocate.
- `save`: writing 16 GiB of bf16 tensors held on the GPU as safetensors: one shard after another (what
  save_pretrained does), and the same shards from 8 threads (whether safetensors lets threads overlap).

With --after-training STEPS, only the `eval` probe, in one child that first trains STEPS steps through
train_adapter (its in-process path: what a run without the GPU pool does before evaluating).

With --sdpa, only the `eval` probe, twice, each child with CUDA_CACHE_DISABLE=1 (no kernels compiled at run time
are kept on disk between processes: every child is a machine's first process): torch's default attention
backends, then with cuDNN attention turned off (torch.backends.cuda.enable_cudnn_sdp(False)); each records the
backend torch picks for a padded batch (`torch._fused_sdp_choice`). It showed that the base model's slow first
loss pass on a fresh machine was cuDNN attention building a graph per new shape (docs/performance.md,
"Evaluation").

usage (GPU host, after bench_job.py --keep): python3 bench/probe_eval.py --runs /tmp/qlora-job/runs0 --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
GIB = 2**30


def _clock(fn: Any) -> tuple[Any, float]:
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)  # CPU: a smoke test
    sync()
    start = time.perf_counter()
    value = fn()
    sync()
    return value, round(time.perf_counter() - start, 2)


def _allocator(mode: str) -> None:
    from tasks.models.memory import set_expandable_segments

    set_expandable_segments(mode == "expandable")


def probe_eval(runs: Path, mode: str, train_steps: int = 0, attention: str = "default") -> dict[str, Any]:
    import torch
    from peft import PeftModel

    from tasks.config import EvalArgs
    from tasks.evaluate_adapter import sequences as stage
    from tasks.evaluate_adapter.generation import generation_tokens, greedy_generate
    from tasks.models.loading import load_for_evaluation, load_tokenizer
    from tasks.on_disk.parquet_dataset import ParquetExamples

    _allocator(mode)
    model_dir = next(p.parent for p in (runs / "prepare_model").glob("*/manifest.json"))
    data_dir = next(p.parent for p in (runs / "prepare_data").glob("*/manifest.json"))
    adapter = next(p.parent for p in (runs / "train_adapter").glob("*/manifest.json")) / "adapter"
    out: dict[str, Any] = {"mode": mode, "attention": attention}
    if attention == "no-cudnn":  # for the rest of this child: torch's other fused backends, math last
        torch.backends.cuda.enable_cudnn_sdp(False)
    if train_steps:  # first train in this process, as a run without the GPU pool does before evaluating
        from tasks.config import LoraArgs, SpeedArgs, TrainArgs
        from tasks.train_adapter.stage import train_adapter

        start = time.perf_counter()
        trained = train_adapter.fn(LoraArgs(), TrainArgs(max_steps=train_steps, save_steps=10**6), SpeedArgs(),
                                   runs, str(data_dir), str(model_dir))
        adapter = Path(trained) / "adapter"
        out.update(train_steps=train_steps, train_s=round(time.perf_counter() - start, 1))
    args = EvalArgs()
    tokenizer = load_tokenizer(model_dir)
    model, load_s = _clock(lambda: load_for_evaluation(model_dir, args.dequantize))
    examples = ParquetExamples(data_dir / "eval.parquet")
    batches = stage._batches(examples, len(examples), args.per_device_eval_batch_size, model.config.pad_token_id or 0)
    prompts, _ = stage._held_out(examples, len(examples), args.generation_samples, data_dir)
    budget = generation_tokens(model, max(b["input_ids"].numel() for b in batches))
    eos = [tokenizer.eos_token_id]

    def answers(m: Any) -> Any:
        return greedy_generate(m, prompts, args.per_device_eval_batch_size, args.max_new_tokens,
                               tokenizer.pad_token_id, eos, budget)

    out.update(load_s=load_s, batches=len(batches), prompts=len(prompts), sdpa_choice=_sdpa_choice(model))
    (loss, _), out["base_loss_1_s"] = _clock(lambda: stage.mean_loss(model, batches))
    (loss2, _), out["base_loss_2_s"] = _clock(lambda: stage.mean_loss(model, batches))
    out["base_loss_equal"] = loss == loss2
    _, out["base_answers_1_s"] = _clock(lambda: answers(model))
    _, out["base_answers_2_s"] = _clock(lambda: answers(model))
    tuned = PeftModel.from_pretrained(model, adapter, adapter_name="tuned")
    _, out["tuned_loss_s"] = _clock(lambda: stage.mean_loss(tuned, batches))
    _, out["tuned_answers_s"] = _clock(lambda: answers(tuned))
    stats = torch.cuda.memory_stats() if torch.cuda.is_available() else {}
    out.update(peak_reserved_gib=round(stats.get("reserved_bytes.all.peak", 0) / GIB, 2),
               segments=stats.get("segment.all.allocated"), alloc_retries=stats.get("num_alloc_retries"))
    return out


def _sdpa_choice(model: Any) -> str:
    """The backend scaled_dot_product_attention picks for an evaluation-like padded batch on the model's device."""
    import torch
    from torch.nn.attention import SDPBackend

    device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    heads, dim = model.config.num_attention_heads, model.config.hidden_size // model.config.num_attention_heads
    q = k = v = torch.zeros(4, heads, 200, dim, device=device, dtype=dtype)
    mask = torch.ones(4, 1, 200, 200, device=device, dtype=torch.bool).tril()
    return SDPBackend(torch._fused_sdp_choice(q, k, v, mask, 0.0, False)).name


def probe_alloc(mode: str) -> dict[str, Any]:
    import torch

    _allocator(mode)
    sizes = [int(GIB * (0.25 + i * 0.25)) for i in range(96)]
    torch.ones(1, device="cuda")  # the context, outside the timing

    def grow() -> None:
        for size in sizes:
            block = torch.empty(size, dtype=torch.uint8, device="cuda")
            block[-1] = 1  # touch it: the allocation is real
            del block

    _, first = _clock(grow)
    _, second = _clock(grow)
    return {"mode": mode, "growing_s": first, "again_s": second,
            "reserved_gib": round(torch.cuda.memory_reserved() / GIB, 2)}


def probe_save(folder: Path) -> dict[str, Any]:
    import torch
    from safetensors.torch import save_file

    tensors = {f"t{i}": torch.randn(128 * 2**20, dtype=torch.bfloat16, device="cuda") for i in range(64)}  # 16 GiB
    shards = [dict(list(tensors.items())[i:i + 8]) for i in range(0, 64, 8)]  # 2 GiB each

    def write(way: str, threads: int) -> float:
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        start = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda ix: save_file(ix[1], folder / f"{way}-{ix[0]}.safetensors"), enumerate(shards)))
        return round(time.perf_counter() - start, 2)

    result = {"gib": 16, "one_after_another_s": write("seq", 1), "eight_threads_s": write("par", 8),
              "one_after_another_again_s": write("seq", 1)}
    shutil.rmtree(folder, ignore_errors=True)
    return result


def _child(args: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    done = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, **(env or {})})
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if done.returncode == 0 and lines else {"args": args, "error": done.stderr[-3000:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=Path, help="a finished job's runs_dir (bench_job.py --keep)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--after-training", type=int, default=0, metavar="STEPS",
                        help="only: train STEPS steps in the eval child first (default allocator), then evaluate")
    parser.add_argument("--sdpa", action="store_true", help="only: the eval probe with and without cuDNN attention, "
                        "each child with CUDA_CACHE_DISABLE=1")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, *rest = args.child
        result = {"eval": lambda: probe_eval(Path(rest[0]), rest[1], int(rest[2]) if rest[2:] else 0,
                                             rest[3] if rest[3:] else "default"),
                  "alloc": lambda: probe_alloc(rest[0]),
                  "save": lambda: probe_save(Path(rest[0]))}[kind]()
        print(json.dumps(result), flush=True)
        return
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv)}
    if args.sdpa:
        result["eval"] = [_child(["--child", "eval", str(args.runs), "default", "0", a], {"CUDA_CACHE_DISABLE": "1"})
                          for a in ("default", "no-cudnn")]
        print(json.dumps(result["eval"]), flush=True)
        args.out.write_text(json.dumps(result, indent=2))
        return
    if args.after_training:
        result["eval"] = [_child(["--child", "eval", str(args.runs), "default", str(args.after_training)])]
        print(json.dumps(result["eval"]), flush=True)
        args.out.write_text(json.dumps(result, indent=2))
        return
    result["alloc"] = [_child(["--child", "alloc", m]) for m in ("expandable", "default")]
    print(json.dumps(result["alloc"]), flush=True)
    if args.runs:
        result["eval"] = [_child(["--child", "eval", str(args.runs), m]) for m in ("expandable", "default")]
        print(json.dumps(result["eval"]), flush=True)
    result["save"] = _child(["--child", "save", "/tmp/probe-save"])
    print(json.dumps(result["save"]), flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
