"""Training helpers for train_adapter: Parquet examples, padding, checkpoints, loss log, progress."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

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


class mark_complete(TrainerCallback):  # noqa: N801
    """Writes the complete marker after the Trainer has saved everything for a checkpoint."""

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        tmp = folder / f".{COMPLETE}.tmp"
        tmp.write_text(json.dumps({"step": state.global_step, "time": time.time()}))
        os.replace(tmp, folder / COMPLETE)


class LossLog(TrainerCallback):
    """Appends one JSON line per logged step; on resume, drops lines after the checkpoint's step."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.path.exists():
            lines = [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
            kept = [line for line in lines if line["step"] <= state.global_step]
            self.path.write_text("".join(json.dumps(line) + "\n" for line in kept))
        else:
            self.path.touch()

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
        if logs and "loss" in logs:
            entry = {"step": state.global_step, "epoch": round(state.epoch or 0, 4),
                     **{k: logs[k] for k in ("loss", "learning_rate", "grad_norm") if k in logs}}
            with self.path.open("a") as f:
                f.write(json.dumps(entry) + "\n")


class Progress(TrainerCallback):
    """Logs step / total, loss, real tokens/s and ETA at each logging step."""

    def __init__(self, collator: pad_collator) -> None:
        self.collator = collator
        self.start = time.time()
        self.first_step = 0

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.start, self.first_step, self.collator.real_tokens = time.time(), state.global_step, 0

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
        if not logs or "loss" not in logs:
            return
        elapsed = max(time.time() - self.start, 1e-9)
        done = state.global_step - self.first_step
        eta = elapsed / max(done, 1) * (state.max_steps - state.global_step)
        logger().info("train_adapter: step %d/%d loss %.4f, %.0f tokens/s, ETA %.0fs", state.global_step,
                      state.max_steps, logs["loss"], self.collator.real_tokens / elapsed, eta)
