"""The reference QLoRA recipe that the performance table compares train_adapter with, timed on one GPU.

The recipe as commonly published for transformers + peft + bitsandbytes, with nothing of this project's:
the base model loaded in 4 bits (NF4, double quantization, bf16 compute, sdpa attention), peft's
prepare_model_for_kbit_training (frozen norms, embeddings and output layer cast to float32; gradient checkpointing),
LoRA r=16, alpha 32, dropout 0.05 on q_proj, k_proj, v_proj and o_proj, transformers' Trainer with paged 8-bit
AdamW, learning rate 2e-4, bf16, one example per micro-batch (padded to itself: no padding) and 16 micro-batches per
optimizer step (--ga).

The examples are bench_train.py's own (the same token ids and lengths the pipeline trains on: lognormal lengths,
median 250, cut at --seq, seed 0; or every example --seq tokens with --lengths fixed). The first two optimizer steps
warm up; then each step is timed with the GPU synchronized at its start and end. real_tokens_per_s is the real tokens
of a step (micro-batch x accumulation x the examples' mean length) over the median step time; the mean over the
timed steps' exact token counts is beside it.

usage (GPU host, repository root; the model folder from bench_train.py's build, bench/shapes.py):
  python bench/reference_recipe.py /tmp/llama8b --seq 2048 --ga 16 --steps 6
  python bench/reference_recipe.py /tmp/llama8b --seq 4096 --lengths fixed --ga 1 --steps 1 --cap-gib 16
Prints one line `RESULT {json}`; out of memory is a result too (`"oom": true`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))
GIB = 2**30
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def load_model(model_dir: str) -> Any:
    """The base model in 4 bits and LoRA on q/k/v/o, as the recipe prepares it."""
    import torch
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.bfloat16)
    # use_kernels=False: transformers 5.25 otherwise fetches Hub kernels while loading, which the recipe never did
    device = 0 if torch.cuda.is_available() else "cpu"  # a CPU runs it only as a smoke test of this script
    model = AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=quant, dtype=torch.bfloat16,
                                                 device_map={"": device}, attn_implementation="sdpa",
                                                 use_kernels=False)
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True,
                                            gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules=TARGETS, bias="none",
                      task_type="CAUSAL_LM")
    return get_peft_model(model, lora)


def examples(n: int, seq: int, fixed: bool, vocab: int) -> list[dict[str, Any]]:
    """bench_train's token rows (the pipeline's own examples), labels equal to the inputs."""
    import torch

    from bench.bench_train import lengths, token_rows

    rows = token_rows([seq] * n if fixed else lengths(n, seq), vocab)
    return [{"input_ids": torch.tensor(r), "labels": torch.tensor(r)} for r in rows]


def collate(batch: list[dict[str, Any]]) -> dict[str, Any]:
    """Right-padded rows; with one example per micro-batch there is nothing to pad."""
    import torch

    longest = max(len(b["input_ids"]) for b in batch)

    def pad(t: Any, value: int) -> Any:
        return torch.cat([t, torch.full((longest - len(t),), value, dtype=t.dtype)])

    return {"input_ids": torch.stack([pad(b["input_ids"], 0) for b in batch]),
            "labels": torch.stack([pad(b["labels"], -100) for b in batch]),
            "attention_mask": torch.stack([pad(torch.ones_like(b["input_ids"]), 0) for b in batch])}


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _peak(kind: str) -> float:
    import torch

    if not torch.cuda.is_available():
        return 0.0
    return round((torch.cuda.max_memory_allocated() if kind == "allocated" else torch.cuda.max_memory_reserved()) / GIB,
                 2)


def train(a: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    if a.cap_gib and torch.cuda.is_available():  # a smaller card: this process may allocate no more
        torch.cuda.set_per_process_memory_fraction(a.cap_gib * GIB / torch.cuda.get_device_properties(0).total_memory)
    start = time.time()
    model = load_model(a.model_dir)
    load_s = time.time() - start
    vocab = model.get_input_embeddings().num_embeddings
    data = examples(a.bs * a.ga * (a.steps + 2), a.seq, a.lengths == "fixed", vocab)
    fed: list[Any] = []  # per training forward: its real tokens, read once the step is over (no wait per forward)
    steps: list[tuple[float, int]] = []  # (seconds, real tokens) per optimizer step

    def count(module: Any, args: tuple, kwargs: dict) -> None:
        if module.training and torch.is_grad_enabled():
            fed.append(kwargs["attention_mask"].sum())

    model.register_forward_pre_hook(count, with_kwargs=True)

    class Clock(TrainerCallback):
        def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
            _sync()
            fed.clear()
            self.started = time.perf_counter()

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            _sync()
            steps.append((time.perf_counter() - self.started, sum(int(k) for k in fed)))

    args = TrainingArguments(output_dir=str(Path(a.work) / "reference-out"), per_device_train_batch_size=a.bs,
                             gradient_accumulation_steps=a.ga, max_steps=a.steps + 2, learning_rate=2e-4, bf16=True,
                             optim="paged_adamw_8bit", gradient_checkpointing=True,
                             gradient_checkpointing_kwargs={"use_reentrant": False}, logging_steps=1,
                             save_strategy="no", report_to=[], disable_tqdm=True, dataloader_num_workers=0,
                             use_cpu=not torch.cuda.is_available())
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[Clock()],
                      data_collator=collate)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    try:
        trainer.train()
    except torch.OutOfMemoryError:
        return {"seq": a.seq, "lengths": a.lengths, "cap_gib": a.cap_gib, "oom": True}
    timed = steps[2:]
    mean_len = sum(len(d["input_ids"]) for d in data) / len(data)
    median_s = statistics.median(s for s, _ in timed)
    return {"recipe": "nf4 + double quant, prepare_model_for_kbit_training, LoRA r16/a32/d0.05 q/k/v/o, "
                      "paged_adamw_8bit, gradient checkpointing", "seq": a.seq, "lengths": a.lengths,
            "cap_gib": a.cap_gib, "bs": a.bs, "ga": a.ga, "timed_steps": len(timed), "mean_len": round(mean_len, 1),
            "load_s": round(load_s, 1), "step_s_median": round(median_s, 3),
            "real_tokens_per_s": round(a.bs * a.ga * mean_len / median_s, 1),
            "real_tokens_per_s_mean": round(sum(k for _, k in timed) / sum(s for s, _ in timed), 1),
            "peak_allocated_gib": _peak("allocated"), "peak_reserved_gib": _peak("reserved"),
            "losses": [round(h["loss"], 4) for h in trainer.state.log_history if "loss" in h]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir", help="a bf16 model folder with a tokenizer (bench_train.py's build)")
    ap.add_argument("--seq", type=int, default=2048, help="lengths are cut at this many tokens")
    ap.add_argument("--lengths", choices=("lognormal", "fixed"), default="lognormal")
    ap.add_argument("--bs", type=int, default=1, help="examples per micro-batch")
    ap.add_argument("--ga", type=int, default=16, help="micro-batches per optimizer step")
    ap.add_argument("--steps", type=int, default=6, help="timed optimizer steps, after 2 warm-up steps")
    ap.add_argument("--cap-gib", type=float, default=0.0, help="GPU memory this process may allocate (0: the card)")
    ap.add_argument("--work", default="/tmp/qlora-bench")
    print("RESULT " + json.dumps(train(ap.parse_args())), flush=True)


if __name__ == "__main__":
    main()
