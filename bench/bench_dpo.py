"""DPO speed and memory: train_adapter's DPO path (its speed levers) beside TRL's plain DPOTrainer recipe, on the
same 4-bit Llama-3.1-8B-shaped model and the same synthetic preference pairs, in one GPU run.

Builds the 8B-shaped model with random weights and quantizes it through the pipeline's prepare_model (bench_train's
worker_build: bench/shapes.py's model, a 128,256-id word-level tokenizer), then measures,
each in its own process so that its GPU memory figures are its own:

  (a) pipeline: tasks.train_adapter.builder.fit_and_save with DPO's unit, its defaults: padding-free
      micro-batches of whole pairs sized in tokens by the memory plan for the GPU's memory (which also chooses
      the recomputed layers and the offloads), fused LoRA layers, MLP chunks, Liger where installed, TRL's fused
      LM head; data pre-tokenized as prepare_data writes it
  (b) trl: TRL's documented QLoRA recipe: AutoModelForCausalLM with a BitsAndBytesConfig (nf4, double
      quantization, bf16 compute), DPOTrainer with peft_config (the reference = the adapter disabled),
      gradient checkpointing, bf16, paged 8-bit AdamW; the pairs as text that its own tokenization turns back
      into the same ids

Both: LoRA r=16, alpha 32 on all seven projections, beta 0.1, sigmoid loss, 1 accumulation step; (b) takes
--pairs-per-step pairs per step, (a) as many as its memory plan's micro-batch holds (its `pairs_per_step` says
how many on average; with --variants '{"padded": {"packing": false}}' a run of (a) with TRL's padded batches of
--pairs-per-step pairs). Pairs: token ids at random (seed 0), prompt lengths lognormal (median 200, sigma 0.6, at least
16, at most --prompt-max), answer lengths lognormal (median 150, sigma 0.6, at least 4, at most --answer-max), each
answer ending in eos; ids whose decimal form starts with 3-9 (see make_pairs). Reported: real tokens/s (the
non-padding tokens of prompt+chosen and prompt+rejected, from the end of the first optimizer step to the end of
the last), seconds per step, peak allocated GPU memory (from the start of training, the resident model
included), and the losses; for (a) also the memory plan (`budget_gib`, `plan`, `predicted_peak_gib`) and
`padding_free`.

usage (GPU host, from the repository root; about 5 minutes on one H200):
  python bench/bench_dpo.py --steps 5 --out bench/results/dpo-h200.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
GIB = 2**30
EOS = 2  # bench_train's tokenizer: t0 unk/pad, t1 bos, t2 eos


def make_pairs(n: int, prompt_max: int, answer_max: int, vocab: int) -> list[dict[str, list[int]]]:
    """n synthetic pairs of token ids (seed 0), no special token inside, answers ending in eos."""
    import numpy as np

    rng = np.random.default_rng(0)

    def lens(median: int, low: int, high: int) -> Any:
        return np.clip(rng.lognormal(np.log(median), 0.6, n).astype(int), low, high)

    p, c, r = lens(200, 16, prompt_max), lens(150, 4, answer_max), lens(150, 4, answer_max)
    # ids written tN with N starting 3-9: the tokenizer splits its special tokens t0/t1/t2 out of longer words
    # (t10778 -> t1 0778), so TRL's text path would not get these ids back otherwise
    allowed = np.array([i for i in range(3, vocab) if str(i)[0] in "3456789"])
    ids = lambda k: [int(x) for x in rng.choice(allowed, k - 1 if k > 1 else 0)]  # noqa: E731
    return [{"prompt_ids": ids(a + 1), "chosen_ids": ids(b) + [EOS], "rejected_ids": ids(d) + [EOS]}
            for a, b, d in zip(p, c, r, strict=True)]


def write_pairs(path: Path, pairs: list[dict[str, list[int]]]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(pairs, schema=pa.schema([(k, pa.list_(pa.int32())) for k in pairs[0]])),
                   path)


class _Timer:
    """(time, real tokens) after each optimizer step, the GPU synchronized; peak memory from train start."""

    def __init__(self) -> None:
        self.marks: list[tuple[float, int]] = []
        self.tokens = 0
        self.losses: list[float] = []

    def callback(self) -> Any:
        import torch
        from transformers import TrainerCallback

        timer = self

        class Cb(TrainerCallback):
            def on_train_begin(self, *a: Any, **k: Any) -> None:
                if torch.cuda.is_available():
                    torch.cuda.reset_peak_memory_stats()
                timer.marks = [(time.perf_counter(), 0)]
                timer.tokens = 0

            def on_step_end(self, *a: Any, **k: Any) -> None:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                timer.marks.append((time.perf_counter(), timer.tokens))

            def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **k: Any) -> None:
                if logs and "loss" in logs:
                    timer.losses.append(round(float(logs["loss"]), 4))
        return Cb()

    def summary(self) -> dict[str, Any]:
        import torch

        (t0, k0), (t1, k1) = self.marks[1], self.marks[-1]  # after the first (warm-up) step
        steps = len(self.marks) - 2
        cuda = torch.cuda.is_available()
        return {"real_tokens_per_s": round((k1 - k0) / (t1 - t0), 1), "s_per_step": round((t1 - t0) / steps, 3),
                "timed_steps": steps, "peak_gpu_allocated_gib": round(torch.cuda.max_memory_allocated() / GIB, 2)
                if cuda else 0.0, "peak_gpu_reserved_gib": round(torch.cuda.max_memory_reserved() / GIB, 2)
                if cuda else 0.0, "losses": self.losses}


def worker_pipeline(spec: dict[str, Any]) -> dict[str, Any]:
    """train_adapter's DPO path as the stage runs it (its Progress callback measures)."""
    from tasks.config import LoraArgs, SpeedArgs, TrainArgs
    from tasks.train_adapter import builder
    from tasks.train_adapter.methods import unit

    out = Path(spec["work"]) / "pipeline-out"
    shutil.rmtree(out, ignore_errors=True)  # each variant starts afresh, no checkpoint to resume
    out.mkdir(parents=True)
    train = TrainArgs(method="dpo", max_steps=spec["steps"] + 1, per_device_train_batch_size=spec["pairs_per_step"],
                      learning_rate=5e-6, warmup_steps=0, logging_steps=1, save_steps=10**6, beta=0.1)
    t = time.time()
    metrics = builder.fit_and_save(unit(train.method), LoraArgs(), train, SpeedArgs(**spec.get("speed", {})),
                                   spec["data_dir"], spec["model_dir_4bit"], out)
    losses = [json.loads(line)["loss"] for line in (out / "loss.jsonl").read_text().splitlines()]
    import pyarrow.parquet as pq
    import torch

    plan = metrics.get("memory_plan") or {}
    pairs = pq.read_metadata(Path(spec["data_dir"]) / "train.parquet").num_rows
    groups = metrics.get("micro_batches_per_epoch")  # None: TRL's batches of pairs_per_step pairs (packing off)
    per_step = round(pairs / groups, 1) if groups else spec["pairs_per_step"]
    return {**metrics, "budget_gib": plan.get("budget_gib"), "plan": plan or None,
            "predicted_peak_gib": plan.get("predicted_peak_gib"), "pairs_per_step": per_step,
            "wall_s": round(time.time() - t, 1), "losses": [round(x, 4) for x in losses],
            "peak_gpu_reserved_gib": round(torch.cuda.max_memory_reserved() / GIB, 2)
            if torch.cuda.is_available() else None}


def worker_trl(spec: dict[str, Any]) -> dict[str, Any]:
    """TRL's plain QLoRA DPO recipe: no pipeline code, no levers."""
    import pyarrow.parquet as pq
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig
    from trl import DPOConfig, DPOTrainer
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    from tasks.models.loading import LOAD_KWARGS

    text = lambda ids: " ".join(f"t{i}" for i in ids)  # noqa: E731 - the word-level tokenizer maps back to ids
    rows = pq.read_table(Path(spec["data_dir"]) / "train.parquet").to_pylist()
    # answers start with a space (prompt + answer is one string to TRL) and end in the eos token "t2"
    data = Dataset.from_list([{"prompt": text(r["prompt_ids"]), "chosen": " " + text(r["chosen_ids"]),
                               "rejected": " " + text(r["rejected_ids"])} for r in rows])
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    t = time.time()
    model = AutoModelForCausalLM.from_pretrained(
        spec["model_dir"], dtype=torch.bfloat16, device_map={"": 0} if torch.cuda.is_available() else "cpu",
        quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                               bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16),
        **LOAD_KWARGS)  # the recipe as it ran before transformers 5.25 fetched Hub kernels by default
    load_s = time.time() - t
    timer = _Timer()
    inner = DataCollatorForPreference(pad_token_id=tokenizer.pad_token_id)

    def collate(examples: list[dict[str, Any]]) -> dict[str, Any]:
        batch = inner(examples)
        timer.tokens += int(batch["attention_mask"].sum())
        return batch

    args = DPOConfig(output_dir=str(Path(spec["work"]) / "trl-out"), max_steps=spec["steps"] + 1,
                     per_device_train_batch_size=spec["pairs_per_step"], gradient_accumulation_steps=1,
                     learning_rate=5e-6, warmup_steps=0, logging_steps=1, save_strategy="no", report_to=[],
                     bf16=torch.cuda.is_available(), gradient_checkpointing=True, optim="paged_adamw_8bit", beta=0.1,
                     max_length=None, disable_tqdm=True)
    peft = LoraConfig(task_type="CAUSAL_LM", r=16, lora_alpha=32, lora_dropout=0.0,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    trainer = DPOTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer, peft_config=peft,
                         data_collator=collate, callbacks=[timer.callback()])
    first = trainer.train_dataset[0]
    same = (first["prompt_ids"], first["chosen_ids"]) == (rows[0]["prompt_ids"], rows[0]["chosen_ids"])
    t = time.time()
    trainer.train()
    return {**timer.summary(), "load_s": round(load_s, 1), "train_s": round(time.time() - t, 1),
            "same_token_ids_as_pipeline": same, "pairs_per_step": spec["pairs_per_step"], "padding_free": False}


def _run(kind: str, spec: dict[str, Any], log: Path, timeout: int) -> dict[str, Any]:
    from worker import run_worker

    return run_worker(__file__, kind, spec, log, timeout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", default="/tmp/llama8b")
    ap.add_argument("--work", default="/tmp/qlora-bench-dpo")
    ap.add_argument("--pairs", type=int, default=256, help="pairs written (the pipeline's token-sized micro-batches "
                    "take about 20 each at 16k tokens: enough for --steps + 1 without repeating)")
    ap.add_argument("--pairs-per-step", type=int, default=4, help="TRL's micro-batch; the pipeline's with packing "
                    "off or on a CPU")
    ap.add_argument("--steps", type=int, default=8, help="timed optimizer steps, after one warm-up step")
    ap.add_argument("--prompt-max", type=int, default=512)
    ap.add_argument("--answer-max", type=int, default=512)
    ap.add_argument("--variants", default="{}", help='more pipeline runs, JSON {name: speed overrides}, e.g. '
                    '{"padded": {"packing": false}} (TRL\'s padded batches of --pairs-per-step pairs)')
    ap.add_argument("--out", type=Path, help="write the JSON here (default: print only)")
    ap.add_argument("--smoke", action="store_true", help="a tiny model with the same vocabulary: checks the script "
                    "end to end on a CPU in a few minutes (figures meaningless)")
    a = ap.parse_args()
    if a.worker:
        spec = json.loads(Path(a.spec).read_text())
        if a.worker == "build":
            from bench_train import worker_build

            result = worker_build(spec)
        else:
            result = {"pipeline": worker_pipeline, "trl": worker_trl}[a.worker](spec)
        print("RESULT " + json.dumps(result), flush=True)
        return
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    started = time.time()
    # the smoke test's model: 2 tiny layers with the 8B shape's vocabulary (bench/shapes.py)
    built = _run("build", {"model_dir": a.model_dir, "runs_dir": str(work / "runs"),
                           "shape": "tiny-llama" if a.smoke else "llama-3.1-8b"}, work / "build.log", 1200)
    if "error" in built:
        sys.exit(f"build failed: {json.dumps(built)[:3000]}")
    data_dir = work / "data"
    write_pairs(data_dir / "train.parquet", make_pairs(a.pairs, a.prompt_max, a.answer_max, 128256))
    spec = {"work": str(work), "data_dir": str(data_dir), "model_dir": a.model_dir,
            "model_dir_4bit": built["model_dir_4bit"], "steps": a.steps, "pairs_per_step": a.pairs_per_step}
    results = {"pipeline": _run("pipeline", spec, work / "pipeline.log", 900),
               "trl": _run("trl", spec, work / "trl.log", 900)}
    for name, speed in json.loads(a.variants).items():  # pipeline variants, reported beside the two above
        results[f"pipeline_{name}"] = _run("pipeline", {**spec, "speed": speed}, work / f"pipeline-{name}.log", 900)
    p, t = results["pipeline"], results["trl"]
    report = {"bench": "bench_dpo", "date": datetime.date.today().isoformat(), "argv": sys.argv[1:],
              "gpu": _gpu_name(), "build": built, **results, "wall_s": round(time.time() - started, 1)}
    if "error" not in p and "error" not in t:
        report["speedup"] = round(p["real_tokens_per_s"] / t["real_tokens_per_s"], 3)
        report["memory_ratio"] = round(p.get("peak_gpu_allocated_gib", 0) / max(t["peak_gpu_allocated_gib"], 1e-9), 3)
        print(f"{'':10} {'tokens/s':>10} {'peak GiB':>9}\n{'pipeline':10} {p['real_tokens_per_s']:>10} "
              f"{p.get('peak_gpu_allocated_gib', 0):>9}\n{'trl':10} {t['real_tokens_per_s']:>10} "
              f"{t['peak_gpu_allocated_gib']:>9}")
    text = json.dumps(report, indent=2)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text)
    print(text)


def _gpu_name() -> str | None:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
