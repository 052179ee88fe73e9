"""A registry that nights without a human can trust (issue 41): damaged records are repaired from the export stage
folders they came from or refused with the file and the fix, `history` never prints a traceback, a version folder is
verified by its own record wherever it is copied, an adapter with non-finite weights is never published, a first
version must beat its base model, and a copied runs_dir names its own folders.

A real registry of two versions (the weak and the strong adapter of tests/test_gate.py, published by the real
stages through .fn()) is built once; each test damages a copy of it the way a disk, a person or a sync tool does.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from deployments.cli import USER_ERROR_EXIT, main
from tasks.config import PROJECT_ROOT, EvalArgs, ExportArgs, LoraArgs, SpeedArgs, TrainArgs
from tasks.errors import UserError
from tasks.evaluate_adapter.champion import score_champion
from tasks.evaluate_adapter.stage import evaluate_adapter
from tasks.export_adapter.stage import export_adapter
from tasks.hashing.files import file_sha256
from tasks.on_disk.manifest import MANIFEST, read_manifest
from tasks.registry import store as registry
from tasks.registry.init_adapter import resolve_adapter
from tasks.train_adapter.stage import train_adapter

# the keys of tests/test_gate.py's adapters and evaluation: in one session these stages are computed once
EVAL = EvalArgs(max_samples=16, generation_samples=2, max_new_tokens=4, per_device_eval_batch_size=8)
EXPORT = ExportArgs(promotion_margin=0.001)  # two steps move the tiny model's eval loss by well under 1%


@pytest.fixture(scope="module")
def published(stages: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """runs_dir `template` with registry `adapter`: v0001 the weak adapter (it beats the base model), v0002 the
    strong one (it beats v0001 on the same data: the champion), and the export stage folders that published them."""
    runs, template = stages["runs"], tmp_path_factory.mktemp("registry")
    lora = LoraArgs(r=4, lora_alpha=8)
    adapters = {"weak": train_adapter.fn(lora, TrainArgs(max_steps=2, logging_steps=1), SpeedArgs(), runs,
                                         stages["data"], stages["model"]),
                "strong": train_adapter.fn(lora, TrainArgs(max_steps=12, learning_rate=0.02, logging_steps=1),
                                           SpeedArgs(), runs, stages["data"], stages["model"])}
    exports, evals = {}, {}
    for name in ("weak", "strong"):
        evals[name] = evaluate_adapter.fn(EVAL, runs, stages["data"], stages["model"], adapters[name])
        judged = score_champion.fn(EVAL, template, stages["data"], stages["model"], adapters[name], evals[name],
                                   EXPORT)
        exports[name] = export_adapter.fn(EXPORT, template, stages["data"], stages["model"], adapters[name],
                                          evals[name], judged)
    root = template / "exports" / "adapter"
    assert [(r["version"], r["promotion"]) for r in registry.versions(root)] == [("v0001", "promoted"),
                                                                                ("v0002", "promoted")]
    return {**stages, "template": template, "adapters": adapters, "evals": evals, "exports": exports}


def _copy(published: dict[str, Any], tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the template runs_dir to damage: (runs_dir, registry root)."""
    runs = tmp_path / "runs"
    shutil.copytree(published["template"], runs)
    return runs, registry.registry_dir(runs, "adapter")


def _tree(folder: Path) -> dict[str, bytes]:
    """Every file under folder with its bytes (hidden ones too: a leftover temp file is a difference)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _edited(change: Callable[[dict[str, Any]], Any]) -> Callable[[bytes], bytes]:
    def edit(good: bytes) -> bytes:
        record = json.loads(good)
        change(record)
        return json.dumps(record).encode()
    return edit


# how records are found damaged: a write cut short, a file zeroed, another file's bytes, a tool that wrote an empty
# list, a hand edit that lost a field or wrote the wrong type
DAMAGE: dict[str, Callable[[bytes], bytes]] = {
    "truncated": lambda good: good[:len(good) // 2],
    "empty": lambda good: b"",
    "binary": lambda good: bytes(range(256)) * 8,
    "a list": lambda good: b"[]",
    "metrics-less": _edited(lambda r: r.pop("metrics")),
    "wrong-typed": _edited(lambda r: r["metrics"].update(tuned_eval_loss="low")),
    "version as a number": _edited(lambda r: r.update(version=2)),
}


def _history(runs: Path, capsys: pytest.CaptureFixture[str], name: str = "adapter") -> tuple[int, str, str]:
    code = main(["history", "--runs-dir", str(runs), "--export-name", name])
    out, err = capsys.readouterr()
    return code, out, " ".join(err.split())


@pytest.mark.parametrize("how", list(DAMAGE))
def test_a_damaged_version_record_is_restored_from_its_stage_folder(published: dict[str, Any], tmp_path: Path,
                                                                    how: str, capsys: pytest.CaptureFixture[str]
                                                                    ) -> None:
    runs, root = _copy(published, tmp_path)
    record = root / "v0002" / registry.VERSION_FILE
    whole = _tree(root)
    record.write_bytes(DAMAGE[how](record.read_bytes()))
    code, out, err = _history(runs, capsys)
    assert code == 0, err
    assert f"repaired: restored v0002 from {runs / 'export_adapter'}" in err and "(its version.json " in err
    assert err.count("repaired: restored v0002") == 1, err  # said once, by the registry
    assert "| v0001 |" in out and "| v0002 |" in out and "Traceback" not in err
    assert _tree(root) == whole  # the record back as it was published, nothing else changed, nothing left over
    assert registry.champion(root)["version"] == "v0002"


@pytest.mark.parametrize("how", list(DAMAGE))
def test_a_damaged_champion_record_is_rewritten_for_the_same_champion(published: dict[str, Any], tmp_path: Path,
                                                                      how: str) -> None:
    runs, root = _copy(published, tmp_path)
    whole = _tree(root)
    champion = root / registry.CHAMPION
    champion.write_bytes(DAMAGE[how](champion.read_bytes()))
    registry.check_registry("adapter", runs)  # what a run does before any stage
    assert _tree(root) == whole
    assert registry.champion(root)["version"] == "v0002"


def test_a_deleted_champion_folder_comes_back_from_its_stage_folder(published: dict[str, Any], tmp_path: Path) -> None:
    runs, root = _copy(published, tmp_path)
    whole = _tree(root)
    shutil.rmtree(root / "v0002")
    assert registry.champion(root)["version"] == "v0002" and _tree(root) == whole


def test_a_record_nothing_can_restore_is_exit_2_naming_the_file_and_the_fix(published: dict[str, Any],
                                                                           tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    runs, root = _copy(published, tmp_path)
    record = root / "v0001" / registry.VERSION_FILE
    record.write_bytes(DAMAGE["truncated"](record.read_bytes()))
    shutil.rmtree(runs / "export_adapter" / Path(published["exports"]["weak"]).name)  # its stage folder is gone too
    before = _tree(runs)
    code, out, err = _history(runs, capsys)
    assert code == USER_ERROR_EXIT and "Traceback" not in err
    assert f"{record} is not readable JSON (JSONDecodeError)" in err
    assert f"Move each of those version folders out of {root}" in err and "put back an intact copy" in err
    assert [line[:9] for line in out.splitlines() if line.startswith("| v0")] == ["| v0002 |"]  # the intact rows
    # a run refuses before any stage, and publishing writes nothing: which version is champion would be a guess
    with pytest.raises(UserError, match="no export stage folder can restore"):
        registry.check_registry("adapter", runs)
    source = tmp_path / "another-export"
    shutil.copytree(published["exports"]["strong"], source, ignore=shutil.ignore_patterns(registry.PUBLISHED))
    with pytest.raises(UserError, match="no export stage folder can restore"):
        registry.publish(root, source, "another-key", {"tuned_eval_loss": 1.0, "base_eval_loss": 2.0}, 0.01, "d",
                         lambda folder, record: "card")
    assert _tree(runs) == before
    shutil.move(root / "v0001", tmp_path / "set-aside")  # the fix the paragraph gives
    code, out, err = _history(runs, capsys)
    assert code == 0 and "| v0002 |" in out


def test_promote_says_each_repair_once(published: dict[str, Any], tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    """`qlora-pipeline promote` repairs what it reads, as a run and `history` do, and says each repair once: a damaged
    record of another version (heal), and the promoted version's damaged adapter file (restored before it is made
    champion)."""
    runs, root = _copy(published, tmp_path)
    (root / "v0002" / registry.VERSION_FILE).write_bytes(b"")
    (root / "v0001" / "adapter_model.safetensors").write_bytes(b"not the adapter")
    code = main(["promote", "adapter", "v0001", "--set", f"runs_dir={runs}"])
    out, err = capsys.readouterr()
    err = " ".join(err.split())
    assert code == 0 and "champion now v0001" in out, (out, err)
    assert err.count("exports registry adapter: repaired: restored v0002 from") == 1, err
    assert err.count("exports registry adapter: repaired: restored v0001 from") == 1, err
    assert "adapter_model.safetensors is damaged" in err and "Traceback" not in err
    assert registry.damage(root, registry.version_record(root, "v0001")) == ""


def test_history_in_a_process_never_prints_a_traceback(published: dict[str, Any], tmp_path: Path) -> None:
    """The command as typed, on a registry whose every record is damaged in another way."""
    runs, root = _copy(published, tmp_path)
    (root / "v0001" / registry.VERSION_FILE).write_bytes(b"\x00\xff" * 100)
    (root / "v0002" / registry.VERSION_FILE).write_bytes(b"[]")
    (root / registry.CHAMPION).write_bytes(b"")
    out = subprocess.run([sys.executable, "-m", "deployments.cli", "history", "--export-name", "adapter",
                          "--runs-dir", str(runs)], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    assert "| v0001 |" in out.stdout and "| v0002 |" in out.stdout
    assert registry.champion(root)["version"] == "v0002"


def _set(path: Path, change: Callable[[dict[str, Any]], Any]) -> None:
    record = json.loads(path.read_text())
    change(record)
    path.write_text(json.dumps(record))  # json writes NaN and Infinity as a hand edit in Python would


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_champion_whose_numbers_were_set_non_finite_by_hand_is_repaired(published: dict[str, Any], tmp_path: Path,
                                                                          value: float,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """A NaN or infinite metric is damage: the record comes back from its stage folder, and no gate compares against
    it (every challenger was "rejected ... needed < nan", and the summary crashed)."""
    runs, root = _copy(published, tmp_path)
    whole = _tree(root)
    for path in (root / registry.CHAMPION, root / "v0002" / registry.VERSION_FILE):
        _set(path, lambda r: r["metrics"].update(tuned_eval_loss=value))
    code, out, err = _history(runs, capsys)
    assert code == 0 and "Traceback" not in err, err
    assert "has no finite number for metrics.tuned_eval_loss" in err and err.count("repaired: restored v0002") == 1
    assert "nan" not in out and "inf" not in out and _tree(root) == whole
    _set(root / registry.CHAMPION, lambda r: r["metrics"].update(tuned_eval_loss=value))  # champion.json alone
    registry.check_registry("adapter", runs)
    assert _tree(root) == whole


def test_a_champion_with_non_finite_weights_set_by_hand_is_never_the_bar(published: dict[str, Any],
                                                                         tmp_path: Path) -> None:
    """Weights replaced by a diverged adapter's, hashes edited to match: the record differs from what its stage
    folder published, so the version is restored before any stage. A champion that still scores NaN on a run's data
    (its stage folder gone) is not compared against: the challenger is judged against the base model."""
    from safetensors.torch import load_file, save_file

    runs, root = _copy(published, tmp_path)
    whole = _tree(root)
    weights = root / "v0002" / "adapter_model.safetensors"
    weights.unlink()  # a hard link into the stage folder: replace it, as a hand copy would
    tensors = load_file(published["template"] / "exports" / "adapter" / "v0002" / "adapter_model.safetensors")
    save_file({k: v.clone().fill_(float("nan")) for k, v in tensors.items()}, weights)
    for path in (root / "v0002" / registry.VERSION_FILE, root / registry.CHAMPION):
        _set(path, lambda r: r["files"].update({"adapter_model.safetensors": file_sha256(weights)}))
    registry.check_registry("adapter", runs)  # what a run does before any stage
    assert _tree(root) == whole and not registry.non_finite(root / "v0002")

    from tasks.registry.gate import identity

    champion = registry.champion(root)
    source = tmp_path / "challenger"
    shutil.copytree(Path(published["adapters"]["weak"]) / "adapter", source)
    record = registry.publish(root, source, "challenger", {
        "tuned_eval_loss": 6.0, "base_eval_loss": 6.9, "champion_eval_loss": float("nan"),
        "champion_adapter": identity(champion), "judged_against": "v0002"}, 0.01, "d", lambda folder, rec: "card")
    assert record["promotion"] == "promoted" and "nan" not in record["reason"].split(":")[-1], record["reason"]
    assert record["reason"].startswith(
        "champion v0002's eval loss is nan on this run's eval data (same-data rule): it is damaged, so it is not "
        "compared against; judged against the base model instead: tuned eval loss 6.0000 beats the base model's "
        "6.9000"), record["reason"]


def test_a_version_folder_copied_in_by_hand_is_refused_not_listed(published: dict[str, Any], tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """v0001 copied to v0003 and its record renamed: not a version any stage published, so `history` names it and the
    fix (it listed it as promoted), `promote` refuses in one paragraph (it died with "Deadlock"), and moving it out
    is the fix."""
    runs, root = _copy(published, tmp_path)
    shutil.copytree(root / "v0001", root / "v0003")
    _set(root / "v0003" / registry.VERSION_FILE, lambda r: r.update(version="v0003", path="exports/adapter/v0003"))
    code, out, err = _history(runs, capsys)
    assert code == USER_ERROR_EXIT and "Traceback" not in err
    assert f"{root / 'v0003' / registry.VERSION_FILE} claims to be v0003, but its export stage folder" in err
    assert "published it as v0001 (a version folder copied in by hand?)" in err and "Move each of those" in err
    assert [line[:9] for line in out.splitlines() if line.startswith("| v0")] == ["| v0001 |", "| v0002 |"]
    with pytest.raises(UserError, match="claims to be v0003"):
        registry.check_registry("adapter", runs)  # a run: refused before any stage
    code = main(["promote", "adapter", "v0001", "--set", f"runs_dir={runs}"])
    out, err = capsys.readouterr()
    assert code == USER_ERROR_EXIT and "claims to be v0003" in err and "The champion was not changed" in err
    assert "Traceback" not in err and "Deadlock" not in err
    assert json.loads((root / registry.CHAMPION).read_text())["version"] == "v0002"
    shutil.move(root / "v0003", tmp_path / "set-aside")
    assert main(["promote", "adapter", "v0001", "--set", f"runs_dir={runs}"]) == 0
    assert registry.champion(root)["version"] == "v0001"


def test_a_champion_record_that_is_a_folder_and_a_linked_version_folder(published: dict[str, Any], tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """champion.json a folder: an empty one is replaced by the record, one with files is left and named with the fix
    (`run` exited 1 with IsADirectoryError, `history` advised a permissions fix). A version folder that is a link to
    a copy with a damaged record: the link gives way to the version restored from its stage folder, the copy it
    pointed to is left as it was (it raised "exists although no version.json names it")."""
    runs, root = _copy(published, tmp_path)
    whole = _tree(root)
    (root / registry.CHAMPION).unlink()
    (root / registry.CHAMPION).mkdir()
    code, out, err = _history(runs, capsys)
    assert code == 0 and "removed the empty folder champion.json" in err and _tree(root) == whole, err
    (root / registry.CHAMPION).unlink()
    (root / registry.CHAMPION).mkdir()
    (root / registry.CHAMPION / "notes.txt").write_text("mine")
    code, out, err = _history(runs, capsys)
    assert code == USER_ERROR_EXIT and "Traceback" not in err and "user who can write" not in err
    assert f"{root / registry.CHAMPION} is a folder, not the registry's champion record, and it holds files" in err
    with pytest.raises(UserError, match="Move it away"):
        registry.check_registry("adapter", runs)
    shutil.move(root / registry.CHAMPION, tmp_path / "champion.json.bad")  # the fix it gives
    registry.check_registry("adapter", runs)
    assert _tree(root) == whole

    elsewhere = tmp_path / "copy-of-v0002"
    shutil.move(root / "v0002", elsewhere)
    (root / "v0002").symlink_to(elsewhere, target_is_directory=True)
    (elsewhere / registry.VERSION_FILE).write_bytes(b"")
    code, out, err = _history(runs, capsys)
    assert code == 0 and "Traceback" not in err and err.count("repaired: restored v0002") == 1, err
    assert not (root / "v0002").is_symlink() and _tree(root) == whole
    assert (elsewhere / registry.VERSION_FILE).read_bytes() == b""  # the link's target is not the registry's


@pytest.mark.slow  # the command as typed: a process with Prefect's temporary server
def test_run_refuses_a_champion_record_that_is_a_folder_with_exit_2(published: dict[str, Any], tmp_path: Path) -> None:
    from tests.conftest import cli_env

    runs, root = _copy(published, tmp_path)
    (root / registry.CHAMPION).unlink()
    (root / registry.CHAMPION).mkdir()
    (root / registry.CHAMPION / "notes.txt").write_text("mine")
    done = subprocess.run([sys.executable, "-m", "deployments.cli", "run", "--set", f"runs_dir={runs}"],
                          cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=600, env=cli_env(tmp_path / "p"))
    said = " ".join(done.stderr.split())
    assert done.returncode == USER_ERROR_EXIT and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "is a folder, not the registry's champion record" in said and "Move it away" in said


@pytest.mark.parametrize("name", ["../..", "/etc", "a/b", ".hidden"])
def test_history_validates_the_export_name_as_export_name_is(tmp_path: Path, name: str,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _history(tmp_path, capsys, name)
    assert code == USER_ERROR_EXIT and out == ""
    assert f"error: --export-name {name!r}: must be one folder name" in err


def _flip(path: Path) -> None:
    """4 KB of the weights inverted in place: the size stays, the header still loads."""
    with path.open("r+b") as f:
        f.seek(path.stat().st_size - 4096)
        block = f.read(4096)
        f.seek(path.stat().st_size - 4096)
        f.write(bytes(b ^ 0xFF for b in block))


@pytest.mark.parametrize("name", ["my-adapter", "v0002"])
def test_a_copied_version_folder_is_verified_by_its_own_record(published: dict[str, Any], tmp_path: Path,
                                                               name: str) -> None:
    """`train.init_adapter: /some/copy/of/v0002`, or a renamed copy: a same-size corruption in the copy is seen."""
    copy = tmp_path / "served" / name
    shutil.copytree(published["template"] / "exports" / "adapter" / "v0002", copy)
    assert resolve_adapter(str(copy), tmp_path) == copy.resolve()
    weights = copy / "adapter_model.safetensors"
    _flip(weights)
    with pytest.raises(UserError) as caught:
        resolve_adapter(str(copy), tmp_path)
    assert (f"{weights} is damaged (its sha256 is not the one recorded when v0002 was published)"
            in str(caught.value))
    (copy / registry.VERSION_FILE).write_bytes(b"[]")  # a copy whose record is damaged cannot be verified
    with pytest.raises(UserError, match="version.json holds a JSON list, not a version record, so the folder's "
                                        "files cannot be verified"):
        resolve_adapter(str(copy), tmp_path)


def _resealed(train_dir: str, into: Path, value: float) -> str:
    """A copy of a train_adapter stage folder whose weights hold `value` in one tensor, its manifest sealed over them:
    what a training that diverged would have left."""
    from safetensors.torch import load_file, save_file

    folder = into / Path(train_dir).name
    shutil.copytree(train_dir, folder)
    weights = folder / "adapter" / "adapter_model.safetensors"
    tensors = load_file(weights)
    first = sorted(tensors)[0]
    tensors[first] = tensors[first].clone().fill_(value)
    save_file(tensors, weights)
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["hashes"]["adapter/adapter_model.safetensors"] = file_sha256(weights)
    manifest["outputs"]["adapter/adapter_model.safetensors"] = weights.stat().st_size
    (folder / MANIFEST).write_text(json.dumps(manifest))
    assert read_manifest(folder) is not None
    return str(folder)


def test_an_adapter_with_non_finite_weights_is_never_published(published: dict[str, Any], tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    diverged = _resealed(published["adapters"]["weak"], tmp_path / "train", float("nan"))
    with pytest.raises(UserError) as caught:
        export_adapter.fn(EXPORT, runs, published["data"], published["model"], diverged, published["evals"]["weak"])
    assert "1 of its" in str(caught.value) and "hold inf or NaN values" in str(caught.value)
    assert "training diverged. Nothing was exported or published" in str(caught.value)
    assert not list(runs.glob("export_adapter/*/manifest.json")) and not (runs / "exports").exists()
    # publishing itself refuses such a folder, whoever calls it
    source = tmp_path / "stage"
    shutil.copytree(Path(diverged) / "adapter", source)
    with pytest.raises(UserError, match="hold inf or NaN values: .* training diverged"):
        registry.publish(runs / "exports" / "adapter", source, "k", {"tuned_eval_loss": 1.0, "base_eval_loss": 2.0},
                         0.01, "d", lambda folder, record: "card")
    assert not list((runs / "exports" / "adapter").glob("v*"))


def test_a_first_version_that_does_not_beat_its_base_model_is_not_champion(published: dict[str, Any],
                                                                          tmp_path: Path) -> None:
    """The diverged run of the issue: uniform predictions (ln 1024) against the base model's 6.9026."""
    root = tmp_path / "runs" / "exports" / "adapter"
    source = tmp_path / "stage"
    shutil.copytree(Path(published["adapters"]["weak"]) / "adapter", source)
    record = registry.publish(root, source, "k", {"tuned_eval_loss": 6.9315, "base_eval_loss": 6.9026}, 0.01,
                              "d", lambda folder, record: "card")
    assert (record["promotion"], record["rule"]) == ("rejected", "first")
    assert record["reason"] == (
        "first version (no champion yet): tuned eval loss 6.9315 does not beat the base model's 6.9026 on this "
        "run's eval data by more than the 1.0% margin (needed < 6.8336); a version becomes the first champion only "
        "when it beats its base model")
    assert registry.champion(root) is None and not (root / registry.CHAMPION).exists()
    source = tmp_path / "stage-2"  # a stage folder publishes one version (its key's)
    shutil.copytree(Path(published["adapters"]["weak"]) / "adapter", source)
    preference = registry.publish(root, source, "k2", {"tuned_eval_loss": 1.0, "tuned_reward_accuracy": 0.5,
                                                       "base_reward_accuracy": 0.5}, 0.01, "d",
                                  lambda folder, record: "card", {"method": "dpo"})
    assert preference["promotion"] == "rejected" and "does not beat the base model's 0.500" in preference["reason"]
    assert registry.champion(root) is None


# --- real runs: a copied runs_dir, then damaged, then damaged beyond repair -------------------------------------

def _registry_files(root: Path) -> str:
    return "".join(p.read_text() for p in sorted(root.rglob("*.json")) if p.parent == root or p.name == "version.json")


@pytest.mark.slow  # four runs of the flow (one computes) and one command in a process of its own
def test_copied_and_damaged_registries_across_real_runs(prefect_env: Path, small_data: Path, tmp_path: Path) -> None:
    from tests.conftest import cli, cli_env, finish, run_flow, small_overrides, statuses

    original, copy = tmp_path / "a", tmp_path / "copy"
    run_flow(small_overrides(small_data, original))
    shutil.copytree(original, copy)
    overrides = small_overrides(small_data, copy)
    again = run_flow(overrides)
    assert set(statuses(again).values()) == {"cached"}
    root = registry.registry_dir(copy, "adapter")
    m = again["metrics"]
    assert (m["export_version"], m["champion_version"]) == ("v0001", "v0001")
    assert m["export_path"] == str(root / "v0001")  # the copy's own version, not the original's
    assert json.loads((Path(again["run_dir"]) / "run.json").read_text())["metrics"]["export_path"] == m["export_path"]
    export_metrics = read_manifest(Path(again["export_dir"])).metrics.model_dump_json()
    assert str(original.resolve()) not in _registry_files(root) + export_metrics
    # records damaged between nights: the next run repairs them and goes on
    whole = _tree(root)
    (root / registry.CHAMPION).write_bytes(b'{"version": "v00')
    (root / "v0001" / registry.VERSION_FILE).write_bytes(b"[]")
    assert run_flow(overrides)["metrics"]["champion_version"] == "v0001" and _tree(root) == whole
    # damaged beyond repair (its stage folder's copy of the record is gone too): the command stops before any stage
    (root / "v0001" / registry.VERSION_FILE).write_bytes(b"")
    shutil.rmtree(Path(again["export_dir"]) / registry.PUBLISHED)
    before = sorted(p.relative_to(copy) for p in copy.rglob("*") if p.is_dir())
    proc = cli(["run", *(a for o in overrides for a in ("--set", o))], cli_env(tmp_path / "prefect"), tmp_path / "log")
    out, err = finish(proc, tmp_path / "log", timeout=600)
    text = " ".join(err.split())
    assert proc.returncode == USER_ERROR_EXIT, out[-2000:] + err[-3000:]
    assert f"{root / 'v0001' / registry.VERSION_FILE} is not readable JSON" in text and "Traceback" not in err
    assert sorted(p.relative_to(copy) for p in copy.rglob("*") if p.is_dir()) == before  # no stage, no run folder
    # the fix the paragraph gives: the version folder moved out; the next run publishes again and goes on
    shutil.move(root / "v0001", tmp_path / "set-aside")
    fixed = run_flow(overrides)
    assert fixed["metrics"]["champion_version"] == "v0001" and fixed["metrics"]["promotion"] == "promoted"
