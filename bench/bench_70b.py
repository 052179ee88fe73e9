"""A Llama-3.1-70B-shaped model trained with train_adapter's defaults on one GPU.

Builds the random-weight 4-bit checkpoint with bench/build_4bit.py (one layer at a time on the GPU; the bf16 model
is never held, in memory or on disk) into --work (reused when already there), then, in one fresh subprocess,
loads it and trains through the functions bench_train's pipeline worker uses (builder.adapted, builder.trainer_for) on
bench_train's synthetic examples, three runs on the one loaded model:

  (a) speed.max_tokens_per_batch 2,048   (b) train_adapter's defaults (the pack size its plan picks)
  (c) speed.max_tokens_per_batch 6,144

Each: 2 warm-up optimizer steps, then --steps timed ones; real tokens/s, peak allocated and reserved GiB, the
micro-batch plan chosen, losses. Also the build's seconds, bytes, peak GPU memory and peak host RSS, and the
model's allocated GiB and load seconds. The JSON is written after each phase, so a run cut short keeps its figures.

usage (GPU host, repository root, PYTHONPATH=$PWD:/tmp/site): python3 bench/bench_70b.py --out $OUT/results/70b.json
smoke test on a CPU: python bench/bench_70b.py --shape tiny --work /tmp/qlora-70b-tiny --out /tmp/tiny70b.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # `python bench/bench_70b.py` puts bench/ first on the path, not the repository

from bench.bench_train import Runner, _gpu, _versions, _write_tokenizer, lengths, worker_pipeline  # noqa: E402

# seconds per optimizer step of one packed micro-batch, by its tokens, on an H200 (the brief's guesses; the
# printed estimate only, nothing waits on it)
STEP_S = {"70b": lambda tokens: 0.5 + tokens / 900, "tiny": lambda tokens: 0.2 + tokens / 20000}
BUILD_S = {"70b": 180, "tiny": 10}
LOAD_S = {"70b": 60, "tiny": 10}


def worker_build(spec: dict[str, Any]) -> dict[str, Any]:
    """The 4-bit checkpoint of the shape, built part by part on this machine's device."""
    import torch

    from bench.build_4bit import build_4bit_checkpoint, llama_config
    from tasks.config import EMBEDDED_MODEL

    tokenizer = EMBEDDED_MODEL
    if spec["shape"] != "tiny":  # 128,256 ids, like bench_train's 8B model
        tokenizer = Path(spec["work"]) / "tokenizer"
        tokenizer.mkdir(parents=True, exist_ok=True)
        _write_tokenizer(tokenizer)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return build_4bit_checkpoint(llama_config(spec["shape"]), Path(spec["work"]) / "runs", tokenizer,
                                 device=device, seed=0)


WORKERS = {"build": worker_build, "pipeline": worker_pipeline}


def worker_cmd(kind: str, spec: dict[str, Any]) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--worker", kind, "--spec", json.dumps(spec)]


def runs(steps: int, packs: list[int | None], mean_len: float, budget_gb: float = 0) -> list[dict[str, Any]]:
    """One run per pack size (None: train_adapter's own choice, its memory plan), with enough examples for its
    steps; budget_gb sets speed.gpu_memory_budget_gb (0: the card)."""
    out = []
    for tokens in packs:
        speed = {"max_tokens_per_batch": tokens} if tokens else {}
        if budget_gb:
            speed["gpu_memory_budget_gb"] = budget_gb
        n = math.ceil((steps + 2) * (tokens or 16384) / mean_len * 1.5) + 16
        out.append({"name": f"tokens{tokens}" if tokens else "default", "n": n,
                    "train": {"max_steps": steps + 2, **speed}})
    return out


def estimate(shape: str, steps: int, packs: list[int | None], default_tokens: int) -> dict[str, float]:
    """Seconds each phase should take, printed up front, so a run that will not fit its slot is seen early."""
    step = STEP_S[shape]
    train = sum((steps + 2) * step(t or default_tokens) + 15 for t in packs)  # 15: data, Trainer, first step
    return {"build_s": BUILD_S[shape], "load_s": LOAD_S[shape], "train_s": round(train)}


def logged_runs(log: Path, name: str) -> list[dict[str, Any]]:
    """The RUN lines of the worker's latest section of the log: what finished before a timeout cut it short."""
    text = log.read_text() if log.exists() else ""
    section = text.rsplit(f"===== {name} ", 1)[-1] if f"===== {name} " in text else ""
    return [json.loads(line[4:]) for line in section.splitlines() if line.startswith("RUN ")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--shape", default="70b", choices=["70b", "tiny"], help="tiny: the whole script on a CPU")
    ap.add_argument("--work", default="/tmp/qlora-70b", help="the 4-bit checkpoint (~39 GB for 70b) and data")
    ap.add_argument("--steps", type=int, default=6, help="timed optimizer steps per run, after 2 warm-up steps")
    ap.add_argument("--packs", default="2048,default", help="max_tokens_per_batch per run; default = unset")
    ap.add_argument("--seq", type=int, default=2048, help="example lengths are cut at this many tokens")
    ap.add_argument("--memory-budget-gb", type=float, default=0, help="speed.gpu_memory_budget_gb of every run "
                    "(0: the card's memory, the default)")
    ap.add_argument("--budget", type=int, default=540, help="seconds for the whole script; the training worker "
                    "is stopped at what is left of it (its finished runs are kept)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" /
                                         f"{datetime.date.today().isoformat()}-h200-70b.json"))
    ap.add_argument("--logs", default=os.environ.get("OUT", "/tmp/qlora-70b-logs"))
    a = ap.parse_args()
    if a.worker:
        print("RESULT " + json.dumps(WORKERS[a.worker](json.loads(a.spec))), flush=True)
        return

    from bench.build_4bit import SHAPES

    start = time.time()
    logs, out, work = Path(a.logs), Path(a.out), Path(a.work)
    runner = Runner(logs / "bench_70b.log")
    packs = [None if p == "default" else int(p) for p in a.packs.split(",")]
    vocab = SHAPES[a.shape]["vocab_size"]
    lens = lengths(4000, a.seq)
    mean_len = sum(lens) / len(lens)
    guess = estimate(a.shape, a.steps, packs, default_tokens=6144)
    result: dict[str, Any] = {"date": datetime.date.today().isoformat(), "command": " ".join(sys.argv),
                              "gpu": _gpu(), "versions": _versions(), "shape": {a.shape: SHAPES[a.shape]},
                              "data": {"lengths": f"lognormal median 250 sigma 0.8, min 16, cut at {a.seq}, seed 0",
                                       "mean_len_4000": round(mean_len, 1)},
                              "estimate_s": guess}
    print(f"estimated seconds: {guess} (total {sum(guess.values())}, budget {a.budget})", flush=True)

    def save() -> None:  # after every phase, so a run cut short still leaves its figures
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({**summary(result), "raw": result}, indent=1) + "\n")
        logs.mkdir(parents=True, exist_ok=True)
        (logs / out.name).write_text(out.read_text())

    result["build"] = runner.run("build", worker_cmd("build", {"shape": a.shape, "work": str(work)}),
                                 timeout=max(60, a.budget - 60))
    save()
    if "model_dir_4bit" not in result["build"]:
        sys.exit("build failed; see " + str(runner.log))
    spec = {"model_dir_4bit": result["build"]["model_dir_4bit"], "work": str(work), "seq": a.seq, "vocab": vocab,
            "name": a.shape, "runs": runs(a.steps, packs, mean_len, a.memory_budget_gb)}
    left = int(a.budget - (time.time() - start) - 10)
    print(f"training: {len(packs)} runs in one process, {left} s left of the budget", flush=True)
    train = runner.run("pipeline", worker_cmd("pipeline", spec), timeout=max(60, left))
    if "runs" not in train:
        train["runs"] = logged_runs(runner.log, "pipeline")
    result["pipeline"] = train
    result["wall_s"] = round(time.time() - start, 1)
    save()
    print(json.dumps(summary(result), indent=1))
    print(f"wrote {out}")


def summary(r: dict[str, Any]) -> dict[str, Any]:
    """The figures: the build's cost, and per run tokens/s, peak memory and the plan chosen."""
    build = r.get("build", {})
    pipe = r.get("pipeline", {})
    s: dict[str, Any] = {k: r[k] for k in ("date", "command", "gpu", "shape") if k in r}
    s["build"] = {k: build.get(k) for k in ("build_s", "bytes_on_disk", "peak_gpu_allocated_gib",
                                            "peak_host_rss_gib", "reused", "wall_s", "error")}
    s["load"] = {"load_s": pipe.get("load_s"), "model_allocated_gib": pipe.get("model_allocated_gib")}
    s["runs"] = [{k: run.get(k) for k in ("name", "real_tokens_per_s", "peak_allocated_gib", "peak_reserved_gib",
                                          "batches", "steps", "losses", "oom", "error")}
                 for run in pipe.get("runs", [])]
    if "error" in pipe:
        s["pipeline_error"] = {"error": pipe["error"], "tail": pipe.get("tail")}
    return s


if __name__ == "__main__":
    main()
