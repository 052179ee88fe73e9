"""Probe for the torch.compile lever: compile each decoder layer of a 4-bit LoRA model set up as
train_adapter sets it up (fused LoRA layers, fused loss, packed rows, checkpointing), count Dynamo's graph breaks
and compare the loss and LoRA gradients with the same model run eagerly. On CPU by default (the project's tiny
Llama, NF4 through transformers' bitsandbytes loader); on a GPU with --device cuda (bf16 compute, the varlen
attention and Liger's kernels come in there too).

usage:  python bench/probe_compile.py [--backend aot_eager|inductor] [--checkpoint none|plain|offload]
        python bench/probe_compile.py --device cuda --backend inductor --shape 8b --layers 4 --tokens 8192 --steps 5
(the second: Llama-3.1-8B-shaped layers with random weights, timed micro-steps eager against compiled)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


# Llama-3.1-8B's shape (bench_train's model), for timings on a GPU
SHAPE_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
            "vocab_size": 128256, "max_position_embeddings": 131072, "rope_theta": 500000.0,
            "tie_word_embeddings": False}


def deeper_model(layers: int, shape: str, device: str) -> str:
    """The project's tiny Llama with more decoder layers, or with 8B-shaped ones (random weights, bf16, made on
    the device), saved to a temporary folder: Dynamo caches compiled code per code object and recompiles at
    most torch._dynamo.config.recompile_limit times, which 4 layers do not reach and 32 might."""
    import tempfile

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tasks.config import EMBEDDED_MODEL

    config = AutoConfig.from_pretrained(EMBEDDED_MODEL)
    if shape == "8b":
        config.update(SHAPE_8B)
    config.num_hidden_layers = layers or config.num_hidden_layers
    folder = tempfile.mkdtemp(prefix="probe-compile-")
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if shape == "8b" else torch.float32)
    model.save_pretrained(folder)
    return folder


def packed_batch(tokens: int, vocab: int, device: str) -> dict[str, Any]:
    """Rows of 40, 25 and 63 tokens, or with --tokens, lognormal lengths around 250 (bench_train's) filling
    that many tokens, packed by the pipeline's collator."""
    import torch

    from tasks.train_adapter.levers.packs import pack_collator

    g = torch.Generator().manual_seed(2)
    lens = [40, 25, 63]
    if tokens:
        lens = []
        while sum(lens) < tokens:
            lens.append(min(int(torch.empty(()).log_normal_(5.52, 0.8, generator=g)) + 16, tokens - sum(lens)))
    rows = [torch.randint(3, min(vocab, 1000 if not tokens else vocab), (n,), generator=g).tolist() for n in lens]
    packed = pack_collator()([{"input_ids": rows, "labels": rows}])
    return {k: v.to(device) if hasattr(v, "to") else v for k, v in packed.items()}


def build(device: str, checkpoint: str, source: str, speed: dict[str, Any]) -> Any:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from tasks.config import SpeedArgs
    from tasks.models.loading import LOAD_KWARGS
    from tasks.train_adapter.levers.recompute import enable_checkpointing
    from tasks.train_adapter.plan import prepare_base, prepare_peft

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=dtype)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, device_map=device,
                                                 quantization_config=quant, **LOAD_KWARGS)
    prepare_base(model, SpeedArgs(**speed))
    torch.manual_seed(0)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # non-zero B, so that every LoRA weight gets a gradient
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g).to(p) * 0.05)
    prepare_peft(model, SpeedArgs(**speed))
    if checkpoint != "none":
        enable_checkpointing(model.get_base_model(), offload=checkpoint == "offload")
    return model.train()


def forward_backward(model: Any, batch: dict[str, Any], bf16: bool) -> Any:
    import torch

    model.zero_grad(set_to_none=True)
    with torch.autocast(batch["input_ids"].device.type, dtype=torch.bfloat16, enabled=bf16):
        loss = model(**batch).loss
    loss.backward()
    return loss


def step(model: Any, batch: dict[str, Any], bf16: bool) -> tuple[float, dict[str, Any]]:
    loss = forward_backward(model, batch, bf16)
    return float(loss), {n: p.grad.float().clone() for n, p in model.named_parameters() if p.requires_grad}


def timed(model: Any, batch: dict[str, Any], bf16: bool, steps: int) -> dict[str, float]:
    """Mean seconds per micro-step (forward, loss, backward) over steps after the two measured before, and the
    peak GPU memory; the host waits for the GPU only at the start and the end."""
    import torch

    if not steps:
        return {}
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        forward_backward(model, batch, bf16)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / steps
    return {"ms": round(seconds * 1000, 1), "tokens_per_s": round(batch["input_ids"].numel() / seconds),
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else 0}


def main() -> None:
    import torch
    import torch._dynamo

    from bench.compile_layers import compile_layers, dynamo_counts
    from tasks.config import EMBEDDED_MODEL
    from tasks.train_adapter.levers.mlp import decoder_layers

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="aot_eager")
    ap.add_argument("--checkpoint", default="offload", choices=["none", "plain", "offload"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--inside", action="store_true", help="with --checkpoint offload: compile the layer forward "
                    "inside the offloaded checkpoint instead of the layer call around it")
    ap.add_argument("--layers", type=int, default=0, help="decoder layers (0: the tiny Llama's own 4)")
    ap.add_argument("--shape", default="tiny", choices=["tiny", "8b"], help="8b: Llama-3.1-8B-shaped layers")
    ap.add_argument("--tokens", type=int, default=0, help="packed tokens per micro-step (0: 128 in 3 rows)")
    ap.add_argument("--steps", type=int, default=0, help="timed micro-steps after the two compared")
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast on CPU too (always on a GPU, as the "
                    "Trainer runs there)")
    ap.add_argument("--no-liger", action="store_true", help="without Liger's kernels (speed.use_liger_kernel)")
    a = ap.parse_args()
    source = deeper_model(a.layers, a.shape, a.device) if a.layers or a.shape != "tiny" else str(EMBEDDED_MODEL)
    batch = packed_batch(a.tokens, 128256 if a.shape == "8b" else 1000, a.device)
    results, times, bf16 = {}, {}, a.bf16 or a.device != "cpu"
    for compiled in (False, True):
        model = build(a.device, a.checkpoint, source, {"use_liger_kernel": False} if a.no_liger else {})
        if compiled:
            compile_layers(model, "inside" if a.checkpoint == "offload" and a.inside else "layers", a.backend)
        start = time.time()
        first = step(model, batch, bf16)
        first_s = time.time() - start
        results[compiled] = (first, step(model, batch, bf16), first_s)  # a second step: no recompilation
        times[compiled], layers = timed(model, batch, bf16, a.steps), len(decoder_layers(model))
        print(f"{'compiled' if compiled else 'eager'}: first step {first_s:.1f} s, {times[compiled]}", flush=True)
        del model
    (eager, _, _), (fused, again, first_s) = results[False], results[True]
    worst = max(float((fused[1][n] - eager[1][n]).norm() / eager[1][n].norm()) for n in eager[1])
    counts = dynamo_counts()
    print(f"backend {a.backend}, checkpoint {a.checkpoint}, {a.device}: {len(eager[1])} LoRA gradients, "
          f"loss {eager[0]:.6f} eager / {fused[0]:.6f} compiled, worst gradient relative difference {worst:.2e}, "
          f"{layers} layers, graph breaks {counts['graph_breaks']}, compiled graphs {counts['compiled_graphs']}, "
          f"first compiled step {first_s:.1f} s, "
          f"second step loss {again[0]:.6f}")
    for reason, n in torch._dynamo.utils.counters["graph_break"].items():
        print(f"  {n} x {reason.splitlines()[0]}")


if __name__ == "__main__":
    main()
