"""prepare_data for prompts (format `prompts`, train.method grpo): prompt rows -> train.parquet / eval.parquet.

Each row has a `prompt`: a string (used as it is) or a list of {role, content} messages (TRL's conversational form,
rendered with data.chat_template and its generation prompt). Its other columns (`answer`, ...) are kept as one JSON
object per row in `columns`; train_adapter and evaluate_adapter hand them to the reward functions as keyword lists.
Written columns: prompt (the text TRL tokenizes), prompt_ids (int32: the tokenizer's ids of it, as TRL makes them,
for evaluation), columns (JSON). A prompt that fills data.max_seq_length leaves no room to answer: dropped and
counted. The split is by content hash, as for the other formats. Bad rows (an empty prompt, one that is neither text
nor messages, a column that is not JSON data) are collected and raised together.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from tasks.config import DataArgs
from tasks.prepare_data.overlap import Overlap
from tasks.prepare_data.preference import _renderer
from tasks.prepare_data.sources import Problems, RawChunk, decode


def write(args: DataArgs, tokenizer: Any, fmt: str, chunks: Iterator[RawChunk], problems: Problems, folder: Path,
          version: str, eval_chunks: Iterator[RawChunk] | None = None, eval_problems: Problems | None = None
          ) -> tuple[dict[str, Any], list[str]]:
    """Validate, tokenize and split the prompt rows into folder/train.parquet and eval.parquet; DataMetrics and a few
    eval prompts that are training prompts too (as preference.write)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    meta = {"qlora_pipeline": json.dumps({"stage": "prepare_data", "version": version, "format": fmt,
                                          "packed": False, "max_seq_length": args.max_seq_length})}
    schema = pa.schema([("prompt", pa.string()), ("prompt_ids", pa.list_(pa.int32())), ("columns", pa.string())],
                       metadata=meta)
    cut = int(args.eval_fraction * 2**64)
    stats = {"rows_in": 0, "dropped_prompt_too_long": 0, "conversational": 0}
    lengths: list[int] = []
    counts = {"train": [0, 0], "eval": [0, 0]}  # prompts, tokens
    render = _renderer(tokenizer, args.chat_template)
    shared = Overlap()
    every: set[str] = set()  # the columns besides prompt, of every row: what reward functions may read
    with pq.ParquetWriter(folder / "train.parquet", schema) as train, \
            pq.ParquetWriter(folder / "eval.parquet", schema) as evals:
        forced = None if eval_chunks is None else "train"
        eval_bad = eval_problems if eval_problems is not None else problems
        tagged = itertools.chain(((c, "eval", eval_bad) for c in eval_chunks or ()),
                                 ((c, forced, problems) for c in chunks))
        for chunk, split_of_all, bad in tagged:
            rows: dict[str, list[dict[str, Any]]] = {"train": [], "eval": []}
            keys: dict[str, list[int]] = {"train": [], "eval": []}
            for where, record in decode(chunk, args.column_mapping, bad):
                stats["rows_in"] += 1
                row = _row(record, render, bad, chunk.where, where, stats)
                if row is None:
                    continue
                every.update(k for k in record if k != "prompt")
                row["prompt_ids"] = tokenizer(row["prompt"])["input_ids"]
                lengths.append(len(row["prompt_ids"]))
                if len(row["prompt_ids"]) >= args.max_seq_length:
                    stats["dropped_prompt_too_long"] += 1
                    continue
                key = _hash(row)
                split = split_of_all or ("eval" if key < cut else "train")
                rows[split].append(row)
                keys[split].append(key)
                counts[split][0] += 1
                counts[split][1] += len(row["prompt_ids"])
            for split, file in (("train", train), ("eval", evals)):
                if rows[split]:
                    file.write_table(pa.Table.from_pylist(rows[split], schema=schema))
            if eval_chunks is not None:
                shared.add_eval(np.array(keys["eval"], dtype=np.uint64))
                shared.match(np.array(keys["train"], dtype=np.uint64),
                             functools.partial(_nth_prompt, rows["train"]))
    return {**_metrics(args, stats, lengths, counts, every), "eval_overlap": shared.count()}, shared.examples


def _row(record: dict[str, Any], render: Any, problems: Problems, file: str, where: str, stats: dict[str, int]
         ) -> dict[str, Any] | None:
    """{prompt (text), columns (JSON)}, or None after recording the row's problems."""
    prompt = record.get("prompt")
    others = {k: v for k, v in record.items() if k != "prompt"}
    bad = []
    if isinstance(prompt, list):
        if not all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt):
            bad.append("have a prompt list that is not {role, content} messages")
        elif not any(str(m.get("content") or "").strip() for m in prompt):
            bad.append("have an empty prompt (every row needs one)")
    elif not isinstance(prompt, str):
        bad.append("have a prompt that is neither text nor a list of messages" if prompt is not None
                   else "have an empty prompt (every row needs one)")
    elif not prompt.strip():
        bad.append("have an empty prompt (every row needs one)")
    text = None
    if not bad and isinstance(prompt, list):
        try:
            text = render([{"role": str(m["role"]), "content": str(m["content"])} for m in prompt], True)
            stats["conversational"] += 1
        except ValueError as exc:
            bad.append(f"cannot be rendered as a conversation: {exc}")
    try:
        columns = json.dumps(others, allow_nan=False, sort_keys=True)
    except (TypeError, ValueError):
        bad.append("have a column that is not JSON data (text, numbers, lists, objects; no NaN)")
    for problem in bad:
        problems.add(problem, file, where)
    if bad:
        return None
    return {"prompt": text if text is not None else prompt, "columns": columns}


def _hash(row: dict[str, Any]) -> int:
    text = row["prompt"] + "\x00" + row["columns"]
    return int.from_bytes(hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()[:8], "big")


def _nth_prompt(rows: list[dict[str, Any]], i: int) -> str:
    return rows[i]["prompt"]


def _metrics(args: DataArgs, stats: dict[str, int], lengths: list[int], counts: dict[str, list[int]],
             columns: set[str]) -> dict[str, Any]:
    seq = np.array(lengths or [0])
    kept = counts["train"][0] + counts["eval"][0]
    return {"format": "prompts", "completion_only_loss": True,
            "chat_template": args.chat_template if stats["conversational"] else None, "pack_examples": False,
            "rows_in": stats["rows_in"], "dropped_empty": 0,
            "dropped_prompt_too_long": stats["dropped_prompt_too_long"], "truncated": 0, "truncated_tokens": 0,
            "rows_out": kept, "train_examples": counts["train"][0], "eval_examples": counts["eval"][0],
            "train_rows": counts["train"][0], "truncation_rate": 0.0,
            **{f"len_p{q}": int(np.percentile(seq, q, method="inverted_cdf")) for q in (50, 90, 99)},
            "len_max": int(seq.max()), "len_min": int(seq.min()),
            "tokens": counts["train"][1] + counts["eval"][1], "train_label_tokens": 0,
            "padding_waste": round(1 - counts["train"][1] / max(counts["train"][0] * args.max_seq_length, 1), 4),
            "prompt_columns": sorted(columns)}
