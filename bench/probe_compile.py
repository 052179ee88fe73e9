"""Probe for the torch.compile lever (issue 15): compile each decoder layer of a 4-bit LoRA model set up as
train_adapter sets it up (fused LoRA layers, fused loss, packed rows, checkpointing), count Dynamo's graph breaks
and compare the loss and LoRA gradients with the same model run eagerly. On CPU by default (the project's tiny
Llama, NF4 through transformers' bitsandbytes loader); on a GPU with --device cuda (bf16 compute, the varlen
attention and Liger's kernels come in there too).

usage:  python bench/probe_compile.py [--backend aot_eager|inductor] [--checkpoint none|plain|offload]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def build(device: str, checkpoint: str) -> Any:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from tasks.config import EMBEDDED_MODEL, SpeedArgs
    from tasks.train_adapter.checkpointing import enable_checkpointing
    from tasks.train_adapter.plan import prepare_base, prepare_peft

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=dtype)
    model = AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL, dtype=dtype, device_map=device,
                                                 quantization_config=quant)
    prepare_base(model, SpeedArgs())
    torch.manual_seed(0)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # non-zero B, so that every LoRA weight gets a gradient
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g).to(p) * 0.05)
    prepare_peft(model, SpeedArgs())
    if checkpoint != "none":
        enable_checkpointing(model.get_base_model(), offload=checkpoint == "offload")
    return model.train()


def step(model: Any, batch: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return float(loss), {n: p.grad.float().clone() for n, p in model.named_parameters() if p.requires_grad}


def main() -> None:
    import torch
    import torch._dynamo

    from tasks.train_adapter.mlp import decoder_layers
    from tasks.train_adapter.packs import pack_collator

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="aot_eager")
    ap.add_argument("--checkpoint", default="offload", choices=["none", "plain", "offload"])
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    g = torch.Generator().manual_seed(2)
    rows = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (40, 25, 63)]
    packed = pack_collator()([{"input_ids": rows, "labels": rows}])
    batch = {k: v.to(a.device) if hasattr(v, "to") else v for k, v in packed.items()}
    results = {}
    for compiled in (False, True):
        model = build(a.device, a.checkpoint)
        if compiled:
            for layer in decoder_layers(model):
                layer.compile(backend=a.backend)
        start = time.time()
        first = step(model, batch)
        first_s = time.time() - start
        results[compiled] = (first, step(model, batch), first_s)  # a second step: no recompilation
    (eager, _, _), (fused, again, first_s) = results[False], results[True]
    worst = max(float((fused[1][n] - eager[1][n]).norm() / eager[1][n].norm()) for n in eager[1])
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    print(f"backend {a.backend}, checkpoint {a.checkpoint}, {a.device}: {len(eager[1])} LoRA gradients, "
          f"loss {eager[0]:.6f} eager / {fused[0]:.6f} compiled, worst gradient relative difference {worst:.2e}, "
          f"graph breaks {breaks}, first compiled step {first_s:.1f} s, second step loss {again[0]:.6f}")
    for reason, n in torch._dynamo.utils.counters["graph_break"].items():
        print(f"  {n} x {reason.splitlines()[0]}")


if __name__ == "__main__":
    main()
