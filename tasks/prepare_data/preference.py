"""prepare_data for preference data: `preference` (prompt, chosen, rejected) and `unpaired_preference` (prompt,
completion, label) -> train.parquet / eval.parquet in the columns TRL's DPOTrainer and KTOTrainer read
pre-tokenized: prompt_ids, chosen_ids, rejected_ids (int32 lists), or prompt_ids, completion_ids, label (bool).

Each field is a string (TRL's standard form: the prompt as it is, the answers appended) or a list of
{role, content} messages (TRL's conversational form, rendered with data.chat_template). Prompt and answers are
tokenized apart and joined, like the SFT formats: the tokenizer's BOS starts the prompt (chat templates write
their own), its EOS ends each answer. A pair whose prompt alone fills data.max_seq_length is dropped (counted);
longer answers are cut at the end (counted). The split is by content hash, as for SFT. Bad rows (an empty
prompt, a missing answer, chosen == rejected, a label that is not true/false) are collected and raised together.
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
from tasks.prepare_data.formats import CHAT_TEMPLATES
from tasks.prepare_data.overlap import Overlap, preference_text
from tasks.prepare_data.sources import Problems, RawChunk, decode

ANSWERS = {"preference": ("chosen", "rejected"), "unpaired_preference": ("completion",)}
_LABELS = {True: True, False: False, "true": True, "false": False, "1": True, "0": False}  # 1 == True, 0 == False


def write(args: DataArgs, tokenizer: Any, fmt: str, chunks: Iterator[RawChunk], problems: Problems, folder: Path,
          version: str, eval_chunks: Iterator[RawChunk] | None = None, eval_problems: Problems | None = None
          ) -> tuple[dict[str, Any], list[str]]:
    """Validate, tokenize and split the rows into folder/train.parquet and eval.parquet; returns DataMetrics and a
    few eval examples that are training examples too (tasks/prepare_data/overlap.py). With eval_chunks
    (data.eval_source), every row of `chunks` trains and every row of eval_chunks evaluates; their bad rows go to
    eval_problems."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    answers = ANSWERS[fmt]
    list_type = pa.list_(pa.int32())
    fields = [(f"{c}_ids", list_type) for c in ("prompt", *answers)] + ([("label", pa.bool_())] if fmt ==
                                                                        "unpaired_preference" else [])
    meta = {"qlora_pipeline": json.dumps({"stage": "prepare_data", "version": version, "format": fmt,
                                          "packed": False, "max_seq_length": args.max_seq_length})}
    schema = pa.schema(fields, metadata=meta)
    cut = int(args.eval_fraction * 2**64)
    stats = {"rows_in": 0, "dropped_prompt_too_long": 0, "truncated": 0, "truncated_tokens": 0, "conversational": 0}
    lengths: list[int] = []
    counts = {"train": [0, 0, 0], "eval": [0, 0, 0]}  # examples, tokens, answer tokens
    render = _renderer(tokenizer, args.chat_template)
    shared = Overlap()  # with eval_chunks: eval examples that training has too
    with pq.ParquetWriter(folder / "train.parquet", schema) as train, \
            pq.ParquetWriter(folder / "eval.parquet", schema) as evals:
        forced = None if eval_chunks is None else "train"  # None: split by content hash
        # the eval set first: its hashes are what the training examples are looked up in
        eval_bad = eval_problems if eval_problems is not None else problems
        tagged = itertools.chain(((c, "eval", eval_bad) for c in eval_chunks or ()),
                                 ((c, forced, problems) for c in chunks))
        for chunk, split_of_all, bad in tagged:
            rows: dict[str, list[Any]] = {"train": [], "eval": []}
            keys: dict[str, list[int]] = {"train": [], "eval": []}
            shown: list[dict[str, Any]] = []  # the texts of the training rows, for the overlap's examples
            for where, record in decode(chunk, args.column_mapping, bad):
                stats["rows_in"] += 1
                texts = _texts(record, fmt, render, bad, chunk.where, where)
                if texts is None:
                    continue
                conversational = texts.pop("conversational")
                stats["conversational"] += conversational
                row = _tokenize(tokenizer, texts, answers, conversational, args.max_seq_length, stats, lengths)
                if row is None:
                    continue
                key = _hash(texts)
                split = split_of_all or ("eval" if key < cut else "train")
                rows[split].append(row)
                keys[split].append(key)
                if split == "train":
                    shown.append(texts)
                answer_tokens = sum(len(row[f"{a}_ids"]) for a in answers)
                counts[split][0] += 1
                counts[split][1] += len(row["prompt_ids"]) * len(answers) + answer_tokens
                counts[split][2] += answer_tokens
            for split, file in (("train", train), ("eval", evals)):
                if rows[split]:
                    file.write_table(pa.Table.from_pylist(rows[split], schema=schema))
            if eval_chunks is not None:
                shared.add_eval(np.array(keys["eval"], dtype=np.uint64))
                texts_of = functools.partial(_nth_text, shown)
                shared.match(np.array(keys["train"], dtype=np.uint64), texts_of)
    return {**_metrics(fmt, args, stats, lengths, counts), "eval_overlap": shared.count()}, shared.examples


def _nth_text(rows: list[dict[str, Any]], i: int) -> str:
    return preference_text(rows[i])


def _renderer(tokenizer: Any, chat_template: str) -> Any:
    template = CHAT_TEMPLATES.get(chat_template)

    def render(messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        if template is None and not tokenizer.chat_template:
            raise ValueError("the tokenizer has no chat template; set data.chat_template to "
                             + " or ".join(CHAT_TEMPLATES))
        return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    return render


def _texts(record: dict[str, Any], fmt: str, render: Any, problems: Problems, file: str, where: str
           ) -> dict[str, Any] | None:
    """{prompt, answer columns..., label?, conversational} as strings, or None after recording the row's problems."""
    bad = []
    prompt = record.get("prompt")
    conversational = isinstance(prompt, list)
    if _empty(prompt):
        bad.append("have an empty prompt (every row needs one)")
    answers = {a: record.get(a) for a in ANSWERS[fmt]}
    for name, value in answers.items():
        if _empty(value):
            bad.append(f"lack a {name} answer (missing or empty)")
    if fmt == "preference" and not bad and _same(answers["chosen"], answers["rejected"]):
        bad.append("have chosen == rejected (nothing to prefer: drop the row or fix the answer)")
    label = record.get("label")
    if fmt == "unpaired_preference" and (isinstance(label, float) or _LABELS.get(
            label.lower() if isinstance(label, str) else label) is None):
        bad.append("have a label that is not true or false")
    if not bad and conversational:
        try:
            texts = _render_conversation(prompt, answers, render)
        except ValueError as exc:
            bad.append(f"cannot be rendered as a conversation: {exc}")
    elif not bad:
        texts = {"prompt": str(prompt), **{k: str(v) for k, v in answers.items()}}
    for problem in bad:
        problems.add(problem, file, where)
    if bad:
        return None
    if fmt == "unpaired_preference":
        texts["label"] = _LABELS[label.lower() if isinstance(label, str) else label]
    return {**texts, "conversational": conversational}


def _empty(value: Any) -> bool:
    if isinstance(value, list):
        return not any(isinstance(m, dict) and str(m.get("content") or "").strip() for m in value)
    return value is None or not str(value).strip()


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, list) and isinstance(b, list):
        return [str(m.get("content", "")).strip() for m in a] == [str(m.get("content", "")).strip() for m in b]
    return str(a).strip() == str(b).strip()


def _render_conversation(prompt: Any, answers: dict[str, Any], render: Any) -> dict[str, str]:
    """TRL's conversational form: the prompt's messages, then each answer's; the answer is what its messages add."""
    for value in (prompt, *answers.values()):
        if not isinstance(value, list) or not all(isinstance(m, dict) and "role" in m and "content" in m
                                                  for m in value):
            raise ValueError("prompt and answers must all be lists of {role, content} messages")
    head = render(prompt, True)
    texts = {"prompt": head}
    for name, messages in answers.items():
        full = render(prompt + messages, False)
        if not full.startswith(head):
            raise ValueError("the chat template renders the conversation differently from its prompt")
        texts[name] = full[len(head):]
    return texts


def _hash(texts: dict[str, Any]) -> int:
    text = "\x00".join(str(v) for k, v in texts.items() if k != "label")
    return int.from_bytes(hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()[:8], "big")


def _tokenize(tokenizer: Any, texts: dict[str, Any], answers: tuple[str, ...], conversational: bool, max_len: int,
              stats: dict[str, int], lengths: list[int]) -> dict[str, Any] | None:
    prefix = [] if conversational or tokenizer.bos_token_id is None else _bos(tokenizer)
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    encoded = tokenizer([texts[k] for k in ("prompt", *answers)], add_special_tokens=False)["input_ids"]
    prompt = prefix + encoded[0]
    row: dict[str, Any] = {"prompt_ids": prompt}
    lengths.append(len(prompt) + max(len(ids) + len(eos) for ids in encoded[1:]))
    if len(prompt) >= max_len:
        stats["dropped_prompt_too_long"] += 1
        return None
    room = max_len - len(prompt)
    cut = False
    for name, ids in zip(answers, encoded[1:], strict=True):
        ends = eos if not (eos and texts[name].rstrip().endswith(tokenizer.eos_token)) else []
        full = ids + ends
        row[f"{name}_ids"] = full[:room]
        if len(full) > room:
            cut = True
            stats["truncated_tokens"] += len(full) - room
    stats["truncated"] += cut
    if "label" in texts:
        row["label"] = texts["label"]
    return row


def _bos(tokenizer: Any) -> list[int]:
    probe = tokenizer("a")["input_ids"]
    return probe[:1] if probe and probe[0] == tokenizer.bos_token_id else []


def _metrics(fmt: str, args: DataArgs, stats: dict[str, int], lengths: list[int], counts: dict[str, list[int]]
             ) -> dict[str, Any]:
    seq = np.array(lengths or [0])
    kept = counts["train"][0] + counts["eval"][0]
    sequences = counts["train"][0] * len(ANSWERS[fmt])
    return {"format": fmt, "completion_only_loss": True,
            "chat_template": args.chat_template if stats["conversational"] else None, "pack_examples": False,
            "rows_in": stats["rows_in"], "dropped_empty": 0,
            "dropped_prompt_too_long": stats["dropped_prompt_too_long"],
            "truncated": stats["truncated"], "truncated_tokens": stats["truncated_tokens"], "rows_out": kept,
            "train_examples": counts["train"][0], "eval_examples": counts["eval"][0], "train_rows": counts["train"][0],
            "truncation_rate": round(stats["truncated"] / max(kept, 1), 4),
            **{f"len_p{q}": int(np.percentile(seq, q, method="inverted_cdf")) for q in (50, 90, 99)},
            "len_max": int(seq.max()), "len_min": int(seq.min()),
            "tokens": counts["train"][1] + counts["eval"][1], "train_label_tokens": counts["train"][2],
            "padding_waste": round(1 - counts["train"][1] / max(sequences * args.max_seq_length, 1), 4)}
