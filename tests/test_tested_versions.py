"""constraints.txt (the tested versions): it pins exactly what the install resolves to, this environment is
installed from it, and a run or `--version` whose key libraries differ says which."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tasks import tested_versions
from tasks.config import PROJECT_ROOT, TrackArgs
from tasks.tested_versions import CONSTRAINTS, KEY_LIBRARIES, warn_untested_versions
from tests.conftest import flow_run_logs

EXTRAS = {"dev", "tracking", "serving", "eval"}  # the README's install line


def _needed(root: str, extras: set[str]) -> set[str]:
    """Every distribution that installing `root[extras]` needs here, by canonical name (markers evaluated)."""
    seen: dict[str, set[str]] = {}
    todo = [(root, extras)]
    while todo:
        name, wanted = todo.pop()
        for text in metadata.requires(name) or []:
            requirement = Requirement(text)
            marker = requirement.marker
            if marker and not any(marker.evaluate({"extra": e}) for e in wanted or {""}):
                continue
            key = canonicalize_name(requirement.name)
            if key not in seen or not requirement.extras <= seen[key]:
                seen[key] = seen.get(key, set()) | requirement.extras
                todo.append((requirement.name, requirement.extras))
    return set(seen)


def test_constraints_pin_exactly_what_the_install_needs_at_the_installed_versions() -> None:
    pinned = tested_versions.tested_versions()
    needed = _needed("qlora-pipeline", EXTRAS)
    assert sorted(needed - set(pinned)) == [], "not pinned: regenerate constraints.txt with .ci/lock"
    assert sorted(set(pinned) - needed) == [], "pinned but not needed: regenerate constraints.txt with .ci/lock"
    differ = {name: (metadata.version(name), version) for name, version in pinned.items()
              if Version(metadata.version(name)).public != Version(version).public}
    assert differ == {}, "this environment is not the tested one: install with -c constraints.txt (README: set-up)"


def test_key_libraries_are_pinned_and_torch_by_its_public_version() -> None:
    pinned = tested_versions.tested_versions()
    assert set(KEY_LIBRARIES) | set(tested_versions.TRACKING_LIBRARIES.values()) <= set(pinned)
    assert Version(pinned["torch"]).local is None  # its CPU and CUDA builds (+cpu, +cu130) both satisfy the pin


def _constraints_with(tmp_path: Path, **versions: str) -> Path:
    """constraints.txt with some pins changed."""
    lines = []
    for line in CONSTRAINTS.read_text().splitlines():
        name = line.partition("==")[0]
        lines.append(f"{name}=={versions[name]}" if name in versions else line)
    path = tmp_path / "constraints.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_drift_is_one_warning_naming_each_library_and_nothing_when_equal(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = _constraints_with(tmp_path, transformers="4.0.0", peft="0.1.0", mlflow="1.0.0")
    with caplog.at_level(logging.INFO, logger="qlora_pipeline"):
        warn_untested_versions(TrackArgs(), path)
        warn_untested_versions(TrackArgs(backend=["mlflow"]), path)
        warn_untested_versions(TrackArgs(backend=["mlflow"]))  # the real file: this environment is the tested one
    first, tracked = [r for r in caplog.records if r.name == "qlora_pipeline"]
    assert first.levelno == logging.WARNING
    assert f"transformers {metadata.version('transformers')} (tested 4.0.0)" in first.message
    assert f"peft {metadata.version('peft')} (tested 0.1.0)" in first.message
    assert "mlflow" not in first.message and "torch" not in first.message  # torch 2.13.0+cpu is the tested 2.13.0
    assert f"mlflow {metadata.version('mlflow')} (tested 1.0.0)" in tracked.message


def test_a_flow_run_logs_the_drift_before_any_stage(prefect_env: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The flow's first line; the run then fails on its missing data, as it would have anyway."""
    from flows.qlora_pipeline import qlora_pipeline
    from tasks.config import load_config

    monkeypatch.setattr(tested_versions, "CONSTRAINTS", _constraints_with(tmp_path, trl="0.0.1"))
    config = load_config(None, [f"runs_dir={tmp_path / 'runs'}", f"data.source={tmp_path / 'none.jsonl'}"])
    state = qlora_pipeline(config=config, return_state=True)
    assert state.is_failed()
    drift = [log for log in flow_run_logs(state) if "differ from the tested versions" in log.message]
    assert len(drift) == 1 and f"trl {metadata.version('trl')} (tested 0.0.1)" in drift[0].message


def test_version_says_whether_the_libraries_are_the_tested_ones(tmp_path: Path) -> None:
    """`qlora-pipeline --version` of this checkout, and of a copy whose constraints.txt pins another transformers."""
    def version(root: Path) -> str:
        done = subprocess.run([sys.executable, "-m", "deployments.cli", "--version"], cwd=root, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout

    here = version(PROJECT_ROOT)
    assert here.startswith(f"qlora-pipeline {metadata.version('qlora-pipeline')} ({PROJECT_ROOT})")
    assert f"transformers {metadata.version('transformers')}" in here and "as tested (constraints.txt)" in here
    copy = tmp_path / "checkout"
    for package in ("tasks", "flows", "deployments"):
        shutil.copytree(PROJECT_ROOT / package, copy / package, ignore=shutil.ignore_patterns("__pycache__"))
    _constraints_with(copy, transformers="4.0.0")
    there = version(copy)
    assert f"({copy})" in there
    assert f"differ from constraints.txt: transformers {metadata.version('transformers')} (tested 4.0.0)" in there
