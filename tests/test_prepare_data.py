"""prepare_data alone, through .fn(): every source and format on data the test writes, and the report."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tasks.config import EMBEDDED_MODEL, DataArgs, ModelArgs
from tasks.on_disk.manifest import read_manifest
from tasks.on_disk.parquet_dataset import ParquetExamples
from tasks.prepare_data.formats import CONTEXT_TEMPLATE, INSTRUCTION_TEMPLATE, RESPONSE_HEADER
from tasks.prepare_data.stage import prepare_data, spec

TOKENIZER = None


def tokenizer() -> Any:
    global TOKENIZER
    if TOKENIZER is None:
        from tasks.models.loading import load_tokenizer

        TOKENIZER = load_tokenizer(EMBEDDED_MODEL)
    return TOKENIZER


def dolly(n: int = 40, **extra: Any) -> list[dict[str, Any]]:
    return [{"instruction": f"Question {i}: what is {i} plus one?", "context": "" if i % 2 else f"Facts about {i}.",
             "response": f"It is {i + 1}.", **extra} for i in range(n)]


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def run(tmp_path: Path, source: Path | str, model: ModelArgs | None = None, **data: Any) -> dict[str, Any]:
    """Run the stage; return its manifest plus both splits as lists of rows."""
    folder = Path(prepare_data.fn(DataArgs(source=str(source), **data), model or ModelArgs(), tmp_path / "runs"))
    manifest = read_manifest(folder)
    assert manifest is not None
    assert sorted(p.name for p in folder.iterdir()) == [".hashes.json", "eval.parquet", "manifest.json",
                                                         "train.parquet"]
    return {**manifest.model_dump(), "dir": folder, "train": pq.read_table(folder / "train.parquet").to_pylist(),
            "eval": pq.read_table(folder / "eval.parquet").to_pylist()}


def rows(out: dict[str, Any]) -> list[dict[str, Any]]:
    return out["train"] + out["eval"]


def decoded_labels(row: dict[str, Any]) -> str:
    return tokenizer().decode([t for t in row["labels"] if t != -100])


def fails(tmp_path: Path, source: Path | str, *fragments: str, **data: Any) -> str:
    """The stage raises a UserError whose message holds every fragment, and leaves no manifest."""
    from tasks.errors import UserError

    with pytest.raises(UserError) as info:
        prepare_data.fn(DataArgs(source=str(source), **data), ModelArgs(), tmp_path / "failed-runs")
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, message
    assert not list((tmp_path / "failed-runs").glob("prepare_data/*/manifest.json"))
    return message


# ---- sources -------------------------------------------------------------------------------------------


def test_jsonl_dolly_masks_the_prompt_and_trains_on_the_response(tmp_path: Path) -> None:
    out = run(tmp_path, write_jsonl(tmp_path / "d.jsonl", dolly()))
    m = out["metrics"]
    assert (m["format"], m["completion_only_loss"], m["rows_in"], m["rows_out"]) == ("dolly", True, 40, 40)
    assert m["train_examples"] + m["eval_examples"] == 40 and m["eval_examples"] > 0
    row = next(r for r in rows(out) if tokenizer().decode(r["input_ids"]).startswith(
        INSTRUCTION_TEMPLATE.format(instruction="Question 4: what is 4 plus one?")))
    text = tokenizer().decode(row["input_ids"])
    assert CONTEXT_TEMPLATE.format(context="Facts about 4.") in text and RESPONSE_HEADER in text
    assert decoded_labels(row) == "It is 5." + tokenizer().eos_token
    assert row["input_ids"][-1] == tokenizer().eos_token_id
    assert len(ParquetExamples(out["dir"] / "train.parquet")) == m["train_examples"]  # training's reader


def test_json_array_alpaca(tmp_path: Path) -> None:
    records = [{"instruction": f"Add {i} and 1.", "input": "" if i % 3 else "numbers", "output": f"{i + 1}"}
               for i in range(30)]
    (tmp_path / "a.json").write_text(json.dumps(records, indent=1))
    out = run(tmp_path, tmp_path / "a.json")
    assert out["metrics"]["format"] == "alpaca" and out["metrics"]["rows_out"] == 30
    row = next(r for r in rows(out) if "Add 3 and 1." in tokenizer().decode(r["input_ids"]))
    assert "### Context:\nnumbers" in tokenizer().decode(row["input_ids"])
    assert decoded_labels(row) == "4" + tokenizer().eos_token


def test_json_lines_in_a_json_file(tmp_path: Path) -> None:
    out = run(tmp_path, write_jsonl(tmp_path / "d.json", dolly(12)), eval_fraction=0.3)
    assert out["metrics"]["rows_out"] == 12


def test_csv_prompt_completion_with_quoted_commas_and_line_breaks(tmp_path: Path) -> None:
    lines = ["prompt,completion"] + [f'"Say {i}, then stop:\nnow"," {i}, done"' for i in range(25)]
    (tmp_path / "p.csv").write_text("\n".join(lines) + "\n")
    out = run(tmp_path, tmp_path / "p.csv", eval_fraction=0.2)
    assert out["metrics"]["format"] == "prompt_completion" and out["metrics"]["rows_out"] == 25
    row = next(r for r in rows(out) if tokenizer().decode(r["input_ids"]).startswith("Say 7, then stop:\nnow"))
    assert decoded_labels(row) == " 7, done" + tokenizer().eos_token


def test_parquet_chat_with_a_named_template(tmp_path: Path) -> None:
    turns = [("system", "Be brief."), ("user", "Hi {i}"), ("assistant", "Hello {i}"), ("user", "Bye"),
             ("assistant", "Bye now")]
    conversations = [{"messages": [{"role": r, "content": c.format(i=i)} for r, c in turns]} for i in range(20)]
    pq.write_table(pa.Table.from_pylist(conversations), tmp_path / "c.parquet")
    out = run(tmp_path, tmp_path / "c.parquet", chat_template="chatml", eval_fraction=0.2)
    assert (out["metrics"]["format"], out["metrics"]["chat_template"]) == ("chat", "chatml")
    row = next(r for r in rows(out) if "Hi 3" in tokenizer().decode(r["input_ids"]))
    assert tokenizer().decode(row["input_ids"]).startswith(
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi 3<|im_end|>\n<|im_start|>assistant\nHello 3")
    # only the assistant turns (with their end markers) are trained; EOS follows the last one
    assert decoded_labels(row) == "Hello 3<|im_end|>\nBye now<|im_end|>\n" + tokenizer().eos_token


def test_chat_uses_the_tokenizers_own_template(tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(EMBEDDED_MODEL, model, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}{% endfor %}"
                               "{% if add_generation_prompt %}[assistant] {% endif %}")
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    convs = [{"messages": [{"role": "user", "content": f"ping {i}"}, {"role": "assistant", "content": f"pong {i}"}]}
             for i in range(20)]
    out = run(tmp_path, write_jsonl(tmp_path / "c.jsonl", convs), ModelArgs(base_model=str(model)), eval_fraction=0.2)
    row = next(r for r in rows(out) if "ping 2" in tokenizer().decode(r["input_ids"]))
    assert tokenizer().decode(row["input_ids"]) == "[user] ping 2</s>[assistant] pong 2</s>"
    assert decoded_labels(row) == "pong 2</s>"  # the template ends in EOS: none added


def test_chat_without_a_template_says_how_to_pick_one(tmp_path: Path) -> None:
    convs = [{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}]
    fails(tmp_path, write_jsonl(tmp_path / "c.jsonl", convs), "has no chat template", "data.chat_template",
          "chatml, llama3")


def test_plain_text_trains_on_every_token_and_drops_blank_lines(tmp_path: Path) -> None:
    lines = [" = Heading = ", " "] + [f" Sentence number {i} is here ." for i in range(30)] + [""]
    (tmp_path / "wiki.txt").write_text("\n".join(lines) + "\n")
    out = run(tmp_path, tmp_path / "wiki.txt", eval_fraction=0.3)
    m = out["metrics"]
    assert (m["format"], m["completion_only_loss"], m["rows_in"], m["dropped_empty"]) == ("text", False, 33, 2)
    row = next(r for r in rows(out) if "number 5 " in tokenizer().decode(r["input_ids"]))
    assert row["labels"] == row["input_ids"]  # full-text loss (no prefix token in this tokenizer)


def test_folder_and_glob_of_mixed_files(tmp_path: Path) -> None:
    folder = tmp_path / "shards"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", dolly(20))
    pq.write_table(pa.Table.from_pylist(dolly(20, category="x")[10:]), folder / "b.parquet")
    (folder / "notes.md").write_text("not data")
    out = run(tmp_path, folder)
    assert out["metrics"]["rows_in"] == 30
    assert run(tmp_path, f"{folder}/*.jsonl")["metrics"]["rows_in"] == 20


def test_fsspec_url(tmp_path: Path) -> None:
    import fsspec

    fs = fsspec.filesystem("memory")
    fs.pipe("/qlora-test/d.jsonl", "".join(json.dumps(r) + "\n" for r in dolly(25)).encode())
    try:
        out = run(tmp_path, "memory://qlora-test/d.jsonl", eval_fraction=0.2)
        assert out["metrics"]["rows_in"] == 25
        key = out["key"]
        fs.pipe("/qlora-test/d.jsonl", "".join(json.dumps(r) + "\n" for r in dolly(26)).encode())
        assert spec(DataArgs(source="memory://qlora-test/d.jsonl"), ModelArgs(), tmp_path).key != key
    finally:
        fs.rm("/qlora-test", recursive=True)


def test_fsspec_url_whose_package_is_missing_names_it(tmp_path: Path) -> None:
    pytest.importorskip("fsspec")
    try:
        import s3fs  # noqa: F401

        pytest.skip("s3fs is installed")
    except ImportError:
        pass
    fails(tmp_path, "s3://bucket/data.jsonl", "needs the s3fs package", "pip install s3fs")


def test_hub_dataset_from_a_hub_cache_folder_with_config_split_and_slice(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets
    import huggingface_hub

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hf" / "hub" / "datasets--acme--tiny-wiki"
    snapshot = repo / "snapshots" / commit
    for config, n in (("small", 30), ("large", 50)):
        (snapshot / config).mkdir(parents=True)
        pq.write_table(pa.table({"text": [f" {config} line {i} ." for i in range(n)]}),
                       snapshot / config / "train.parquet")
    (snapshot / "README.md").write_text("---\nconfigs:\n" + "".join(
        f"- config_name: {c}\n  data_files:\n  - split: train\n    path: {c}/train.parquet\n"
        for c in ("small", "large")) + "---\n")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    for name, value in (("HF_HOME", tmp_path / "hf"), ("HF_HUB_CACHE", tmp_path / "hf" / "hub"),
                        ("HF_HUB_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1")):
        monkeypatch.setenv(name, str(value))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf" / "datasets")
    out = run(tmp_path, "acme/tiny-wiki", name="large", split="train[:40]")
    assert out["fingerprint"]["data"] == f"hub:acme/tiny-wiki@{commit}"
    assert (out["metrics"]["format"], out["metrics"]["rows_in"]) == ("text", 40)
    assert all(" large line" in tokenizer().decode(r["input_ids"]) for r in rows(out))


# ---- formats, detection, loss ---------------------------------------------------------------------------


def test_column_mapping_and_format_override(tmp_path: Path) -> None:
    records = [{"question": f"Why {i}?", "answer": f"Because {i}.", "text": f"Text {i}"} for i in range(20)]
    source = write_jsonl(tmp_path / "q.jsonl", records)
    out = run(tmp_path, source, column_mapping={"question": "instruction", "answer": "response"}, eval_fraction=0.2)
    assert out["metrics"]["format"] == "dolly"
    assert run(tmp_path, source, format="text", eval_fraction=0.2)["metrics"]["format"] == "text"


def test_completion_only_loss_can_be_turned_off(tmp_path: Path) -> None:
    out = run(tmp_path, write_jsonl(tmp_path / "d.jsonl", dolly(20)), completion_only_loss=False, eval_fraction=0.2)
    assert all(r["labels"] == r["input_ids"] for r in rows(out))


def test_truncation_is_counted_and_prompts_that_fill_the_window_are_dropped(tmp_path: Path) -> None:
    records = dolly(20) + [{"instruction": "word " * 200, "response": "short"},
                           {"instruction": "Tell a long story.", "response": "and then " * 200}]
    out = run(tmp_path, write_jsonl(tmp_path / "d.jsonl", records), max_seq_length=64, eval_fraction=0.2)
    m = out["metrics"]
    assert (m["dropped_prompt_too_long"], m["truncated"], m["rows_out"]) == (1, 1, 21)
    assert m["len_max"] > 64 >= max(len(r["input_ids"]) for r in rows(out))
    assert m["truncated_tokens"] == m["len_max"] - 64  # one example truncated: the longest
    assert m["len_p50"] <= m["len_p90"] <= m["len_p99"] <= m["len_max"] and 0 < m["padding_waste"] < 1


def test_packing_records_position_ids_per_example(tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "d.jsonl", dolly(60))
    plain = run(tmp_path, source, max_seq_length=128)
    out = run(tmp_path, source, max_seq_length=128, pack_examples=True)
    m = out["metrics"]
    assert m["pack_examples"] and m["train_rows"] < m["train_examples"] == plain["metrics"]["train_examples"]
    assert json.loads(pq.read_schema(out["dir"] / "train.parquet").metadata[b"qlora_pipeline"])["packed"] is True
    assert "position_ids" not in out["eval"][0]  # eval stays one example per row
    total = 0
    for row in out["train"]:
        assert len(row["input_ids"]) == len(row["labels"]) == len(row["position_ids"]) <= 128
        starts = [i for i, p in enumerate(row["position_ids"]) if p == 0]
        assert len(starts) == len(row["seq_lengths"]) and sum(row["seq_lengths"]) == len(row["input_ids"])
        assert all(row["labels"][i] == -100 for i in starts)
        total += len(row["seq_lengths"])
    assert total == m["train_examples"]


def test_split_is_by_content_and_ignores_row_order(tmp_path: Path) -> None:
    records = dolly(80)
    a = run(tmp_path / "a", write_jsonl(tmp_path / "a.jsonl", records))
    b = run(tmp_path / "b", write_jsonl(tmp_path / "b.jsonl", records[::-1]))
    as_set = lambda out, split: sorted(tuple(r["input_ids"]) for r in out[split])  # noqa: E731
    assert as_set(a, "eval") == as_set(b, "eval") and as_set(a, "train") == as_set(b, "train")


def test_cache_key_follows_every_byte_of_every_file(tmp_path: Path) -> None:
    folder = tmp_path / "shards"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", dolly(5))
    write_jsonl(folder / "b.jsonl", dolly(6))
    key = lambda: spec(DataArgs(source=str(folder)), ModelArgs(), tmp_path).key  # noqa: E731
    before = key()
    assert key() == before
    text = (folder / "b.jsonl").read_text()
    (folder / "b.jsonl").write_text(text.replace("It is 3.", "It is 4."))
    assert key() != before


def test_worker_pool_gives_the_same_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tasks.prepare_data.sources
    import tasks.prepare_data.tokenization

    source = write_jsonl(tmp_path / "d.jsonl", dolly(300))
    alone = run(tmp_path / "one", source)
    monkeypatch.setattr(tasks.prepare_data.tokenization, "POOL_AFTER_CHUNKS", 1)
    monkeypatch.setenv("QLORA_CPU_THREADS", "2")  # two tokenizer workers, whatever this host's share is
    monkeypatch.setattr(tasks.prepare_data.sources, "CHUNK_ROWS", 64)
    pooled = run(tmp_path / "pool", source)
    assert pooled["train"] == alone["train"] and pooled["eval"] == alone["eval"]
    # a __main__ that a spawned process cannot re-import (`python - <script`): everything stays in this process
    import sys

    monkeypatch.setattr(sys.modules["__main__"], "__file__", str(tmp_path / "<stdin>"), raising=False)
    assert run(tmp_path / "stdin", source)["train"] == alone["train"]


def test_tokenizer_read_here_or_in_a_helper_gives_the_same_key_and_bytes(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside a flow run the tokenizer is read in this process, alone in a helper process: one key, one output."""
    import tasks.prepare_data.tokenization as tokenization

    source = write_jsonl(tmp_path / "d.jsonl", dolly(60))
    out = {}
    for here in (False, True):
        monkeypatch.setattr(tokenization, "_DESCRIBED", {})  # nothing remembered from the other way or other tests
        monkeypatch.setattr(tokenization, "_imports_transformers_anyway", lambda here=here: here)
        out[here] = run(tmp_path / str(here), source)
    assert out[True]["dir"].name == out[False]["dir"].name == out[True]["key"]
    assert out[True]["hashes"] == out[False]["hashes"]
    assert out[True]["train"] == out[False]["train"] and out[True]["eval"] == out[False]["eval"]


def test_parquet_rows_are_written_as_pyarrows_filtered_table_would(tmp_path: Path) -> None:
    """The writer builds its list columns from numpy buffers (no pandas import): the file is byte for byte the one
    a pyarrow table of all examples, filtered by the mask, gives."""
    import types

    import numpy as np

    from tasks.prepare_data.stage import _Writer
    from tasks.prepare_data.tokenization import Tokenized

    lengths = np.array([3, 1, 4, 2, 5], np.int64)
    ids = np.arange(1, lengths.sum() + 1, dtype=np.int32)
    labels = np.where(ids % 3 == 0, np.int32(-100), ids).astype(np.int32)
    part = Tokenized(ids, labels, lengths, np.arange(5, dtype=np.uint64), lengths)
    mask = np.array([True, False, True, True, False])
    with _Writer(tmp_path / "ours.parquet", False, types.SimpleNamespace(max_len=8, fmt="dolly")) as ours:
        ours.write(part, mask)
        ours.write(part, ~mask)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    with pq.ParquetWriter(tmp_path / "theirs.parquet", ours.schema) as theirs:
        for m in (mask, ~mask):
            table = pa.table({name: pa.ListArray.from_arrays(offsets, values)
                              for name, values in (("input_ids", ids), ("labels", labels))}).filter(m)
            theirs.write_table(table.cast(ours.schema))
    assert (tmp_path / "ours.parquet").read_bytes() == (tmp_path / "theirs.parquet").read_bytes()
    assert (ours.examples, ours.tokens, ours.label_tokens) == (5, 15, int((labels != -100).sum()))


# ---- bad input: one clear error listing every problem, no manifest ----------------------------------------


def test_malformed_json_lines_are_listed_by_line_number(tmp_path: Path) -> None:
    lines = [json.dumps(r) for r in dolly(30)]
    for i in (2, 5, 7, 8, 11, 13, 17, 19, 21, 23, 25, 29):
        lines[i] = lines[i][:-3]  # 12 broken lines, 0-based
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n[1, 2]\n")
    message = fails(tmp_path, tmp_path / "d.jsonl", "12 row(s) are not valid JSON",
                    "d.jsonl line 3, line 6, line 8, line 9, line 12, line 14, line 18, line 20, line 22, line 24 ...",
                    "1 row(s) are JSON but not objects", "d.jsonl line 31")
    assert "line 26" not in message  # only the first 10 are listed


def test_missing_columns_list_the_columns_found_and_formats_they_match(tmp_path: Path) -> None:
    records = [{"instruction": "q", "answer": "a", "text": "t"}] * 5
    fails(tmp_path, write_jsonl(tmp_path / "d.jsonl", records), "data.format='dolly' needs column(s) response, "
          "which data.source=",
          "Columns found: answer, instruction, text", "They would match: text", "data.column_mapping", format="dolly")
    fails(tmp_path, write_jsonl(tmp_path / "e.jsonl", [{"question": "q", "answer": "a"}]),
          "Cannot tell the format of data.source=", "e.jsonl' from its columns: answer, question",
          "dolly: instruction, response")


def test_rows_lacking_a_column_are_listed(tmp_path: Path) -> None:
    records = dolly(10)
    del records[3]["response"], records[6]["response"]
    fails(tmp_path, write_jsonl(tmp_path / "d.jsonl", records), "2 row(s) lack column 'response'",
          "d.jsonl line 4, line 7.")


def test_empty_responses_are_dropped_and_too_many_fail(tmp_path: Path) -> None:
    records = dolly(40)
    records[0]["response"], records[1]["response"] = "", " \n\t"
    out = run(tmp_path, write_jsonl(tmp_path / "d.jsonl", records))
    assert (out["metrics"]["dropped_empty"], out["metrics"]["rows_out"]) == (2, 38)
    for r in records[:10]:
        r["response"] = "  "
    fails(tmp_path, write_jsonl(tmp_path / "e.jsonl", records), "10 of 40 rows (25%) have an empty",
          "data.max_empty_fraction=0.1")


def test_bytes_that_are_not_utf8(tmp_path: Path) -> None:
    lines = [json.dumps(r).encode() for r in dolly(10)]
    lines[4] = lines[4].replace(b"plus", b"pl\xffus")
    (tmp_path / "d.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    fails(tmp_path, tmp_path / "d.jsonl", "1 row(s) are not UTF-8", "d.jsonl line 5", "save the file as UTF-8")
    (tmp_path / "d.csv").write_bytes(b"prompt,completion\na,b\nc\xe9,d\n")
    fails(tmp_path, tmp_path / "d.csv", "are not UTF-8", "d.csv line 3")


def test_csv_with_ragged_rows(tmp_path: Path) -> None:
    (tmp_path / "d.csv").write_text("prompt,completion\na,b\nc,d,e\nf\ng,h\n")
    fails(tmp_path, tmp_path / "d.csv", "2 row(s) have a different number of fields than the header's 2",
          "d.csv line 3 (3 fields), line 4 (1 fields).")


def test_empty_after_filtering(tmp_path: Path) -> None:
    (tmp_path / "blank.txt").write_text(" \n\n   \n")
    fails(tmp_path, tmp_path / "blank.txt", "No training examples left", "3 rows read, 3 empty")
    (tmp_path / "nothing.jsonl").write_text("")
    fails(tmp_path, tmp_path / "nothing.jsonl", "holds no rows")


def test_every_example_longer_than_max_seq_length(tmp_path: Path) -> None:
    fails(tmp_path, write_jsonl(tmp_path / "d.jsonl", dolly(20)), "Every example is longer than "
          "data.max_seq_length=8 tokens", "Raise data.max_seq_length", max_seq_length=8)


def test_missing_source_and_unsupported_file_type(tmp_path: Path) -> None:
    fails(tmp_path, tmp_path / "nope.jsonl", "no such file.")
    (tmp_path / "d.xlsx").write_text("x")
    fails(tmp_path, tmp_path / "d.xlsx", "unsupported file type '.xlsx'")
