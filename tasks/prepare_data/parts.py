"""Per-file parts of prepare_data: each data file's tokenized rows, reused by content on later runs.

A source of several files (a folder, a glob, a remote prefix) is tokenized file by file into
runs_dir/prepare_data/parts/<key>/, key = hash(the file's sha256, the settings that shape its tokens, the
tokenizer's fingerprint, the stage version); no path is in it. A part holds rows.parquet (input_ids, labels
and the split hash of each kept example, one row group per chunk as the tokenizer made it) and part.json (the
file's counts and token-length histogram, rows.parquet's size and sha256). It is written in a temporary folder
and renamed into place, so a part folder is whole or absent; a file with bad rows gets no part. Assembling
train/eval from parts gives the rows, row groups and order a direct pass over the files gives.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from tasks.errors import UserError
from tasks.hashing.files import file_sha256
from tasks.hashing.keys import cache_key
from tasks.log import logger
from tasks.prepare_data.sources import Problems, RawChunk, content_sha256, file_chunks
from tasks.prepare_data.tokenization import Settings, Tokenized, tokenize_all

ROWS, META = "rows.parquet", "part.json"
COUNTS = ("rows_in", "dropped_empty", "dropped_prompt_too_long", "truncated", "truncated_tokens")


class Tally:
    """Counts by reason and a histogram of token lengths before truncation (memory does not grow with the data)."""

    def __init__(self) -> None:
        self.counts = dict.fromkeys(COUNTS, 0)
        self.histogram = np.zeros(1, dtype=np.int64)

    def add(self, part: Tokenized) -> None:
        for key, value in zip(COUNTS, (part.rows, part.empty, part.prompt_too_long, part.truncated, part.tokens_cut),
                              strict=True):
            self.counts[key] += value
        self._count(np.bincount(part.raw_lengths))

    def merge(self, saved: dict[str, Any]) -> None:
        """Add a tally saved by `to_json`."""
        for key in COUNTS:
            self.counts[key] += saved["counts"][key]
        pairs = np.array(saved["histogram"], dtype=np.int64).reshape(-1, 2)  # [length, examples]
        more = np.zeros(int(pairs[:, 0].max()) + 1 if len(pairs) else 1, dtype=np.int64)
        more[pairs[:, 0]] = pairs[:, 1]
        self._count(more)

    def _count(self, more: np.ndarray) -> None:
        if len(more) > len(self.histogram):
            self.histogram = np.pad(self.histogram, (0, len(more) - len(self.histogram)))
        self.histogram[:len(more)] += more

    def to_json(self) -> dict[str, Any]:
        at = np.flatnonzero(self.histogram)  # sparse: [length, examples]
        return {"counts": self.counts, "histogram": [[int(i), int(self.histogram[i])] for i in at]}


def part_key(sha256: str, settings: Settings, tokenizer: dict[str, str], version: str) -> str:
    """The key of one file's part: its bytes and what shapes its tokens, never its path."""
    shaping = {"fmt": settings.fmt, "column_mapping": settings.column_mapping, "completion_only":
               settings.completion_only, "max_len": settings.max_len, "chat_template": settings.chat_template,
               "prefix": settings.prefix, "eos": settings.eos, "fold_system": settings.fold_system}
    return cache_key(["prepare_data-part", version, sha256, shaping, tokenizer])


def read_part(folder: Path) -> dict[str, Any] | None:
    """part.json of a whole, intact part folder, else None (it is then computed again)."""
    try:
        meta = json.loads((folder / META).read_text())
        rows = folder / ROWS
        if rows.stat().st_size == meta["size"] and file_sha256(rows) == meta["sha256"]:
            return meta
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def prepare(fs: Any, paths: list[str], settings: Settings, tokenizer: dict[str, str], version: str,
            parts_dir: Path, problems: Problems, workers: int, limit: int) -> tuple[list[Path], int]:
    """Each file's part folder, in file order, and how many were tokenized: reused where the part exists,
    tokenized otherwise (all missing ones through one pool). Bad rows of every file go to `problems`; such a
    file gets no part."""
    shas = {p: content_sha256(fs, p) for p in paths}
    folders = {p: parts_dir / part_key(shas[p], settings, tokenizer, version) for p in paths}
    todo: dict[Path, str] = {}  # part folder -> the first file with its bytes
    for path, folder in folders.items():
        if folder not in todo and read_part(folder) is None:
            todo[folder] = path
    logger().info("prepare_data: %d of %d files to tokenize, the others' parts reused from %s", len(todo),
                  len(paths), parts_dir)
    writers = {path: _PartWriter(folder, version) for folder, path in todo.items()}
    order: deque[str] = deque()  # the file of each chunk handed to the tokenizer, oldest first

    def chunks() -> Iterator[RawChunk]:
        for path, writer in writers.items():
            for chunk in file_chunks(fs, path, writer.problems, limit):
                order.append(path)
                yield chunk

    try:
        for tokenized in tokenize_all(chunks(), settings, workers):
            writers[order.popleft()].write(tokenized)
    except BaseException:  # a full disk, a bad file, a kill: no temporary part stays to hold the space
        for writer in writers.values():
            writer.discard()
        raise
    changed = []
    for path, writer in writers.items():  # in file order; a file without rows gets an empty part
        problems.merge(writer.problems)
        same = content_sha256(fs, path) == shas[path]  # a stat, unless the file changed while it was read
        changed += [] if same else [path]
        writer.close(keep=same and not writer.problems.counts)  # bad rows: reported on every run until fixed
    if changed:
        raise UserError(f"{', '.join(changed[:5])} changed while prepare_data was reading it, so nothing was "
                        "written. Run again once the data is no longer being written.")
    return [folders[p] for p in paths], len(todo)


def chunks_of(folder: Path) -> Iterator[Tokenized]:
    """A part's chunks as the tokenizer made them (kept examples, their split hashes; no counts)."""
    import pyarrow.parquet as pq

    file = pq.ParquetFile(folder / ROWS)
    for group in range(file.num_row_groups):
        table = file.read_row_group(group)
        ids, labels = table.column("input_ids").combine_chunks(), table.column("labels").combine_chunks()
        lengths = np.diff(ids.offsets.to_numpy()).astype(np.int64)
        yield Tokenized(ids.flatten().to_numpy(), labels.flatten().to_numpy(), lengths,
                        table.column("hash").to_numpy(), np.zeros(0, np.int64))


class _PartWriter:
    """One file's part, written into a temporary folder that close() renames into place (or removes)."""

    def __init__(self, folder: Path, version: str) -> None:
        self.folder, self.version = folder, version
        self.tmp = folder.parent / f".{folder.name}.{os.getpid()}.{threading.get_ident()}.tmp"
        self.tally, self.problems, self.file = Tally(), Problems(), None

    def write(self, part: Tokenized) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        self.tally.add(part)
        self.problems.merge(part.problems)
        if self.file is None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp.mkdir(parents=True)
            self.file = pq.ParquetWriter(self.tmp / ROWS, _schema())
        if len(part.lengths):
            offsets = pa.array(np.concatenate([[0], np.cumsum(part.lengths)]).astype(np.int32))
            self.file.write_table(pa.table({"input_ids": pa.ListArray.from_arrays(offsets, part.input_ids),
                                            "labels": pa.ListArray.from_arrays(offsets, part.labels),
                                            "hash": pa.array(part.hashes, pa.uint64())}))

    def discard(self) -> None:
        """Drop the temporary folder (the part was not finished)."""
        if self.file is not None:
            try:
                self.file.close()
            except OSError:
                pass  # its last write hit the full disk; the folder goes anyway
        shutil.rmtree(self.tmp, ignore_errors=True)

    def close(self, keep: bool) -> None:
        import pyarrow.parquet as pq

        if self.file is None:  # no chunk at all: an empty file
            self.tmp.mkdir(parents=True, exist_ok=True)
            self.file = pq.ParquetWriter(self.tmp / ROWS, _schema())
        self.file.close()
        try:
            if keep and read_part(self.folder) is None:  # else another run put the same part in place first
                rows = self.tmp / ROWS
                meta = {"version": self.version, "size": rows.stat().st_size, "sha256": file_sha256(rows),
                        **self.tally.to_json()}
                (self.tmp / META).write_text(json.dumps(meta))
                shutil.rmtree(self.folder, ignore_errors=True)  # a damaged part of this key: replaced
                try:
                    os.replace(self.tmp, self.folder)
                except OSError:
                    if read_part(self.folder) is None:
                        raise
                    # another run renamed the same part into place just now: same bytes, keep theirs
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)


def _schema() -> Any:
    import pyarrow as pa

    ids = pa.list_(pa.int32())
    return pa.schema([("input_ids", ids), ("labels", ids), ("hash", pa.uint64())])
