"""Training checkpoints: complete only once the marker is written, last of all; the newest intact one resumes.

The marker lists every file the checkpoint holds with its size and sha256. A checkpoint whose files differ
from its marker (one missing, truncated or changed in place) is damaged: it is removed with a warning and
the previous complete one resumes instead (the Trainer keeps two, save_total_limit=2).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

from tasks.hashing.files import file_sha256
from tasks.log import logger
from tasks.on_disk import disk

COMPLETE = "complete"  # marker written into a checkpoint folder once everything in it is saved


def write_marker(folder: Path, step: int) -> None:
    """Mark a saved checkpoint complete, recording each of its files' size and sha256."""
    files = {str(p.relative_to(folder)): [p.stat().st_size, file_sha256(p)]
             for p in sorted(folder.rglob("*")) if p.is_file() and not p.name.startswith((COMPLETE, f".{COMPLETE}"))}
    disk.write_whole(folder / COMPLETE, json.dumps({"step": step, "time": time.time(), "files": files}))


def damage(folder: Path) -> str | None:
    """Why a checkpoint cannot be resumed from, or None when it is complete and intact."""
    try:
        marker: dict[str, Any] = json.loads((folder / COMPLETE).read_text())
    except FileNotFoundError:
        return "half-written (no complete marker)"
    except (OSError, ValueError):
        return "its complete marker is unreadable"
    files = marker.get("files")
    if not isinstance(files, dict) or not files:
        return "its complete marker lists no files"
    for name, (size, digest) in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size or file_sha256(path) != digest:
            return f"{name} is damaged"
    return None


def latest_checkpoint(folder: Path) -> Path | None:
    """The newest complete and intact checkpoint-N folder; half-written and damaged ones are deleted.

    Not transformers' get_last_checkpoint: it returns the newest checkpoint folder whether or not its files were
    all written, which after a kill in the middle of a save is a checkpoint that cannot be resumed."""
    if not folder.is_dir():
        return None
    found = sorted((p for p in folder.glob("checkpoint-*") if p.name.split("-")[-1].isdigit()),
                   key=lambda p: int(p.name.split("-")[-1]), reverse=True)
    for checkpoint in found:
        problem = damage(checkpoint)
        if problem is None:
            return checkpoint
        logger().warning("train_adapter: skipping %s: %s; removing it and trying the previous checkpoint",
                         checkpoint.name, problem)
        shutil.rmtree(checkpoint, ignore_errors=True)
    return None


def remove_half_written(stage_dir: Path) -> list[str]:
    """Remove the checkpoints of a train_adapter folder that have no complete marker (a save cut short, by a full
    disk say), and the Trainer's temporary checkpoint folders; their names. Complete ones stay, for the resume."""
    folder = Path(stage_dir) / "checkpoints"
    if not folder.is_dir():
        return []
    removed = [p for p in folder.iterdir() if p.is_dir() and (
        p.name.startswith("tmp-checkpoint-") or (p.name.startswith("checkpoint-") and not (p / COMPLETE).is_file()))]
    for checkpoint in removed:
        shutil.rmtree(checkpoint, ignore_errors=True)
    return [p.name for p in removed]
