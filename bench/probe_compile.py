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


def deeper_model(layers: int) -> str:
    """The project's tiny Llama with more decoder layers (random weights), saved to a temporary folder: Dynamo
    caches compiled code per code object and recompiles at most torch._dynamo.config.recompile_limit times,
    which 4 layers do not reach and 32 might."""
    import tempfile

    from transformers import AutoConfig, AutoModelForCausalLM

    from tasks.config import EMBEDDED_MODEL

    config = AutoConfig.from_pretrained(EMBEDDED_MODEL)
    config.num_hidden_layers = layers
    folder = tempfile.mkdtemp(prefix="probe-compile-")
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def build(device: str, checkpoint: str, source: str) -> Any:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from tasks.config import SpeedArgs
    from tasks.train_adapter.checkpointing import enable_checkpointing
    from tasks.train_adapter.plan import prepare_base, prepare_peft

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=dtype)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, device_map=device,
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


def compiled_inside(checkpoint: Any, backend: str) -> Any:
    """The layer's checkpoint function, running a compiled layer forward: transformers 5.24 hands it
    partial(forward, layer, **kwargs), and Dynamo cannot trace the offloaded checkpoint's Function around it,
    so the compiled region is the forward inside, compiled once for all layers (same code, layers as inputs)."""
    import functools

    compiled = _compiled_forward(backend)

    def run(function: Any, *args: Any, **kwargs: Any) -> Any:
        inner = functools.partial(compiled(function.func), *function.args, **function.keywords)
        return checkpoint(inner, *args, **kwargs)

    return run


_COMPILED: dict[Any, Any] = {}


def _compiled_forward(backend: str) -> Any:
    import torch

    def get(func: Any) -> Any:
        if func not in _COMPILED:
            _COMPILED[func] = torch.compile(func, backend=backend)
        return _COMPILED[func]

    return get


def step(model: Any, batch: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return float(loss), {n: p.grad.float().clone() for n, p in model.named_parameters() if p.requires_grad}


def main() -> None:
    import torch
    import torch._dynamo

    from tasks.config import EMBEDDED_MODEL
    from tasks.train_adapter.mlp import decoder_layers
    from tasks.train_adapter.packs import pack_collator

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="aot_eager")
    ap.add_argument("--checkpoint", default="offload", choices=["none", "plain", "offload"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--inside", action="store_true", help="with --checkpoint offload: compile the layer forward "
                    "inside the offloaded checkpoint instead of the layer call around it")
    ap.add_argument("--layers", type=int, default=0, help="decoder layers (0: the tiny Llama's own 4)")
    a = ap.parse_args()
    source = deeper_model(a.layers) if a.layers else str(EMBEDDED_MODEL)
    g = torch.Generator().manual_seed(2)
    rows = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (40, 25, 63)]
    packed = pack_collator()([{"input_ids": rows, "labels": rows}])
    batch = {k: v.to(a.device) if hasattr(v, "to") else v for k, v in packed.items()}
    results = {}
    for compiled in (False, True):
        model = build(a.device, a.checkpoint, source)
        if compiled:
            for layer in decoder_layers(model):
                if a.checkpoint == "offload" and a.inside:
                    layer._gradient_checkpointing_func = compiled_inside(layer._gradient_checkpointing_func,
                                                                         a.backend)
                else:
                    layer.compile(backend=a.backend)
        start = time.time()
        first = step(model, batch)
        first_s = time.time() - start
        results[compiled] = (first, step(model, batch), first_s)  # a second step: no recompilation
    (eager, _, _), (fused, again, first_s) = results[False], results[True]
    worst = max(float((fused[1][n] - eager[1][n]).norm() / eager[1][n].norm()) for n in eager[1])
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    print(f"backend {a.backend}, checkpoint {a.checkpoint}, {a.device}: {len(eager[1])} LoRA gradients, "
          f"loss {eager[0]:.6f} eager / {fused[0]:.6f} compiled, worst gradient relative difference {worst:.2e}, "
          f"{len(decoder_layers(model))} layers, graph breaks {breaks}, compiled graphs {graphs}, "
          f"first compiled step {first_s:.1f} s, "
          f"second step loss {again[0]:.6f}")
    for reason, n in torch._dynamo.utils.counters["graph_break"].items():
        print(f"  {n} x {reason.splitlines()[0]}")


if __name__ == "__main__":
    main()
