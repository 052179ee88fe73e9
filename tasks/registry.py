"""The exports registry: numbered versions of an adapter and a champion chosen by a promotion gate.

    runs_dir/exports/<name>/
        v0001/, v0002/, ...   one per published export stage, never overwritten; version.json says why
        champion.json         the current champion: its version, path and eval metrics

A version is copied under a temp name and renamed into place, so a crash leaves no half version (only
a `.tmp-*` folder, cleared by the next publish); champion.json is replaced atomically (temp file +
os.replace). A file lock beside the registry serializes publishers. Each version records the export
stage key that produced it: a stage recomputed under the same key (its manifest lost after publishing)
gets that version back instead of a second one.

The registry repairs itself from the export stage folders: each keeps a copy of its version's record
and card in `published/`, so `repair` restores a deleted version folder, and a missing or stale
champion.json is rebuilt from the newest promoted version still present. `current` says what the
registry holds now; the run summary reports that, not what the manifest recorded when it published.
Part of the shared contract (not of export_adapter) because the run record calls it too.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from filelock import FileLock

VERSION_FILE = "version.json"
CHAMPION = "champion.json"
PUBLISHED = "published"  # in the export stage folder: the version.json and README.md it was published with
_VERSION_NAME = re.compile(r"^v(\d{4,})$")


def registry_dir(runs_dir: Path, name: str) -> Path:
    """runs_dir/exports/<name>: the versions and champion of one named adapter."""
    return Path(runs_dir).expanduser().resolve() / "exports" / name


def champion(root: Path) -> dict[str, Any] | None:
    """The current champion record (version, path, metrics), or None before the first promotion."""
    try:
        return json.loads((root / CHAMPION).read_text())
    except FileNotFoundError:
        return None


def versions(root: Path) -> list[dict[str, Any]]:
    """Every published version's record, oldest first."""
    found = sorted((int(m.group(1)), p) for p in root.glob("v*") if (m := _VERSION_NAME.match(p.name)))
    return [json.loads((p / VERSION_FILE).read_text()) for _, p in found if (p / VERSION_FILE).is_file()]


def gate(metrics: dict[str, Any], current: dict[str, Any] | None, margin: float, eval_data: str) -> tuple[str, str]:
    """('promoted' | 'rejected', reason): promoted when the tuned eval loss beats the champion's by the margin;
    for preference runs (their metrics have a tuned reward accuracy) when the reward accuracy does."""
    if metrics.get("tuned_reward_accuracy") is not None:
        return _preference_gate(metrics, current, margin, eval_data)
    loss = metrics["tuned_eval_loss"]
    if current is None:
        return "promoted", f"first version: no champion yet (tuned eval loss {loss:.4f})"
    best = current["metrics"]["tuned_eval_loss"]
    needed = best * (1 - margin)  # relative margin: the same rule for losses of 0.5 and of 5
    # a different eval split makes the two losses less comparable; say so rather than refuse
    note = "" if current.get("eval_data") == eval_data else " (the champion was evaluated on other eval data)"
    if loss < needed:  # a NaN loss is never below, so it is rejected
        return "promoted", (f"tuned eval loss {loss:.4f} beats champion {current['version']}'s {best:.4f} by more "
                            f"than the {margin:.1%} margin (needed < {needed:.4f}){note}")
    return "rejected", (f"tuned eval loss {loss:.4f} does not beat champion {current['version']}'s {best:.4f} by "
                        f"more than the {margin:.1%} margin (needed < {needed:.4f}){note}")


def _preference_gate(metrics: dict[str, Any], current: dict[str, Any] | None, margin: float, eval_data: str
                     ) -> tuple[str, str]:
    """Preference runs: the share of held-out pairs the adapter prefers the right way must beat the champion's by
    more than `margin` (absolute: 0.01 is one point). The eval loss of a DPO/KTO adapter measures something it
    was not trained for, so it does not decide."""
    accuracy = metrics["tuned_reward_accuracy"]
    if current is None:
        return "promoted", f"first version: no champion yet (tuned reward accuracy {accuracy:.3f})"
    best = current["metrics"].get("tuned_reward_accuracy")
    if best is None:
        return "promoted", (f"tuned reward accuracy {accuracy:.3f}; champion {current['version']} was not a "
                            "preference run (no reward accuracy to beat)")
    note = "" if current.get("eval_data") == eval_data else " (the champion was evaluated on other eval data)"
    verb = "beats" if accuracy > best + margin else "does not beat"  # a NaN accuracy is never above
    return ("promoted" if verb == "beats" else "rejected"), (
        f"tuned reward accuracy {accuracy:.3f} {verb} champion {current['version']}'s {best:.3f} by more than the "
        f"{margin:.2f} margin (needed > {best + margin:.3f}){note}")


def publish(root: Path, source: Path, stage_key: str, metrics: dict[str, Any], margin: float, eval_data: str,
            card: Callable[[Path, dict[str, Any]], str]) -> dict[str, Any]:
    """Publish a finished export stage folder as the next version, run the gate, return the version record.

    `card(version_folder, record)` renders the version's README.md (it names its own folder and verdict).
    """
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root) + ".lock"):
        for record in versions(root):
            if record["stage_key"] == stage_key:
                _keep_published(root / record["version"], Path(source))
                _ensure_champion(root, record)
                return {**record, "published_now": False}
        for stale in root.glob(".tmp-*"):  # a publisher killed mid-copy
            shutil.rmtree(stale)
        current = champion(root)
        number = max((int(r["version"][1:]) for r in versions(root)), default=0) + 1
        version = f"v{number:04d}"
        promotion, reason = gate(metrics, current, margin, eval_data)
        record = {"version": version, "path": str(root / version), "promotion": promotion, "reason": reason,
                  "margin": margin, "metrics": metrics, "eval_data": eval_data, "stage_key": stage_key,
                  "source": str(source), "champion_before": current and {k: current[k] for k in ("version",
                                                                                             "metrics")},
                  "published_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        published = Path(source) / PUBLISHED
        published.mkdir(exist_ok=True)
        (published / "README.md").write_text(card(root / version, record))
        (published / VERSION_FILE).write_text(json.dumps(record, indent=2))
        _place_version(root, Path(source), version)
        _ensure_champion(root, record)
        return {**record, "published_now": True}


def _keep_published(version_dir: Path, source: Path) -> None:
    """Copy a version's record and card into the stage folder's published/ (a stage recomputed under its key)."""
    (source / PUBLISHED).mkdir(exist_ok=True)
    for name in ("README.md", VERSION_FILE):
        shutil.copyfile(version_dir / name, source / PUBLISHED / name)


def _place_version(root: Path, source: Path, version: str) -> None:
    """Copy a stage folder (with its published/ card and record) to root/version, atomically by rename."""
    tmp = root / f".tmp-{version}-{os.getpid()}"
    shutil.copytree(source, tmp, ignore=shutil.ignore_patterns("manifest.json", ".*", PUBLISHED),
                    copy_function=_link_or_copy)
    for name in ("README.md", VERSION_FILE):
        (tmp / name).unlink(missing_ok=True)  # may be a hard link to the stage's card: never write through
        shutil.copyfile(source / PUBLISHED / name, tmp / name)
    if (root / version).exists():  # rename would replace an empty folder; never overwrite anything
        raise RuntimeError(f"{root / version} exists although no version.json names it; remove it by hand")
    os.rename(tmp, root / version)


def repair(root: Path, stage_dir: Path) -> list[str]:
    """Restore what is missing of the version an export stage folder published, and champion.json; what was done."""
    record_file = Path(stage_dir) / PUBLISHED / VERSION_FILE
    if not record_file.is_file():
        return []
    record = json.loads(record_file.read_text())
    root.mkdir(parents=True, exist_ok=True)
    done: list[str] = []
    with FileLock(str(root) + ".lock"):
        version = record["version"]
        if not (root / version / VERSION_FILE).is_file():
            if (root / version).exists():
                shutil.rmtree(root / version)  # a damaged copy: its version.json is gone
            _place_version(root, Path(stage_dir), version)
            done.append(f"restored {version} from {stage_dir}")
        current = champion(root)
        if current is None or not (root / current["version"] / VERSION_FILE).is_file():
            newest = next((r for r in reversed(versions(root)) if r["promotion"] == "promoted"), None)
            (root / CHAMPION).unlink(missing_ok=True)
            if newest is not None:
                _ensure_champion(root, newest)
                done.append(f"rebuilt {CHAMPION}: champion {newest['version']}")
    return done


def current(root: Path) -> dict[str, Any]:
    """The registry as it is now: its versions and champion (version, path, tuned eval loss)."""
    now = champion(root)
    if now is not None and not (root / now["version"] / VERSION_FILE).is_file():
        now = None  # champion.json names a version that is gone
    return {"versions": [r["version"] for r in versions(root)],
            "champion_version": now and now["version"], "champion_path": now and now["path"],
            "champion_tuned_eval_loss": now and now["metrics"]["tuned_eval_loss"]}


def _ensure_champion(root: Path, record: dict[str, Any]) -> None:
    """Point champion.json at a promoted version unless a newer one holds it (also repairs a crash in between)."""
    if record["promotion"] != "promoted":
        return
    current = champion(root)
    if current is not None and int(current["version"][1:]) >= int(record["version"][1:]):
        return
    keep = ("version", "path", "metrics", "eval_data", "reason", "published_at")
    tmp = root / f".{CHAMPION}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps({k: record[k] for k in keep}, indent=2))
    os.replace(tmp, root / CHAMPION)


def _link_or_copy(src: str, dst: str) -> None:
    """Hard link (no second copy of a merged model) where the filesystem allows it, else a copy.

    Safe because stage outputs are never modified in place: a recomputed stage unlinks and rewrites them.
    """
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
