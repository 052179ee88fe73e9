"""Where prepare_data's rows come from: local files, directories and globs, fsspec URLs, hub datasets.

Everything is read in chunks (RawChunk) that tokenizer workers decode, so memory does not grow with
the dataset. Problems in the data (bad JSON lines, non-UTF-8 bytes, ragged CSV rows) are collected in
`Problems`, not raised one by one, so one error message lists them all.
"""

from __future__ import annotations

import csv
import glob
import hashlib
import io
import json
import os
import re
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from tasks import allowed, credentials
from tasks.config import DataArgs
from tasks.errors import UserError
from tasks.hashing.files import file_sha256, files_fingerprint
from tasks.hashing.keys import hash_json
from tasks.log import logger
from tasks.models.sources import is_local, resolve_hub_revision

SUFFIXES = (".jsonl", ".json", ".csv", ".parquet", ".txt", ".raw")  # .txt/.raw: one text row per line
CHUNK_ROWS = 4096  # rows per chunk: one tokenizer call, one Parquet row group
CHUNK_BYTES = 8 << 20  # and at most this many bytes, for long documents
_SURROGATE = re.compile("[\udc80-\udcff]")  # what undecodable bytes become under errors="surrogateescape"
# first bytes of files that are not text, whatever their name says
_BINARY = {b"\x1f\x8b": "gzip-compressed", b"PK\x03\x04": "a zip archive", b"\x28\xb5\x2f\xfd": "zstd-compressed"}
_REMOTE_HASHES: dict[tuple[str, str], str] = {}


@dataclass
class RawChunk:
    """Rows as read, before decoding: JSON lines or text lines (bytes), or records (dicts or an Arrow batch)."""

    where: str  # file or dataset, for messages
    kind: Literal["json_lines", "text_lines", "records", "arrow"]
    rows: Any
    first: int  # line number (lines) or 1-based row number (records) of rows[0]
    unit: str = "line"
    limit: int | None = None  # data.max_record_bytes: a longer record is a problem (decode), not tokenized


@dataclass
class Problems:
    """Bad rows by problem; each problem's text ends with its fix. Keeps the first 10 locations of each."""

    counts: Counter = field(default_factory=Counter)
    where: dict[str, list[tuple[str, str]]] = field(default_factory=dict)  # problem -> [(file, "line 7")]

    def add(self, problem: str, file: str, location: str) -> None:
        self.counts[problem] += 1
        shown = self.where.setdefault(problem, [])
        if len(shown) < 10:
            shown.append((file, location))

    def merge(self, other: Problems) -> None:
        for problem, locations in other.where.items():
            kept = self.where.setdefault(problem, [])
            kept += locations[: 10 - len(kept)]
        self.counts.update(other.counts)

    def raise_if_any(self, source: str, field: str = "data.source") -> None:
        if self.counts:
            raise UserError(self.message(source, field))

    def message(self, source: str, field: str = "data.source") -> str:
        """One paragraph on every problem, or "" when there is none."""
        if not self.counts:
            return ""
        parts = []
        for problem, n in self.counts.items():
            by_file: dict[str, list[str]] = {}
            for file, location in self.where[problem]:
                by_file.setdefault(file, []).append(location)
            shown = "; ".join(f"{file} {', '.join(locs)}" for file, locs in by_file.items())
            parts.append(f"{n} row(s) {problem}: {shown}{' ...' if n > 10 else ''}.")
        return f"{field}={source!r} has bad rows, so nothing was written. " + " ".join(parts)


def is_hub(source: str) -> bool:
    """A hub dataset id (`org/name`), not a URL, an existing path or something written like a file name."""
    return not ("://" in source or is_local(source) or source.endswith(SUFFIXES) or glob.has_magic(source))


def data_files(source: str, field: str = "data.source") -> tuple[Any, list[str]]:
    """The fsspec filesystem and the sorted data files a local or URL source names (a file, folder or glob)."""
    import fsspec
    from fsspec.registry import known_implementations

    url = source if "://" in source else str(Path(source).expanduser())
    try:
        fs, path = fsspec.core.url_to_fs(url)
    except ImportError as exc:  # fsspec knows the protocol but a package it needs is missing
        protocol = source.split("://")[0]
        # the module that failed to import (aiohttp for https://), else the implementation's own package
        package = (getattr(exc.__cause__, "name", None) or exc.name
                   or known_implementations.get(protocol, {}).get("class", "").split(".")[0])
        raise UserError(f"{field}={source!r}: reading {protocol}:// needs the {package or protocol} package, "
                        f"which is not installed. Install it (pip install {package}) or copy the data to a "
                        "local file.") from exc
    except ValueError as exc:
        raise UserError(f"{field}={source!r}: {exc}. Give a local path, a URL whose protocol fsspec "
                        "knows (s3://, gs://, ...) or a hub dataset id.") from exc
    with _refused_access(source, field):
        paths = _listed(fs, path, source, field)
    paths = sorted(p for p in paths if p.endswith(SUFFIXES))
    if not paths:
        raise UserError(f"{field}={source!r} matched no {'/'.join(SUFFIXES)} files.")
    return fs, paths


@contextmanager
def _refused_access(source: str, field: str) -> Iterator[None]:
    """A server that refuses the request (HTTP 401 or 403, an object store's access denied) is a UserError naming
    where the credentials go: the environment of the process that runs the flow, never the URL."""
    try:
        yield
    except Exception as exc:
        status = getattr(exc, "status", None) or getattr(exc, "status_code", None)
        if "://" not in source or (not isinstance(exc, PermissionError) and status not in (401, 403)):
            raise
        raise UserError(f"{field}={source!r}: the server refused access ({status or type(exc).__name__}: "
                        f"{str(exc)[:200]}). Give the credentials {credentials.DATA_INSTEAD}.") from None


def _listed(fs: Any, path: str, source: str, field: str) -> list[str]:
    if glob.has_magic(path):
        paths = [p for p in fs.glob(path) if fs.isfile(p)]
    elif fs.isdir(path):
        paths = fs.find(path)
    elif fs.isfile(path):
        if not path.endswith(SUFFIXES):
            raise UserError(f"{field}={source!r}: unsupported file type {Path(path).suffix!r}; "
                            f"use one of {', '.join(SUFFIXES)}.")
        paths = [path]
    else:
        raise UserError(f"{field}={source!r}: no such file. Give a {'/'.join(SUFFIXES)} file, a folder or "
                        "glob of them, a URL, or a hub dataset id such as databricks/databricks-dolly-15k.")
    return paths


def _is_local_fs(fs: Any) -> bool:
    return "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))


def roots(args: DataArgs) -> list[str] | None:
    """The places data may be read from: the config's data.allowed_roots where an old config still names them (they
    lie inside the operator's, check_access), else the operator's QLORA_DATA_ROOTS (tasks/allowed.py); None: any."""
    return args.allowed_roots if args.allowed_roots is not None else allowed.data_roots()


def check_access(args: DataArgs) -> None:
    """Before any stage: the run asks to read nothing its worker's operator does not allow (QLORA_DATA_ROOTS) through
    its config (data.allowed_roots of an old config, data.source, data.eval_source) or its job variables; one
    UserError listing every problem."""
    allowed.check_run_overrides()
    problems = []
    operator = allowed.data_roots()
    if args.allowed_roots is not None:
        logger().warning("data.allowed_roots is no longer a run parameter (a run form could widen it): it only narrows "
                         "what the worker allows. Drop it from the config and set the places in the worker's "
                         "environment, %s=%s (docs/data.md)", allowed.DATA_ROOTS, ",".join(args.allowed_roots))
    if operator is not None and args.allowed_roots is not None:
        wider = [root for root in args.allowed_roots if not allowed.inside(root, operator)]
        if wider:
            problems.append(f"data.allowed_roots names {', '.join(wider)}, outside what the worker allows "
                            f"({allowed.DATA_ROOTS}={','.join(operator)}): a config can only narrow that. Leave "
                            "data.allowed_roots out (it is no longer a run parameter), or ask whoever runs the "
                            f"worker to add the place to {allowed.DATA_ROOTS}.")
    for name in ("source", "eval_source"):
        source = getattr(args, name)
        if source is not None and not problems:
            try:
                check_allowed(args.model_copy(update={"source": source}), field=f"data.{name}")
            except UserError as exc:
                problems.append(str(exc))
    if problems:
        raise UserError(" ".join(problems))


def check_allowed(args: DataArgs, paths: list[str] | None = None, field: str = "data.source") -> None:
    """Where reading is confined (roots), the source and every file read must lie inside one of the allowed places
    (links resolved).

    Called before the source is looked at (nothing is said about files outside) and again on the files found.
    """
    allowed_places = roots(args)
    if allowed_places is None or is_hub(args.source):
        return
    if paths is None and "://" not in args.source:
        static = args.source[:min((args.source.find(c) for c in "*?[" if c in args.source), default=None)]
        paths = [static or "."]
    outside = [p for p in ([args.source] if "://" in args.source else paths or [])
               if not allowed.inside(p, allowed_places)]
    if outside:
        who = ("data.allowed_roots" if args.allowed_roots is not None
               else f"what the worker allows ({allowed.DATA_ROOTS})")
        raise UserError(f"{field}={args.source!r} reads {', '.join(outside[:5])}{' ...' if len(outside) > 5 else ''}, "
                        f"outside {who}: {', '.join(allowed_places)}. Put the data in one of those places, or ask "
                        f"whoever runs the worker to allow its place (environment variable {allowed.DATA_ROOTS}).")


def fingerprint(args: DataArgs, field: str = "data.source", runs_dir: Path | None = None) -> str:
    """Content identity of the data: the bytes of every file read (their hashes memoised in runs_dir), or the
    resolved hub commit."""
    if is_hub(args.source):
        return f"hub:{args.source}@{resolve_hub_revision(args.source, args.revision, repo_type='dataset')}"
    check_allowed(args, field=field)
    fs, paths = data_files(args.source, field)
    check_allowed(args, paths, field)
    if _is_local_fs(fs):
        if len(paths) == 1:
            return file_sha256(Path(paths[0]), runs_dir)
        return files_fingerprint([Path(p) for p in paths], root=Path(os.path.commonpath(paths)), runs_dir=runs_dir)
    return hash_json(sorted((p, _remote_sha256(fs, p)) for p in paths))


def content_sha256(fs: Any, path: str) -> str:
    """sha256 of one data file's bytes (memoised: by identity for local files, by the server's checksum else)."""
    return file_sha256(Path(path)) if _is_local_fs(fs) else _remote_sha256(fs, path)


def _remote_sha256(fs: Any, path: str) -> str:
    # the bytes themselves, memoised by the server's checksum (ETag, md5, mtime) within the process
    memo = (path, str(fs.checksum(path)))
    if memo not in _REMOTE_HASHES:
        h = hashlib.sha256()
        with fs.open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        _REMOTE_HASHES[memo] = h.hexdigest()
    return _REMOTE_HASHES[memo]


def read_chunks(args: DataArgs, problems: Problems, field: str = "data.source") -> Iterator[RawChunk]:
    """The source's rows in chunks, in a fixed order (files sorted by name)."""
    if is_hub(args.source):
        for chunk in _hub_chunks(args):
            chunk.limit = args.max_record_bytes
            yield chunk
        return
    fs, paths = data_files(args.source, field)
    check_allowed(args, paths, field)
    for path in paths:
        yield from file_chunks(fs, path, problems, args.max_record_bytes)


def file_chunks(fs: Any, path: str, problems: Problems, limit: int) -> Iterator[RawChunk]:
    """One data file's rows in chunks; a chunk never spans two files. A record longer than `limit` bytes is a
    problem, never held whole: a line's bytes are skipped as they are read."""
    with fs.open(path, "rb") as f:
        if path.endswith(".csv"):
            chunks = _csv_chunks(f, path, problems)
        elif path.endswith(".parquet"):
            chunks = _arrow_chunks(_parquet_batches(f), path)
        elif path.endswith((".txt", ".raw")):
            chunks = _line_chunks(f, path, "text_lines", problems, limit)
        elif path.endswith(".json") and _starts_array(f):
            chunks = _json_array_chunks(f, path, problems)
        else:
            chunks = _line_chunks(f, path, "json_lines", problems, limit)
        for chunk in chunks:
            chunk.limit = limit
            yield chunk


def too_long(limit: int) -> str:
    """The problem of a record longer than data.max_record_bytes, with its fix."""
    return (f"are longer than data.max_record_bytes ({limit:,} bytes), more than one record may hold: tokenizing a "
            "record takes about a hundred times its size in memory (split such records, or raise "
            "data.max_record_bytes where the worker has the memory)")


def _line_chunks(f: Any, where: str, kind: Literal["json_lines", "text_lines"], problems: Problems, limit: int
                 ) -> Iterator[RawChunk]:
    rows: list[bytes] = []
    first = size = 0
    head = f.read(4)
    kind_of = next((what for magic, what in _BINARY.items() if head.startswith(magic)), None)
    if kind_of:
        problems.add(f"are not text: the file is {kind_of} (decompress or convert it to {Path(where).suffix} "
                     "text first)", where, "line 1")
        return
    for number, line in enumerate(_bounded_lines(f, head, limit), start=1):
        if isinstance(line, int):  # longer than the limit: its bytes were not kept
            problems.add(too_long(limit), where, f"line {number} ({line:,} bytes)")
            continue
        if number == 1:
            line = line.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte order mark, as .csv and .json accept
        if not rows:
            first = number
        rows.append(line)
        size += len(line)
        if len(rows) >= CHUNK_ROWS or size >= CHUNK_BYTES:
            yield RawChunk(where, kind, rows, first)
            rows, size = [], 0
    if rows:
        yield RawChunk(where, kind, rows, first)


def _bounded_lines(f: Any, head: bytes, limit: int) -> Iterator[bytes | int]:
    """The lines of binary file `f` (whose first bytes, `head`, were read already) with their newline, as iterating
    the file gives them; a line longer than `limit` bytes as its length instead, its bytes dropped as they are read
    (a 50 MB line was read, decoded and tokenized whole, and the kernel killed the run for its memory)."""
    partial: list[bytes] = []  # the line so far, while it is within the limit
    held = skipped = 0  # its bytes held; bytes of an over-long line seen (0: not skipping)
    block = head
    while block:
        lines = block.split(b"\n")
        for piece in lines[:-1]:  # complete lines (each ended by a newline)
            if skipped or held + len(piece) + 1 > limit:
                yield skipped + held + len(piece) + 1
            else:
                yield b"".join([*partial, piece, b"\n"])
            partial, held, skipped = [], 0, 0
        tail = lines[-1]
        if skipped or held + len(tail) > limit:
            skipped, partial, held = skipped + held + len(tail), [], 0
        elif tail:
            partial.append(tail)
            held += len(tail)
        block = f.read(1 << 20)
    if skipped:
        yield skipped
    elif held:
        yield b"".join(partial)


def _starts_array(f: Any) -> bool:
    head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    f.seek(0)
    return head.startswith(b"[")


def _json_array_chunks(f: Any, where: str, problems: Problems) -> Iterator[RawChunk]:
    # one JSON array cannot be streamed with the standard library: it is read whole (use .jsonl for big data)
    try:
        records = json.loads(f.read().decode("utf-8"))
    except UnicodeDecodeError as exc:
        problems.add("are not UTF-8 (save the file as UTF-8)", where, f"byte {exc.start}")
        return
    except ValueError as exc:
        problems.add("are not valid JSON (fix the syntax)", where, f"line {getattr(exc, 'lineno', '?')}")
        return
    for start in range(0, len(records), CHUNK_ROWS):
        yield RawChunk(where, "records", records[start:start + CHUNK_ROWS], start + 1, unit="item")


def _csv_chunks(f: Any, where: str, problems: Problems) -> Iterator[RawChunk]:
    # the csv module, not pyarrow's reader: it gives the line number of every ragged or undecodable row
    text = io.TextIOWrapper(f, encoding="utf-8-sig", errors="surrogateescape", newline="")
    reader = csv.reader(text)
    records: list[dict[str, str]] = []
    try:
        header = next(reader, [])
        line, count = reader.line_num, 0
        for row in reader:
            start, line = line + 1, reader.line_num
            if not row:
                continue
            if _SURROGATE.search("".join(row)):
                problems.add("are not UTF-8 (save the file as UTF-8)", where, f"line {start}")
            elif len(row) != len(header):
                problems.add(f"have a different number of fields than the header's {len(header)} (quote fields "
                             "that contain commas or line breaks)", where, f"line {start} ({len(row)} fields)")
            else:
                count += 1
                records.append(dict(zip(header, row, strict=True)))
                if len(records) >= CHUNK_ROWS:
                    yield RawChunk(where, "records", records, count - len(records) + 1, unit="row")
                    records = []
    except csv.Error as exc:  # a field longer than the csv module reads: the rest of the file cannot be parsed
        problems.add(f"cannot be read as CSV ({exc}; a field that long belongs in a .jsonl or .parquet file)", where,
                     f"line {reader.line_num}")
        return
    if records:
        yield RawChunk(where, "records", records, count - len(records) + 1, unit="row")


def _parquet_batches(f: Any) -> Iterator[Any]:
    import pyarrow.parquet as pq

    yield from pq.ParquetFile(f).iter_batches(batch_size=CHUNK_ROWS)


def _arrow_chunks(batches: Iterator[Any], where: str) -> Iterator[RawChunk]:
    row = 1
    for batch in batches:
        yield RawChunk(where, "arrow", batch, row, unit="row")
        row += batch.num_rows


def _hub_chunks(args: DataArgs) -> Iterator[RawChunk]:
    import huggingface_hub
    from datasets import load_dataset
    from huggingface_hub import snapshot_download

    commit = resolve_hub_revision(args.source, args.revision, repo_type="dataset")
    if huggingface_hub.constants.HF_HUB_OFFLINE:
        # datasets cannot read the hub cache offline, only its own; the snapshot folder holds the same files
        path = snapshot_download(args.source, repo_type="dataset", revision=commit, local_files_only=True)
        dataset = load_dataset(path, args.name, split=args.split)
    else:
        dataset = load_dataset(args.source, args.name, split=args.split, revision=commit)
    yield from _arrow_chunks(dataset.with_format("arrow").iter(batch_size=CHUNK_ROWS), f"{args.source}@{commit[:8]}")


def columns(chunk: RawChunk, mapping: dict[str, str]) -> list[str]:
    """Column names seen in a chunk (after renaming), for format detection."""
    if chunk.kind == "arrow":
        names = list(chunk.rows.schema.names)
    elif chunk.kind == "text_lines":
        names = ["text"]
    else:
        found: dict[str, None] = {}
        for row in chunk.rows[:1000]:
            record = row if isinstance(row, dict) else _try_json(row)
            found.update(dict.fromkeys(record if isinstance(record, dict) else ()))
        names = list(found)
    return [mapping.get(n, n) for n in names]


def _try_json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return None


def decode(chunk: RawChunk, mapping: dict[str, str], problems: Problems) -> Iterator[tuple[str, dict[str, Any]]]:
    """("line 7", record) for each row of a chunk; undecodable rows go to `problems`."""
    at = f"{chunk.unit} {{}}".format
    if chunk.kind == "arrow":
        rows: Any = chunk.rows.to_pylist()
    elif chunk.kind == "text_lines":
        rows = (_text_line(raw, chunk.where, at(chunk.first + i), problems) for i, raw in enumerate(chunk.rows))
    elif chunk.kind == "json_lines":
        rows = (_json_line(raw, chunk.where, at(chunk.first + i), problems) for i, raw in enumerate(chunk.rows))
    else:
        rows = chunk.rows
    for i, record in enumerate(rows):
        if record is None:
            continue
        if chunk.kind in ("records", "arrow") and chunk.limit and (size := _record_bytes(record)) > chunk.limit:
            problems.add(too_long(chunk.limit), chunk.where, f"{at(chunk.first + i)} ({size:,} bytes)")
            continue
        if mapping:
            record = {mapping.get(k, k): v for k, v in record.items()}
        yield at(chunk.first + i), record


def _record_bytes(value: Any) -> int:
    """About how many bytes a record's text takes (its strings' lengths, nested values included)."""
    if isinstance(value, str | bytes):
        return len(value)
    if isinstance(value, dict):
        return sum(_record_bytes(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(_record_bytes(v) for v in value)
    return 8


def _text_line(raw: bytes, file: str, where: str, problems: Problems) -> dict[str, str] | None:
    try:
        return {"text": raw.decode("utf-8").rstrip("\r\n")}
    except UnicodeDecodeError:
        problems.add("are not UTF-8 (save the file as UTF-8)", file, where)
        return None


def _json_line(raw: bytes, file: str, where: str, problems: Problems) -> dict[str, Any] | None:
    if not raw.strip():
        return None  # blank lines are allowed between records
    try:
        record = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        problems.add("are not UTF-8 (save the file as UTF-8)", file, where)
        return None
    except ValueError:
        problems.add("are not valid JSON (each line must be one complete JSON object)", file, where)
        return None
    if not isinstance(record, dict):
        problems.add("are JSON but not objects (each line must be one {\"column\": value, ...} object)", file, where)
        return None
    return record
