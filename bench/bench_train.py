"""Training speed and memory of train_adapter beside the reference recipe (and Unsloth), in one GPU run.

Builds a Llama-3.1-8B-shaped model with random weights once (bench/shapes.py), quantizes it through the pipeline's
own prepare_model stage, then measures on the same synthetic examples (token ids at random, lengths lognormal with
median 250 and sigma 0.8, at least 16, cut at --seq, seed 0):

  (a) reference: bench/reference_recipe.py, as a subprocess (transformers + peft + bitsandbytes, q/k/v/o,
                 micro-batch 1 x --reference-ga)
  (b) pipeline:  train_adapter's own model and Trainer (tasks.train_adapter.builder.adapted and trainer_for, with
                 SFT's unit) with its defaults, LoRA r=16 on all seven projections
  (c) unsloth:   bench/unsloth_peer.py in Unsloth's own environment (--unsloth-python or --unsloth-site)

For each: real (non-padding) tokens/s, time per 1,000 examples, peak allocated and reserved GPU memory,
losses, and the longest sequence that trains under a 16 GiB cap (torch.cuda.set_per_process_memory_fraction).
pipeline.loss_rel_diff is the relative difference of the per-token loss of the pipeline's training forward
and the reference recipe's (prepare_model_for_kbit_training, micro-batch 1) on the same 4-bit weights and
examples before any update. Timed runs go one at a time; the capped probes run side by side afterwards.

usage (GPU host, from the repository root; bench/README.md has the set-up):
  python bench/bench_train.py --out bench/results/train-h200.json --logs /tmp/qlora-bench-logs
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# for `bench.*` without PYTHONPATH; appended, not put first: a sweep entry's tree must keep its own tasks/ first
sys.path.append(str(ROOT))
VOCAB = 128256
GIB = 2**30


# --------------------------------------------------------------------------------------------------------------
# The examples: every tool trains on these lengths and ids
# --------------------------------------------------------------------------------------------------------------

def settings(flat: dict[str, Any]) -> tuple[Any, Any]:
    """TrainArgs and SpeedArgs from one flat dict of fields (the bench specs and sweeps mix both sections)."""
    from tasks.config import SpeedArgs, TrainArgs

    speed = {k: v for k, v in flat.items() if k in SpeedArgs.model_fields}
    return TrainArgs(**{k: v for k, v in flat.items() if k not in speed}), SpeedArgs(**speed)


def lengths(n: int, seq: int) -> list[int]:
    import numpy as np

    rng = np.random.default_rng(0)
    return [int(x) for x in np.minimum(np.maximum(rng.lognormal(np.log(250), 0.8, n).astype(int), 16), seq)]


def token_rows(lens: list[int], vocab: int = VOCAB) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (L,), generator=g).tolist() for L in lens]


def write_examples(path: Path, rows: list[list[int]]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"input_ids": rows, "labels": rows}), path)
    return path


# --------------------------------------------------------------------------------------------------------------
# Workers (each runs in its own process so that its GPU memory figures are its own)
# --------------------------------------------------------------------------------------------------------------

def worker_build(spec: dict[str, Any]) -> dict[str, Any]:
    """The bf16 model of spec's shape (bench/shapes.py; the 8B shape by default), a 128,256-id tokenizer, and the
    pipeline's 4-bit stage."""
    from bench.shapes import make_model_dir

    t = time.time()
    make_model_dir(spec["model_dir"], spec.get("shape", "llama-3.1-8b"))
    made = time.time() - t
    _write_tokenizer(Path(spec["model_dir"]))
    import tasks.prepare_model.stage as pm
    from tasks.config import ModelArgs

    # hashing 16 GB of random weights costs ~30 s and proves nothing here: fingerprint by name and size
    pm.model_fingerprint = lambda source, revision, only=None, **_: {
        "files": json.dumps(sorted((p.name, p.stat().st_size) for p in Path(source).iterdir()))}
    t = time.time()
    folder = pm.prepare_model.fn(ModelArgs(base_model=spec["model_dir"], **spec.get("model", {})),
                                 Path(spec["runs_dir"]))
    return {"model_dir_4bit": folder, "build_s": round(made, 1), "prepare_model_s": round(time.time() - t, 1)}


def _write_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    if (folder / "tokenizer.json").exists():
        return
    tok = Tokenizer(WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2",
                                   pad_token="t0")
    fast.save_pretrained(folder)


def _cap(gib: float) -> None:
    import torch

    if gib and torch.cuda.is_available():
        torch.cuda.set_per_process_memory_fraction(gib * GIB / torch.cuda.get_device_properties(0).total_memory)


def worker_pipeline(spec: dict[str, Any]) -> dict[str, Any]:
    """train_adapter's model and Trainer; several runs (TrainArgs overrides) on one loaded model."""
    import torch

    _cap(spec.get("cap_gib", 0))
    from tasks.config import LoraArgs
    from tasks.errors import UserError
    from tasks.on_disk.parquet_dataset import ParquetExamples
    from tasks.train_adapter import builder
    from tasks.train_adapter.methods import sft

    model_dir = Path(spec["model_dir_4bit"])
    # logging_steps stays the pipeline's default: each logged step makes the host wait for the GPU
    base = {"learning_rate": 2e-4, "save_steps": 10**6, "warmup_steps": 0, **spec.get("train", {})}
    t = time.time()
    model = builder.adapted(sft.UNIT, model_dir, LoraArgs(**spec.get("lora", {})), *settings(base))[0]
    out: dict[str, Any] = {"load_s": round(time.time() - t, 1), "runs": [],
                           "model_allocated_gib": round(torch.cuda.memory_allocated() / GIB, 2)
                           if torch.cuda.is_available() else None}
    for i, run in enumerate(spec["runs"]):
        train = settings({**base, **run.get("train", {})})
        data = Path(spec["work"]) / f"data-{spec['name']}-{i}" / "train.parquet"
        lens = [run["fixed"]] * run["n"] if run.get("fixed") else lengths(run["n"], spec["seq"])
        rows = token_rows(lens, spec.get("vocab", VOCAB))
        examples = ParquetExamples(write_examples(data, rows))
        res: dict[str, Any] = {"name": run.get("name", str(i)), "train": run.get("train", {})}
        try:
            res.update(_train_once(model, examples, train, data.parent, model_dir, run, spec.get("compile")))
        except (torch.OutOfMemoryError, UserError) as exc:  # UserError: no memory plan fits the budget
            res.update(oom=True, error=str(exc).splitlines()[0][:300])
        print("RUN " + json.dumps(res), flush=True)
        out["runs"].append(res)
        import gc

        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if res.get("oom") and run.get("stop_on_oom"):
            break
    return out


def _train_once(model: Any, examples: Any, train: tuple[Any, Any], out: Path, model_dir: Path, run: dict[str, Any],
                compile_how: str | None = None) -> dict[str, Any]:
    import torch
    from transformers import TrainerCallback

    from bench.compile_layers import compile_layers, dynamo_counts
    from tasks.train_adapter import builder
    from tasks.train_adapter.methods import sft

    trainer, chosen = builder.trainer_for(sft.UNIT, model, None, *train, examples, out, model_dir)
    if compile_how:  # after the Trainer: it sets the checkpoint function that "inside" wraps
        compile_layers(model, compile_how)
    collator = trainer.data_collator
    res: dict[str, Any] = {}
    if run.get("loss_check"):
        res["loss_check"] = _pipeline_loss(model, collator, examples, run["loss_check"])
        res["packing_check"] = _packing_check(model, examples)
    marks: list[tuple[float, int]] = []

    class Clock(TrainerCallback):
        """Marks the end of step 2 (warm-up done) and of the last step; a wait for the GPU at every step would
        slow the steps it times."""

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step in (2, state.max_steps):
                _sync()
                marks.append((time.perf_counter(), collator.real_tokens))
            steps[0] = state.global_step

    steps = [0]
    trainer.add_callback(Clock())
    profiler = None
    if run.get("profile_steps"):
        from bench.step_profile import StepProfile

        profiler = StepProfile(first=3, count=run["profile_steps"])
        trainer.add_callback(profiler)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    result = trainer.train()
    res.update(steps=steps[0], train_loss=round(result.training_loss, 4),
               losses=[round(h["loss"], 4) for h in trainer.state.log_history if "loss" in h],
               mean_len=round(sum(map(len, examples.input_ids)) / len(examples), 1),
               packs=len(trainer.train_dataset), batches=dataclasses.asdict(chosen), **_peaks())
    if len(marks) == 2:  # time from the end of the 2nd optimizer step (warm-up) to the end of the last
        (t0, k0), (t1, k1) = marks
        res.update(timed_steps=steps[0] - 2, timed_tokens=k1 - k0, real_tokens_per_s=round((k1 - k0) / (t1 - t0), 1))
    if compile_how:
        res["dynamo"] = dynamo_counts()
    if profiler is not None:
        res["step_profile"] = profiler.report
    if run.get("profile"):
        res["profile"] = _profile(model, collator, examples, run["profile"])
    del trainer
    return res


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _peaks() -> dict[str, float]:
    import torch

    if not torch.cuda.is_available():
        return {}
    return {"peak_allocated_gib": round(torch.cuda.max_memory_allocated() / GIB, 2),
            "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / GIB, 2)}


def _autocast() -> Any:
    import contextlib

    import torch

    return torch.autocast("cuda", dtype=torch.bfloat16) if torch.cuda.is_available() else contextlib.nullcontext()


def _batch(collator: Any, examples: Any, idx: list[int]) -> dict[str, Any]:
    import torch

    if type(collator).__name__ == "PackCollator":
        batch = collator([{"input_ids": [examples[i]["input_ids"] for i in idx],
                           "labels": [examples[i]["labels"] for i in idx]}])
    else:
        batch = collator([examples[i] for i in idx])
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    return {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _pipeline_loss(model: Any, collator: Any, examples: Any, k: int) -> dict[str, Any]:
    """Per-token loss of the first k examples through the training forward, before any update."""
    import torch

    model.train()
    sums, count = 0.0, 0
    with torch.no_grad(), _autocast():
        for start in range(0, k, 8):
            idx = list(range(start, min(k, start + 8)))
            batch = _batch(collator, examples, idx)
            n = int(batch["labels"][..., 1:].ne(-100).sum())
            sums += float(model(**batch).loss) * n
            count += n
    return {"examples": k, "tokens": count, "per_token_loss": sums / count}


def _packing_check(model: Any, examples: Any, n: int = 4) -> dict[str, Any]:
    """Last hidden states of n examples packed in one row vs each run alone: relative difference. The same row
    without position ids (plain causal attention across examples) shows what leaking between examples costs."""
    import torch

    from tasks.train_adapter.levers.packs import pack_collator

    inner = model.get_base_model().model
    dev = next(inner.parameters()).device
    ids = [examples[i]["input_ids"] for i in range(n)]
    batch = pack_collator()([{"input_ids": ids, "labels": ids}])
    keys = ("position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
    with torch.no_grad(), _autocast():
        x = batch["input_ids"].to(dev)
        packed = inner(input_ids=x, **{k: batch[k].to(dev) if isinstance(batch[k], torch.Tensor) else batch[k]
                                        for k in keys}).last_hidden_state[0].float()
        leaky = inner(input_ids=x).last_hidden_state[0].float()
        alone = torch.cat([inner(input_ids=torch.tensor([row], device=dev)).last_hidden_state[0].float()
                           for row in ids])
        attn = inner.config._attn_implementation
        model.get_base_model().set_attn_implementation("sdpa")  # transformers' block-diagonal mask, for scale
        masked = inner(input_ids=x, position_ids=batch["position_ids"].to(dev)).last_hidden_state[0].float()
        model.get_base_model().set_attn_implementation(attn)

    def rel(a: Any) -> float:
        return float((a - alone).norm() / alone.norm())

    return {"examples": n, "attn": attn, "packed_vs_alone": rel(packed), "sdpa_mask_packed_vs_alone": rel(masked),
            "no_position_ids_vs_alone": rel(leaky)}


def first_examples(examples: Any, tokens: int) -> list[int]:
    """Indices of the first examples whose lengths add up to at most `tokens` (at least one)."""
    idx, total = [], 0
    for i in range(len(examples)):
        if idx and total + len(examples.input_ids[i]) > tokens:
            break
        idx.append(i)
        total += len(examples.input_ids[i])
    return idx


def _profile(model: Any, collator: Any, examples: Any, tokens: int) -> str:
    """CPU and CUDA time of one forward+backward micro-step of about `tokens` real tokens."""
    from torch.profiler import ProfilerActivity, profile

    idx = first_examples(examples, tokens)
    total = sum(len(examples.input_ids[i]) for i in idx)
    batch = _batch(collator, examples, idx)
    model.train()

    def step() -> None:
        with _autocast():
            loss = model(**batch).loss
        loss.backward()
        model.zero_grad(set_to_none=True)

    step()
    _sync()
    t = time.perf_counter()
    step()
    _sync()
    wall = time.perf_counter() - t
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        _sync()
    ka = prof.key_averages()
    gpu_ms = sum(e.self_device_time_total for e in ka) / 1e3
    head = f"profile: {total} tokens, one micro-step {wall * 1e3:.0f} ms wall, {gpu_ms:.0f} ms self CUDA time\n"
    return (head + ka.table(sort_by="self_device_time_total", row_limit=18, max_name_column_width=50)
            + ka.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=50))


def worker_refloss(spec: dict[str, Any]) -> dict[str, Any]:
    """The reference recipe's per-token loss (upcast, LoRA q/k/v/o, micro-batch 1) on the pipeline's 4-bit weights."""
    import torch
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    from tasks.models.loading import load_quantized

    model = prepare_model_for_kbit_training(load_quantized(Path(spec["model_dir_4bit"])),
                                            use_gradient_checkpointing=True)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, task_type="CAUSAL_LM",
                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])).train()
    rows = token_rows(lengths(spec["n"], spec["seq"]), spec.get("vocab", VOCAB))[: spec["k"]]
    sums, count = 0.0, 0
    with torch.no_grad(), _autocast():
        for ids in rows:
            x = torch.tensor([ids], device=model.device)
            sums += float(model(input_ids=x, labels=x).loss) * (len(ids) - 1)
            count += len(ids) - 1
    return {"examples": len(rows), "tokens": count, "per_token_loss": sums / count}


def worker_matmul(spec: dict[str, Any]) -> dict[str, Any]:
    """bf16 matrix-product throughput of this card on random data (8192^3, the mean of 20 after 3 warm-ups): the
    ceiling that pipeline.fraction_of_limit divides by."""
    import torch

    if not torch.cuda.is_available():
        return {}
    n = spec.get("n", 8192)
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        a @ b
    stop.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(stop) / 1e3 / 20
    return {"n": n, "tflops": round(2 * n**3 / seconds / 1e12, 1)}


def flops_per_token(config: dict[str, Any]) -> float:
    """6 x parameters: forward, recomputation and the input gradient (frozen weights need no weight gradient),
    2 FLOP per weight each; the embedding and output layer counted once each (8.0e9 for the 8B shape)."""
    h, i, layers, v = (config[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size"))
    kv = h // config["num_attention_heads"] * config.get("num_key_value_heads", config["num_attention_heads"])
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
    return 6.0 * (layers * per_layer + 2 * v * h + h)


WORKERS = {"build": worker_build, "pipeline": worker_pipeline, "refloss": worker_refloss, "matmul": worker_matmul}


# --------------------------------------------------------------------------------------------------------------
# Orchestration
# --------------------------------------------------------------------------------------------------------------

class Runner:
    """Starts subprocesses, keeps their output for the log, returns their last RESULT line."""

    def __init__(self, log: Path) -> None:
        self.log = log
        log.parent.mkdir(parents=True, exist_ok=True)

    def run(self, name: str, cmd: list[str], env: dict[str, str] | None = None, timeout: int = 900,
            cwd: str | None = None) -> dict[str, Any]:
        t = time.time()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=cwd)
            text, code = proc.stdout + proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as exc:
            text, code = f"{exc.stdout or ''}{exc.stderr or ''}\nTIMEOUT after {timeout}s", -1
        seconds = time.time() - t
        with self.log.open("a") as f:
            f.write(f"\n===== {name} ({seconds:.0f}s, exit {code}): {' '.join(cmd)[:400]}\n{_trim(text)}\n")
        result = None
        for line in text.splitlines():
            if line.startswith("RESULT "):
                result = json.loads(line[len("RESULT "):])
        out = result if isinstance(result, dict) else {"error": f"no RESULT (exit {code})",
                                                       "tail": text.strip().splitlines()[-3:]}
        out["wall_s"] = round(seconds, 1)
        print(f"[{time.strftime('%H:%M:%S')}] {name}: {json.dumps(out)[:600]}", flush=True)
        return out


def _trim(text: str, keep: int = 30000) -> str:
    noise = ("Loading weights", "it/s]", "warnings.warn")
    lines = [ln for ln in text.splitlines() if not any(n in ln for n in noise)]
    text = "\n".join(lines)
    return text if len(text) <= keep else text[:keep // 3] + "\n...\n" + text[-2 * keep // 3:]


def worker_cmd(kind: str, spec: dict[str, Any]) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--worker", kind, "--spec", json.dumps(spec)]


def tree_env(extra: dict[str, Any]) -> dict[str, str] | None:
    """A sweep entry's "tree": a folder holding another commit's tasks/ (`git archive COMMIT tasks | tar -x -C
    TREE`), to measure the code before a change beside the code after it in one run."""
    if not extra.get("tree"):
        return None
    tree = str(Path(extra["tree"]).resolve())
    if not (Path(tree) / "tasks").is_dir():  # else the worker would quietly run this checkout's code
        sys.exit(f"sweep entry {extra['name']}: {tree} has no tasks/ (mkdir {extra['tree']} && git archive COMMIT "
                 f"tasks | tar -x -C {extra['tree']})")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [tree, os.environ.get("PYTHONPATH")]))}


def pipeline_runs(a: argparse.Namespace, n: int) -> list[dict[str, Any]]:
    run = {"name": "default", "n": n, "train": {"max_steps": (a.pipeline_steps or a.steps) + 2},
           "loss_check": a.loss_examples}
    return [{**run, "profile": a.profile_tokens} if a.profile_tokens else run]


def max_seq_runs(ladder: list[int], train: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"name": f"seq{s}", "n": 2, "fixed": s, "stop_on_oom": True,
             "train": {"max_steps": 1, "max_tokens_per_batch": s, **train}} for s in ladder]


def longest_fit(runs: list[dict[str, Any]]) -> int | None:
    fits = [int(r["name"].removeprefix("seq")) for r in runs if not r.get("oom") and not r.get("error")]
    return max(fits) if fits else None


def reference_cmd(model_dir: str, seq: int) -> list[str]:
    """bench/reference_recipe.py on model_dir, its lengths cut at seq."""
    return [sys.executable, str(ROOT / "bench" / "reference_recipe.py"), model_dir, "--seq", str(seq)]


def unsloth_cmd(python: str, model_dir: str, seq: int) -> list[str]:
    """bench/unsloth_peer.py under Unsloth's Python."""
    return [python, str(ROOT / "bench" / "unsloth_peer.py"), model_dir, "--seq", str(seq)]


def unsloth_setup(a: argparse.Namespace, env: dict[str, str]) -> tuple[str, dict[str, str] | None]:
    """The Python that runs Unsloth and its environment; no environment when neither option names one."""
    if not (a.unsloth_python or a.unsloth_site):
        return "", None
    uns_env = {**env, "HF_HUB_OFFLINE": "1", "UNSLOTH_DISABLE_STATISTICS": "1"}
    if a.unsloth_site:  # its packages shadow this Python's own (transformers, trl, datasets)
        uns_env["PYTHONPATH"] = a.unsloth_site
    return a.unsloth_python or sys.executable, uns_env


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", default="/tmp/llama8b")
    ap.add_argument("--shape", default="llama-3.1-8b", help="bench/shapes.py's shape to build into --model-dir "
                    "(tiny-llama: a CPU smoke test of this script)")
    ap.add_argument("--work", default="/tmp/qlora-bench")
    ap.add_argument("--seq", type=int, default=2048, help="lengths are cut at this many tokens")
    ap.add_argument("--steps", type=int, default=6, help="timed optimizer steps, after 2 warm-up steps")
    ap.add_argument("--pipeline-steps", type=int, default=0, help="timed steps of (b) if not --steps (its "
                    "micro-batches are smaller: more steps for the same timed tokens)")
    ap.add_argument("--loss-examples", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=VOCAB, help=argparse.SUPPRESS)  # CPU smoke tests: tiny models
    ap.add_argument("--unsloth-python", default="", help="the Python of a virtual environment with Unsloth "
                    "installed (bench/README.md); empty, and no --unsloth-site: skip (c)")
    ap.add_argument("--unsloth-site", default="", help="or: a folder of Unsloth's packages put first on PYTHONPATH "
                    "for this Python (a GPU host without network)")
    ap.add_argument("--unsloth-bs", type=int, default=2)
    ap.add_argument("--unsloth-ga", type=int, default=4)
    ap.add_argument("--unsloth-steps", type=int, default=6, help="timed steps of (c), after its 2 warm-up steps")
    ap.add_argument("--reference-ga", type=int, default=16, help="the reference recipe's micro-batches per step")
    ap.add_argument("--pipeline-ladder", default="32768,65536,98304,131072")
    ap.add_argument("--reference-ladder", default="2048,4096")
    ap.add_argument("--unsloth-ladder", default="32768,65536")
    ap.add_argument("--sweep", default="", help="JSON list of extra pipeline workers {name, lora, train, runs}, "
                    "optionally tree (another commit's tasks/) and compile (layers or inside: bench/compile_layers.py)")
    ap.add_argument("--profile-tokens", type=int, default=0, help="profile one pipeline micro-step of this size")
    ap.add_argument("--skip", default="", help="comma list of: reference, unsloth, caps, pipeline")
    ap.add_argument("--out", default="bench/results/train-h200.json", help="the result's JSON (a folder: "
                    "<date>-h200.json in it)")
    ap.add_argument("--logs", default=os.environ.get("OUT", "/tmp/qlora-bench"))
    a = ap.parse_args()
    if a.worker:
        print("RESULT " + json.dumps(WORKERS[a.worker](json.loads(a.spec))), flush=True)
        return

    skip = set(filter(None, a.skip.split(",")))
    logs = Path(a.logs)
    runner = Runner(logs / "bench.log")
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")}
    result: dict[str, Any] = {"date": datetime.date.today().isoformat(), "command": " ".join(sys.argv),
                              "seq": a.seq, "versions": _versions(), "gpu": _gpu()}
    work = Path(a.work)
    path = Path(a.out) if a.out.endswith(".json") else Path(a.out) / f"{result['date']}-h200.json"

    def save() -> None:  # after every phase, so a run cut short still leaves its figures
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**summarize(result, mean_len, a), "raw": result}, indent=1) + "\n")
        (logs / path.name).write_text(path.read_text())

    mean_len = 0.0
    build = runner.run("build", worker_cmd("build", {"model_dir": a.model_dir, "runs_dir": str(work / "runs"),
                                                     "shape": a.shape}), timeout=900)
    result["build"] = build
    four = build["model_dir_4bit"]
    result["matmul"] = runner.run("matmul", worker_cmd("matmul", {}))
    result["flops_per_token"] = flops_per_token(json.loads((Path(a.model_dir) / "config.json").read_text()))
    lens = lengths(4000, a.seq)
    mean_len = sum(lens) / len(lens)
    result["data"] = {"lengths": f"lognormal median 250 sigma 0.8, min 16, cut at {a.seq}, seed 0",
                      "mean_len_4000": round(mean_len, 1)}
    base = {"model_dir_4bit": four, "work": str(work), "seq": a.seq, "vocab": a.vocab}

    if "pipeline" not in skip:
        spec = {**base, "name": "pipeline", "runs": pipeline_runs(a, 4000)}
        result["pipeline_run"] = runner.run("pipeline", worker_cmd("pipeline", spec))
        save()
    for extra in json.loads(a.sweep or "[]"):
        spec = {**base, "name": extra["name"], "lora": extra.get("lora", {}), "train": extra.get("train", {}),
                "runs": extra["runs"], "compile": extra.get("compile"), "cap_gib": extra.get("cap_gib", 0)}
        result.setdefault("sweep", {})[extra["name"]] = runner.run(f"sweep {extra['name']}",
                                                                   worker_cmd("pipeline", spec), tree_env(extra))
        save()
    if "reference" not in skip:
        cmd = [*reference_cmd(a.model_dir, a.seq), "--ga", str(a.reference_ga), "--steps", str(a.steps)]
        result["reference_run"] = runner.run("reference", cmd, env=env)
        save()
    uns_python, uns_env = unsloth_setup(a, env)
    unsloth_cwd = str(work / "unsloth-cwd")  # Unsloth writes its compiled cache into the working directory
    if uns_env and "unsloth" not in skip:
        cmd = [*unsloth_cmd(uns_python, a.model_dir, a.seq), "--bs", str(a.unsloth_bs), "--ga", str(a.unsloth_ga),
               "--packing", "--steps", str(a.unsloth_steps)]
        Path(unsloth_cwd).mkdir(parents=True, exist_ok=True)
        result["unsloth_run"] = runner.run("unsloth", cmd, env=uns_env, cwd=unsloth_cwd, timeout=360)
        save()

    if "caps" not in skip:  # untimed probes, side by side
        jobs: dict[str, Any] = {}
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            ladder = [int(s) for s in a.pipeline_ladder.split(",") if s]
            # the memory plan sees the cap as its budget, as a user with a 16 GB card would set it
            spec = {**base, "name": "cap", "cap_gib": 16, "runs": max_seq_runs(ladder, {"gpu_memory_budget_gb": 16})}
            jobs["pipeline_cap"] = pool.submit(runner.run, "pipeline cap 16 GiB", worker_cmd("pipeline", spec))
            spec = {**base, "n": 4000, "k": a.loss_examples}
            jobs["refloss"] = pool.submit(runner.run, "reference loss", worker_cmd("refloss", spec))
            if "reference" not in skip:
                for s in filter(None, a.reference_ladder.split(",")):
                    cmd = [*reference_cmd(a.model_dir, int(s)), "--lengths", "fixed", "--ga", "1", "--steps", "1",
                           "--cap-gib", "16"]
                    jobs[f"reference_cap_{s}"] = pool.submit(runner.run, f"reference cap {s}", cmd, env)
            if uns_env and "unsloth" not in skip:
                Path(unsloth_cwd).mkdir(parents=True, exist_ok=True)
                for s in filter(None, a.unsloth_ladder.split(",")):
                    cmd = [*unsloth_cmd(uns_python, a.model_dir, int(s)), "--bs", "1", "--ga", "1", "--fixed",
                           "--steps", "1", "--cap-gib", "16"]
                    jobs[f"unsloth_cap_{s}"] = pool.submit(runner.run, f"unsloth cap {s}", cmd, uns_env,
                                                           360, unsloth_cwd)
        result.update({k: f.result() for k, f in jobs.items()})

    save()
    print(table(summarize(result, mean_len, a)))
    print(f"wrote {path}")


def summarize(r: dict[str, Any], mean_len: float, a: argparse.Namespace) -> dict[str, Any]:
    """The summary: reference.*, pipeline.*, unsloth.* with GPU, versions, date, command."""
    def per_1000(tps: float | None) -> float | None:
        return round(1000 * mean_len / tps, 1) if tps else None

    s: dict[str, Any] = {k: r[k] for k in ("date", "command", "gpu", "versions", "data")}
    ref, uns = r.get("reference_run", {}), r.get("unsloth_run", {})
    caps = {k: v for k, v in r.items() if "_cap_" in k}
    if ref:
        fits = [int(k.rsplit("_", 1)[1]) for k, v in caps.items() if k.startswith("reference_cap") and
                not v.get("oom") and "error" not in v]
        s["reference"] = {"real_tokens_per_s": ref.get("real_tokens_per_s"),
                          "seconds_per_1000_examples": per_1000(ref.get("real_tokens_per_s")),
                          "peak_allocated_gib": ref.get("peak_allocated_gib"),
                          "peak_reserved_gib": ref.get("peak_reserved_gib"),
                          "max_seq_under_16gib": max(fits) if fits else None,
                          "tried_under_16gib": a.reference_ladder, "losses": ref.get("losses"),
                          "setup": f"reference_recipe.py, q/k/v/o, micro-batch 1 x {a.reference_ga}"}
    pipe = (r.get("pipeline_run", {}).get("runs") or [{}])[0]
    if pipe:
        ref_loss = r.get("refloss", {}).get("per_token_loss")
        pl = (pipe.get("loss_check") or {}).get("per_token_loss")
        s["pipeline"] = {"real_tokens_per_s": pipe.get("real_tokens_per_s"),
                         "seconds_per_1000_examples": per_1000(pipe.get("real_tokens_per_s")),
                         "peak_allocated_gib": pipe.get("peak_allocated_gib"),
                         "peak_reserved_gib": pipe.get("peak_reserved_gib"),
                         "max_seq_under_16gib": longest_fit(r.get("pipeline_cap", {}).get("runs", [])),
                         "tried_under_16gib": a.pipeline_ladder,
                         "per_token_loss": pl, "reference_per_token_loss": ref_loss,
                         "loss_rel_diff": abs(pl - ref_loss) / ref_loss if pl and ref_loss else None,
                         "losses": pipe.get("losses"), "max_tokens_per_batch": pipe.get("max_tokens_per_batch"),
                         "setup": "train_adapter defaults (LoRA r=16 on all 7 projections)",
                         **plan_fields(pipe), **limit_fields(r, pipe.get("real_tokens_per_s"))}
        for name, entry in r.get("sweep", {}).items():
            for run in entry.get("runs", []):
                s.setdefault("pipeline_variants", {})[f"{name}/{run.get('name')}"] = {
                    "real_tokens_per_s": run.get("real_tokens_per_s"), "peak_allocated_gib":
                    run.get("peak_allocated_gib"), **plan_fields(run), **limit_fields(r, run.get("real_tokens_per_s"))}
    if uns:
        fits = [int(k.rsplit("_", 1)[1]) for k, v in caps.items() if k.startswith("unsloth_cap") and
                not v.get("oom") and "error" not in v]
        s["unsloth"] = {"real_tokens_per_s": uns.get("real_tokens_per_s"),
                        "seconds_per_1000_examples": per_1000(uns.get("real_tokens_per_s")),
                        "peak_allocated_gib": uns.get("peak_allocated_gib"),
                        "peak_reserved_gib": uns.get("peak_reserved_gib"),
                        "max_seq_under_16gib": max(fits) if fits else None, "tried_under_16gib": a.unsloth_ladder,
                        "losses": uns.get("losses"),
                        "setup": f"unsloth_peer.py --packing, all 7, micro-batch {a.unsloth_bs} x {a.unsloth_ga}"}
    return s


def plan_fields(run: dict[str, Any]) -> dict[str, Any]:
    """The memory plan a run trained with (tasks/train_adapter/memory_plan.py), and how far its predicted peak was
    from the measured one."""
    plan = (run.get("batches") or {}).get("memory_plan")
    if not plan:
        return {}
    peak = run.get("peak_allocated_gib")
    return {"budget_gib": plan["budget_gib"], "predicted_peak_gib": plan["predicted_peak_gib"],
            "plan": {k: plan.get(k) for k in ("tokens", "recompute_layers", "recompute_mlp_layers", "chunk_recomputed",
                                              "offload_activations", "offload_embeddings")},
            "relative_time": plan.get("relative_time"),
            "prediction_error": round(plan["predicted_peak_gib"] / peak - 1, 3) if peak else None}


def limit_fields(r: dict[str, Any], tps: float | None) -> dict[str, Any]:
    """The card's limit for this model in tokens/s (measured matmul rate / FLOP per token) and the share reached."""
    tflops, per_token = r.get("matmul", {}).get("tflops"), r.get("flops_per_token")
    if not (tflops and per_token and tps):
        return {}
    limit = tflops * 1e12 / per_token
    return {"matmul_tflops": tflops, "limit_tokens_per_s": round(limit), "fraction_of_limit": round(tps / limit, 3)}


def table(s: dict[str, Any]) -> str:
    rows = ["| | real tokens/s | s per 1,000 examples | peak allocated GiB | peak reserved GiB "
            "| longest seq under 16 GiB |",
            "|---|---|---|---|---|---|"]
    for tool in ("reference", "pipeline", "unsloth"):
        if tool in s:
            t = s[tool]
            rows.append(f"| {tool} | {t['real_tokens_per_s']} | {t['seconds_per_1000_examples']} | "
                        f"{t['peak_allocated_gib']} | {t['peak_reserved_gib']} | {t['max_seq_under_16gib']} |")
    if "pipeline" in s:
        rows.append(f"\npipeline loss_rel_diff vs reference: {s['pipeline']['loss_rel_diff']}")
    return "\n".join(rows)


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": sys.version.split()[0]}
    for name in ("torch", "transformers", "peft", "bitsandbytes", "accelerate", "liger-kernel", "triton"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "absent"
    return out


def _gpu() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30).stdout.strip()
    except OSError:
        return "unknown"


if __name__ == "__main__":
    main()
