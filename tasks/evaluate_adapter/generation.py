"""Generation metrics for evaluate_adapter: held-out prompts, batched greedy answers, exact match, ROUGE-L.

A tokenized eval example (input_ids, labels) carries its own prompt and reference: the prompt is every
token before the first label token (masked from the loss with -100), the reference is the first run of
label tokens after it (the first answer; later turns of a chat are left out).
"""

from __future__ import annotations

import re
from typing import Any

# the prompt/reference split lives in the contract (serving checks a served champion on the same prompts)
from tasks.on_disk.parquet_dataset import split_prompt  # noqa: F401 - re-exported for the stage and its tests


def normalize(text: str) -> str:
    """Whitespace-insensitive form used by exact match: stripped, inner runs of whitespace as one space."""
    return " ".join(text.split())


def exact_match(prediction: str, reference: str) -> float:
    """1.0 when the texts are equal up to whitespace (case and punctuation count), else 0.0."""
    return float(normalize(prediction) == normalize(reference))


def rouge_tokens(text: str) -> list[str]:
    """rouge_score's default tokenizer (no stemming): lowercase, runs of non-[a-z0-9] split words."""
    return re.sub(r"[^a-z0-9]+", " ", text.lower()).split()


def lcs_length(a: list[str], b: list[str]) -> int:
    """Length of the longest common subsequence, one DP row at a time (O(len(a) * len(b)) time)."""
    row = [0] * (len(b) + 1)
    for x in a:
        diagonal = 0  # row[j - 1] of the previous row
        for j, y in enumerate(b, start=1):
            diagonal, row[j] = row[j], diagonal + 1 if x == y else max(row[j], row[j - 1])
    return row[-1]


def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F1 over rouge_tokens: LCS-based precision and recall, as rouge_score's rougeL fmeasure."""
    pred, ref = rouge_tokens(prediction), rouge_tokens(reference)
    common = lcs_length(pred, ref)
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def by_length(lengths: list[int], size: int, budget: int | None = None) -> list[list[int]]:
    """Indices grouped shortest first, each group padded to its longest holding at most `budget` tokens (default:
    `size` times the longest of all `lengths`: as much memory as `size` longest items, fewer groups when most are
    short)."""
    budget = budget or size * max(lengths, default=0)
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):  # stable: equal lengths keep their order
        if groups and (len(groups[-1]) + 1) * lengths[i] <= budget:
            groups[-1].append(i)  # ascending lengths: item i is the group's longest so far
        else:
            groups.append([i])
    return groups


def generation_tokens(model: Any, loss_tokens: int) -> int:
    """Tokens a generation batch may hold (prompts plus new tokens, padded) for no more memory than a loss batch of
    `loss_tokens` tokens: a loss batch holds each token's logits (vocabulary x 6 bytes: the model's bf16 or fp32
    output and the fp32 copy the loss reads), a generation batch each token's keys and values in every layer (the
    logits of one position per row). For Llama-3.1-8B that is 5.9 times the tokens, so the 32 held-out prompts of
    the Dolly job fit one batch instead of four: four times fewer decoding steps."""
    from tasks.models.dims import model_dims

    dims = model_dims(model.config)
    dtype = next(model.parameters()).dtype
    kv_bytes = 2 * dims.layers * dims.kv * dtype.itemsize
    return max(loss_tokens, loss_tokens * dims.vocab * 6 // kv_bytes)


def greedy_generate(model: Any, prompts: list[list[int]], batch_size: int, max_new_tokens: int, pad_id: int,
                    eos_ids: list[int], tokens: int | None = None) -> list[list[int]]:
    """New tokens per prompt by greedy decoding, each cut at its first eos, in the prompts' order. Prompts are
    batched by length (by_length: at most `tokens` tokens a batch, prompts plus max_new_tokens, padded; default
    batch_size times the longest), left-padded so that new tokens start together."""
    import torch

    device = next(model.parameters()).device
    model.eval()  # no LoRA dropout: greedy answers are then a pure function of the weights
    outputs: list[list[int]] = [[] for _ in prompts]
    for group in by_length([len(p) + max_new_tokens for p in prompts], batch_size, tokens):
        batch = [prompts[i] for i in group]
        width = max(map(len, batch))
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                 do_sample=False, num_beams=1, pad_token_id=pad_id, eos_token_id=eos_ids)
        for i, row in zip(group, out[:, width:].tolist(), strict=True):
            cut = next((j for j, t in enumerate(row) if t in eos_ids), len(row))
            outputs[i] = row[:cut]
    return outputs


def score(predictions: list[str], references: list[str]) -> dict[str, float | None]:
    """Mean exact match and ROUGE-L over the answers (None when there are none)."""
    if not references:
        return {"exact_match": None, "rouge_l": None}
    n = len(references)
    return {"exact_match": sum(map(exact_match, predictions, references)) / n,
            "rouge_l": sum(map(rouge_l, predictions, references)) / n}
