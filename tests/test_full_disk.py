"""A full disk anywhere the pipeline writes (a real 8 MB tmpfs as runs_dir): one paragraph naming the step, what it
needs and the fix; nothing half-written left or taken as done; the next run, with space, recovers.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from deployments.cli import USER_ERROR_EXIT
from tasks.config import EMBEDDED_DATA, LoraArgs, ModelArgs, SpeedArgs, TrainArgs, load_config
from tasks.errors import UserError
from tasks.hashing.files import HASH_MEMO, INPUT_HASH_MEMO
from tasks.on_disk.manifest import MANIFEST
from tasks.prepare_model.stage import prepare_model
from tasks.train_adapter.stage import train_adapter
from tests.conftest import cli, cli_env, finish, last_json, small_overrides


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 8 MB filesystem (tmpfs) for runs_dir; mounting needs root."""
    mount = tmp_path / "disk"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)], capture_output=True,
                          text=True, check=False)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {made.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def _fill(disk: Path, leave: int) -> Path:
    """Fill disk with one file, leaving about `leave` bytes free."""
    filler = disk / "filler"
    filler.write_bytes(b"\0" * (shutil.disk_usage(disk).free - leave))
    return filler


def _full_disk_paragraph(info: pytest.ExceptionInfo[UserError], stage: str, runs: Path) -> None:
    message = str(info.value)
    for fragment in (f"{stage}: not enough disk space under runs_dir {runs}", "B free of 8.0 MB",
                     "Free space there or set runs_dir to a larger disk"):
        assert fragment in message, message
    assert "\n" not in message


def test_prepare_model_checks_the_space_it_needs(small_disk: Path) -> None:
    runs = small_disk / "runs"
    filler = _fill(small_disk, 200_000)
    with pytest.raises(UserError) as info:
        prepare_model.fn(ModelArgs(), runs)
    _full_disk_paragraph(info, "prepare_model", runs)
    assert "it needs about" in str(info.value) and "the 4-bit checkpoint" in str(info.value)
    assert not list(runs.glob("prepare_model/*/*.safetensors")) and not list(runs.rglob(MANIFEST))
    filler.unlink()
    assert (Path(prepare_model.fn(ModelArgs(), runs)) / MANIFEST).is_file()


@pytest.mark.slow  # two short trainings
def test_checkpoint_on_a_full_disk_is_one_paragraph_and_resumes(small_disk: Path, stages: dict[str, Any]) -> None:
    runs, train = small_disk / "runs", TrainArgs(max_steps=3, save_steps=1, logging_steps=1)
    lora = LoraArgs(r=32, lora_alpha=32)  # checkpoints of about 2 MB: the second does not fit
    filler = _fill(small_disk, 3_000_000)
    with pytest.raises(UserError) as info:
        train_adapter.fn(lora, train, SpeedArgs(), runs, stages["data"], stages["model"])
    _full_disk_paragraph(info, "train_adapter", runs)
    assert not list(runs.rglob(MANIFEST)) and not list(runs.glob("train_adapter/*/adapter"))
    complete = [c.name for c in runs.glob("train_adapter/*/checkpoints/checkpoint-*") if (c / "complete").is_file()]
    assert complete == ["checkpoint-1"]  # kept for the resume
    left = [c.name for c in runs.glob("train_adapter/*/checkpoints/*")]
    assert left == ["checkpoint-1"]  # the half-written one is removed now, as the paragraph says, not on the next run
    filler.unlink()
    folder = Path(train_adapter.fn(lora, train, SpeedArgs(), runs, stages["data"], stages["model"]))
    made = json.loads((folder / MANIFEST).read_text())
    assert made["resumed_from_step"] == 1 and made["metrics"]["optimizer_steps"] == 3


@pytest.fixture
def exported(small_disk: Path, stages: dict[str, Any]) -> dict[str, Any]:
    """A finished train, eval and export (registry v0001, the champion) with runs_dir on the small disk."""
    from tasks.config import EvalArgs, ExportArgs
    from tasks.evaluate_adapter.stage import evaluate_adapter
    from tasks.export_adapter.stage import export_adapter

    runs = small_disk / "runs"
    dirs = [stages["data"], stages["model"]]
    dirs.append(train_adapter.fn(LoraArgs(r=4, lora_alpha=8), TrainArgs(max_steps=2, logging_steps=1), SpeedArgs(),
                                 runs, *dirs))
    dirs.append(evaluate_adapter.fn(EvalArgs(max_samples=8, generation_samples=2, max_new_tokens=4), runs, *dirs))
    upstream = list(dirs)
    # two steps beat the base model, by less than the default 1%: the version must be the champion
    export = lambda: export_adapter.fn(ExportArgs(promotion_margin=0.001), runs, *upstream)  # noqa: E731 - again later
    dirs.append(export())
    return {"runs": runs, "dirs": dirs, "export": export, "root": runs / "exports" / ExportArgs().name}


def _tree(folder: Path) -> dict[str, bytes]:
    """Every file under folder with its bytes (hidden ones too: a leftover temp file is a difference)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.slow  # a training, an evaluation and an export on the small disk (25-50 s)
def test_registry_repair_on_a_full_disk_leaves_the_registry_as_it_was(small_disk: Path, exported: dict[str, Any]
                                                                       ) -> None:
    root = exported["root"]
    whole = _tree(root)
    shutil.rmtree(root / "v0001")  # what the cached export's self-repair restores: a version and champion.json
    (root / "champion.json").unlink()
    before = _tree(root)
    filler = _fill(small_disk, 0)
    with pytest.raises(UserError) as info:
        exported["export"]()
    _full_disk_paragraph(info, "the repair of exports registry adapter", exported["runs"])
    assert "nothing half-made is in the registry" in str(info.value) and "it needs about" in str(info.value)
    assert _tree(root) == before  # no half version, no .tmp-* folder, no half champion.json
    filler.unlink()
    assert exported["export"]() == exported["dirs"][-1]  # the cached export repairs the registry now
    assert _tree(root) == whole


@pytest.mark.slow  # a training, an evaluation and an export on the small disk (25-50 s)
@pytest.mark.parametrize("backend", [[], ["tensorboard"]])
def test_run_record_on_a_full_disk_leaves_no_run_folder(small_disk: Path, exported: dict[str, Any],
                                                        backend: list[str]) -> None:
    from tasks.reporting.run_record import record_run

    config = load_config(None, [f"runs_dir={exported['runs']}", f"track.backend={json.dumps(backend)}"])
    events = exported["runs"] / "tensorboard"
    filler = _fill(small_disk, 0)
    with pytest.raises(UserError) as info:
        record_run(config, exported["dirs"])
    step = "tracking (TensorBoard)" if backend else "the run record (run.json)"
    _full_disk_paragraph(info, step, exported["runs"])
    assert not list((exported["runs"] / "runs").glob("*"))  # no run folder without its whole run.json
    assert not [p for p in events.rglob("*") if p.is_file()]  # no half event file that says "logged"
    filler.unlink()
    summary = record_run(config, exported["dirs"])
    record = json.loads((Path(summary["run_dir"]) / "run.json").read_text())
    assert record["stages"]["export_adapter"]["key"] == Path(exported["dirs"][-1]).name
    assert sorted(p.name for p in Path(summary["run_dir"]).iterdir()) == ["loss.png", "registry-history.png",
                                                                          "run.json"]
    if backend:
        assert summary["tracking"]["tensorboard"]["logged"] == "now"
        assert not [p for p in events.rglob(".*")]  # the temporary folder is gone


@pytest.mark.slow  # three CLI runs
def test_cli_full_disk_in_the_registry_repair_is_exit_2_and_recovers(small_disk: Path, small_data: Path,
                                                                    tmp_path: Path) -> None:
    """The command a person types: every stage cached, the registry's self-repair finds the disk full."""
    runs = small_disk / "runs"
    args = ["run", "--json", *sum((["--set", o] for o in small_overrides(small_data, runs)), [])]
    env = cli_env(tmp_path / "prefect")
    out, err = finish(cli(args, env, tmp_path / "first"), tmp_path / "first", timeout=900)
    first = last_json(out)
    root = runs / "exports" / "adapter"
    whole = _tree(root)
    shutil.rmtree(root / "v0001")
    (root / "champion.json").unlink()
    before = _tree(root)
    filler = _fill(small_disk, 0)
    full = cli(args, env, tmp_path / "full")
    out, err = finish(full, tmp_path / "full", timeout=900)
    assert full.returncode == USER_ERROR_EXIT, err[-3000:]
    message = " ".join(err.split())
    assert f"error: the repair of exports registry adapter: not enough disk space under runs_dir {runs}" in message
    assert "Traceback" not in err and "it needs about" in message, err[-3000:]
    assert _tree(root) == before and [p.name for p in (runs / "runs").iterdir()] == [Path(first["run_dir"]).name]
    filler.unlink()
    out, err = finish(cli(args, env, tmp_path / "again"), tmp_path / "again", timeout=900)
    again = last_json(out)
    assert {k: v["status"] for k, v in again["stages"].items()} == dict.fromkeys(first["stages"], "cached")
    assert _tree(root) == whole and again["metrics"]["champion_version"] == "v0001"


@pytest.mark.parametrize("leave", [0, 9 * 4096])
def test_prepare_data_parts_on_a_full_disk_leave_no_temporary_part(small_disk: Path, tmp_path: Path, leave: int
                                                                    ) -> None:
    from tasks.config import DataArgs
    from tasks.prepare_data.parts import read_part
    from tasks.prepare_data.stage import prepare_data

    shards = tmp_path / "shards"  # a folder source: tokenized file by file into parts
    shards.mkdir()
    lines = EMBEDDED_DATA.read_text().splitlines(keepends=True)
    for n in range(3):
        (shards / f"{n}.jsonl").write_text("".join(lines[n * 100:(n + 1) * 100]))
    runs, roomy = small_disk / "runs", tmp_path / "roomy"
    filler = _fill(small_disk, leave)
    with pytest.raises(UserError) as info:
        prepare_data.fn(DataArgs(source=str(shards)), ModelArgs(), runs)
    _full_disk_paragraph(info, "prepare_data", runs)
    memos = (HASH_MEMO, INPUT_HASH_MEMO)  # the hash memos are whole files (written by os.replace), not leftovers
    assert not [p for p in runs.rglob(".*") if p.name not in memos]  # no temporary part or file
    assert not list(runs.rglob(MANIFEST))
    assert all(read_part(p) is not None for p in runs.glob("prepare_data/parts/*") if p.is_dir())  # whole parts
    filler.unlink()
    folder = Path(prepare_data.fn(DataArgs(source=str(shards)), ModelArgs(), runs))
    alone = Path(prepare_data.fn(DataArgs(source=str(shards)), ModelArgs(), roomy))
    assert folder.name == alone.name  # the same key, and byte-identical data to a run that had space:
    assert [(folder / f).read_bytes() for f in ("train.parquet", "eval.parquet")] == \
        [(alone / f).read_bytes() for f in ("train.parquet", "eval.parquet")]


def test_sweep_record_on_a_full_disk_keeps_the_old_file(small_disk: Path) -> None:
    from tasks.reporting.sweep import _write

    record = small_disk / "runs" / "sweeps" / "k" / "sweep.json"
    _write(record, '{"before": true}')
    filler = _fill(small_disk, 0)
    with pytest.raises(UserError) as info:
        _write(record, json.dumps({"after": "x" * 100_000}))
    _full_disk_paragraph(info, "the sweep record (sweep.json)", small_disk / "runs")
    assert _tree(record.parent) == {"sweep.json": b'{"before": true}'}  # whole, no temporary file beside it
    filler.unlink()


def test_libraries_full_disk_errors_are_recognised(small_disk: Path) -> None:
    """safetensors and torch.save report a full disk in their own words (torch's zip writer: "unexpected pos"),
    not as OSError(ENOSPC)."""
    import torch
    from safetensors.torch import save_file

    from tasks.on_disk.disk import is_out_of_space

    _fill(small_disk, 100_000)
    tensors = {"w": torch.zeros(1_000_000)}  # 4 MB
    for write in (lambda: save_file(tensors, small_disk / "w.safetensors"),
                  lambda: torch.save(tensors, small_disk / "w.pt"),
                  lambda: (small_disk / "w.bin").write_bytes(b"\0" * 4_000_000)):
        with pytest.raises(Exception) as info:  # noqa: PT011 - each library's own type
            write()
        assert is_out_of_space(info.value, small_disk), repr(info.value)
    assert not is_out_of_space(RuntimeError("CUDA out of memory"), Path.home())
    assert not is_out_of_space(FileNotFoundError(2, "x"))
