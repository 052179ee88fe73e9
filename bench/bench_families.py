"""Every common decoder-only family on one GPU with the pipeline's defaults, then a second real shape's speed.

Part 1, families: for each of tests/families.FAMILIES, a random-weight model of that family (hidden 1024, 4 layers,
16 query / 4 key-value heads, MLP 2816, the project's 1,024-token tokenizer) built on the GPU and saved to --work,
then the five stages through .fn() with default settings (train.max_steps --steps) on the embedded sample
instructions, each family in its own process (--parallel at a time). Per family: completed or the error, the speed
levers train_adapter applied and those that stepped aside (its log lines), base and tuned eval loss, training
tokens/s and peak memory.

Part 2, a second shape (--shape, default the Qwen2.5-7B shape: hidden 3584, 28 layers, 28 query / 4 key-value
heads, MLP 18944, vocabulary 152064) with random weights: bench_train.py's own workers measure train_adapter's
defaults (real tokens/s, peak memory) next to the reference recipe (bench/reference_recipe.py) on the same model,
one at a time, on bench_train's synthetic examples. The shape is built and quantized while part 1 runs; the timed
runs go alone.

usage (GPU host, from the repository root, after the set-up in bench/README.md):
  python bench/bench_families.py --out bench/results/families-h200.json
Runs in about 6-8 minutes on one H200.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import bench_train  # noqa: E402 - bench/ is not a package; its workers and Runner are reused
from shapes import SHAPES, make_model_dir  # noqa: E402

FAMILY_DIMS = {"hidden": 1024, "layers": 4, "heads": 16, "kv_heads": 4, "intermediate": 2816, "vocab": 1024}
# --------------------------------------------------------------------------------------------------------------
# Workers (own processes: a family that crashes or holds GPU memory does not touch the others)
# --------------------------------------------------------------------------------------------------------------

class _Lines(logging.Handler):
    """Keeps the pipeline's own log lines (the `qlora_pipeline` logger: stages run through .fn(), outside a flow)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def worker_family(spec: dict[str, Any]) -> dict[str, Any]:
    """One family through the five stages with default settings."""
    from tests.families import build_family_model

    lines = _Lines()
    logging.getLogger("qlora_pipeline").addHandler(lines)
    logging.getLogger("qlora_pipeline").setLevel(logging.INFO)
    out: dict[str, Any] = {"family": spec["family"], "completed": False}
    t = time.time()
    try:
        import torch

        cuda = torch.cuda.is_available()  # a CPU run is a smoke test of this script (--dims for small models)
        folder = build_family_model(spec["family"], Path(spec["work"]) / "models" / spec["family"],
                                    device="cuda" if cuda else "cpu", dtype=torch.bfloat16 if cuda else torch.float32,
                                    **spec["dims"])
        out.update(_stages(folder, Path(spec["work"]) / "runs", spec["steps"], out, spec.get("speed") or {}))
        out["completed"] = True
    except BaseException as exc:  # noqa: BLE001 - recorded per family; the others go on
        out["error"] = f"{type(exc).__name__}: {exc}"[:600]
        out["traceback_tail"] = traceback.format_exc().strip().splitlines()[-4:]
    out["seconds"] = round(time.time() - t, 1)
    out.update(_levers(lines.lines))
    return out


def _stages(folder: Path, runs: Path, steps: int, out: dict[str, Any], speed: dict[str, Any]) -> dict[str, Any]:
    from tasks.config import DataArgs, EvalArgs, ExportArgs, LoraArgs, ModelArgs, SpeedArgs, TrainArgs
    from tasks.evaluate_adapter.stage import evaluate_adapter
    from tasks.export_adapter.stage import export_adapter
    from tasks.on_disk.manifest import read_manifest
    from tasks.prepare_data.stage import prepare_data
    from tasks.prepare_model.stage import prepare_model
    from tasks.train_adapter.stage import train_adapter

    model = ModelArgs(base_model=str(folder))
    out["stage"] = "prepare_data"
    data = prepare_data.fn(DataArgs(), model, runs)
    out["stage"] = "prepare_model"
    model_dir = prepare_model.fn(model, runs)
    out["stage"] = "train_adapter"
    adapter = train_adapter.fn(LoraArgs(), TrainArgs(max_steps=steps, save_steps=10**6), SpeedArgs(**speed), runs,
                               data, model_dir)
    out["stage"] = "evaluate_adapter"
    evals = evaluate_adapter.fn(EvalArgs(max_samples=128, generation_samples=4, max_new_tokens=8), runs, data,
                                model_dir, adapter)
    out["stage"] = "export_adapter"
    export_adapter.fn(ExportArgs(name=folder.name), runs, data, model_dir, adapter, evals)
    out.pop("stage")
    made, trained, scored = (read_manifest(Path(d)).metrics for d in (model_dir, adapter, evals))
    return {"attn_implementation": made.attn_implementation, "base_eval_loss": scored.base_eval_loss,
            "tuned_eval_loss": scored.tuned_eval_loss,
            "tuned_below_base": scored.tuned_eval_loss < scored.base_eval_loss,
            "real_tokens_per_s": trained.real_tokens_per_s, "peak_gpu_allocated_gib": trained.peak_gpu_allocated_gib,
            "optimizer_steps": trained.optimizer_steps}


def _levers(lines: list[str]) -> dict[str, Any]:
    """train_adapter's own account of the levers: what it applied, and each lever that stepped aside and why."""
    said = [ln.removeprefix("train_adapter: ") for ln in lines if ln.startswith("train_adapter: ")]
    aside = [ln for ln in said if "steps aside" in ln]
    # plan.prepare_base's line, then plan.prepare_peft's (the rest: micro-batches, steps, resumes, warnings)
    applied = [ln for ln in said if ln not in aside and "thread(s) per process" not in ln and not ln.startswith(
        ("micro-batches", "step ", "resuming", "out of memory", "Liger kernels not applied", "speed.", "memory plan",
         "optimizer"))][:3]
    batches = next((ln.removeprefix("micro-batches ") for ln in said if ln.startswith("micro-batches")), None)
    warnings = [ln for ln in lines if ln.startswith("prepare_model: model.attn_implementation")]
    return {"levers_applied": applied, "levers_stepped_aside": aside, "micro_batches": batches,
            "attention_fallback": warnings}


def worker_shape(spec: dict[str, Any]) -> dict[str, Any]:
    """A random-weight model of spec['shape'] (bench/shapes.py), skipped when already there."""
    return make_model_dir(spec["model_dir"], spec["shape"])


WORKERS = {"family": worker_family, "shape": worker_shape}


# --------------------------------------------------------------------------------------------------------------
# Orchestration
# --------------------------------------------------------------------------------------------------------------

def _cmd(kind: str, spec: dict[str, Any]) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--worker", kind, "--spec", json.dumps(spec)]


def families_part(a: argparse.Namespace, runner: bench_train.Runner) -> dict[str, Any]:
    from tests.families import FAMILIES

    wanted = [f for f in (a.families.split(",") if a.families else FAMILIES) if f]
    work = str(Path(a.work) / "families")
    dims = {**FAMILY_DIMS, **json.loads(a.dims or "{}")}
    with concurrent.futures.ThreadPoolExecutor(a.parallel) as pool:
        jobs = {f: pool.submit(runner.run, f"family {f}", _cmd("family", {"family": f, "work": work, "steps": a.steps,
                                                                          "dims": dims, "speed": json.loads(a.speed)}),
                               None, 420)
                for f in wanted}
        return {f: job.result() for f, job in jobs.items()}


def shape_build(a: argparse.Namespace, runner: bench_train.Runner) -> dict[str, Any]:
    """The shape's bf16 folder, then bench_train's build worker: its tokenizer and the pipeline's 4-bit stage."""
    model_dir = str(Path(a.work) / a.shape)
    built = runner.run("shape", _cmd("shape", {"shape": a.shape, "model_dir": model_dir}), None, 600)
    spec = {"model_dir": model_dir, "runs_dir": str(Path(a.work) / "runs")}
    return {"shape": built, "build": runner.run("shape prepare_model", bench_train.worker_cmd("build", spec),
                                                None, 600)}


def shape_part(a: argparse.Namespace, runner: bench_train.Runner, build: dict[str, Any]) -> dict[str, Any]:
    """train_adapter's defaults, then the reference recipe, on the same shape and examples, one at a time."""
    result: dict[str, Any] = {"shape": a.shape, "dims": SHAPES[a.shape], **build}
    four = build["build"].get("model_dir_4bit")
    vocab = min(SHAPES[a.shape]["vocab_size"], bench_train.VOCAB)  # ids the 128,256-id bench tokenizer knows
    if four:
        spec = {"model_dir_4bit": four, "work": a.work, "seq": a.seq, "vocab": vocab, "name": "pipeline",
                "runs": [{"name": "default", "n": 4000, "train": {"max_steps": a.shape_steps + 2}}]}
        result["pipeline_run"] = runner.run("shape pipeline", bench_train.worker_cmd("pipeline", spec))
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")}
    cmd = [*bench_train.reference_cmd(build["shape"].get("model_dir", ""), a.seq), "--ga", str(a.reference_ga),
           "--steps", str(a.reference_steps)]
    result["reference_run"] = runner.run("shape reference", cmd, env=env, timeout=600)
    return result


def summary(shape: dict[str, Any]) -> dict[str, Any]:
    pipe = ((shape.get("pipeline_run") or {}).get("runs") or [{}])[0]
    ref = shape.get("reference_run") or {}
    return {"pipeline": {"real_tokens_per_s": pipe.get("real_tokens_per_s"),
                         "peak_allocated_gib": pipe.get("peak_allocated_gib"),
                         "peak_reserved_gib": pipe.get("peak_reserved_gib"), "losses": pipe.get("losses"),
                         "setup": "train_adapter defaults (LoRA r=16 on all-linear, packed micro-batches)"},
            "reference": {"real_tokens_per_s": ref.get("real_tokens_per_s"),
                          "peak_allocated_gib": ref.get("peak_allocated_gib"),
                          "peak_reserved_gib": ref.get("peak_reserved_gib"), "losses": ref.get("losses"),
                          "setup": f"reference_recipe.py, q/k/v/o, micro-batch 1 x {ref.get('ga')}"}}


def table(families: dict[str, Any]) -> str:
    rows = ["| family | completed | attention | base loss | tuned loss | tokens/s | levers applied | stepped aside |",
            "|---|---|---|---|---|---|---|---|"]
    for name, r in families.items():
        def fmt(x: Any) -> str:
            return f"{x:.4f}" if isinstance(x, float) else str(x)

        done = "yes" if r.get("completed") else f"no: {r.get('stage', '')} {r.get('error', '')[:80]}"
        rows.append(f"| {name} | {done} | {r.get('attn_implementation')} | {fmt(r.get('base_eval_loss'))} | "
                    f"{fmt(r.get('tuned_eval_loss'))} | {r.get('real_tokens_per_s')} | "
                    f"{'; '.join(r.get('levers_applied', []))} | {'; '.join(r.get('levers_stepped_aside', []))} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--work", default="/tmp/qlora-families")
    ap.add_argument("--families", default="", help="comma list; empty = all of tests/families.FAMILIES")
    ap.add_argument("--steps", type=int, default=40, help="optimizer steps per family")
    ap.add_argument("--dims", default="", help="JSON overrides of FAMILY_DIMS (CPU smoke tests: small models)")
    ap.add_argument("--parallel", type=int, default=5, help="families at a time (each in its own process)")
    ap.add_argument("--shape", default="qwen2.5-7b", choices=sorted(SHAPES))
    ap.add_argument("--seq", type=int, default=2048, help="bench_train's example lengths are cut here")
    ap.add_argument("--shape-steps", type=int, default=8, help="timed pipeline steps, after 2 warm-up steps")
    ap.add_argument("--reference-steps", type=int, default=6, help="timed reference steps, after 2 warm-up steps")
    ap.add_argument("--reference-ga", type=int, default=16, help="the reference recipe's micro-batches per step")
    ap.add_argument("--speed", default="{}", help="JSON SpeedArgs overrides for the families' training, e.g. "
                    '\'{"gpu_memory_budget_gb": 0.3}\' so the plan recomputes and offloads layers')
    ap.add_argument("--skip", default="", help="comma list of: families, shape")
    ap.add_argument("--out", default="bench/results/families.json")
    ap.add_argument("--logs", default=os.environ.get("OUT", "/tmp/qlora-families"))
    a = ap.parse_args()
    if a.worker:
        print("RESULT " + json.dumps(WORKERS[a.worker](json.loads(a.spec)), default=str), flush=True)
        return
    skip = set(filter(None, a.skip.split(",")))
    runner = bench_train.Runner(Path(a.logs) / "bench_families.log")
    result: dict[str, Any] = {"date": datetime.date.today().isoformat(), "command": " ".join(sys.argv),
                              "gpu": bench_train._gpu(), "versions": bench_train._versions(),
                              "family_dims": FAMILY_DIMS}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with concurrent.futures.ThreadPoolExecutor(1) as background:  # build and quantize the shape meanwhile
        build = background.submit(shape_build, a, runner) if "shape" not in skip else None
        if "families" not in skip:
            result["families"] = families_part(a, runner)
            out.write_text(json.dumps(result, indent=1) + "\n")
            print(table(result["families"]), flush=True)
        if build is not None:
            result["shape_run"] = shape_part(a, runner, build.result())
            result["shape_summary"] = summary(result["shape_run"])
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "shape_run"}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
