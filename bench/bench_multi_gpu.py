"""Data-parallel scaling of train_adapter: 1 GPU against 2 (DDP), and the FSDP option, in one run.

Builds the Llama-3.1-8B-shaped model with random weights once (bench_train's build: bench/shapes.py's model,
quantized by the pipeline's prepare_model stage; a second 4-bit copy stores
its weights as bfloat16 for FSDP), writes bench_train's synthetic examples (lognormal lengths, median 250, cut
at 2,048, seed 0) as train.parquet, and trains each variant through train_adapter's own launcher
(tasks.train_adapter.launch.launch: torchrun, one process per GPU), each in a fresh process group:

  one_gpu   num_gpus 1 (torchrun with one process: the same code path)
  two_gpus  num_gpus 2, DDP (each GPU a full 4-bit copy; same micro-batches per GPU, so twice the global batch)
  fsdp      num_gpus 2, speed.fsdp (FSDP2 over the decoder layers; 4-bit weights stored as bfloat16)
  fsdp_resume  num_gpus 2, speed.fsdp, killed (SIGKILL to the whole process group) once checkpoint 3 is complete,
            then started again with the same arguments: it must resume from checkpoint 3 and finish at step 6

Each figure is train_adapter's own: real (non-padding) tokens/s of all ranks together from the end of the
first optimizer step to the end of the last (tasks.train_adapter.callbacks.Progress.summary), the peak GPU memory of the
busiest rank, the loss. scaling_2_over_1 = two_gpus / one_gpu real tokens/s.

usage (a host with 2 GPUs, from the repository root; bench/README.md has the set-up):
  python3 bench/bench_multi_gpu.py --out bench/results/multi-gpu-h200x2.json
CPU smoke test of this script (tiny model, gloo, the resume check with DDP, no FSDP):
  python bench/bench_multi_gpu.py --tiny --steps 6 --n 400 --out /tmp/mg --logs /tmp/mg
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import bench_train as bt  # noqa: E402

TRAIN = {"max_tokens_per_batch": 16384, "gradient_accumulation_steps": 2, "learning_rate": 2e-4,
         "warmup_steps": 0, "logging_steps": 1, "save_steps": 10**6, "seed": 0}


def train_cmd(spec: dict[str, Any]) -> list[str]:
    """A child process that runs tasks.train_adapter.launch.launch (itself starting torchrun) and prints its metrics."""
    return [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)]


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    import logging

    from tasks.config import LoraArgs
    from tasks.train_adapter import launch

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    t = time.time()
    metrics = launch.launch(LoraArgs(), *bt.settings(spec["train"]), spec["data_dir"], spec["model_dir"], out,
                            spec["nproc"])
    metrics["wall_s"] = round(time.time() - t, 1)
    logged = [json.loads(line) for line in (out / "loss.jsonl").read_text().splitlines()]
    metrics["losses"], metrics["loss_steps"] = [x["loss"] for x in logged], [x["step"] for x in logged]
    return metrics


def kill_after_checkpoint(runner: bt.Runner, spec: dict[str, Any], step: int, log: Path) -> dict[str, Any]:
    """Start a training, SIGKILL its whole process group once checkpoint `step` is complete."""
    marker = Path(spec["out"]) / "checkpoints" / f"checkpoint-{step}" / "complete"
    t = time.time()
    with log.open("a") as f, subprocess.Popen(train_cmd(spec), stdout=f, stderr=subprocess.STDOUT,
                                                start_new_session=True) as proc:
        while proc.poll() is None and not marker.exists() and time.time() - t < 600:
            time.sleep(0.5)
        killed = proc.poll() is None
        if killed:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return {"killed": killed, "marker_seen": marker.exists(), "seconds": round(time.time() - t, 1),
            "exit": proc.returncode}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", default="/tmp/llama8b")
    ap.add_argument("--work", default="/tmp/qlora-bench-mg")
    ap.add_argument("--steps", type=int, default=10, help="optimizer steps per variant (the first is warm-up)")
    ap.add_argument("--n", type=int, default=4000, help="examples")
    ap.add_argument("--skip", default="", help="comma list of: one_gpu, two_gpus, fsdp, fsdp_resume")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per variant before it is killed")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test: the embedded tiny model, gloo, DDP only")
    ap.add_argument("--out", default="bench/results", help="the result's JSON, or a folder for a dated name")
    ap.add_argument("--logs", default=os.environ.get("OUT", "/tmp/qlora-bench-mg"))
    a = ap.parse_args()
    if a.worker:
        print("RESULT " + json.dumps(worker(json.loads(a.worker))), flush=True)
        return

    work, logs = Path(a.work), Path(a.logs)
    runner = bt.Runner(logs / "bench-multi-gpu.log")
    result: dict[str, Any] = {"date": datetime.date.today().isoformat(), "command": " ".join(sys.argv),
                              "versions": bt._versions(), "gpu": bt._gpu(), "train": TRAIN, "steps": a.steps}
    path = Path(a.out) if a.out.endswith(".json") else \
        Path(a.out) / f"{result['date']}-{'cpu-tiny' if a.tiny else 'h200x2'}-multi-gpu.json"
    skip = set(filter(None, a.skip.split(",")))
    train = {**TRAIN, "max_steps": a.steps}
    if a.tiny:
        models, vocab = _tiny_models(work), 1024
        train.update(max_tokens_per_batch=None, per_device_train_batch_size=8, learning_rate=2e-3)
        skip.add("fsdp")  # the resume check runs with DDP instead
    else:
        models, vocab = _models(runner, a, work), bt.VOCAB
        result["build"] = models
    data_dir = work / "data"
    rows = bt.token_rows(bt.lengths(a.n, 2048), vocab)
    bt.write_examples(data_dir / "train.parquet", rows)
    result["data"] = {"examples": a.n, "mean_len": round(sum(map(len, rows)) / len(rows), 1),
                      "lengths": "lognormal median 250 sigma 0.8, min 16, cut at 2048, seed 0"}

    def spec(name: str, nproc: int, **extra: Any) -> dict[str, Any]:
        model = models["bf16_storage"] if extra.get("fsdp") else models["uint8_storage"]
        return {"out": str(work / name), "data_dir": str(data_dir), "model_dir": model, "nproc": nproc,
                "train": {**train, **extra}}

    variants = {"one_gpu": spec("one_gpu", 1), "two_gpus": spec("two_gpus", 2),
                "fsdp": spec("fsdp", 2, fsdp=True)}
    for name, s in variants.items():
        if name not in skip:
            result[name] = runner.run(name, train_cmd(s), timeout=a.timeout)
            _keep_rank_log(result[name], s, logs)
            _save(result, path, logs)
    if "fsdp_resume" not in skip:
        s = spec("fsdp_resume", 2, fsdp=not a.tiny, max_steps=6, save_steps=3)
        first = kill_after_checkpoint(runner, s, 3, logs / "bench-multi-gpu.log")
        second = runner.run("fsdp_resume", train_cmd(s), timeout=a.timeout)
        _keep_rank_log(second, s, logs)
        result["fsdp_resume"] = {"first": first, "second": second,
                                 "resumed": second.get("loss_steps") == list(range(1, 7)) and first["killed"]}
    one, two = result.get("one_gpu", {}), result.get("two_gpus", {})
    if one.get("real_tokens_per_s") and two.get("real_tokens_per_s"):
        result["scaling_2_over_1"] = round(two["real_tokens_per_s"] / one["real_tokens_per_s"], 3)
    _save(result, path, logs)
    print(json.dumps({k: result.get(k) for k in ("scaling_2_over_1",)}))
    for name in ("one_gpu", "two_gpus", "fsdp"):
        r = result.get(name, {})
        print(f"{name:9s} tokens/s {r.get('real_tokens_per_s')}  peak GiB {r.get('peak_gpu_allocated_gib')}  "
              f"loss {r.get('train_loss')}  sharding {r.get('sharding')}  error {r.get('error')}")
    print(f"wrote {path}")


def _models(runner: bt.Runner, a: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The 8B-shaped model, quantized twice: uint8 storage (DDP) and bfloat16 storage (FSDP)."""
    out = {}
    for name, model in (("uint8_storage", {}), ("bf16_storage", {"bnb_4bit_quant_storage": "bfloat16"})):
        built = runner.run(f"build {name}", bt.worker_cmd("build", {"model_dir": a.model_dir,
                                                                    "runs_dir": str(work / "runs"), "model": model}))
        out[name], out[f"{name}_s"] = built["model_dir_4bit"], built.get("prepare_model_s")
    return out


def _tiny_models(work: Path) -> dict[str, Any]:
    from tasks.config import ModelArgs
    from tasks.prepare_model.stage import prepare_model

    folder = prepare_model.fn(ModelArgs(), work / "runs")
    return {"uint8_storage": folder, "bf16_storage": folder}


def _keep_rank_log(res: dict[str, Any], spec: dict[str, Any], logs: Path) -> None:
    """On a failure, append the ranks' whole output (tasks.train_adapter.launch.LOG) to the bench log."""
    from tasks.train_adapter.launch import LOG

    rank_log = Path(spec["out"]) / LOG
    if res.get("error") and rank_log.exists():
        with (logs / "bench-multi-gpu.log").open("a") as f:
            f.write(f"\n===== ranks' output ({rank_log})\n" + bt._trim(rank_log.read_text(), 20000) + "\n")


def _save(result: dict[str, Any], path: Path, logs: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    logs.mkdir(parents=True, exist_ok=True)
    (logs / path.name).write_text(path.read_text())


if __name__ == "__main__":
    main()
