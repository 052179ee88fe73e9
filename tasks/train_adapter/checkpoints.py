"""Training checkpoints: complete only once the marker is written, last of all; the newest complete one resumes."""

from __future__ import annotations

import shutil
from pathlib import Path

from tasks.log import logger

COMPLETE = "complete"  # marker written into a checkpoint folder once everything in it is saved


def latest_checkpoint(folder: Path) -> Path | None:
    """The newest checkpoint-N folder holding the complete marker; half-written ones are deleted.

    Not transformers' get_last_checkpoint: it returns the newest checkpoint folder whether or not its files were
    all written, which after a kill in the middle of a save is a checkpoint that cannot be resumed."""
    if not folder.is_dir():
        return None
    found = sorted((p for p in folder.glob("checkpoint-*") if p.name.split("-")[-1].isdigit()),
                   key=lambda p: int(p.name.split("-")[-1]))
    complete = [p for p in found if (p / COMPLETE).is_file()]
    for partial in set(found) - set(complete):
        logger().warning("train_adapter: ignoring half-written %s", partial.name)
        shutil.rmtree(partial, ignore_errors=True)
    return complete[-1] if complete else None
