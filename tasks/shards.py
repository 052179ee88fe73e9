"""Model shards written and hashed at once: inside `hashed_writes()`, each safetensors shard that transformers'
save_pretrained writes is serialized in memory, then written to its file and hashed from the same bytes on two
threads while save_pretrained prepares the next shard. The hashes go into the manifest's per-process memo
(tasks/manifest.py `remember_sha256`), so the stage's manifest does not read the files back.

Why: every stage output's sha256 is in its manifest (the on-disk contract), and the large outputs are model
shards. On the H200 host the merged 8B model (16 GB in four 5 GB shards) took 15.3 s to save and then 5.4 s to
hash, reading back what was just written; and each shard's write waited for the previous one's (transformers
writes them in a loop, holding the GIL in safetensors' serializer). Here the hash costs no read, and the disk
writes of one shard overlap the copy and serialization of the next (bench/README.md, "Issue 24, fifth pass").

How: transformers' modeling_utils calls its module-level `safe_save_file` for each shard. We install a
replacement once, which writes exactly what safetensors' save_file writes (safetensors.torch.save gives the same
bytes; the test compares the files), and which only changes how it writes when the calling thread is inside
`hashed_writes()`; elsewhere it calls the original. If transformers no longer has that name, save_pretrained runs
as it is and the manifest hashes the files afterwards, as before.
"""

from __future__ import annotations

import hashlib
import threading
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tasks.manifest import remember_sha256

IN_FLIGHT = 2  # shards serialized but not yet written: each is a shard's size of host memory (5 GB by default)
_LOCAL = threading.local()  # .writes: the calling thread's shards in flight, when inside hashed_writes
_INSTALL = threading.Lock()
MARK = "_qlora_hashed_writes"  # attribute of our replacement: installed already


@contextmanager
def hashed_writes() -> Iterator[None]:
    """Within, save_pretrained's safetensors shards are written and hashed at once (see the module docstring);
    on leaving, every shard is on disk and its sha256 remembered. A write's error is raised here."""
    if getattr(_LOCAL, "writes", None) is not None or not _install():
        yield  # nested, or transformers without the hook: plain writes
        return
    writes: deque[tuple[Path, Future[int], Future[str]]] = deque()
    _LOCAL.writes = writes
    try:
        with ThreadPoolExecutor(2 * IN_FLIGHT, thread_name_prefix="shard") as pool:
            _LOCAL.pool = pool
            try:
                yield
            finally:
                _LOCAL.writes = _LOCAL.pool = None
                while writes:  # every write finished before leaving, even when the body failed
                    _settle(writes.popleft())
    finally:
        _LOCAL.writes = _LOCAL.pool = None


def _install() -> bool:
    """Put our save_file in transformers' modeling_utils (once per process); False if it has no such name."""
    try:
        from transformers import modeling_utils
    except ImportError:
        return False
    with _INSTALL:
        original = getattr(modeling_utils, "safe_save_file", None)
        if original is None:
            return False
        if not getattr(original, MARK, False):
            def save_file(tensors: dict[str, Any], filename: str, metadata: dict[str, str] | None = None) -> None:
                writes = getattr(_LOCAL, "writes", None)
                if writes is None:
                    return original(tensors, filename, metadata=metadata)
                _submit(writes, tensors, Path(filename), metadata)
                return None

            setattr(save_file, MARK, True)
            modeling_utils.safe_save_file = save_file
    return True


def _submit(writes: deque[tuple[Path, Future[int], Future[str]]], tensors: dict[str, Any], path: Path,
            metadata: dict[str, str] | None) -> None:
    from safetensors.torch import save

    while len(writes) >= IN_FLIGHT:  # bound the host memory held by serialized shards
        _settle(writes.popleft())
    data = save(tensors, metadata=metadata)
    pool = _LOCAL.pool
    writes.append((path, pool.submit(path.write_bytes, data), pool.submit(_sha256, data)))


def _settle(write: tuple[Path, Future[int], Future[str]]) -> None:
    path, written, digest = write
    written.result()
    remember_sha256(path, digest.result())


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()  # releases the GIL for large buffers: runs beside the write
