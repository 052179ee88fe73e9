"""Disk space: a stage that knows what it will write checks before writing, and a full disk is one paragraph.

A stage that runs out of space mid-write leaves no manifest (it is written last), so nothing half-written is
ever taken as done; open_stage also removes the partial outputs (checkpoints excepted: an incomplete one has no
`complete` marker and is skipped on resume), freeing what they held.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

from tasks.errors import UserError

# what libraries say when a write hit a full disk without raising OSError: safetensors' SafetensorError
# ("I/O error: No space left on device (os error 28)"), torch.save's RuntimeError ("file write failed")
_FULL_DISK_TEXTS = ("No space left on device", "os error 28", "Disk quota exceeded", "file write failed")
NEARLY_FULL = 1 << 20  # bytes free below which a failed write is taken for a full disk
HEADROOM = 1.1  # filesystem blocks, metadata and the manifest: ask for a tenth more than the files' bytes


def free_bytes(path: Path) -> int:
    """Free bytes on the filesystem holding path (or its nearest existing parent)."""
    return shutil.disk_usage(_existing(path)).free


def is_out_of_space(exc: BaseException, folder: Path | None = None) -> bool:
    """Whether exc (or an exception it was raised from) is a write that found the disk full: one that says so,
    or, as torch.save's zip writer does ("unexpected pos 576 vs 534"), an error while folder's disk is full."""
    if folder is not None and isinstance(exc, (OSError, RuntimeError)) and free_bytes(folder) < NEARLY_FULL:
        return True
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(text in str(seen) for text in _FULL_DISK_TEXTS):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _mb(size: int) -> str:
    return f"{size / 2**20:,.1f} MB"


def _paragraph(stage: str, runs_dir: Path, folder: Path, needed: int | None, what: str) -> str:
    usage = shutil.disk_usage(_existing(folder))
    need = f"; it needs about {_mb(needed)} for {what}" if needed else (f" ({what})" if what else "")
    return (f"{stage}: not enough disk space under runs_dir {runs_dir}: {_mb(usage.free)} free of {_mb(usage.total)} "
            f"on that filesystem{need}. Nothing half-written counts as done (no manifest.json; "
            f"partial outputs in {folder} were removed, complete checkpoints kept). Free space there or set "
            "runs_dir to a larger disk, then run again: finished stages are reused and training resumes from its "
            "latest complete checkpoint.")


def _existing(path: Path) -> Path:
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def require(stage: str, runs_dir: Path, folder: Path, needed: int, what: str) -> None:
    """Fail before writing when the filesystem of folder has less than about `needed` bytes free."""
    if free_bytes(folder) < needed * HEADROOM:
        raise UserError(_paragraph(stage, runs_dir, folder, int(needed * HEADROOM), what))


def out_of_space(stage: str, runs_dir: Path, folder: Path, what: str = "") -> UserError:
    """The UserError for a write into folder that found the disk full."""
    return UserError(_paragraph(stage, runs_dir, folder, None, what))


def folder_bytes(folder: Path) -> int:
    """Bytes of the files under folder (0 when it does not exist)."""
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file()) if Path(folder).is_dir() else 0
