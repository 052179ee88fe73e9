"""Tokenizer workers for prepare_data: a chunk of raw rows -> token arrays, in this process or in a pool.

A worker decodes the rows (JSON parsing included), renders each record into text segments
(tasks.formats), tokenizes all segments of the chunk in one batched call of the fast tokenizer and
assembles input_ids/labels with numpy, truncated to max_seq_length. Chunks come back in input order,
so the output does not depend on the number of workers. Workers get the fast tokenizer serialized and
import neither transformers nor torch (unless chat templates need them), so they start fast and stay small.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import multiprocessing
import os
import sys
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tasks.log import logger
from tasks.on_disk import disk
from tasks.prepare_data.formats import Segments, fold_system, to_segments
from tasks.prepare_data.sources import Problems, RawChunk, decode

_DESCRIBED: dict[tuple, dict[str, Any]] = {}
POOL_AFTER_CHUNKS = 8  # small data stays in this process: starting workers costs seconds (imports, tokenizer)


@dataclass(frozen=True)
class Settings:
    """What a worker needs to turn rows into tokens (picklable: it is sent to spawned workers)."""

    tokenizer_dir: str
    fmt: str
    column_mapping: dict[str, str]
    completion_only: bool
    max_len: int
    chat_template: str | None  # Jinja text for chat; None = the tokenizer's own
    prefix: list[int]  # special tokens before each example (BOS); none for chat: templates write their own
    eos: list[int]
    eos_text: str
    backend_json: str | None  # the fast tokenizer as loaded here, so workers need not import transformers
    fold_system: bool = False  # the chat template refuses a system role: tasks.formats.fold_system applies


def make_settings(tokenizer_dir: str, fmt: str, column_mapping: dict[str, str], completion_only: bool,
                  max_len: int, chat_template: str | None, saved: Path | None = None) -> Settings:
    """Settings for this tokenizer and format; loads the tokenizer into this process too. `saved`: a file that
    keeps what transformers says of the tokenizer across processes, named by the tokenizer's content."""
    # ctime too: a tokenizer file rewritten with its mtime put back (cp -p) is another tokenizer
    memo = (tokenizer_dir, *sorted((p.name, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
                                   for p in Path(tokenizer_dir).iterdir() for st in [p.stat()]))
    if memo not in _DESCRIBED and saved is not None and fmt != "chat" and saved.is_file():
        _DESCRIBED[memo] = json.loads(saved.read_text())
    if memo not in _DESCRIBED and (fmt == "chat" or _imports_transformers_anyway() or not _can_spawn()):
        _DESCRIBED[memo] = _describe(tokenizer_dir)
    elif memo not in _DESCRIBED:
        _DESCRIBED[memo] = _describe_in_helper(tokenizer_dir)
    facts = _DESCRIBED[memo]
    if saved is not None and not saved.is_file():
        saved.parent.mkdir(parents=True, exist_ok=True)
        disk.write_whole(saved, json.dumps(facts))  # a full disk leaves no temp file (the stage says so)
    settings = Settings(str(tokenizer_dir), fmt, column_mapping, completion_only, max_len, chat_template,
                        prefix=[] if fmt == "chat" else facts["prefix"], eos=facts["eos"],
                        eos_text=facts["eos_text"], backend_json=facts["backend_json"])
    init(settings, worker=False)
    if fmt == "chat" and refuses_system_role(_STATE["tokenizer"], chat_template):
        settings = dataclasses.replace(settings, fold_system=True)
        init(settings, worker=False)
    return settings


def refuses_system_role(tokenizer: Any, chat_template: str | None) -> bool:
    """True when the chat template renders a user turn but raises on a system message (Gemma's)."""
    def renders(messages: list[dict[str, str]]) -> bool:
        try:
            tokenizer.apply_chat_template(messages, chat_template=chat_template, tokenize=False)
        except Exception:  # noqa: BLE001 - jinja's raise_exception surfaces as a TemplateError
            return False
        return True

    user = {"role": "user", "content": "hi"}
    return renders([user]) and not renders([{"role": "system", "content": "be brief"}, user])


def _imports_transformers_anyway() -> bool:
    """True when this process has transformers already, or will: inside a flow run, whose next stage
    (prepare_model) loads the base model in this process, so a helper would import it a second time."""
    if "transformers" in sys.modules:
        return True
    from prefect.context import FlowRunContext

    return FlowRunContext.get() is not None


def _describe_in_helper(tokenizer_dir: str) -> dict[str, Any]:
    """_describe in a short-lived process: transformers imports torch (0.3-1 GB of RSS, seconds), which prepare_data
    alone does not need here."""
    helper = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    try:
        return helper.submit(_describe, tokenizer_dir).result()
    finally:
        helper.shutdown(wait=False)  # its exit (unloading torch) took 1.8 s that nothing here needs to wait for


def _describe(tokenizer_dir: str) -> dict[str, Any]:
    from tasks.models.loading import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir)
    probe = tokenizer("a")["input_ids"]
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    at = next(i for i in range(len(probe)) if probe[i:i + len(plain)] == plain)
    backend = getattr(tokenizer, "_tokenizer", None)
    return {"prefix": probe[:at], "eos": [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [],
            "eos_text": tokenizer.eos_token or "\x00", "backend_json": backend.to_str() if backend else None}


@dataclass
class Tokenized:
    """One chunk's output: kept examples concatenated, with per-example lengths, and its counts."""

    input_ids: np.ndarray  # int32
    labels: np.ndarray  # int32, -100 where not in the loss
    lengths: np.ndarray  # int64 per kept example, after truncation
    hashes: np.ndarray  # uint64 per kept example: the split key
    raw_lengths: np.ndarray  # int64 per non-empty example, before truncation
    rows: int = 0
    empty: int = 0
    prompt_too_long: int = 0
    truncated: int = 0
    tokens_cut: int = 0  # tokens lost to truncation, in the examples kept
    problems: Problems = field(default_factory=Problems)


_STATE: dict[str, Any] = {}


def init(settings: Settings, worker: bool = True) -> None:
    """Load the tokenizer once per process: from its serialized backend, or with transformers where needed."""
    if worker:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker: the pool is the parallelism
    tokenizer = backend = None
    if settings.fmt == "chat" or settings.backend_json is None:  # needs transformers: chat templates, slow tokenizers
        from tasks.models.loading import load_tokenizer

        tokenizer = load_tokenizer(settings.tokenizer_dir)
        backend = getattr(tokenizer, "_tokenizer", None)
    else:
        from tokenizers import Tokenizer

        backend = Tokenizer.from_str(settings.backend_json)
    _STATE.update(settings=settings, tokenizer=tokenizer, backend=backend)


def _render_chat(messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
    if _STATE["settings"].fold_system:
        messages = fold_system(messages)
    return _STATE["tokenizer"].apply_chat_template(
        messages, chat_template=_STATE["settings"].chat_template, tokenize=False,
        add_generation_prompt=add_generation_prompt)


def tokenize_chunk(chunk: RawChunk) -> Tokenized:
    """Decode, render, tokenize and truncate one chunk (in a worker or in this process)."""
    s: Settings = _STATE["settings"]
    out = Tokenized(*(np.zeros(0, t) for t in (np.int32, np.int32, np.int64, np.uint64, np.int64)))
    pieces: list[list[int] | None] = []  # per example: prefix, its segments' tokens, eos
    piece_example: list[int] = []
    piece_trained: list[bool] = []
    texts: list[str] = []
    slots: list[int] = []
    hashes: list[int] = []
    for where, record in decode(chunk, s.column_mapping, out.problems):
        out.rows += 1
        try:
            segments = to_segments(record, s.fmt, s.completion_only, _render_chat)
        except KeyError as exc:
            out.problems.add(f"lack column {exc.args[0]!r} (every row needs the format's columns; "
                             "rename others with data.column_mapping)", chunk.where, where)
            continue
        except Exception as exc:  # noqa: BLE001 - a row the format cannot read (bad messages, template error)
            out.problems.add(f"cannot be read as format {s.fmt!r}: {exc}", chunk.where, where)
            continue
        if segments is None:
            out.empty += 1
            continue
        example = len(hashes)
        hashes.append(_hash(segments))
        eos = s.eos if s.fmt != "chat" or not segments[-1][0].rstrip().endswith(s.eos_text) else []
        fixed: list[tuple[list[int], bool]] = [(s.prefix, not s.completion_only)]
        for text, trained in segments:
            slots.append(len(pieces) + len(fixed))
            fixed.append(([], trained))
            texts.append(text)
        fixed.append((eos, segments[-1][1]))
        for ids, trained in fixed:
            pieces.append(ids)
            piece_example.append(example)
            piece_trained.append(trained)
    for slot, ids in zip(slots, _encode(texts), strict=True):
        pieces[slot] = ids
    if hashes:
        _assemble(out, pieces, piece_example, piece_trained, len(hashes), s.max_len)
        out.hashes = np.array(hashes, dtype=np.uint64)[out.hashes]  # _assemble left the kept indices there
    return out


def detokenize(ids: list[int]) -> str:
    """Token ids as text, by the tokenizer make_settings loaded into this process (for messages)."""
    backend = _STATE.get("backend")
    if backend is not None:
        return backend.decode(ids, skip_special_tokens=True)
    return _STATE["tokenizer"].decode(ids, skip_special_tokens=True)


def _encode(texts: list[str]) -> list[list[int]]:
    backend = _STATE["backend"]
    if backend is None:  # a slow (Python) tokenizer
        return _STATE["tokenizer"](texts, add_special_tokens=False)["input_ids"]
    encode = getattr(backend, "encode_batch_fast", backend.encode_batch)  # _fast skips character offsets
    return [e.ids for e in encode(texts, add_special_tokens=False)]


def _hash(segments: Segments) -> int:
    text = "\x00".join(t for t, _ in segments)
    return int.from_bytes(hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()[:8], "big")


def _assemble(out: Tokenized, pieces: list[Any], piece_example: list[int], piece_trained: list[bool],
              n: int, max_len: int) -> None:
    # all in numpy: the Python loop above is per example, this is per token
    sizes = np.fromiter(map(len, pieces), np.int64, len(pieces))
    ids = np.fromiter(itertools.chain.from_iterable(pieces), np.int32, int(sizes.sum()))
    labels = np.where(np.repeat(np.array(piece_trained), sizes), ids, np.int32(-100)).astype(np.int32)
    length = np.bincount(np.array(piece_example), weights=sizes, minlength=n).astype(np.int64)
    position = np.arange(len(ids)) - np.repeat(np.cumsum(length) - length, length)
    ids, labels = ids[position < max_len], labels[position < max_len]
    kept_length = np.minimum(length, max_len)
    trained = np.bincount(np.repeat(np.arange(n), kept_length), weights=labels != -100, minlength=n)
    keep = trained > 0  # a prompt that fills max_seq_length leaves nothing to learn from
    token_keep = np.repeat(keep, kept_length)
    out.input_ids, out.labels, out.lengths = ids[token_keep], labels[token_keep], kept_length[keep]
    out.raw_lengths, out.hashes = length, np.flatnonzero(keep)
    out.truncated = int((length[keep] > max_len).sum())
    out.tokens_cut = int((length[keep] - kept_length[keep]).sum())
    out.prompt_too_long = int(n - keep.sum())


def _can_spawn() -> bool:
    # a spawned process re-imports __main__ from its file: impossible for `python - <script` (or a REPL's "<stdin>")
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    return path is None or os.path.isfile(path)


def tokenize_all(chunks: Iterator[RawChunk], settings: Settings, workers: int) -> Iterator[Tokenized]:
    """tokenize_chunk over chunks, in order: the first POOL_AFTER_CHUNKS here, the rest in a pool of workers.

    `settings` must come from make_settings in this process. tokenize_chunk reads the process's loaded settings, so
    they are loaded again here when another source's (data.eval_source in another format) were loaded since: the
    training rows were read with the eval set's format, and failed as bad rows of data.source."""
    chunks = iter(chunks)
    alone = workers <= 1 or not _can_spawn()
    for chunk in itertools.islice(chunks, None if alone else POOL_AFTER_CHUNKS):
        if _STATE.get("settings") is not settings:  # another source's were loaded since (an eval set in another format)
            init(settings, worker=False)
        yield tokenize_chunk(chunk)
    rest = next(chunks, None)
    if rest is None:
        return
    logger().info("prepare_data: more than %d chunks of rows: tokenizing in %d processes", POOL_AFTER_CHUNKS, workers)
    # spawn, not fork: the parent may hold threads (Prefect, tokenizers) that a fork would copy mid-lock
    context = multiprocessing.get_context("spawn")
    with context.Pool(workers, initializer=init, initargs=(settings,)) as pool:
        pending: deque[Any] = deque()
        for chunk in itertools.chain([rest], chunks):
            pending.append(pool.apply_async(tokenize_chunk, (chunk,)))
            if len(pending) >= workers + 2:  # bounded read-ahead: memory stays flat however big the data
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
