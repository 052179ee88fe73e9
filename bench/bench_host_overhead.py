"""Host-side cost of one training micro-step with peft's LoRA layers vs the fused ones (speed.fused_lora), on CPU.

On a GPU, small packed micro-batches are slow because every micro-step costs a fixed ~0.7 s of host time
(Python, dispatcher, autograd, kernel launches) whatever its token count. This measures that cost on CPU, where
a narrow model makes the arithmetic negligible: a 32-layer Llama with the 8B model's layer structure but
hidden 256 (intermediate 1,024, 8 heads, 2 kv heads, vocab 2,048), random weights, quantized to NF4 by the
pipeline's own prepare_model loader and wrapped by train_adapter's own _peft_model (LoRA r=16 on all seven
projections, packing, fused cross-entropy) with checkpointing enabled as training_batches does. One micro-step
is forward + backward of one packed row of about --tokens tokens.

The two modes alternate on the same model (A/B/A/B, --rounds rounds of --steps timed steps each, after a
warm-up), and it prints the median wall ms and this thread's CPU ms per micro-step of each (CPU time is not
inflated while other work holds the core), then the number of aten ops (all, and
top-level: called from Python rather than from another op) and autograd nodes run per micro-step
(torch.profiler). The same counts under bf16 autocast, as on a GPU, with --autocast.

usage:  OMP_NUM_THREADS=1 taskset -c 1 python bench/bench_host_overhead.py [--tokens 256] [--rounds 6]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHAPE = {"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 32, "num_attention_heads": 8,
         "num_key_value_heads": 2, "vocab_size": 2048, "max_position_embeddings": 4096}


class _Examples:
    def __init__(self, lengths: list[int], vocab: int, seed: int) -> None:
        import torch

        g = torch.Generator().manual_seed(seed)
        self.input_ids = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
        self.labels = [list(x) for x in self.input_ids]

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return {"input_ids": self.input_ids[i], "labels": self.labels[i]}


def build_model(folder: Path) -> Path:
    """The narrow 32-layer Llama, random weights, quantized to NF4 through prepare_model's loader."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tasks.config import EMBEDDED_MODEL, ModelArgs
    from tasks.models.loading import load_tokenizer
    from tasks.prepare_model.stage import prepare_model

    torch.manual_seed(0)
    config = LlamaConfig(**SHAPE, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(folder / "base")
    load_tokenizer(EMBEDDED_MODEL).save_pretrained(folder / "base")  # prepare_model saves the tokenizer too
    # the stage itself (train_adapter reads its manifest), float32 compute as on a CPU
    return Path(prepare_model.fn(ModelArgs(base_model=str(folder / "base"), bnb_4bit_compute_dtype="float32"),
                                 folder / "runs"))


def training_model(model_dir: Path, tokens: int) -> tuple[Any, dict[str, Any]]:
    """train_adapter's LoRA model (fused layers off) with checkpointing on, and one packed batch of ~tokens."""
    import torch

    from tasks.config import LoraArgs, SpeedArgs, TrainArgs
    from tasks.train_adapter import builder, plan
    from tasks.train_adapter.methods import sft

    train, speed = TrainArgs(), SpeedArgs(fused_lora=False, max_tokens_per_batch=tokens)
    model = builder.adapted(sft.UNIT, model_dir, LoraArgs(), train, speed)[0]
    with torch.no_grad():  # LoRA B starts at zero; make the adapter path carry real values
        g = torch.Generator().manual_seed(1)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.01)
    lengths = [41, 77, 23, 96, 19, 63, 88, 30, 52, 70, 44, 61, 12]
    packs, collator, _ = plan.training_batches(model, _Examples(lengths, SHAPE["vocab_size"], 0), train, speed)
    sizes = {i: sum(map(len, packs[i]["input_ids"])) for i in range(len(packs))}
    fits = [i for i in sizes if sizes[i] <= tokens]
    pick = max(fits, key=sizes.get) if fits else min(sizes, key=sizes.get)  # the fullest pack within tokens
    batch = collator([packs[pick]])
    return model.train(), batch


def step(model: Any, batch: dict[str, Any], autocast: bool) -> None:
    import torch

    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(**batch).loss
    loss.backward()
    model.zero_grad(set_to_none=True)


def counts(model: Any, batch: dict[str, Any], autocast: bool) -> dict[str, int]:
    """aten ops (all, and top-level) and autograd nodes run in one micro-step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(model, batch, autocast)
    events = prof.events()
    aten = [e for e in events if e.name.startswith("aten::")]
    top = [e for e in aten if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
    nodes = [e for e in events if e.name.startswith("autograd::engine::evaluate_function")]
    return {"aten_ops": len(aten), "aten_ops_top_level": len(top), "autograd_nodes": len(nodes)}


def set_mode(model: Any, fused: bool) -> None:
    from tasks.train_adapter.levers.fused_lora import fuse_lora_layers, unfuse_lora_layers

    (fuse_lora_layers if fused else unfuse_lora_layers)(model)


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=256, help="tokens per packed micro-batch (at most)")
    ap.add_argument("--rounds", type=int, default=6, help="A/B rounds")
    ap.add_argument("--steps", type=int, default=5, help="timed micro-steps per mode per round")
    ap.add_argument("--hidden", type=int, default=SHAPE["hidden_size"],
                    help="hidden size (intermediate = 4x); narrower leaves less arithmetic beside the host cost")
    ap.add_argument("--autocast", action="store_true", help="also count ops under bf16 autocast")
    ap.add_argument("--out", type=Path, help="write the figures as JSON here")
    a = ap.parse_args()
    SHAPE.update(hidden_size=a.hidden, intermediate_size=4 * a.hidden)

    with tempfile.TemporaryDirectory() as tmp:
        model, batch = training_model(build_model(Path(tmp)), a.tokens)
    real = int(batch["labels"].ne(-100).sum())
    times: dict[str, list[float]] = {"peft": [], "fused": []}
    cpu: dict[str, list[float]] = {"peft": [], "fused": []}  # this thread's CPU time: not inflated by other work
    for mode in times:  # warm-up
        set_mode(model, mode == "fused")
        for _ in range(3):
            step(model, batch, False)
    for _ in range(a.rounds):
        for mode in times:
            set_mode(model, mode == "fused")
            for _ in range(a.steps):
                t, c = time.perf_counter(), time.thread_time()
                step(model, batch, False)
                times[mode].append((time.perf_counter() - t) * 1e3)
                cpu[mode].append((time.thread_time() - c) * 1e3)
    result: dict[str, Any] = {
        "command": " ".join(sys.argv), "date": datetime.date.today().isoformat(), "machine": platform.processor()
        or platform.machine(), "torch": torch.__version__, "threads": torch.get_num_threads(),
        "tokens": int(batch["input_ids"].shape[1]), "labelled_tokens": real, "shape": SHAPE, "modes": {}}
    for mode, ms in times.items():
        set_mode(model, mode == "fused")
        result["modes"][mode] = {"median_ms": round(statistics.median(ms), 1), "min_ms": round(min(ms), 1),
                                 "median_cpu_ms": round(statistics.median(cpu[mode]), 1),
                                 "max_ms": round(max(ms), 1), "steps": len(ms), **counts(model, batch, False)}
        if a.autocast:
            result["modes"][mode]["bf16_autocast"] = counts(model, batch, True)
    peft, fused = result["modes"]["peft"], result["modes"]["fused"]
    result["speedup"] = round(peft["median_ms"] / fused["median_ms"], 2)
    result["speedup_cpu"] = round(peft["median_cpu_ms"] / fused["median_cpu_ms"], 2)
    print(f"{result['tokens']} tokens per micro-step, {result['threads']} thread(s), torch {torch.__version__}")
    print(f"{'':8} {'median ms':>10} {'min':>7} {'max':>7} {'CPU ms':>7} {'aten ops':>9} {'top-level':>10} "
          f"{'autograd':>9}")
    for mode, r in result["modes"].items():
        print(f"{mode:8} {r['median_ms']:>10} {r['min_ms']:>7} {r['max_ms']:>7} {r['median_cpu_ms']:>7} "
              f"{r['aten_ops']:>9} {r['aten_ops_top_level']:>10} {r['autograd_nodes']:>9}")
        if "bf16_autocast" in r:
            c = r["bf16_autocast"]
            print(f"{'  bf16':8} {'':>10} {'':>7} {'':>7} {'':>7} {c['aten_ops']:>9} {c['aten_ops_top_level']:>10} "
                  f"{c['autograd_nodes']:>9}")
    print(f"peft / fused: {result['speedup']}x wall time, {result['speedup_cpu']}x CPU time per micro-step")
    if a.out:
        a.out.write_text(json.dumps(result, indent=1))
    with contextlib.suppress(Exception):
        sys.stdout.flush()


if __name__ == "__main__":
    main()
