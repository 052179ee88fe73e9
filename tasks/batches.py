"""Training data and checkpoint helpers shared by train_adapter and evaluate_adapter (no torch at import)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from tasks.log import logger

COMPLETE = "complete"  # marker written into a checkpoint folder once everything in it is saved


class ParquetExamples:
    """A map-style dataset over a tokenized Parquet file (input_ids, labels). Rows packed at data time
    (data.pack_examples: a seq_lengths column) are split back into their examples, so that every consumer
    sees whole examples and train-time packing keeps them apart."""

    def __init__(self, path: Path) -> None:
        import pyarrow.parquet as pq

        packed = "seq_lengths" in pq.read_schema(path).names
        table = pq.read_table(path, columns=["input_ids", "labels", *(["seq_lengths"] if packed else [])])
        self.input_ids = table.column("input_ids").to_pylist()
        self.labels = table.column("labels").to_pylist()
        if packed:
            self.input_ids, self.labels = _split(self.input_ids, self.labels, table.column("seq_lengths").to_pylist())

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return {"input_ids": self.input_ids[i], "labels": self.labels[i]}


def _split(ids: list[list[int]], labels: list[list[int]], sizes: list[list[int]]
           ) -> tuple[list[list[int]], list[list[int]]]:
    out_ids, out_labels = [], []
    for row_ids, row_labels, row_sizes in zip(ids, labels, sizes, strict=True):
        start = 0
        for n in row_sizes:
            out_ids.append(row_ids[start:start + n])
            out_labels.append(row_labels[start:start + n])
            start += n
    return out_ids, out_labels


class pad_collator:  # noqa: N801 - used like a function
    """Pads a batch to its longest example (labels with -100) and counts the real tokens it saw."""

    def __init__(self, pad_id: int, multiple_of: int = 1) -> None:
        self.pad_id, self.multiple_of, self.real_tokens = pad_id, multiple_of, 0

    def __call__(self, batch: list[dict[str, list[int]]]) -> dict[str, Any]:
        import torch

        longest = max(len(b["input_ids"]) for b in batch)
        width = -(-longest // self.multiple_of) * self.multiple_of
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, b in enumerate(batch):
            n = len(b["input_ids"])
            ids[row, :n] = torch.tensor(b["input_ids"])
            labels[row, :n] = torch.tensor(b["labels"])
            mask[row, :n] = 1
            self.real_tokens += n
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}


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


def latest_checkpoint(folder: Path) -> Path | None:
    """The newest checkpoint-N folder holding the complete marker; half-written ones are deleted."""
    if not folder.is_dir():
        return None
    found = sorted((p for p in folder.glob("checkpoint-*") if p.name.split("-")[-1].isdigit()),
                   key=lambda p: int(p.name.split("-")[-1]))
    complete = [p for p in found if (p / COMPLETE).is_file()]
    for partial in set(found) - set(complete):
        logger().warning("train_adapter: ignoring half-written %s", partial.name)
        shutil.rmtree(partial, ignore_errors=True)
    return complete[-1] if complete else None
