"""prepare_data's tokenized Parquet as examples, for train_adapter and evaluate_adapter (no torch at import)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

IGNORE = -100  # the label of a token the loss skips (a prompt token, padding)


def split_prompt(input_ids: list[int], labels: list[int]) -> tuple[list[int], list[int]] | None:
    """(prompt ids, reference ids) of one example; None when no prompt tokens are masked (plain text).

    The prompt is every token before the first label token, the reference the first run of label tokens after it
    (the first answer; later turns of a chat are left out): evaluate_adapter's greedy prompts, and the prompt serving
    checks a served champion with."""
    first = next((i for i, label in enumerate(labels) if label != IGNORE), None)
    if first is None or first == 0:
        return None
    end = next((i for i in range(first, len(labels)) if labels[i] == IGNORE), len(labels))
    return list(input_ids[:first]), list(labels[first:end])


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
