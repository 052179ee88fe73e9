"""Offloaded layers on a GPU (tasks/train_adapter/offload_layers.py): the same loss and LoRA gradients as keeping
the activations, less GPU memory at the end of the forward pass, and the time side by side (GPU).

A random-weight Llama of 8 layers (hidden 1,024, MLP 3,584) in bf16 with LoRA r=16 on all seven projections, one
sequence of --tokens tokens, three ways: every layer keeps its activations; --offload of them (spread, as the
memory plan places them) keep theirs in pinned host memory; the same layers recompute instead (torch's
checkpoint). Prints one JSON line: the largest gradient difference against keeping, memory allocated at the end
of the forward pass and peak, and milliseconds per forward + backward (the best of 5 after a warm-up).

usage (GPU host): python3 bench/check_offload_layers.py [--tokens 16384] [--offload 2]
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import torch


def build(tokens: int) -> tuple[torch.nn.Module, torch.Tensor]:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=1024, intermediate_size=3584, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=tokens,
                         attn_implementation="sdpa", use_cache=False)
    model = LlamaForCausalLM(config).to("cuda", torch.bfloat16)
    torch.manual_seed(1)
    model = get_peft_model(model, LoraConfig(r=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                    "gate_proj", "up_proj", "down_proj"],
                                             init_lora_weights="gaussian"))
    ids = torch.randint(3, 4096, (1, tokens), generator=torch.Generator().manual_seed(0)).cuda()
    return model, ids


def step(model: torch.nn.Module, ids: torch.Tensor) -> tuple[float, int, int]:
    """(loss, bytes allocated at the end of the forward pass, peak bytes) of one forward + backward."""
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    loss = model(input_ids=ids, labels=ids).loss
    torch.cuda.synchronize()
    after_forward = torch.cuda.memory_allocated()
    loss.backward()
    torch.cuda.synchronize()
    return loss.item(), after_forward, torch.cuda.max_memory_allocated()


def run(mode: str, tokens: int, count: int) -> dict:
    from tasks.train_adapter.memory_plan import HOST, layer_modes
    from tasks.train_adapter.offload_layers import offload_layers

    model, ids = build(tokens)
    layers = list(model.get_base_model().model.layers)
    chosen = [i for i, m in enumerate(layer_modes(len(layers), 0, 0, count)) if m == HOST]
    if mode == "offload":
        offload_layers(layers, chosen)
    elif mode == "recompute":
        model.get_base_model()._set_gradient_checkpointing(
            enable=True, gradient_checkpointing_func=functools.partial(torch.utils.checkpoint.checkpoint,
                                                                       use_reentrant=False))
        for index, layer in enumerate(layers):
            layer.gradient_checkpointing = index in chosen
        model.enable_input_require_grads()
    model.train()
    loss, after_forward, peak = step(model, ids)
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.requires_grad}
    times = []
    for _ in range(5):
        start = time.perf_counter()
        step(model, ids)
        times.append(time.perf_counter() - start)
    return {"loss": loss, "after_forward_gib": round(after_forward / 2**30, 3), "peak_gib": round(peak / 2**30, 3),
            "ms": round(1000 * min(times), 1), "layers": chosen, "grads": grads}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--offload", type=int, default=2)
    args = parser.parse_args()
    results = {mode: run(mode, args.tokens, args.offload) for mode in ("keep", "offload", "recompute")}
    kept = results["keep"]["grads"]
    out = {"tokens": args.tokens, "offloaded_layers": results["offload"]["layers"]}
    for mode, r in results.items():
        grads = r.pop("grads")
        r["max_grad_diff"] = max(float((grads[n] - g).abs().max()) for n, g in kept.items())
        r["max_grad"] = max(float(g.abs().max()) for g in kept.values())
        r.pop("layers")
        out[mode] = r
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
