"""Training data and checkpoint helpers shared by train_adapter and evaluate_adapter (no torch at import)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from tasks.log import logger

COMPLETE = "complete"  # marker written into a checkpoint folder once everything in it is saved


class ParquetExamples:
    """A map-style dataset over a tokenized Parquet file (input_ids, labels)."""

    def __init__(self, path: Path) -> None:
        import pyarrow.parquet as pq

        table = pq.read_table(path, columns=["input_ids", "labels"])
        self.input_ids = table.column("input_ids").to_pylist()
        self.labels = table.column("labels").to_pylist()

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return {"input_ids": self.input_ids[i], "labels": self.labels[i]}


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
