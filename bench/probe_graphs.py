"""Do CUDA-graphed decoding steps (tasks/train_adapter/levers/decode_graphs.py) compute what eager ones do?

On a small random Llama in float32 and in bf16, left-padded prompts: transformers' generate with a static cache,
eager, twice (eager runs against each other: cuBLAS's own run-to-run spread), then with the decoding steps replayed as
a CUDA graph; greedy and sampled (same seed). Per step until the tokens first differ: the largest relative difference
of the logits rows. A graph that wrote the keys and values at the wrong place, or read a stale mask, would differ at
the first decoding step by far more than rounding.

usage (GPU host, repository root): python bench/probe_graphs.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    from tasks.train_adapter.levers.decode_graphs import Decoder

    report: dict[str, Any] = {}
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                             num_key_value_heads=2, vocab_size=1000, max_position_embeddings=256)
        model = LlamaForCausalLM(config).to("cuda", dtype)  # training mode, as TRL samples
        ids = torch.randint(3, 1000, (4, 20), device="cuda")
        mask = torch.ones_like(ids)
        mask[1, :5] = mask[3, :9] = 0  # left padding
        for sample in (False, True):
            runs = {}
            for name in ("eager", "eager_again", "graphed"):
                gen = GenerationConfig(max_new_tokens=24, do_sample=sample, temperature=1.0, top_k=0, pad_token_id=0,
                                       eos_token_id=[2], cache_implementation="static", disable_compile=True,
                                       output_logits=True, return_dict_in_generate=True)
                decoder = Decoder()
                torch.manual_seed(1)
                with torch.no_grad():
                    if name == "graphed":
                        with decoder.graphed(model, gen):
                            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen)
                    else:
                        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen)
                runs[name] = (out.sequences[:, 20:].tolist(), torch.stack(out.logits, 1).float(), decoder.failed)
            report[f"{str(dtype)[6:]} {'sampled' if sample else 'greedy'}"] = {
                name: _compare(runs["eager"], runs[name]) for name in ("eager_again", "graphed")}
    print(json.dumps(report, indent=1))


def _compare(a: Any, b: Any) -> dict[str, Any]:
    tokens_a, logits_a, _ = a
    tokens_b, logits_b, failed = b
    first = [next((i for i, (x, y) in enumerate(zip(r, s, strict=True)) if x != y), len(r))
             for r, s in zip(tokens_a, tokens_b, strict=True)]
    same = min(first)  # steps whose inputs were the same in every row
    diffs = [float((logits_b[:, i] - logits_a[:, i]).norm() / logits_a[:, i].norm()) for i in range(max(same, 1))]
    return {"tokens_equal": tokens_a == tokens_b, "first_difference_per_row": first,
            "max_logits_rel_diff_while_equal": max(diffs), "first_step_logits_rel_diff": diffs[0], "failed": failed}


if __name__ == "__main__":
    main()
