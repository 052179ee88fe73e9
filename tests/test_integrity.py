"""Integrity (issue 17): damage that sizes miss is caught by content hashes, incomplete checkpoints are skipped,
the registry repairs itself, and the exported run config round-trips. Stages run alone through .fn().
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import yaml

from tasks.config import (
    EMBEDDED_DATA,
    DataArgs,
    EvalArgs,
    ExportArgs,
    LoraArgs,
    ModelArgs,
    SpeedArgs,
    TrainArgs,
    load_config,
)
from tasks.evaluate_adapter.stage import evaluate_adapter
from tasks.export_adapter.stage import export_adapter
from tasks.hashing.files import HASH_MEMO
from tasks.on_disk.manifest import MANIFEST, check_stage, read_manifest
from tasks.prepare_data.stage import prepare_data
from tasks.prepare_model.stage import prepare_model
from tasks.registry import store as registry
from tasks.train_adapter.resume import latest_checkpoint, write_marker
from tasks.train_adapter.stage import train_adapter
from tests.conftest import settled

LORA, TRAIN = LoraArgs(r=4, lora_alpha=8), TrainArgs(max_steps=2, logging_steps=1)
EVAL = EvalArgs(max_samples=8, generation_samples=2, max_new_tokens=4, per_device_eval_batch_size=4)
EXPORT = ExportArgs(promotion_margin=0.001)  # two steps beat the base model, by less than the default 1%


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    runs = tmp_path_factory.mktemp("runs")
    data = tmp_path_factory.mktemp("data") / "d.jsonl"
    data.write_text("".join(EMBEDDED_DATA.read_text().splitlines(keepends=True)[:120]))
    out: dict[str, Any] = {"runs": runs, "source": data}
    out["data"] = prepare_data.fn(DataArgs(source=str(data)), ModelArgs(), runs)
    out["model"] = prepare_model.fn(ModelArgs(), runs)
    out["adapter"] = train_adapter.fn(LORA, TRAIN, SpeedArgs(), runs, out["data"], out["model"])
    out["eval"] = evaluate_adapter.fn(EVAL, runs, out["data"], out["model"], out["adapter"])
    out["export"] = export_adapter.fn(EXPORT, runs, out["data"], out["model"], out["adapter"], out["eval"])
    return out


def _flip_a_byte(path: Path, at: int = -20) -> None:
    """Same size, different bytes: what a size check cannot see."""
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.slow  # shares the module's five stages, built once (~40 s)
def test_manifests_record_a_hash_of_every_output(built: dict[str, Any]) -> None:
    for stage in ("data", "model", "adapter", "eval", "export"):
        manifest = read_manifest(Path(built[stage]))
        assert manifest is not None and set(manifest.hashes) == set(manifest.outputs), stage
        assert all(len(h) == 64 for h in manifest.hashes.values())


@pytest.mark.slow  # shares the module's five stages, built once (~40 s)
def test_same_size_damage_is_recomputed_with_one_warning(built: dict[str, Any],
                                                         caplog: pytest.LogCaptureFixture) -> None:
    folder = Path(built["data"])
    before = (folder / "eval.parquet").read_bytes()
    _flip_a_byte(folder / "eval.parquet")
    assert check_stage(folder) == (None, "eval.parquet is damaged (its sha256 differs from the one recorded)")
    with caplog.at_level(logging.WARNING):
        again = prepare_data.fn(DataArgs(source=str(built["source"])), ModelArgs(), built["runs"])
    assert again == built["data"] and (folder / "eval.parquet").read_bytes() == before
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "recomputing" in warnings[0] and "eval.parquet is damaged" in warnings[0]


@pytest.mark.slow  # shares the module's five stages, built once (~40 s)
def test_damaged_adapter_is_never_used(built: dict[str, Any]) -> None:
    folder = Path(built["adapter"])
    _flip_a_byte(folder / "adapter" / "adapter_model.safetensors", at=-8)
    assert check_stage(folder)[1].startswith("adapter/adapter_model.safetensors is damaged")
    # downstream built refuse it too: their keys need an intact upstream
    assert read_manifest(folder) is None
    assert train_adapter.fn(LORA, TRAIN, SpeedArgs(), built["runs"], built["data"], built["model"]) == str(folder)
    assert read_manifest(folder) is not None


@pytest.mark.slow  # shares the module's five stages, built once (~40 s)
def test_a_manifest_that_lists_fewer_outputs_does_not_vouch_for_the_stage(built: dict[str, Any]) -> None:
    folder = Path(built["eval"])
    manifest = json.loads((folder / MANIFEST).read_text())
    (folder / MANIFEST).write_text(json.dumps({**manifest, "outputs": {}, "hashes": {}}))
    (folder / "metrics.json").unlink()
    assert check_stage(folder) == (None, "manifest.json does not list metrics.json, samples.jsonl")
    evaluate_adapter.fn(EVAL, built["runs"], built["data"], built["model"], built["adapter"])
    assert read_manifest(folder) is not None and (folder / "metrics.json").is_file()


@pytest.mark.slow  # shares the module's five stages, built once (~40 s)
def test_hashes_are_memoised_per_file_identity(built: dict[str, Any]) -> None:
    folder = Path(built["model"])
    memo = json.loads((folder / HASH_MEMO).read_text())
    *identity, digest = memo["modules.json"]
    st = (folder / "modules.json").stat()
    assert identity == [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]
    # the memo is trusted while the identity holds (no read): a wrong digest there is believed ...
    (folder / HASH_MEMO).write_text(json.dumps({**memo, "modules.json": [*identity, "0" * 64]}))
    assert "modules.json is damaged" in check_stage(folder)[1]
    # ... and a file whose identity changed (here: its mtime) is read and hashed again
    (folder / "modules.json").touch()
    settled(folder / "modules.json")  # else hashed, not memoised: it changed less than a timestamp tick ago
    assert check_stage(folder)[0] is not None
    assert json.loads((folder / HASH_MEMO).read_text())["modules.json"][5] == digest


def _checkpoint(root: Path, step: int) -> Path:
    folder = root / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    for name in ("adapter_model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json"):
        (folder / name).write_bytes(f"{name} at {step}".encode() * 10)
    write_marker(folder, step)
    return folder


@pytest.mark.parametrize("damage", ["missing_optimizer", "truncated_adapter", "same_size_adapter", "no_marker"])
def test_damaged_newest_checkpoint_falls_back_to_the_previous(tmp_path: Path, damage: str,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    older, newest = _checkpoint(tmp_path, 2), _checkpoint(tmp_path, 4)
    assert latest_checkpoint(tmp_path) == newest
    if damage == "missing_optimizer":
        (newest / "optimizer.pt").unlink()
    elif damage == "truncated_adapter":
        (newest / "adapter_model.safetensors").write_bytes(b"trunc")
    elif damage == "same_size_adapter":
        _flip_a_byte(newest / "adapter_model.safetensors", at=0)
    else:
        (newest / "complete").unlink()
    with caplog.at_level(logging.WARNING):
        assert latest_checkpoint(tmp_path) == older
    assert not newest.exists()
    assert any("skipping checkpoint-4" in r.getMessage() for r in caplog.records)


@pytest.mark.slow  # shares the module's five stages, built once (~40 s)
def test_registry_restores_a_deleted_version_and_champion(built: dict[str, Any]) -> None:
    import shutil

    root = registry.registry_dir(built["runs"], "adapter")
    version = read_manifest(Path(built["export"])).metrics.export_version
    files = sorted(p.name for p in (root / version).iterdir())
    shutil.rmtree(root / version)
    (root / registry.CHAMPION).unlink()
    assert registry.current(root)["champion_version"] is None
    # a reused export stage repairs the registry
    export_adapter.fn(EXPORT, built["runs"], built["data"], built["model"], built["adapter"], built["eval"])
    assert sorted(p.name for p in (root / version).iterdir()) == files
    assert registry.current(root)["champion_version"] == version
    # so does the run record (a stage Prefect reports as Cached never runs its body)
    from tasks.reporting.run_record import registry_now

    (root / registry.CHAMPION).unlink()
    shutil.rmtree(root / version)
    now = registry_now(load_config(None, [f"runs_dir={built['runs']}"]), Path(built["export"]))
    assert now["champion_version"] == version and (root / version / registry.VERSION_FILE).is_file()


@pytest.mark.slow  # shares the module's five stages, built once (~40 s)
def test_exported_run_config_round_trips_through_the_cli_loader(built: dict[str, Any]) -> None:
    path = Path(built["export"]) / "run_config.yaml"
    config = load_config(path)
    saved = yaml.safe_load(path.read_text())
    assert config.model_dump(mode="json", exclude={"runs_dir"}) == saved
    assert config.data.source == str(built["source"]) and config.lora.r == 4
