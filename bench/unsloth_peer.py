"""Unsloth, the fastest peer we compare with, on the same model and examples as bench_train.py's other runs.

Unsloth 2026.10.9 pins older libraries than this project (transformers <= 5.17, trl <= 1.15, datasets < 5), so it is
installed apart from the pipeline (bench/README.md, "Unsloth") and runs in its own process: bench_train.py starts
this script with --unsloth-python (a virtual environment's interpreter) or --unsloth-site (a folder put first on
PYTHONPATH).

What it runs: FastLanguageModel in 4 bits (bf16 compute) with LoRA r=16, alpha 32, dropout 0 on all seven
projections, Unsloth's own gradient checkpointing, TRL's SFTTrainer with 8-bit AdamW, learning rate 2e-4, and with
--packing its examples packed into rows of --seq tokens; --bs rows per micro-batch, --ga micro-batches per step. The
examples are bench_train.py's (lognormal lengths, median 250, cut at --seq, seed 0; every one --seq tokens with
--fixed). real_tokens_per_s counts the non-padding tokens each timed step was fed (a forward pre-hook on the model,
read after the step), over the timed steps' seconds; the first two steps warm up.

usage (GPU host, repository root, Unsloth's environment; the model folder from bench_train.py's build):
  /opt/unsloth/bin/python bench/unsloth_peer.py /tmp/llama8b --seq 2048 --bs 2 --ga 4 --packing --steps 10
Prints one line `RESULT {json}`; out of memory is a result too (`"oom": true`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))
GIB = 2**30
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def train(a: argparse.Namespace) -> dict[str, Any]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("UNSLOTH_DISABLE_STATISTICS", "1")
    start = time.time()
    from unsloth import FastLanguageModel  # noqa: I001 - first: it patches transformers and TRL as they import

    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from bench.bench_train import lengths, token_rows

    import_s = time.time() - start
    if a.cap_gib:  # a smaller card: this process may allocate no more
        torch.cuda.set_per_process_memory_fraction(a.cap_gib * GIB / torch.cuda.get_device_properties(0).total_memory)
    start = time.time()
    model, tokenizer = FastLanguageModel.from_pretrained(a.model_dir, max_seq_length=a.seq, load_in_4bit=True,
                                                         dtype=torch.bfloat16)
    model = FastLanguageModel.get_peft_model(model, r=16, lora_alpha=32, lora_dropout=0, target_modules=TARGETS,
                                             bias="none", use_gradient_checkpointing="unsloth", random_state=0)
    load_s = time.time() - start
    n = a.bs * a.ga * (a.steps + 2)
    if a.packing:  # enough examples that every step gets full packed rows, none a short end-of-data step
        n *= max(1, a.seq // 150)
    lens = [a.seq] * n if a.fixed else lengths(n, a.seq)
    rows = token_rows(lens, model.get_input_embeddings().num_embeddings)
    fed: list[Any] = []  # per forward: its real tokens, kept on the GPU until the step ends (no wait per forward)
    steps: list[tuple[float, int]] = []

    def count(module: Any, args: tuple, kwargs: dict) -> None:
        if module.training and torch.is_grad_enabled():
            mask, ids = kwargs.get("attention_mask"), kwargs.get("input_ids", args[0] if args else None)
            fed.append(mask.sum() if mask is not None else ids.numel())

    model.register_forward_pre_hook(count, with_kwargs=True)

    class Clock(TrainerCallback):
        def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
            torch.cuda.synchronize()
            fed.clear()
            self.started = time.perf_counter()

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            torch.cuda.synchronize()
            steps.append((time.perf_counter() - self.started, sum(int(k) for k in fed)))

    config = SFTConfig(output_dir=str(Path(a.work) / "unsloth-out"), per_device_train_batch_size=a.bs,
                       gradient_accumulation_steps=a.ga, max_steps=a.steps + 2, learning_rate=2e-4, bf16=True,
                       optim="adamw_8bit", logging_steps=1, save_strategy="no", report_to=[], max_length=a.seq,
                       packing=a.packing, disable_tqdm=True, dataset_num_proc=1)
    torch.cuda.reset_peak_memory_stats()
    trainer = SFTTrainer(model=model, train_dataset=Dataset.from_dict({"input_ids": rows}), args=config,
                         processing_class=tokenizer, callbacks=[Clock()])
    try:
        trainer.train()
    except torch.OutOfMemoryError:
        return {"tool": "unsloth", "seq": a.seq, "fixed": a.fixed, "cap_gib": a.cap_gib, "oom": True}
    timed = steps[2:]
    return {"tool": "unsloth", "seq": a.seq, "fixed": a.fixed, "cap_gib": a.cap_gib, "bs": a.bs, "ga": a.ga,
            "packing": a.packing, "timed_steps": len(timed), "import_s": round(import_s, 1),
            "load_s": round(load_s, 1), "mean_len": round(sum(lens) / len(lens), 1),
            "step_tokens": [k for _, k in steps], "train_rows": len(trainer.train_dataset),
            "real_tokens_per_s": round(sum(k for _, k in timed) / sum(s for s, _ in timed), 1),
            "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / GIB, 2),
            "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / GIB, 2),
            "losses": [round(h["loss"], 4) for h in trainer.state.log_history if "loss" in h]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir", help="a bf16 model folder with a tokenizer (bench_train.py's build)")
    ap.add_argument("--seq", type=int, default=2048, help="lengths are cut here; packed rows hold this many tokens")
    ap.add_argument("--bs", type=int, default=2, help="rows per micro-batch")
    ap.add_argument("--ga", type=int, default=4, help="micro-batches per optimizer step")
    ap.add_argument("--packing", action="store_true", help="pack examples into rows of --seq tokens")
    ap.add_argument("--fixed", action="store_true", help="every example exactly --seq tokens")
    ap.add_argument("--steps", type=int, default=6, help="timed optimizer steps, after 2 warm-up steps")
    ap.add_argument("--cap-gib", type=float, default=0.0, help="GPU memory this process may allocate (0: the card)")
    ap.add_argument("--work", default="/tmp/qlora-bench")
    print("RESULT " + json.dumps(train(ap.parse_args())), flush=True)


if __name__ == "__main__":
    main()
