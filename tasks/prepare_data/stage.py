"""prepare_data: dataset -> formatted, tokenized train.parquet and eval.parquet.

Reads local .jsonl/.json/.csv/.parquet/.txt files (one, a folder or a glob), fsspec URLs, or a hub
dataset (id, config name, split with slicing, pinned to its resolved revision), and the base model's
tokenizer. Streams the rows in chunks through tokenizer workers on all cores and writes, into
runs_dir/prepare_data/<key>/, train.parquet and eval.parquet one row group per chunk (columns
input_ids and labels, int32 lists; prompt tokens are -100 in labels when training on completions
only; with data.pack_examples, train.parquet rows are packs with position_ids and seq_lengths too)
and manifest.json with the row counts by reason and token-length statistics. Bad data fails with one
UserError listing every problem, before any GPU work and without a manifest.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np
from prefect import task

from tasks.caching import stage_task_options
from tasks.config import DataArgs, ModelArgs
from tasks.errors import UserError
from tasks.limits import cpu_threads
from tasks.log import logger
from tasks.manifest import PREFERENCE_FORMATS, StageSpec, open_stage
from tasks.prepare_data import preference
from tasks.prepare_data.formats import CHAT_TEMPLATES, detect_format
from tasks.prepare_data.sources import Problems, columns, decode, fingerprint, read_chunks
from tasks.prepare_data.tokenization import Settings, Tokenized, make_settings, tokenize_all
from tasks.runtime import TOKENIZER_FILES, load_tokenizer, max_positions, model_fingerprint, model_path

VERSION = "2"
OUTPUTS = ["train.parquet", "eval.parquet"]


def spec(args: DataArgs, model: ModelArgs, runs_dir: Path) -> StageSpec:
    """Cache-key inputs: data settings, the data's bytes or hub commit, the tokenizer's files."""
    return StageSpec(
        stage="prepare_data", version=VERSION, runs_dir=runs_dir,
        params={"data": args.model_dump(), "tokenizer": {"source": model.base_model, "revision": model.revision}},
        fingerprint={"data": fingerprint(args),
                     **{f"tokenizer_{k}": v for k, v in
                        model_fingerprint(model.base_model, model.revision, only=TOKENIZER_FILES).items()}},
    )


@task(name="prepare_data", **stage_task_options(spec, retries=2))
def prepare_data(args: DataArgs, model: ModelArgs, runs_dir: Path) -> str:
    """Format and tokenize the dataset into train/eval Parquet files."""
    with open_stage(spec(args, model, runs_dir)) as stage:
        if stage.done:
            return str(stage.dir)
        problems = Problems()
        chunks = read_chunks(args, problems)
        first = next(chunks, None)
        found = columns(first, args.column_mapping) if first else []
        if not found:
            if first is not None:  # rows that are not records: say which lines and why, not "no rows"
                for _ in decode(first, args.column_mapping, problems):
                    pass
            problems.raise_if_any(args.source)
            raise UserError(f"data.source={args.source!r} holds no rows. Point it at a non-empty dataset.")
        fmt = detect_format(found, args.format)
        if fmt in PREFERENCE_FORMATS:  # pairs or rated answers: their own columns (TRL's)
            tokenizer = load_tokenizer(model_path(model.base_model, model.revision))
            metrics = preference.write(args, tokenizer, fmt, itertools.chain([first], chunks), problems, stage.dir,
                                       VERSION)
            problems.raise_if_any(args.source)
            _check(args, fmt, metrics)
            logger().info("prepare_data: %s format\n%s", fmt, _table(metrics, args.max_seq_length))
            stage.finish(OUTPUTS, metrics)
            return str(stage.dir)
        settings = _settings(args, model, fmt)
        logger().info("prepare_data: %s format, %s loss, max_seq_length %d", fmt,
                      "completion-only" if settings.completion_only else "full-text", settings.max_len)
        report = _Report(args.max_seq_length)
        cut = np.uint64(int(args.eval_fraction * 2**64))  # by content hash: reordering rows keeps the split
        with _Writer(stage.dir / "train.parquet", args.pack_examples, settings) as train, \
                _Writer(stage.dir / "eval.parquet", False, settings) as evals:
            for part in tokenize_all(itertools.chain([first], chunks), settings, _cores()):
                problems.merge(part.problems)
                report.add(part)
                train.write(part, part.hashes >= cut)
                evals.write(part, part.hashes < cut)
        problems.raise_if_any(args.source)
        _check_snapshot(args, stage.spec.fingerprint["data"])
        metrics = {"format": fmt, "completion_only_loss": settings.completion_only,
                   "chat_template": args.chat_template if fmt == "chat" else None,
                   "pack_examples": args.pack_examples, **report.metrics(train, evals)}
        _check(args, fmt, metrics)
        logger().info("prepare_data:\n%s", _table(metrics, args.max_seq_length))
        stage.finish(OUTPUTS, metrics)
        return str(stage.dir)


def _check_snapshot(args: DataArgs, keyed: str) -> None:
    """Fail when the data changed while it was read: the folder would hold rows its key does not cover."""
    now = fingerprint(args)
    if now != keyed:
        raise UserError(f"data.source={args.source!r} changed while prepare_data was reading it (its bytes no longer "
                        "match those the stage key was computed from), so nothing was written. Run again once the "
                        "data is no longer being written.")


def _settings(args: DataArgs, model: ModelArgs, fmt: str) -> Settings:
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
                             args.max_seq_length, template)
    if settings.fold_system:
        logger().info("prepare_data: the chat template has no system role: each system message goes before the next "
                      "user message, separated by a blank line (README: Data formats)")
    return settings


def _cores() -> int:
    """Tokenizer worker processes: this run's share of the host's cores (tasks/limits.py)."""
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
        offsets = np.concatenate([[0], np.cumsum(part.lengths)]).astype(np.int32)
        table = pa.table({name: pa.ListArray.from_arrays(offsets, values)
                          for name, values in (("input_ids", part.input_ids), ("labels", part.labels))}).filter(mask)
        self.examples += len(table)
        self.tokens += int(part.lengths[mask].sum())
        self.label_tokens += int(np.repeat(mask, part.lengths)[part.labels != -100].sum())
        if self.packing:
            table = _pack(table, self.max_len)
        self.rows += len(table)
        self.file.write_table(table.cast(self.schema))


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


class _Report:
    """Counts by reason and a histogram of token lengths (exact percentiles in memory that does not grow)."""

    def __init__(self, max_len: int) -> None:
        self.max_len = max_len
        self.counts = {"rows_in": 0, "dropped_empty": 0, "dropped_prompt_too_long": 0, "truncated": 0,
                       "truncated_tokens": 0}
        self.histogram = np.zeros(max_len + 1, dtype=np.int64)

    def add(self, part: Tokenized) -> None:
        for key, value in (("rows_in", part.rows), ("dropped_empty", part.empty),
                           ("dropped_prompt_too_long", part.prompt_too_long), ("truncated", part.truncated),
                           ("truncated_tokens", part.tokens_cut)):
            self.counts[key] += value
        if len(part.raw_lengths) and part.raw_lengths.max() >= len(self.histogram):
            self.histogram = np.pad(self.histogram, (0, int(part.raw_lengths.max()) + 1 - len(self.histogram)))
        self.histogram += np.bincount(part.raw_lengths, minlength=len(self.histogram))

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
    if m["train_examples"] == 0:
        raise UserError(
            f"No training examples left in {args.source} after filtering: {m['rows_in']} rows read, "
            f"{m['dropped_empty']} empty, {m['dropped_prompt_too_long']} with a prompt of max_seq_length tokens or "
            f"more, {m['eval_examples']} held out for eval. Check the data, or raise data.max_seq_length.")
    if args.eval_fraction > 0 and m["eval_examples"] == 0:
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
    return "\n".join(f"  {label:<38} {value}" for label, value in rows)
