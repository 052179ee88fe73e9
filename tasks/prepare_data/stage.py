"""prepare_data: dataset -> formatted, tokenized train.parquet and eval.parquet.

Reads local .jsonl/.json/.csv/.parquet/.txt files (one, a folder or a glob), fsspec URLs, or a hub
dataset (id, config name, split with slicing, pinned to its resolved revision), and the base model's
tokenizer. Streams the rows in chunks through tokenizer workers on all cores and writes, into
runs_dir/prepare_data/<key>/, train.parquet and eval.parquet one row group per chunk (columns
input_ids and labels, int32 lists; prompt tokens are -100 in labels when training on completions
only; with data.pack_examples, train.parquet rows are packs with position_ids and seq_lengths too)
and manifest.json with the row counts by reason and token-length statistics. A source of several files is
tokenized file by file into content-keyed parts (tasks/prepare_data/parts.py) that later runs reuse, and the
two files are assembled from them. With data.eval_source, eval.parquet is all of it and train.parquet all of
data.source; its examples that are training examples too are counted (tasks/prepare_data/overlap.py), warned about,
and fail the stage above data.max_eval_overlap. Bad data fails with one UserError listing every problem, before any
GPU work and without a manifest.
"""

from __future__ import annotations

import functools
import itertools
import json
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
from prefect import task

from tasks.config import DataArgs, ModelArgs
from tasks.errors import UserError
from tasks.hashing.keys import cache_key
from tasks.log import logger
from tasks.methods import data_kind
from tasks.models.loading import load_tokenizer
from tasks.models.sources import TOKENIZER_FILES, max_positions, model_fingerprint, model_path
from tasks.on_disk.caching import stage_task_options
from tasks.on_disk.folders import StageRun, StageSpec, open_stage
from tasks.on_disk.manifest import DataMetrics, read_manifest
from tasks.pool.cpus import cpu_threads
from tasks.prepare_data import overlap, parts, preference, prompts
from tasks.prepare_data.formats import CHAT_TEMPLATES, detect_format
from tasks.prepare_data.sources import Problems, RawChunk, columns, data_files, decode, fingerprint, is_hub, read_chunks
from tasks.prepare_data.tokenization import Settings, Tokenized, detokenize, make_settings, tokenize_all

VERSION = "2"
OUTPUTS = ["train.parquet", "eval.parquet"]
# where each input lies, not what it holds: out of the key (the fingerprint has the bytes or hub commit)
LOCATED = ("data.source", "data.eval_source", "data.allowed_roots", "tokenizer.source")
CHECKS = ("data.max_eval_overlap", "data.max_record_bytes")  # pass or fail the stage, change nothing it
# writes: out of the key


def spec(args: DataArgs, model: ModelArgs, runs_dir: Path) -> StageSpec:
    """Cache-key inputs: data settings, the data's (and eval data's) bytes or hub commit, the tokenizer's files."""
    evals = {"eval_data": fingerprint(_eval_args(args), "data.eval_source", runs_dir)} if args.eval_source else {}
    tokenizer = model_fingerprint(model.base_model, model.revision, only=TOKENIZER_FILES, runs_dir=runs_dir)
    return StageSpec(
        stage="prepare_data", version=VERSION, runs_dir=runs_dir, located=LOCATED, checks=CHECKS,
        params={"data": args.model_dump(), "tokenizer": {"source": model.base_model, "revision": model.revision}},
        fingerprint={"data": fingerprint(args, runs_dir=runs_dir), **evals,
                     **{f"tokenizer_{k}": v for k, v in tokenizer.items()}},
    )


@task(name="prepare_data", **stage_task_options(spec, retries=2))
def prepare_data(args: DataArgs, model: ModelArgs, runs_dir: Path) -> str:
    """Format and tokenize the dataset into train/eval Parquet files."""
    with open_stage(spec(args, model, runs_dir)) as stage:
        if stage.done:
            _check_reused(args, stage.dir)
            return str(stage.dir)
        train_src = _Source(args, "data.source")
        eval_src = _Source(_eval_args(args), "data.eval_source") if args.eval_source else None
        _check_same_kind(args, train_src, eval_src)
        write = _write_sft if data_kind(train_src.fmt) == "sequences" else _write_trl  # pairs, prompts: TRL's columns
        stage.finish(OUTPUTS, write(args, model, stage, train_src, eval_src))
        return str(stage.dir)


def _check_same_kind(args: DataArgs, train_src: _Source, eval_src: _Source | None) -> None:
    """Fail when data.eval_source holds another kind of example than data.source (pairs against sequences)."""
    fmt = train_src.fmt
    if eval_src is not None and data_kind(eval_src.fmt) != data_kind(fmt):
        raise UserError(f"data.eval_source={args.eval_source!r} is in the {eval_src.fmt} format and data.source "
                        f"in the {fmt} format: evaluation needs the kind of examples training has (preference "
                        "pairs for both, prompts for both, or instruction/chat/text for both). Point "
                        "data.eval_source at such data.")


def _write_trl(args: DataArgs, model: ModelArgs, stage: StageRun, train_src: _Source,
               eval_src: _Source | None) -> dict[str, Any]:
    """Pairs or rated answers (train.method dpo / kto; preference.py) or prompts (grpo; prompts.py) into
    train.parquet and eval.parquet in TRL's columns; their metrics."""
    fmt = train_src.fmt
    tokenizer = load_tokenizer(model_path(model.base_model, model.revision))
    writer = prompts.write if data_kind(fmt) == "prompts" else preference.write
    metrics, shared = writer(args, tokenizer, fmt, train_src.raw(), train_src.problems, stage.dir,
                                       VERSION, eval_src.raw() if eval_src else None,
                                       eval_src.problems if eval_src else None)
    _raise_problems(train_src, eval_src)
    _check(args, fmt, metrics)
    overlap.check(args, metrics["eval_overlap"], metrics["eval_examples"], shared)
    logger().info("prepare_data: %s format\n%s", fmt, _table(metrics, args.max_seq_length))
    return metrics


def _write_sft(args: DataArgs, model: ModelArgs, stage: StageRun, train_src: _Source,
               eval_src: _Source | None) -> dict[str, Any]:
    """Instruction, chat or text examples tokenized (per file into content-keyed parts where the source has several)
    into train.parquet and eval.parquet; their metrics."""
    fmt = train_src.fmt
    keyed = {k: v for k, v in stage.spec.fingerprint.items() if k.startswith("tokenizer_")}
    parts_dir = stage.spec.runs_dir / "prepare_data" / "parts"
    settings = _settings(args, model, fmt, parts_dir / f"tokenizer-{_tokenizer_key(keyed)}.json")
    logger().info("prepare_data: %s format, %s loss, max_seq_length %d", fmt,
                  "completion-only" if settings.completion_only else "full-text", settings.max_len)
    eval_settings = settings if eval_src is None or eval_src.fmt == fmt else _settings(args, model, eval_src.fmt)
    report = _Report(args.max_seq_length)
    trains = train_src.tokenized(settings, report, keyed, parts_dir)
    evals_in = eval_src.tokenized(eval_settings, report, keyed, parts_dir) if eval_src else None
    _raise_problems(train_src, eval_src)  # bad rows of files tokenized into parts, before writing
    cut = np.uint64(int(args.eval_fraction * 2**64))  # by content hash: reordering rows keeps the split
    shared = overlap.Overlap()  # with data.eval_source: its examples that training has too
    with _Writer(stage.dir / "train.parquet", args.pack_examples, settings) as train, \
            _Writer(stage.dir / "eval.parquet", False, settings) as evals:
        for part in evals_in or ():  # first: the eval set's hashes are what training examples are looked up in
            evals.write(part, np.ones(len(part.hashes), bool))
            shared.add_eval(part.hashes)
        for part in trains:
            train.write(part, part.hashes >= cut if evals_in is None else np.ones(len(part.hashes), bool))
            if evals_in is None:
                evals.write(part, part.hashes < cut)
            else:
                shared.match(part.hashes, functools.partial(_example_text, part))
    _raise_problems(train_src, eval_src)
    _check_snapshot(args, stage.spec.fingerprint["data"])
    if eval_src is not None:
        _check_snapshot(_eval_args(args), stage.spec.fingerprint["eval_data"], "data.eval_source")
    metrics = {"format": fmt, "completion_only_loss": settings.completion_only,
               "chat_template": args.chat_template if fmt == "chat" else None,
               "pack_examples": args.pack_examples, **report.metrics(train, evals),
               **_part_counts(train_src, eval_src), "eval_overlap": shared.count()}
    _check(args, fmt, metrics)
    overlap.check(args, metrics["eval_overlap"], metrics["eval_examples"], shared.examples)
    logger().info("prepare_data:\n%s", _table(metrics, args.max_seq_length))
    return metrics


def _check_reused(args: DataArgs, folder: Path) -> None:
    """data.max_eval_overlap is not in the key (it changes nothing the stage writes): a reused folder is held to this
    run's threshold by the overlap its manifest recorded."""
    made = read_manifest(folder)
    if made is not None and isinstance(made.metrics, DataMetrics):
        overlap.check(args, made.metrics.eval_overlap, made.metrics.eval_examples)


def _example_text(part: Tokenized, i: int) -> str:
    """The i-th example of a tokenized chunk as text (for messages)."""
    end = int(part.lengths[:i + 1].sum())
    return detokenize(part.input_ids[end - int(part.lengths[i]):end].tolist())


def _eval_args(args: DataArgs) -> DataArgs:
    """data.eval_source read as a source, with the section's other settings."""
    return args.model_copy(update={"source": args.eval_source, "eval_source": None})


class _Source:
    """One source's rows: probed for its format at once; then tokenized per file into parts (several files)
    or straight through (one file, a hub dataset)."""

    def __init__(self, args: DataArgs, field: str) -> None:
        self.args, self.field, self.problems = args, field, Problems()
        self.computed: int | None = None  # parts tokenized and reused, when the source has several files
        self.reused: int | None = None
        chunks = read_chunks(args, self.problems, field)
        first = next(chunks, None)
        found = columns(first, args.column_mapping) if first else []
        if not found:
            if first is not None:  # rows that are not records: say which lines and why, not "no rows"
                for _ in decode(first, args.column_mapping, self.problems):
                    pass
            self.problems.raise_if_any(args.source, field)
            raise UserError(f"{field}={args.source!r} holds no rows. Point it at a non-empty dataset.")
        self.fmt = detect_format(found, args.format, f"{field}={args.source!r}")
        self.files = None if is_hub(args.source) else data_files(args.source, field)
        if self.files is not None and len(self.files[1]) > 1:
            chunks.close()  # each file is read again on its own, if its part is not there yet
            self.problems, self._chunks = Problems(), None
        else:
            self._chunks = itertools.chain([first], chunks)

    def raw(self) -> Iterator[RawChunk]:
        """The rows in chunks, all files in order (preference data is not kept in parts)."""
        return self._chunks if self._chunks is not None else read_chunks(self.args, self.problems, self.field)

    def tokenized(self, settings: Settings, report: _Report, keyed: dict[str, str], parts_dir: Path
                  ) -> Iterator[Tokenized]:
        """Tokenized chunks in order, counted into the report; the parts of several files are made here, at once."""
        if self._chunks is not None:
            return self._straight(settings, report)
        fs, paths = self.files
        folders, self.computed = parts.prepare(fs, paths, settings, keyed, VERSION, parts_dir, self.problems,
                                               _cores(), self.args.max_record_bytes)
        self.reused = len(paths) - self.computed
        return self._from_parts(folders, report)

    def _straight(self, settings: Settings, report: _Report) -> Iterator[Tokenized]:
        for part in tokenize_all(self._chunks, settings, _cores()):
            self.problems.merge(part.problems)
            report.add(part)
            yield part

    def _from_parts(self, folders: list[Path], report: _Report) -> Iterator[Tokenized]:
        if self.problems.counts:
            return
        for folder in folders:
            report.merge(parts.read_part(folder))
            yield from parts.chunks_of(folder)


def _part_counts(*sources: _Source | None) -> dict[str, int]:
    used = [s for s in sources if s is not None and s.computed is not None]
    return {"parts_tokenized": sum(s.computed for s in used), "parts_reused": sum(s.reused for s in used)} if used \
        else {}


def _raise_problems(*sources: _Source | None) -> None:
    text = " ".join(s.problems.message(s.args.source, s.field) for s in sources if s is not None)
    if text.strip():
        raise UserError(text.strip())


def _check_snapshot(args: DataArgs, keyed: str, field: str = "data.source") -> None:
    """Fail when the data changed while it was read: the folder would hold rows its key does not cover."""
    now = fingerprint(args, field)
    if now != keyed:
        raise UserError(f"{field}={args.source!r} changed while prepare_data was reading it (its bytes no longer "
                        "match those the stage key was computed from), so nothing was written. Run again once the "
                        "data is no longer being written.")


def _tokenizer_key(keyed: dict[str, str]) -> str:
    # what transformers makes of the tokenizer's files may change with its version
    return cache_key([keyed, metadata.version("transformers")])


def _settings(args: DataArgs, model: ModelArgs, fmt: str, saved: Path | None = None) -> Settings:
    tokenizer_dir = model_path(model.base_model, model.revision, weights=False)  # the tokenizer is enough
    positions = max_positions(tokenizer_dir)
    if positions is not None and args.max_seq_length > positions:
        raise UserError(f"data.max_seq_length={args.max_seq_length} is more than the {positions} positions "
                        f"{model.base_model} covers (max_position_embeddings in its config.json). Set "
                        f"data.max_seq_length to {positions} or less.")
    template = CHAT_TEMPLATES.get(args.chat_template) if fmt == "chat" else None
    if fmt == "chat" and template is None and not load_tokenizer(tokenizer_dir).chat_template:
        raise UserError(f"The tokenizer of {model.base_model} has no chat template, so the chat format cannot "
                        f"be rendered. Set data.chat_template to one of {', '.join(CHAT_TEMPLATES)} "
                        "(README: Data formats).")
    completion_only = args.completion_only_loss if args.completion_only_loss is not None else fmt != "text"
    settings = make_settings(str(tokenizer_dir), fmt, dict(args.column_mapping), completion_only,
                             args.max_seq_length, template, saved)
    if settings.fold_system:
        logger().info("prepare_data: the chat template has no system role: each system message goes before the next "
                      "user message, separated by a blank line (README: Data formats)")
    return settings


def _cores() -> int:
    """Tokenizer worker processes: this run's share of the host's cores (tasks/pool/cpus.py)."""
    return cpu_threads("prepare_data (tokenizer workers)")


class _Writer:
    """One Parquet file written a row group per chunk; with packing, each chunk's examples are packed first."""

    def __init__(self, path: Path, packing: bool, settings: Settings) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        self.packing, self.max_len = packing, settings.max_len
        fields = ["input_ids", "labels", *(["position_ids", "seq_lengths"] if packing else [])]
        meta = {"qlora_pipeline": json.dumps({"stage": "prepare_data", "version": VERSION, "format": settings.fmt,
                                              "packed": packing, "max_seq_length": settings.max_len})}
        self.schema = pa.schema([(f, pa.list_(pa.int32())) for f in fields], metadata=meta)
        self.file = pq.ParquetWriter(path, self.schema)
        self.examples = self.rows = self.tokens = self.label_tokens = 0

    def __enter__(self) -> _Writer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.file.close()

    def write(self, part: Tokenized, mask: np.ndarray) -> None:
        import pyarrow as pa

        if not mask.any():
            return
        lengths, tokens = part.lengths[mask], np.repeat(mask, part.lengths)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        table = pa.table({name: _int32_lists(offsets, values[tokens])
                          for name, values in (("input_ids", part.input_ids), ("labels", part.labels))})
        self.examples += len(table)
        self.tokens += int(lengths.sum())
        self.label_tokens += int(tokens[part.labels != -100].sum())
        if self.packing:
            table = _pack(table, self.max_len)
        self.rows += len(table)
        self.file.write_table(table.cast(self.schema))


def _int32_lists(offsets: np.ndarray, values: np.ndarray) -> Any:
    """A list<int32> array over numpy buffers, built without pa.array(ndarray), which imports pandas (0.6 s)."""
    import pyarrow as pa

    def int32(a: np.ndarray) -> Any:
        return pa.Array.from_buffers(pa.int32(), len(a), [None, pa.py_buffer(np.ascontiguousarray(a, np.int32))])

    return pa.ListArray.from_arrays(int32(offsets), int32(values))


def _pack(table: Any, max_len: int) -> Any:
    """Best-fit-decreasing packing (trl's), with position ids restarting at each example."""
    import pyarrow as pa
    from datasets import Dataset
    from trl.data_utils import pack_dataset

    packed = pack_dataset(Dataset(table), max_len, strategy="bfd", map_kwargs={"batch_size": len(table)}).data.table
    lengths = packed.column("seq_lengths").combine_chunks()
    sizes = lengths.flatten().to_numpy()
    positions = np.arange(sizes.sum()) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    labels = packed.column("labels").combine_chunks()
    # the first token of each example would be predicted from the previous example's last: not a label
    flat = np.where(positions == 0, -100, labels.flatten().to_numpy()).astype(np.int32)
    return pa.table({
        "input_ids": packed.column("input_ids").combine_chunks(),
        "labels": pa.ListArray.from_arrays(labels.offsets, flat),
        "position_ids": pa.ListArray.from_arrays(labels.offsets, positions.astype(np.int32)),
        "seq_lengths": lengths,
    })


class _Report(parts.Tally):
    """The tally of every chunk or part, and the DataMetrics drawn from it and the writers."""

    def __init__(self, max_len: int) -> None:
        super().__init__()
        self.max_len = max_len

    def metrics(self, train: _Writer, evals: _Writer) -> dict[str, Any]:
        rendered = int(self.histogram.sum())
        cumulative = np.cumsum(self.histogram)
        at = {q: int(np.searchsorted(cumulative, q / 100 * rendered)) if rendered else 0 for q in (50, 90, 99)}
        kept = train.examples + evals.examples
        return {**self.counts, "rows_out": kept, "train_examples": train.examples, "eval_examples": evals.examples,
                "train_rows": train.rows, "truncation_rate": round(self.counts["truncated"] / max(kept, 1), 4),
                "len_p50": at[50], "len_p90": at[90], "len_p99": at[99],
                "len_max": int(np.flatnonzero(self.histogram)[-1]) if rendered else 0,
                "len_min": int(np.flatnonzero(self.histogram)[0]) if rendered else 0,
                "tokens": train.tokens + evals.tokens, "train_label_tokens": train.label_tokens,
                # share of a [rows x max_seq_length] batch that would be padding
                "padding_waste": round(1 - train.tokens / max(train.rows * self.max_len, 1), 4)}


def _check(args: DataArgs, fmt: str, m: dict[str, Any]) -> None:
    if fmt != "text" and m["dropped_empty"] > args.max_empty_fraction * m["rows_in"]:
        raise UserError(
            f"{m['dropped_empty']} of {m['rows_in']} rows ({m['dropped_empty'] / m['rows_in']:.0%}) have an empty or "
            f"whitespace-only response, more than data.max_empty_fraction={args.max_empty_fraction}. Check that "
            "the response column is the right one (data.column_mapping, data.format), or raise "
            "data.max_empty_fraction.")
    if m["len_min"] > args.max_seq_length:
        raise UserError(
            f"Every example is longer than data.max_seq_length={args.max_seq_length} tokens (shortest {m['len_min']}, "
            f"median {m['len_p50']}). Raise data.max_seq_length (to about {m['len_p90']} to keep 90% whole).")
    if args.eval_source and m["eval_examples"] == 0:
        raise UserError(
            f"data.eval_source={args.eval_source!r} yields no eval examples: every row is empty or has a prompt of "
            "max_seq_length tokens or more. Point it at held-out examples in the format of data.source, or raise "
            "data.max_seq_length.")
    if m["train_examples"] == 0:
        raise UserError(
            f"No training examples left in {args.source} after filtering: {m['rows_in']} rows read, "
            f"{m['dropped_empty']} empty, {m['dropped_prompt_too_long']} with a prompt of max_seq_length tokens or "
            f"more, {m['eval_examples']} held out for eval. Check the data, or raise data.max_seq_length.")
    if not args.eval_source and m["eval_examples"] == 0:
        raise UserError(
            f"No eval examples: data.eval_fraction={args.eval_fraction} of {m['rows_out']} examples held out none. "
            "Raise data.eval_fraction or add data.")


def _table(m: dict[str, Any], max_len: int) -> str:
    rows = [("rows read", f"{m['rows_in']:,}"),
            ("dropped: empty response/text", f"{m['dropped_empty']:,}"),
            ("dropped: prompt fills max_seq_length", f"{m['dropped_prompt_too_long']:,}"),
            ("examples kept (train / eval)", f"{m['rows_out']:,} ({m['train_examples']:,} / {m['eval_examples']:,})"),
            ("truncated to max_seq_length", f"{m['truncated']:,} ({m['truncation_rate']:.1%}) at {max_len}, "
             f"cutting {m['truncated_tokens'] / max(m['tokens'] + m['truncated_tokens'], 1):.1%} of the tokens"),
            ("tokens per example p50/p90/p99/max",
             f"{m['len_p50']} / {m['len_p90']} / {m['len_p99']} / {m['len_max']}"),
            ("train rows" + (" (packed)" if m["pack_examples"] else ""), f"{m['train_rows']:,}"),
            ("padding waste at max_seq_length", f"{m['padding_waste']:.1%}"),
            ("tokens written", f"{m['tokens']:,}")]
    if m.get("parts_tokenized") is not None:
        rows.append(("files tokenized / reused", f"{m['parts_tokenized']:,} / {m['parts_reused']:,}"))
    return "\n".join(f"  {label:<38} {value}" for label, value in rows)
