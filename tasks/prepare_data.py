"""prepare_data: dataset -> formatted, tokenized train.parquet and eval.parquet.

Reads a local .jsonl/.json/.csv/.parquet file or a hub dataset (id, config name, split with slicing,
pinned to its resolved revision) and the base model's tokenizer. Writes, into
runs_dir/prepare_data/<key>/, train.parquet and eval.parquet (columns input_ids and labels, int32
lists; prompt tokens are -100 in labels when training on completions only) and manifest.json with
the row counts by reason and token-length statistics.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from prefect import task

from tasks.caching import stage_task_options
from tasks.config import DataArgs, ModelArgs
from tasks.errors import UserError
from tasks.formats import detect_format, to_prompt_completion
from tasks.log import logger
from tasks.manifest import StageSpec, file_sha256, open_stage
from tasks.runtime import (
    TOKENIZER_FILES,
    is_local,
    load_tokenizer,
    model_fingerprint,
    model_path,
    resolve_hub_revision,
)

VERSION = "1"
LOCAL_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")
BATCH = 1000  # records tokenized per tokenizer call


def spec(args: DataArgs, model: ModelArgs, runs_dir: Path) -> StageSpec:
    """Cache-key inputs: data settings, the data's bytes or hub commit, the tokenizer's files."""
    return StageSpec(
        stage="prepare_data", version=VERSION, runs_dir=runs_dir,
        params={"data": args.model_dump(), "tokenizer": {"source": model.base_model, "revision": model.revision}},
        fingerprint={"data": _data_fingerprint(args),
                     **{f"tokenizer_{k}": v for k, v in
                        model_fingerprint(model.base_model, model.revision, only=TOKENIZER_FILES).items()}},
    )


@task(name="prepare_data", **stage_task_options(spec, retries=2))
def prepare_data(args: DataArgs, model: ModelArgs, runs_dir: Path) -> str:
    """Format and tokenize the dataset into train/eval Parquet files."""
    with open_stage(spec(args, model, runs_dir)) as stage:
        if stage.done:
            return str(stage.dir)
        records = _read_records(args)
        fmt = detect_format(records[0].keys() if records else [], args.format)
        completion_only = args.completion_only_loss if args.completion_only_loss is not None else fmt != "text"
        pairs, dropped = _to_pairs(records, fmt)
        tokenizer = load_tokenizer(model_path(model.base_model, model.revision))
        rows, counts = _tokenize(pairs, tokenizer, args.max_seq_length, completion_only)
        train, evals = _split(rows, args.eval_fraction)
        if not train:
            raise UserError(f"No training examples left in {args.source} after filtering: {counts}.")
        _write_parquet(stage.dir / "train.parquet", train)
        _write_parquet(stage.dir / "eval.parquet", evals)
        metrics = {"format": fmt, "completion_only_loss": completion_only, "rows_in": len(records),
                   "dropped_empty": dropped, **counts, "train_examples": len(train),
                   "eval_examples": len(evals), **_length_stats(rows)}
        logger().info("prepare_data: %s", json.dumps(metrics))
        stage.finish(["train.parquet", "eval.parquet"], metrics)
        return str(stage.dir)


def _data_fingerprint(args: DataArgs) -> str:
    if is_local(args.source):
        return file_sha256(_local_file(args.source))
    return f"hub:{args.source}@{resolve_hub_revision(args.source, args.revision, repo_type='dataset')}"


def _local_file(source: str) -> Path:
    path = Path(source).expanduser()
    if not path.is_file():
        raise UserError(f"data.source={source!r}: no such file. Give a {'/'.join(LOCAL_SUFFIXES)} file "
                        "or a Hugging Face hub dataset id such as databricks/databricks-dolly-15k.")
    if path.suffix not in LOCAL_SUFFIXES:
        raise UserError(f"data.source={source!r}: unsupported file type {path.suffix!r}; "
                        f"use one of {', '.join(LOCAL_SUFFIXES)}.")
    return path


def _read_records(args: DataArgs) -> list[dict[str, Any]]:
    if not is_local(args.source):
        return _read_hub(args)
    path = _local_file(args.source)
    if path.suffix == ".jsonl":
        return _read_jsonl(path)
    import pandas as pd

    try:
        if path.suffix == ".csv":
            frame = pd.read_csv(path, dtype=str, keep_default_na=False, encoding="utf-8")
        elif path.suffix == ".json":
            frame = pd.read_json(path, dtype=False)
        else:
            frame = pd.read_parquet(path)
    except (ValueError, UnicodeDecodeError, pd.errors.ParserError) as exc:
        raise UserError(f"data.source={args.source!r} could not be read as {path.suffix}: {exc}") from exc
    return frame.to_dict(orient="records")


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    records, bad = [], []
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, ValueError):
                bad.append(number)
                continue
            if not isinstance(record, dict):
                bad.append(number)
                continue
            records.append(record)
    if bad:
        shown = ", ".join(map(str, bad[:10])) + (" ..." if len(bad) > 10 else "")
        raise UserError(f"{path}: {len(bad)} line(s) are not UTF-8 JSON objects (lines {shown}). "
                        "Fix or remove them; each line must be one JSON object.")
    return records


def _read_hub(args: DataArgs) -> list[dict[str, Any]]:
    from datasets import load_dataset

    revision = resolve_hub_revision(args.source, args.revision, repo_type="dataset")
    dataset = load_dataset(args.source, args.name, split=args.split, revision=revision)
    return dataset.to_list()


def _to_pairs(records: list[dict[str, Any]], fmt: str) -> tuple[list[tuple[str, str]], int]:
    pairs = [to_prompt_completion(r, fmt) for r in records]
    kept = [(p, c) for p, c in pairs if c.strip()]
    return kept, len(pairs) - len(kept)


def _tokenize(pairs: list[tuple[str, str]], tokenizer: Any, max_len: int, completion_only: bool
              ) -> tuple[list[dict[str, Any]], dict[str, int]]:
    rows: list[dict[str, Any]] = []
    truncated = no_labels = 0
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    for start in range(0, len(pairs), BATCH):
        chunk = pairs[start:start + BATCH]
        prompts = tokenizer([p for p, _ in chunk], add_special_tokens=True)["input_ids"]
        completions = tokenizer([c for _, c in chunk], add_special_tokens=False)["input_ids"]
        for (prompt_text, completion_text), p_ids, c_ids in zip(chunk, prompts, completions, strict=True):
            ids = p_ids + c_ids + eos
            labels = ([-100] * len(p_ids) if completion_only else p_ids) + c_ids + eos
            if len(ids) > max_len:
                truncated += 1
                ids, labels = ids[:max_len], labels[:max_len]
            if all(label == -100 for label in labels):
                no_labels += 1  # the prompt alone fills max_seq_length: nothing to learn from
                continue
            rows.append({"input_ids": ids, "labels": labels, "_hash": _example_hash(prompt_text, completion_text)})
    return rows, {"truncated": truncated, "dropped_prompt_too_long": no_labels}


def _example_hash(prompt: str, completion: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{prompt}\x00{completion}".encode()).digest()[:8], "big")


def _split(rows: list[dict[str, Any]], eval_fraction: float) -> tuple[list[dict], list[dict]]:
    # by content hash, so the split does not change when rows are reordered or appended
    cut = int(eval_fraction * 2**64)
    train = [r for r in rows if r["_hash"] >= cut]
    evals = [r for r in rows if r["_hash"] < cut]
    return train, evals


def _write_parquet(path: Path, rows: list[dict[str, Any]]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({
        "input_ids": pa.array([r["input_ids"] for r in rows], type=pa.list_(pa.int32())),
        "labels": pa.array([r["labels"] for r in rows], type=pa.list_(pa.int32())),
    })
    pq.write_table(table, path)


def _length_stats(rows: list[dict[str, Any]]) -> dict[str, int]:
    import numpy as np

    lengths = np.array([len(r["input_ids"]) for r in rows] or [0])
    p50, p90, p99 = (int(np.percentile(lengths, q)) for q in (50, 90, 99))
    return {"tokens": int(lengths.sum()), "len_p50": p50, "len_p90": p90, "len_p99": p99,
            "len_max": int(lengths.max())}
