"""Disk space: a stage that knows what it will write checks before writing, and a full disk is one paragraph.

A stage that runs out of space mid-write leaves no manifest (it is written last), so nothing half-written is
ever taken as done; open_stage also removes the partial outputs, a checkpoint cut short among them (complete
checkpoints stay, for the resume), freeing what they held.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from tasks.errors import UserError

# what libraries say when a write hit a full disk without raising OSError: safetensors' SafetensorError
# ("I/O error: No space left on device (os error 28)"), torch.save's RuntimeError ("file write failed")
_FULL_DISK_TEXTS = ("No space left on device", "os error 28", "Disk quota exceeded", "file write failed")
NEARLY_FULL = 1 << 20  # bytes free below which a failed write is taken for a full disk
HEADROOM = 1.1  # filesystem blocks, metadata and the manifest: ask for a tenth more than the files' bytes
BLOCK = 4096  # a small file takes at least one filesystem block (a tmpfs page, an ext4 block)
# what a stage's full disk leaves (open_stage): the default of the paragraph's parenthesis
STAGE_LEFT = ("no manifest.json; partial outputs in {folder} were removed, complete checkpoints kept")


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
    return f"{size / 2**20:,.1f} MB" if size >= 2**20 // 10 else f"{size / 2**10:,.0f} KB"  # a record: KB


def _paragraph(step: str, runs_dir: Path, folder: Path, needed: int | None, what: str, left: str) -> str:
    usage = shutil.disk_usage(_existing(folder))
    need = f"; it needs about {_mb(needed)} for {what}" if needed else (f" ({what})" if what else "")
    return (f"{step}: not enough disk space under runs_dir {runs_dir}: {_mb(usage.free)} free of {_mb(usage.total)} "
            f"on that filesystem{need}. Nothing half-written counts as done ({left.format(folder=folder)}). "
            "Free space there or set runs_dir to a larger disk, then run again: finished stages are reused and "
            "training resumes from its latest complete checkpoint.")


def _existing(path: Path) -> Path:
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def require(stage: str, runs_dir: Path, folder: Path, needed: int, what: str) -> None:
    """Fail before writing when the filesystem of folder has less than about `needed` bytes free."""
    if free_bytes(folder) < needed * HEADROOM:
        raise UserError(_paragraph(stage, runs_dir, folder, int(needed * HEADROOM), what, STAGE_LEFT))


def out_of_space(step: str, runs_dir: Path, folder: Path, what: str = "", left: str = STAGE_LEFT,
                 needed: int | None = None) -> UserError:
    """The UserError for a write into folder that found the disk full; `left` says what the failure left behind
    (why nothing half-written is taken as done), `needed` about how many bytes the step needs when known."""
    return UserError(_paragraph(step, runs_dir, folder, needed, what, left))


@contextmanager
def writing(step: str, runs_dir: Path, folder: Path, left: str, what: str = "", needed: int | None = None,
            undo: Callable[[], None] | None = None) -> Iterator[None]:
    """Writes into folder outside a stage's open_stage (the registry, the run record, the sweep folder,
    tracking): a full disk becomes the one-paragraph UserError, after `undo` removed what was half-made."""
    try:
        yield
    except UserError:
        raise
    except Exception as exc:
        if not is_out_of_space(exc, folder):
            raise
        if undo is not None:
            undo()
        raise out_of_space(step, runs_dir, folder, what, left, needed) from exc


def write_whole(path: Path, data: str | bytes) -> None:
    """Write a file whole or not at all: a temp file beside it, renamed over it; the temp file is removed when
    the write fails (a full disk), so a reader never sees half a file and nothing is left behind."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def blocks(*sizes: int) -> int:
    """Bytes that files of these sizes take on disk, about: each rounded up to whole blocks."""
    return sum(-(-size // BLOCK) * BLOCK for size in sizes)


def folder_bytes(folder: Path) -> int:
    """Bytes of the files under folder (0 when it does not exist)."""
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file()) if Path(folder).is_dir() else 0
