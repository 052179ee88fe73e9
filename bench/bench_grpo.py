"""GRPO speed: train_adapter's GRPO path beside TRL's plain GRPOTrainer QLoRA recipe, on the same 4-bit
Llama-3.1-8B-shaped model, the same prompts, the same number and length of answers and the same beta, in one GPU run.

Builds the 8B-shaped model with random weights and quantizes it through the pipeline's prepare_model (bench_train's
worker_build, as bench_dpo.py), then, each in its own process so that its GPU memory figures are its own:

  check: the answers' generation three ways on the pipeline's 4-bit model with a LoRA adapter whose B weights are
         random (an adapter mid-training): (a) the 4-bit layers, TRL's dynamic cache; (b) the dense path
         (levers/generation.py) with a static cache, eager; (c) the same, each decoding step replayed as a CUDA graph
         (levers/decode_graphs.py). Greedy, --check-tokens new tokens for --answers prompts: (b) and (c) must give the
         same tokens (the graph replays (b)'s kernels); `first_logits_rel_diff` compares the first step's logits of
         (a) and (b) (bf16 rounding: bitsandbytes' kernel and a plain matmul of the same dequantized weights);
         seconds per new token of each
  per --lengths L (answers of at most L tokens):
  (a) pipeline: tasks.train_adapter.builder.fit_and_save with GRPO's unit, its defaults (the dense generation, fused
      LoRA layers, torch's fused AdamW, its checkpointing)
  (b) trl: TRL's plain recipe: AutoModelForCausalLM with a BitsAndBytesConfig (nf4, double quantization, bf16
      compute), GRPOTrainer with peft_config (the reference = the adapter disabled), gradient checkpointing, bf16,
      paged 8-bit AdamW
  --variants (pipeline runs beside (a)): `four_bit` (the answers sampled by TRL's own path on the 4-bit layers: the
      pipeline before levers/generation.py), `eager` (the dense path without CUDA graphs, dynamic cache)

Both: LoRA r=16, alpha 32, dropout 0 on all seven projections, beta 0.1, temperature 1, --answers answers per step
(--generations per prompt), 1 accumulation step, learning rate 1e-5, the reward `format` (the answer holds two
consecutive words starting with 9: about a third of 64-token answers). Prompts: token ids at random (seed 0) written
as the bench tokenizer's words (`t<id>`, ids whose decimal form starts with 3-9, see bench_dpo.make_pairs), lengths
lognormal (median --prompt-median, sigma 0.4, at least 16, at most --prompt-max). The random-weight model almost never
samples eos (one id in 128,256), so every answer is L tokens long in both: equal work (`mean_answer_tokens` shows
it). Reported per run: seconds per optimizer step and seconds of generation per step (from the end of the first,
warm-up, step to the end of the last; the GPU synchronized), peak allocated GPU memory, the mean answer length, the
rewards; `speedup` = TRL's seconds per step / the pipeline's, per length.

usage (GPU host, from the repository root; about 6 minutes on one H100 for both lengths, 2 timed steps):
  python bench/bench_grpo.py --lengths 64,256 --steps 2 --check-tokens 16 --variants eager,four_bit \
      --out bench/results/grpo-h100.json
  python bench/bench_grpo.py --smoke --lengths 8 --steps 2 --model-dir /tmp/grpo-smoke-model \
      --work /tmp/grpo-smoke                                   # a CPU check of the script (figures meaningless)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
GIB = 2**30
PATTERN = r"t9\d* t9"  # two consecutive answer words starting with 9 (the format reward's train.reward_pattern)


def make_prompts(n: int, median: int, most: int, vocab: int) -> list[str]:
    """n prompts of the bench tokenizer's words (seed 0), no special token inside."""
    import numpy as np

    rng = np.random.default_rng(0)
    lens = np.clip(rng.lognormal(np.log(median), 0.4, n).astype(int), 16, most)
    allowed = np.array([i for i in range(3, vocab) if str(i)[0] in "3456789"])  # as bench_dpo.make_pairs
    return [" ".join(f"t{int(i)}" for i in rng.choice(allowed, k)) for k in lens]


def write_prompts(folder: Path, prompts: list[str]) -> None:
    """train.parquet as prepare_data writes the prompts format (what grpo.fit_and_save reads of it)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"prompt": prompts, "columns": ["{}"] * len(prompts)}), folder / "train.parquet")


class _Timer:
    """Per optimizer step: the time at its end and the generation seconds in it (the GPU synchronized)."""

    def __init__(self) -> None:
        self.marks: list[float] = []
        self.generation: list[float] = []

    def callback(self) -> Any:
        import torch
        from transformers import TrainerCallback

        timer = self

        class Cb(TrainerCallback):
            def on_train_begin(self, *a: Any, **k: Any) -> None:
                if torch.cuda.is_available():
                    torch.cuda.reset_peak_memory_stats()
                timer.marks, timer.generation = [time.perf_counter()], []

            def on_step_end(self, *a: Any, **k: Any) -> None:
                _sync()
                timer.marks.append(time.perf_counter())
        return Cb()

    def wrap_generation(self, trainer: Any) -> None:
        """Time whatever _generate_single_turn the trainer has (TRL's, or the pipeline's lever)."""
        inner = trainer._generate_single_turn

        def timed(*args: Any, **kwargs: Any) -> Any:
            _sync()
            start = time.perf_counter()
            out = inner(*args, **kwargs)
            _sync()
            self.generation.append(time.perf_counter() - start)
            return out

        trainer._generate_single_turn = timed

    def summary(self, trainer: Any) -> dict[str, Any]:
        import torch

        steps = len(self.marks) - 2  # after the first (warm-up) step
        logged = [h for h in trainer.state.log_history if "reward" in h]
        lengths = [h["completions/mean_length"] for h in logged if "completions/mean_length" in h]
        cuda = torch.cuda.is_available()
        return {"s_per_step": round((self.marks[-1] - self.marks[1]) / steps, 3), "timed_steps": steps,
                "generation_s_per_step": round(sum(self.generation[1:1 + steps]) / steps, 3),
                "warmup_step_s": round(self.marks[1] - self.marks[0], 2),
                "mean_answer_tokens": round(sum(lengths) / len(lengths), 1) if lengths else None,
                "rewards": [round(h["reward"], 3) for h in logged],
                "peak_gpu_allocated_gib": round(torch.cuda.max_memory_allocated() / GIB, 2) if cuda else 0.0,
                "peak_gpu_reserved_gib": round(torch.cuda.max_memory_reserved() / GIB, 2) if cuda else 0.0}


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def worker_pipeline(spec: dict[str, Any]) -> dict[str, Any]:
    """train_adapter's GRPO path as the stage runs it, the bench's timer around its trainer."""
    from tasks.config import LoraArgs, SpeedArgs, TrainArgs
    from tasks.train_adapter import builder
    from tasks.train_adapter.levers import decode_graphs, generation
    from tasks.train_adapter.methods import grpo

    variant = spec.get("variant")
    if variant == "four_bit":  # the pipeline before the lever: TRL's own generation on the 4-bit layers
        generation.install = lambda trainer, speed: None
    elif variant == "eager":
        decode_graphs.unsupported = lambda model: "bench variant eager"
    timer, after = _Timer(), grpo.UNIT.after

    def timed_after(trainer: Any, *args: Any, **kwargs: Any) -> Any:
        done = after(trainer, *args, **kwargs)  # the unit's own arrangements (the generation lever) first
        trainer.add_callback(timer.callback())
        timer.wrap_generation(trainer)
        timed_after.trainer = trainer  # type: ignore[attr-defined]
        return done

    grpo.UNIT.after = timed_after  # type: ignore[method-assign]
    said = _lever_lines()
    out = Path(spec["work"]) / "pipeline-out"
    shutil.rmtree(out, ignore_errors=True)  # each run starts afresh, no checkpoint to resume
    out.mkdir(parents=True)
    train = TrainArgs(method="grpo", rewards=["format"], reward_pattern=PATTERN, max_steps=spec["steps"] + 1,
                      per_device_train_batch_size=spec["answers"], num_generations=spec["generations"],
                      max_completion_length=spec["length"], temperature=1.0, beta=0.1, learning_rate=1e-5,
                      warmup_steps=0, logging_steps=1, save_steps=10**6)
    t = time.time()
    metrics = builder.fit_and_save(grpo.UNIT, LoraArgs(), train, SpeedArgs(), spec["data_dir"],
                                   spec["model_dir_4bit"], out)
    return {**timer.summary(timed_after.trainer), "wall_s": round(time.time() - t, 1),  # type: ignore[attr-defined]
            "variant": variant, "last_reward": metrics.get("last_reward"), "last_kl": metrics.get("last_kl"),
            "generation_log": said}


def _lever_lines() -> list[str]:
    """The generation levers' log lines (what they applied or why they stepped aside), collected as they come."""
    import logging

    said: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            text = record.getMessage()
            if "answers sampled" in text or "decoding steps" in text:
                said.append(text)

    log = logging.getLogger("qlora_pipeline")  # tasks.log.logger() outside a Prefect run
    log.addHandler(Collect(logging.INFO))
    if log.getEffectiveLevel() > logging.INFO:
        log.setLevel(logging.INFO)
    return said


def worker_trl(spec: dict[str, Any]) -> dict[str, Any]:
    """TRL's plain QLoRA GRPO recipe: no pipeline code, no levers."""
    import pyarrow.parquet as pq
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig
    from trl import GRPOConfig, GRPOTrainer

    from tasks.models.loading import LOAD_KWARGS

    data = Dataset.from_list(pq.read_table(Path(spec["data_dir"]) / "train.parquet", columns=["prompt"]).to_pylist())
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    t = time.time()
    model = AutoModelForCausalLM.from_pretrained(
        spec["model_dir"], dtype=torch.bfloat16, device_map={"": 0} if torch.cuda.is_available() else "cpu",
        quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                               bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16),
        **LOAD_KWARGS)  # the recipe as it ran before transformers 5.25 fetched Hub kernels by default
    load_s = time.time() - t
    compiled = re.compile(PATTERN)

    def format_reward(completions: list[str], **_: Any) -> list[float]:  # the pipeline's `format` reward
        return [float(compiled.search(c) is not None) for c in completions]

    cuda = torch.cuda.is_available()
    args = GRPOConfig(output_dir=str(Path(spec["work"]) / "trl-out"), max_steps=spec["steps"] + 1,
                      per_device_train_batch_size=spec["answers"], num_generations=spec["generations"],
                      max_completion_length=spec["length"], temperature=1.0, beta=0.1, learning_rate=1e-5,
                      warmup_steps=0, logging_steps=1, save_strategy="no", report_to=[], bf16=cuda, use_cpu=not cuda,
                      gradient_checkpointing=True, optim="paged_adamw_8bit" if cuda else "adamw_torch",
                      disable_tqdm=True)
    peft = LoraConfig(task_type="CAUSAL_LM", r=16, lora_alpha=32, lora_dropout=0.0,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    timer = _Timer()
    trainer = GRPOTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer,
                          reward_funcs=[format_reward], peft_config=peft, callbacks=[timer.callback()])
    timer.wrap_generation(trainer)
    t = time.time()
    trainer.train()
    return {**timer.summary(trainer), "load_s": round(load_s, 1), "train_s": round(time.time() - t, 1)}


def worker_check(spec: dict[str, Any]) -> dict[str, Any]:
    """The three generation paths on one 4-bit model with a moved adapter: tokens, logits, seconds per token."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoTokenizer, GenerationConfig

    from tasks.models.loading import load_quantized
    from tasks.train_adapter.levers import decode_graphs, generation

    model = get_peft_model(load_quantized(Path(spec["model_dir_4bit"])), LoraConfig(
        task_type="CAUSAL_LM", r=16, lora_alpha=32, target_modules="all-linear"), autocast_adapter_dtype=False)
    torch.manual_seed(1)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.02)
    model.train()  # as TRL samples: training mode
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    prompts = [ids for ids in tokenizer(text=spec["prompts"][:spec["answers"]])["input_ids"]]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = (torch.arange(width, device=ids.device)[None] >= torch.tensor(
        [width - len(p) for p in prompts], device=ids.device)[:, None]).long()
    new = spec["check_tokens"]

    def generate(cache: str | None) -> tuple[list[list[int]], float]:
        config = GenerationConfig(max_new_tokens=new, do_sample=False, pad_token_id=0, eos_token_id=[2],
                                  cache_implementation=cache, disable_compile=True)
        times = []
        for _ in range(2):  # the second is timed: the first creates cuBLAS handles, the graph's first capture
            _sync()
            start = time.perf_counter()
            with torch.no_grad():
                out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
            _sync()
            times.append(time.perf_counter() - start)
        return out[:, width:].tolist(), round(times[-1] / new, 5)

    def first_logits() -> Any:
        with torch.no_grad():
            return model(input_ids=ids, attention_mask=mask).logits[:, -1].float()

    four_bit, four_bit_s = generate(None)
    logits_4bit = first_logits()
    decoder = decode_graphs.Decoder()
    with generation.dense_layers(model):
        eager, eager_s = generate("static")
        dynamic, dynamic_s = generate(None)
        logits_dense = first_logits()
        config = GenerationConfig(max_new_tokens=new, do_sample=False, pad_token_id=0, eos_token_id=[2],
                                  disable_compile=True)
        with decoder.graphed(model, config):
            graphed, graphed_s = generate(config.cache_implementation)
    agree = [next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), new)
             for a, b in zip(four_bit, eager, strict=True)]
    return {"graph_tokens_equal_eager": graphed == eager, "graph_failed": decoder.failed,
            "graphs_unsupported": decode_graphs.unsupported(model),
            "first_logits_rel_diff": round(float((logits_dense - logits_4bit).norm() / logits_4bit.norm()), 6),
            "tokens_before_first_difference_4bit_vs_dense": agree,
            "s_per_token": {"four_bit_dynamic": four_bit_s, "dense_dynamic": dynamic_s, "dense_static_eager": eager_s,
                            "dense_static_graphed": graphed_s},
            "answers": len(prompts), "prompt_tokens": width, "new_tokens": new}


WORKERS = {"pipeline": worker_pipeline, "trl": worker_trl, "check": worker_check}


def _run(kind: str, spec: dict[str, Any], log: Path, timeout: int) -> dict[str, Any]:
    from worker import run_worker

    return run_worker(__file__, kind, spec, log, timeout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", default="/tmp/llama8b")
    ap.add_argument("--work", default="/tmp/qlora-bench-grpo")
    ap.add_argument("--lengths", default="64,256", help="answer lengths (max_completion_length), comma-separated")
    ap.add_argument("--steps", type=int, default=3, help="timed optimizer steps, after one warm-up step")
    ap.add_argument("--answers", type=int, default=8, help="answers per optimizer step")
    ap.add_argument("--generations", type=int, default=8, help="answers per prompt (num_generations)")
    ap.add_argument("--prompt-median", type=int, default=128)
    ap.add_argument("--prompt-max", type=int, default=256)
    ap.add_argument("--variants", default="", help="more pipeline runs per length, comma-separated: four_bit, eager")
    ap.add_argument("--check-tokens", type=int, default=32, help="new tokens of the check worker; 0: no check")
    ap.add_argument("--deadline-s", type=int, default=0, help="start no variant after this many seconds (0: no "
                    "limit); the ones left are reported as skipped")
    ap.add_argument("--out", type=Path, help="write the JSON here, after every run (default: print only)")
    ap.add_argument("--smoke", action="store_true", help="a tiny model with the same vocabulary: checks the script "
                    "end to end on a CPU in a few minutes (figures meaningless)")
    a = ap.parse_args()
    if a.worker:
        spec = json.loads(Path(a.spec).read_text())
        if a.worker == "build":
            from bench_train import worker_build

            result = worker_build(spec)
        else:
            result = WORKERS[a.worker](spec)
        print("RESULT " + json.dumps(result), flush=True)
        return
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    started = time.time()
    report: dict[str, Any] = {"bench": "bench_grpo", "date": datetime.date.today().isoformat(),
                              "command": "bench/bench_grpo.py " + " ".join(sys.argv[1:]), "gpu": _gpu_name(),
                              "versions": _versions()}
    report["build"] = built = _run("build", {"model_dir": a.model_dir, "runs_dir": str(work / "runs"),
                                             "shape": "tiny-llama" if a.smoke else "llama-3.1-8b"},
                                   work / "build.log", 1200)
    if "error" in built:
        _save(report, a.out)
        sys.exit(f"build failed: {json.dumps(built)[:3000]}")
    data_dir = work / "data"
    prompts = make_prompts(a.answers // a.generations * (a.steps + 1), a.prompt_median, a.prompt_max, 128256)
    write_prompts(data_dir, prompts)
    spec = {"work": str(work), "data_dir": str(data_dir), "model_dir": a.model_dir, "prompts": prompts,
            "model_dir_4bit": built["model_dir_4bit"], "steps": a.steps, "answers": a.answers,
            "generations": a.generations, "check_tokens": a.check_tokens}
    if a.check_tokens:
        report["check"] = _run("check", spec, work / "check.log", 600)
        _save(report, a.out)
    lengths = [int(x) for x in a.lengths.split(",")]
    # TRL and the pipeline at every length first, the variants (at the first length) last: a deadline cuts those
    order = [(n, name) for n in lengths for name in ("trl", "pipeline")]
    order += [(lengths[0], v) for v in a.variants.split(",") if v]
    for length, name in order:
        runs = report.setdefault("lengths", {}).setdefault(str(length), {})
        key = name if name in ("trl", "pipeline") else f"pipeline_{name}"
        if key != name and a.deadline_s and time.time() - started > a.deadline_s:  # variants only
            runs[key] = {"error": f"skipped: past --deadline-s {a.deadline_s}"}
            continue
        runs[key] = _run("trl" if name == "trl" else "pipeline",
                         {**spec, "length": length, "variant": None if key == name else name},
                         work / f"{name}-{length}.log", 900)
        if "s_per_step" in runs.get("trl", {}) and "s_per_step" in runs.get("pipeline", {}):
            runs["speedup"] = round(runs["trl"]["s_per_step"] / runs["pipeline"]["s_per_step"], 2)
        _save(report, a.out)
    report["wall_s"] = round(time.time() - started, 1)
    _save(report, a.out)
    print(json.dumps(report, indent=2))
    _table(report)


def _table(report: dict[str, Any]) -> None:
    """The figures side by side, last (the device's reply carries the end of the output)."""
    print(f"\n{report.get('gpu')}: s/step (generation s/step), mean answer tokens")
    for length, runs in report.get("lengths", {}).items():
        cells = [f"{name} {r['s_per_step']} ({r['generation_s_per_step']}) {r['mean_answer_tokens']}"
                 if "s_per_step" in r else f"{name} {str(r.get('error'))[:60]}" for name, r in runs.items()
                 if name != "speedup"]
        print(f"answers of {length}: " + " | ".join(cells) + f" | speedup {runs.get('speedup')}")
    check = report.get("check", {})
    print("check:", {k: check.get(k) for k in ("graph_tokens_equal_eager", "graph_failed", "first_logits_rel_diff",
                                               "s_per_token", "error")})


def _save(report: dict[str, Any], out: Path | None) -> None:
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2))


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("torch", "transformers", "trl", "peft", "bitsandbytes", "accelerate"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "absent"
    return found


def _gpu_name() -> str | None:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
