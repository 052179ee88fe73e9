"""Padding-free packing: examples grouped into micro-batches of whole examples, concatenated into one row."""

from __future__ import annotations

from typing import Any

from tasks.examples import ParquetExamples


def plan_packs(lengths: list[int], max_tokens: int | None, max_examples: int | None, seed: int) -> list[list[int]]:
    """Example indices grouped into micro-batches: a seeded shuffle, then greedy in that order; a pack closes
    when the next example would pass max_tokens or max_examples (an example longer than max_tokens goes alone)."""
    import random

    order = list(range(len(lengths)))
    random.Random(seed).shuffle(order)
    packs: list[list[int]] = []
    current: list[int] = []
    tokens = 0
    for i in order:
        full = (max_tokens is not None and tokens + lengths[i] > max_tokens) or \
            (max_examples is not None and len(current) >= max_examples)
        if current and full:
            packs.append(current)
            current, tokens = [], 0
        current.append(i)
        tokens += lengths[i]
    if current:
        packs.append(current)
    return packs


class PackedExamples:
    """A map-style dataset whose items are packs of examples (one packed micro-batch each)."""

    def __init__(self, examples: ParquetExamples, max_tokens: int | None, max_examples: int | None,
                 seed: int) -> None:
        self.examples = examples
        lengths = [len(ids) for ids in examples.input_ids]
        self.packs = plan_packs(lengths, max_tokens, max_examples, seed)
        self.max_tokens = max(sum(lengths[i] for i in pack) for pack in self.packs) if self.packs else 0

    def __len__(self) -> int:
        return len(self.packs)

    def __getitem__(self, i: int) -> dict[str, list[list[int]]]:
        items = [self.examples[j] for j in self.packs[i]]
        return {"input_ids": [b["input_ids"] for b in items], "labels": [b["labels"] for b in items]}


class pack_collator:  # noqa: N801 - used like a function
    """Concatenates packs into one row without padding: position ids restart at each example, the first label
    of each example is masked (it would be predicted from the previous example), and cu_seq_lens mark the
    examples' boundaries for varlen attention. Counts the real tokens it saw."""

    def __init__(self) -> None:
        self.real_tokens = 0

    def __call__(self, batch: list[dict[str, list[list[int]]]]) -> dict[str, Any]:
        import torch

        ids = [x for pack in batch for x in pack["input_ids"]]
        labels = [y for pack in batch for y in pack["labels"]]
        lengths = [len(x) for x in ids]
        flat_labels = torch.tensor([t for y in labels for t in y], dtype=torch.long)
        starts = torch.tensor([0, *lengths[:-1]], dtype=torch.long).cumsum(0)
        flat_labels[starts] = -100
        positions = torch.cat([torch.arange(n, dtype=torch.long) for n in lengths])
        cu = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        self.real_tokens += sum(lengths)
        return {"input_ids": torch.tensor([t for x in ids for t in x], dtype=torch.long)[None],
                "labels": flat_labels[None], "position_ids": positions[None],
                "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max(lengths), "max_length_k": max(lengths)}
