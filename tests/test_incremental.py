"""prepare_data per file (parts reused by content), data.eval_source, and cache keys that hold no path."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from tasks.config import EMBEDDED_DATA, PROJECT_ROOT, DataArgs, LoraArgs, ModelArgs, SpeedArgs, TrainArgs
from tasks.errors import UserError
from tasks.on_disk.manifest import read_manifest
from tasks.prepare_data.stage import prepare_data
from tests.conftest import cli, cli_env, finish, last_json, settled, small_overrides

LINES = EMBEDDED_DATA.read_text().splitlines(keepends=True)


def shards(folder: Path, *ranges: tuple[int, int]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i, (start, end) in enumerate(ranges):
        (folder / f"shard-{i:03d}.jsonl").write_text("".join(LINES[start:end]))
    return folder


def held_out(count: int, train: list[str], start: int = 500) -> list[str]:
    """`count` sample lines from `start` on whose records are not among `train`'s: the sample data holds each
    example about twice, so a slice of it shares examples with another (the eval overlap check counts those)."""
    trained = {json.dumps(json.loads(line), sort_keys=True) for line in train}
    return [line for line in LINES[start:] if json.dumps(json.loads(line), sort_keys=True) not in trained][:count]


def prepare(source: Path, runs: Path, **data: Any) -> tuple[Path, dict[str, Any]]:
    folder = Path(prepare_data.fn(DataArgs(source=str(source), **data), ModelArgs(), runs))
    manifest = read_manifest(folder)
    assert manifest is not None
    return folder, manifest.metrics.model_dump()


def parts(runs: Path) -> dict[str, int]:
    """Part folder name -> mtime of its rows (a part rewritten would show a new one)."""
    root = runs / "prepare_data" / "parts"
    return {p.name: (p / "rows.parquet").stat().st_mtime_ns for p in root.iterdir() if p.is_dir()} \
        if root.is_dir() else {}


def same_output(a: Path, b: Path) -> None:
    for name in ("train.parquet", "eval.parquet"):
        assert pq.read_table(a / name).to_pylist() == pq.read_table(b / name).to_pylist(), name
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Several chunks per shard, so packing and row groups per chunk are exercised; all tokenized in this process
    (starting pool workers costs seconds; test_prepare_data checks that the pool gives the same output)."""
    import tasks.prepare_data.sources
    import tasks.prepare_data.tokenization

    monkeypatch.setattr(tasks.prepare_data.sources, "CHUNK_ROWS", 32)
    monkeypatch.setattr(tasks.prepare_data.tokenization, "POOL_AFTER_CHUNKS", 10**6)


@pytest.mark.parametrize("pack_examples", [False, True])
def test_a_new_shard_is_the_only_file_tokenized_and_the_output_equals_a_full_preparation(
        tmp_path: Path, small_chunks: None, pack_examples: bool) -> None:
    folder = shards(tmp_path / "shards", (0, 70), (70, 140), (140, 210))
    runs = tmp_path / "runs"
    _, first = prepare(folder, runs, pack_examples=pack_examples)
    assert (first["parts_tokenized"], first["parts_reused"]) == (3, 0)
    before = parts(runs)
    shards(folder, (0, 70), (70, 140), (140, 210), (210, 290))  # one more shard; the others rewritten unchanged
    night2, second = prepare(folder, runs, pack_examples=pack_examples)
    assert (second["parts_tokenized"], second["parts_reused"]) == (1, 3)
    after = parts(runs)
    assert {k: after[k] for k in before} == before and len(after) == 4  # three reused untouched, one new
    full, fresh = prepare(folder, tmp_path / "fresh-runs", pack_examples=pack_examples)
    assert fresh["parts_tokenized"] == 4
    same_output(night2, full)
    assert {k: v for k, v in second.items() if not k.startswith("parts_")} == \
        {k: v for k, v in fresh.items() if not k.startswith("parts_")}  # counts and histogram merged from parts
    assert second["rows_in"] == 290 and second["train_examples"] + second["eval_examples"] == 290


def test_a_changed_byte_in_one_shard_recomputes_exactly_that_part(tmp_path: Path) -> None:
    folder = shards(tmp_path / "shards", (0, 50), (50, 100), (100, 150))
    runs = tmp_path / "runs"
    prepare(folder, runs)
    before = parts(runs)
    shard = folder / "shard-001.jsonl"
    text = shard.read_text()
    at = text.index('"response": "') + len('"response": "')
    shard.write_text(text[:at] + ("X" if text[at] != "X" else "Y") + text[at + 1:])
    changed, metrics = prepare(folder, runs)
    assert (metrics["parts_tokenized"], metrics["parts_reused"]) == (1, 2)
    after = parts(runs)
    assert len(set(after) - set(before)) == 1 and all(after[k] == v for k, v in before.items())
    same_output(changed, prepare(folder, tmp_path / "fresh-runs")[0])


def _rewrite_in_place_keeping_mtime(shard: Path) -> None:
    """Change every response's first letter's case (same size), writing into the same inode, then put the mtime
    back: what `cp -p` or `rsync -t --inplace` of an edited shard, or an edit followed by `touch -d`, leave."""
    before = shard.stat()
    rows = [json.loads(line) for line in shard.read_text().splitlines()]
    for row in rows:
        row["response"] = row["response"][:1].swapcase() + row["response"][1:]
    edited = "".join(json.dumps(row) + "\n" for row in rows).encode()
    assert len(edited) == before.st_size
    with shard.open("r+b") as f:
        f.write(edited)
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = shard.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)


def _key_in_a_new_process(source: Path, runs: Path) -> str:
    code = ("import sys; from pathlib import Path; from tasks.config import DataArgs, ModelArgs; "
            "from tasks.prepare_data.stage import spec; "
            "print(spec(DataArgs(source=sys.argv[1]), ModelArgs(), Path(sys.argv[2])).key)")
    done = subprocess.run([sys.executable, "-c", code, str(source), str(runs)], cwd=PROJECT_ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split()[-1]


def test_a_shard_rewritten_in_place_with_its_mtime_put_back_is_tokenized_and_trained_again(
        tmp_path: Path, stages: dict[str, Any]) -> None:
    """Same path, size, mtime, inode and device: only ctime tells the new bytes apart. The memo of the runs_dir
    (another process's view) and this process's both see it; the new tokens reach train.parquet, and train_adapter
    gets a new key."""
    from tasks.train_adapter.stage import spec as train_spec

    folder = shards(tmp_path / "shards", (0, 50), (50, 100), (100, 150))
    settled(*folder.iterdir())  # memoised by identity, as a night's old shards are
    runs = tmp_path / "runs"
    first, _ = prepare(folder, runs)
    _rewrite_in_place_keeping_mtime(folder / "shard-001.jsonl")
    assert _key_in_a_new_process(folder, runs) != first.name
    second, metrics = prepare(folder, runs)
    assert second != first and (metrics["parts_tokenized"], metrics["parts_reused"]) == (1, 2)
    rows = [pq.read_table(f / "train.parquet").to_pylist() for f in (first, second)]
    assert rows[0] != rows[1]  # the edited responses, trained (the split by content moved some too)
    same_output(second, prepare(folder, tmp_path / "fresh-runs")[0])
    keys = {train_spec(LoraArgs(), TrainArgs(), SpeedArgs(), runs, str(d), stages["model"]).key
            for d in (first, second)}
    assert len(keys) == 2


@pytest.mark.slow
def test_a_shard_edited_in_place_overnight_is_trained_on_by_the_next_run(tmp_path: Path) -> None:
    """The issue's night: a shard rewritten in place with its mtime put back between two runs of the CLI (each its
    own process, reading runs_dir's memo). Every stage that reads the data runs again, on the new bytes."""
    folder = shards(tmp_path / "shards", (0, 120), (120, 240))
    settled(*folder.iterdir())
    overrides = small_overrides(folder, tmp_path / "runs", **{"train.max_steps": 2, "eval.generation_samples": 0})
    args = ["run", "--json", *sum((["--set", o] for o in overrides), [])]
    env = cli_env(tmp_path / "prefect")
    summaries = []
    for night in range(2):
        if night:
            _rewrite_in_place_keeping_mtime(folder / "shard-001.jsonl")
        proc = cli(args, env, tmp_path / f"night{night}")
        out, err = finish(proc, tmp_path / f"night{night}", timeout=900)
        assert proc.returncode == 0, err[-3000:]
        summaries.append(last_json(out))
    assert {s: i["status"] for s, i in summaries[1]["stages"].items()} == {
        "prepare_data": "computed", "prepare_model": "cached", "train_adapter": "computed",
        "evaluate_adapter": "computed", "export_adapter": "computed"}
    data, trained = (Path(summaries[1]["stages"][s]["dir"]) for s in ("prepare_data", "train_adapter"))
    train_parquet = read_manifest(data).hashes["train.parquet"]
    assert read_manifest(trained).fingerprint["train_data"] == train_parquet  # trained on the new tokens
    assert train_parquet != read_manifest(Path(summaries[0]["stages"]["prepare_data"]["dir"])).hashes["train.parquet"]


def test_a_damaged_part_is_tokenized_again(tmp_path: Path) -> None:
    folder = shards(tmp_path / "shards", (0, 50), (50, 100))
    runs = tmp_path / "runs"
    prepare(folder, runs)
    damaged = runs / "prepare_data" / "parts" / sorted(parts(runs))[0] / "rows.parquet"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, other bytes
    damaged.write_bytes(bytes(data))
    shards(folder, (0, 50), (50, 100), (100, 150))
    grown, metrics = prepare(folder, runs)
    assert (metrics["parts_tokenized"], metrics["parts_reused"]) == (2, 1)
    same_output(grown, prepare(folder, tmp_path / "fresh-runs")[0])


def test_bad_rows_of_every_shard_are_reported_and_their_parts_never_kept(tmp_path: Path) -> None:
    folder = shards(tmp_path / "shards", (0, 40), (40, 80), (80, 120))
    for name, line in (("shard-000.jsonl", 3), ("shard-002.jsonl", 5)):
        rows = (folder / name).read_text().splitlines(keepends=True)
        rows[line - 1] = '{"instruction": "cut off\n'
        (folder / name).write_text("".join(rows))
    runs = tmp_path / "runs"
    for _ in range(2):  # the second run reports them again: nothing of theirs was cached
        with pytest.raises(UserError) as info:
            prepare(folder, runs)
        message = str(info.value)
        assert "2 row(s) are not valid JSON" in message, message
        assert f"{folder / 'shard-000.jsonl'} line 3" in message and f"{folder / 'shard-002.jsonl'} line 5" in message
        assert len(parts(runs)) == 1  # the good shard's part only
    assert not list(runs.glob("prepare_data/*/manifest.json"))


def test_eval_source_is_all_of_eval_and_source_is_all_of_train(tmp_path: Path, stages: dict[str, Any]) -> None:
    from tasks.train_adapter.stage import spec as train_spec

    source = shards(tmp_path / "shards", (0, 60), (60, 120))
    golden, held = tmp_path / "golden.jsonl", held_out(31, LINES[0:120])
    golden.write_text("".join(held[:30]))
    runs = tmp_path / "runs"
    one, metrics = prepare(source, runs, eval_source=str(golden))
    assert (metrics["train_examples"], metrics["eval_examples"]) == (120, 30)
    # the eval rows are the golden file's, in order (no split by hash on either side)
    only_golden, _ = prepare(golden, tmp_path / "alone", eval_fraction=0.5)
    alone = pq.read_table(only_golden / "train.parquet").to_pylist() + pq.read_table(
        only_golden / "eval.parquet").to_pylist()
    assert sorted(r["input_ids"] for r in pq.read_table(one / "eval.parquet").to_pylist()) == \
        sorted(r["input_ids"] for r in alone)
    golden.write_text("".join(held))  # the eval set gains an example
    two, metrics = prepare(source, runs, eval_source=str(golden))
    assert two != one and metrics["eval_examples"] == 31
    assert (metrics["parts_tokenized"], metrics["parts_reused"]) == (0, 2)  # the training shards' parts reused
    assert (one / "train.parquet").read_bytes() == (two / "train.parquet").read_bytes()
    keys = [train_spec(LoraArgs(), TrainArgs(), SpeedArgs(), runs, str(d), stages["model"]).key for d in (one, two)]
    assert keys[0] == keys[1]  # train_adapter follows train.parquet's bytes: reused


def test_eval_source_of_preference_pairs(tmp_path: Path) -> None:
    from tasks.config import EMBEDDED_PREFERENCES

    pairs = EMBEDDED_PREFERENCES.read_text().splitlines(keepends=True)
    source, golden = tmp_path / "pairs.jsonl", tmp_path / "golden.jsonl"
    source.write_text("".join(pairs[:60]))
    golden.write_text("".join(pairs[60:80]))
    _, metrics = prepare(source, tmp_path / "runs", eval_source=str(golden))
    assert metrics["format"] == "preference" and metrics["rows_in"] == 80
    kept = 80 - metrics["dropped_prompt_too_long"]
    assert metrics["train_examples"] + metrics["eval_examples"] == kept and 0 < metrics["eval_examples"] <= 20
    assert metrics["train_examples"] >= 60 - metrics["dropped_prompt_too_long"]
    with pytest.raises(UserError, match=r"data\.eval_source='[^']*' is in the dolly format and data\.source in "
                                        r"the preference format"):
        prepare(source, tmp_path / "runs", eval_source=str(EMBEDDED_DATA))


def test_an_eval_set_inside_the_training_data_is_counted_warned_about_and_refused_above_the_threshold(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    source = shards(tmp_path / "shards", (0, 60), (60, 120))
    runs = tmp_path / "runs"
    subset = tmp_path / "subset.jsonl"  # all of it is training data too
    subset.write_text("".join(LINES[10:40]))
    for eval_source in (subset, source / "shard-001.jsonl", source):  # a subset, a whole shard, all of the data
        with pytest.raises(UserError) as info:
            prepare(source, runs, eval_source=str(eval_source))
        message, n = str(info.value), 30 if eval_source == subset else 60 if eval_source.is_file() else 120
        assert message.startswith(f"{n} of the {n} eval examples (100%) of data.eval_source={str(eval_source)!r} are "
                                  f"also training examples of data.source={str(source)!r} (identical after "
                                  "formatting), for example '### Instruction:"), message
        assert "more than data.max_eval_overlap=0.1, so nothing was written" in message
    assert not list(runs.glob("prepare_data/*/manifest.json"))
    mostly_held_out = tmp_path / "golden.jsonl"  # 2 of its 32 examples are training examples
    mostly_held_out.write_text("".join(held_out(30, LINES[0:120]) + LINES[5:7]))
    with caplog.at_level(logging.WARNING):
        _, metrics = prepare(source, runs, eval_source=str(mostly_held_out))
    assert (metrics["eval_overlap"], metrics["eval_examples"]) == (2, 32)
    assert f"2 of the 32 eval examples (6%) of data.eval_source={str(mostly_held_out)!r} are also training" \
           in caplog.text and "(above data.max_eval_overlap=0.1 of the eval set this fails the run)" in caplog.text
    assert prepare(source, runs)[1]["eval_overlap"] == 0  # a split by content hash has none by construction


def test_the_overlap_threshold_is_kept_out_of_the_key_and_held_to_a_reused_folder(tmp_path: Path) -> None:
    from tasks.prepare_data.stage import spec

    source = shards(tmp_path / "shards", (0, 60))
    golden = tmp_path / "golden.jsonl"
    golden.write_text("".join(LINES[0:20]))
    runs = tmp_path / "runs"
    keys = {spec(DataArgs(source=str(source), eval_source=str(golden), max_eval_overlap=m), ModelArgs(), runs).key
            for m in (0.1, 1.0)}
    assert len(keys) == 1  # it changes nothing prepare_data writes
    folder, metrics = prepare(source, runs, eval_source=str(golden), max_eval_overlap=1.0)  # 1 only warns
    assert (metrics["eval_overlap"], metrics["eval_examples"]) == (20, 20) and folder.name in keys
    with pytest.raises(UserError, match=r"^20 of the 20 eval examples \(100%\) .* more than "
                                        r"data\.max_eval_overlap=0\.5"):
        prepare(source, runs, eval_source=str(golden), max_eval_overlap=0.5)  # the same folder, reused
    assert read_manifest(folder) is not None  # kept: another run may accept it


def test_preference_pairs_held_out_are_counted_as_overlap_when_training_has_them(tmp_path: Path) -> None:
    from tasks.config import EMBEDDED_PREFERENCES

    pairs = EMBEDDED_PREFERENCES.read_text().splitlines(keepends=True)
    source, golden = tmp_path / "pairs.jsonl", tmp_path / "golden.jsonl"
    source.write_text("".join(pairs[:60]))
    golden.write_text("".join(pairs[60:75] + pairs[:5]))
    with pytest.raises(UserError) as info:
        prepare(source, tmp_path / "runs", eval_source=str(golden), max_eval_overlap=0.2)
    kept = info.value.args[0].split(" of the ")[1].split(" ")[0]
    assert str(info.value).startswith(f"5 of the {kept} eval examples") and "more than data.max_eval_overlap=0.2" \
        in str(info.value)
    _, metrics = prepare(source, tmp_path / "runs", eval_source=str(golden), max_eval_overlap=0.5)
    assert metrics["eval_overlap"] == 5 and metrics["eval_examples"] == int(kept)


def test_an_eval_set_in_another_format_is_read_in_its_own_and_its_errors_name_it(tmp_path: Path) -> None:
    """Before, the eval set's format was loaded last and the training rows were then read in it: an alpaca eval set
    beside dolly training data failed as 60 bad rows of data.source."""
    source = shards(tmp_path / "shards", (0, 60))
    alpaca = tmp_path / "alpaca.jsonl"
    held = held_out(20, LINES[0:60])
    records = [json.loads(line) for line in held]
    alpaca.write_text("".join(json.dumps({"instruction": r["instruction"], "input": r.get("context", ""),
                                          "output": r["response"]}) + "\n" for r in records))
    folder, metrics = prepare(source, tmp_path / "runs", eval_source=str(alpaca))
    assert (metrics["train_examples"], metrics["eval_examples"], metrics["eval_overlap"]) == (60, 20, 0)
    golden = tmp_path / "golden.jsonl"  # the same examples in data.source's format
    golden.write_text("".join(held))
    dolly_eval, _ = prepare(source, tmp_path / "runs", eval_source=str(golden))
    assert pq.read_table(folder / "eval.parquet").to_pylist() == pq.read_table(dolly_eval / "eval.parquet").to_pylist()
    with pytest.raises(UserError, match=r"^data\.format='dolly' needs column\(s\) response, which "
                                        rf"data\.eval_source={re.escape(repr(str(alpaca)))} lacks\."):
        prepare(source, tmp_path / "runs", eval_source=str(alpaca), format="dolly")
    odd = tmp_path / "odd.csv"
    odd.write_text("question,answer\nq,a\n")
    with pytest.raises(UserError, match=rf"^Cannot tell the format of data\.eval_source={re.escape(repr(str(odd)))} "
                                        r"from its columns: answer, question\."):
        prepare(source, tmp_path / "runs", eval_source=str(odd))


def test_eval_source_bad_inputs_say_which_field(tmp_path: Path) -> None:
    source = shards(tmp_path / "shards", (0, 60))
    missing = tmp_path / "nowhere.jsonl"
    with pytest.raises(UserError, match=r"data\.eval_source='[^']*nowhere\.jsonl': no such file"):
        prepare(source, tmp_path / "runs", eval_source=str(missing))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(UserError, match=r"data\.eval_source='[^']*empty\.jsonl' holds no rows"):
        prepare(source, tmp_path / "runs", eval_source=str(empty))
    blank = tmp_path / "blank.jsonl"  # rows, but none with an answer to score
    blank.write_text("".join(json.dumps({"instruction": f"q{i}", "context": "", "response": " "}) + "\n"
                             for i in range(3)))
    with pytest.raises(UserError, match=r"data\.eval_source='[^']*blank\.jsonl' yields no eval examples"):
        prepare(source, tmp_path / "runs", eval_source=str(blank))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"instruction": "x"\n')
    with pytest.raises(UserError, match=r"data\.eval_source='[^']*bad\.jsonl' has bad rows.*line 1"):
        prepare(source, tmp_path / "runs", eval_source=str(bad))
    assert not list((tmp_path / "runs").glob("prepare_data/*/manifest.json"))


def test_keys_hold_no_checkout_path(tmp_path: Path) -> None:
    """The same commit at two paths (tasks/ and data/ copied): one prepare_data and one prepare_model key, also for
    data outside the checkout given by two different absolute paths to the same bytes."""
    code = ("import sys; from pathlib import Path; from tasks.config import DataArgs, ModelArgs; "
            "import tasks.prepare_data.stage as d, tasks.prepare_model.stage as m; "
            "print(*(d.spec(DataArgs(**({'source': s} if s else {})), ModelArgs(), Path('runs')).key for s in "
            "sys.argv[1:]), m.spec(ModelArgs(), Path('runs')).key)")
    keys = []
    for name in ("clone-a", "deep/clone-b"):
        clone = tmp_path / name
        for part in ("tasks", "data"):
            shutil.copytree(PROJECT_ROOT / part, clone / part, ignore=shutil.ignore_patterns("__pycache__"))
        (clone / "outside").mkdir()
        shutil.copy(EMBEDDED_DATA, clone / "outside" / "mine.jsonl")
        env = {**os.environ, "PYTHONPATH": str(clone)}
        done = subprocess.run([sys.executable, "-c", code, "", str(clone / "outside" / "mine.jsonl")], cwd=clone,
                              env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        keys.append(done.stdout.split())
    # per clone: the default data's prepare_data key, the copy's elsewhere, prepare_model's
    assert keys[0] == keys[1], keys
    assert keys[0][0] == keys[0][1]  # the default data and a copy of it elsewhere: same bytes, same key


@pytest.mark.slow
def test_a_new_eval_file_through_the_cli_recomputes_evaluation_and_export_only(small_data: Path,
                                                                               tmp_path: Path) -> None:
    golden, held = tmp_path / "golden.jsonl", held_out(25, LINES[:240], start=1000)  # small_data: 240 lines
    golden.write_text("".join(held[:20]))
    overrides = small_overrides(small_data, tmp_path / "runs", **{
        "data.eval_source": str(golden), "train.max_steps": 2, "eval.generation_samples": 0,
        "eval.max_samples": "null"})
    args = ["run", "--json", *sum((["--set", o] for o in overrides), [])]
    env = cli_env(tmp_path / "prefect")
    summaries = []
    for night in range(2):
        if night:
            golden.write_text("".join(held))
        proc = cli(args, env, tmp_path / f"night{night}")
        out, err = finish(proc, tmp_path / f"night{night}", timeout=900)
        assert proc.returncode == 0, err[-3000:]
        summaries.append(last_json(out))
    assert {s: i["status"] for s, i in summaries[1]["stages"].items()} == {
        "prepare_data": "computed", "prepare_model": "cached", "train_adapter": "cached",
        "evaluate_adapter": "computed", "export_adapter": "computed"}
    assert summaries[1]["stages"]["train_adapter"]["dir"] == summaries[0]["stages"]["train_adapter"]["dir"]
    assert [s["metrics"]["eval_examples"] for s in summaries] == [20, 25]  # all of the eval file, each night
