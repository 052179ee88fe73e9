"""prepare_data on the real data beside the project (../shared/data); skipped where it is absent (a fresh clone)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tasks.config import PROJECT_ROOT, DataArgs, ModelArgs
from tasks.prepare_data.stage import prepare_data

SHARED = PROJECT_ROOT.parent / "shared" / "data"
DOLLY = SHARED / "dolly" / "dolly_open_qa.jsonl"
WIKITEXT = SHARED / "wikitext-2-raw" / "wiki.test.raw"


def metrics(tmp_path: Path, **data: object) -> dict:
    folder = Path(prepare_data.fn(DataArgs(**data), ModelArgs(), tmp_path))
    return json.loads((folder / "manifest.json").read_text())["metrics"]


@pytest.mark.skipif(not DOLLY.is_file(), reason="needs ../shared/data/dolly")
def test_real_dolly_subset(tmp_path: Path) -> None:
    m = metrics(tmp_path, source=str(DOLLY), max_seq_length=512)
    # 3,739 records, every one with an instruction and a response (shared/data/README.md)
    assert (m["format"], m["rows_in"], m["dropped_empty"], m["rows_out"]) == ("dolly", 3739, 0, 3739)
    assert m["train_examples"] + m["eval_examples"] == 3739 and 0.05 < m["eval_examples"] / 3739 < 0.15
    assert 0 < m["truncation_rate"] < 0.5 and m["len_p50"] < m["len_p90"] < m["len_max"]


@pytest.mark.skipif(not WIKITEXT.is_file(), reason="needs ../shared/data/wikitext-2-raw")
def test_real_wikitext_as_text(tmp_path: Path) -> None:
    m = metrics(tmp_path, source=str(WIKITEXT))
    # 4,358 lines: 2,891 of text and 1,467 blank lines of a single space (shared/data/README.md)
    assert (m["format"], m["completion_only_loss"]) == ("text", False)
    assert (m["rows_in"], m["dropped_empty"], m["rows_out"]) == (4358, 1467, 2891)
