"""The exports registry: numbered versions of an adapter and a champion chosen by a promotion gate.

    runs_dir/exports/<name>/
        v0001/, v0002/, ...   one per published export stage, never overwritten; version.json says why
        champion.json         the current champion: its version, path and eval metrics

Paths in records are relative to runs_dir (`exports/<name>/v0003`, `export_adapter/<key>`), and a version is
always found as root/<version>, so a moved or copied runs_dir reads its own versions (records written with
absolute paths still read: their path is not used). Each record keeps the sha256 of its adapter files, the
base model's identity and the train_adapter key, so a version can be verified on use and a champion is
scored again on this run's eval data only when it fits the same base model (`judged_against`).

A version is copied under a temp name and renamed into place, so a crash leaves no half version (only
a `.tmp-*` folder, cleared by the next publish; a copy that fails, say on a full disk, removes its own);
champion.json is replaced atomically (disk.write_whole). A full disk during a repair is one paragraph
(disk.writing). A file lock beside the registry serializes publishers. Each version records the export
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

from tasks import disk
from tasks.manifest import check_stage, file_sha256, hash_json, read_manifest

VERSION_FILE = "version.json"
CHAMPION = "champion.json"
PUBLISHED = "published"  # in the export stage folder: the version.json and README.md it was published with
_VERSION_NAME = re.compile(r"^v(\d{4,})$")
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


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


def version_record(root: Path, version: str) -> dict[str, Any] | None:
    """One version's record, or None when that version folder (or its version.json) is gone."""
    try:
        return json.loads((root / version / VERSION_FILE).read_text())
    except FileNotFoundError:
        return None


def base_identity(model_dir: Path) -> str:
    """The base model's identity as a version record keeps it: prepare_model's content fingerprint (its files'
    bytes or the resolved hub commit), hashed; quantization settings do not matter to loading an adapter."""
    return hash_json(read_manifest(Path(model_dir)).fingerprint)[:16]


def adapter_hashes(folder: Path) -> dict[str, str]:
    """sha256 of an adapter folder's files, as a version record keeps them."""
    return {name: file_sha256(Path(folder) / name) for name in ADAPTER_FILES if (Path(folder) / name).is_file()}


def identity(record: dict[str, Any] | None) -> str | None:
    """A version's adapter identity (its files' content, not its path); None for records without hashes."""
    files = record and record.get("files")
    return hash_json(files)[:16] if files else None


def damage(root: Path, record: dict[str, Any]) -> str:
    """'' when the version's adapter files have the sha256 its record holds, else what is wrong (one file)."""
    for name, recorded in record["files"].items():
        path = root / record["version"] / name
        if not path.is_file():
            return f"{path} is missing"
        if file_sha256(path) != recorded:
            return f"{path} is damaged (its sha256 is not the one recorded when {record['version']} was published)"
    return ""


def repaired(root: Path, record: dict[str, Any]) -> str:
    """Verify a version's adapter files; if damaged, restore the version from its export stage folder when that
    folder is intact. '' when the version is (now) intact, else the damage and why repair could not help."""
    problem = damage(root, record)
    if not problem:
        return ""
    source = source_dir(root, record)
    stage, why = check_stage(source)
    if stage is None:
        return f"{problem}; its export stage folder {source} cannot restore it ({why})"
    with FileLock(str(root) + ".lock"), _repairing(root, source):
        _place_version(root, source, record["version"], replacing=True)
    return damage(root, record)


def source_dir(root: Path, record: dict[str, Any]) -> Path:
    """The export stage folder a version was published from: relative to runs_dir (old records: absolute, and
    then looked up under this runs_dir by its key when the runs_dir was moved)."""
    runs_dir, source = root.parent.parent, Path(record["source"])
    if not source.is_absolute():
        return runs_dir / source
    return source if source.is_dir() else runs_dir / "export_adapter" / source.name


def judged_against(root: Path, adapter_key: str, base_model: str) -> tuple[dict[str, Any] | None, str]:
    """(champion record, '') to score beside the adapter of train_adapter key `adapter_key`, or (None, why not).

    The current champion, unless this adapter was already published here: then the champion its first version
    was judged against (champion_before), so a re-run after its own promotion keeps its evaluation's key. Only a
    champion with recorded hashes, the same base model and intact (or repaired) files qualifies.
    """
    published = next((r for r in versions(root) if r.get("adapter_key") == adapter_key), None)
    target = published["champion_before"] if published else champion(root)
    if target is None:
        return None, "no champion yet"
    record = version_record(root, target["version"])
    if record is None:
        return None, f"champion {target['version']} is gone from {root}"
    return record, unusable(root, record, base_model)


def unusable(root: Path, record: dict[str, Any], base_model: str, fix: bool = True) -> str:
    """Why a champion cannot be scored on this run's data ('' when it can); `fix`: repair damaged files first
    (not while holding the registry lock: repair takes it)."""
    if not record.get("files") or not record.get("base_model"):
        return f"champion {record['version']} was published before same-data gating (no recorded adapter hashes)"
    if record["base_model"] != base_model:
        return f"champion {record['version']} was trained on another base model"
    problem = repaired(root, record) if fix else damage(root, record)
    return f"champion {record['version']} fails its integrity check: {problem}" if problem else ""


def gate(metrics: dict[str, Any], current: dict[str, Any] | None, margin: float, eval_data: str,
         why_not_same_data: str = "") -> tuple[str, str]:
    """('promoted' | 'rejected', reason): promoted when the tuned eval loss beats the champion's by the margin;
    for preference runs (their metrics have a tuned reward accuracy) when the reward accuracy does.

    Same-data rule when this run scored the champion itself (its metrics' champion_adapter is the champion's
    identity): the champion's numbers are from the same batches and prompts. Otherwise the cross-night fallback:
    the champion's numbers from its own night, with `why_not_same_data` in the reason.
    """
    if current is None:
        key = "reward accuracy" if metrics.get("tuned_reward_accuracy") is not None else "eval loss"
        value = metrics.get("tuned_reward_accuracy") if key == "reward accuracy" else metrics["tuned_eval_loss"]
        return "promoted", f"first version: no champion yet (tuned {key} {value:.4f})"
    if rule(metrics, current) == "same-data":
        theirs, where = {k.removeprefix("champion_"): v for k, v in metrics.items()
                         if k.startswith("champion_")}, "on this run's eval data (same-data rule)"
    else:
        note = why_not_same_data or f"this run scored {metrics.get('judged_against') or 'no champion'} beside it"
        theirs = {k.removeprefix("tuned_"): v for k, v in current["metrics"].items() if k.startswith("tuned_")}
        other = "" if current.get("eval_data") == eval_data else ", on other eval data"
        where = f"on its own night's eval data (cross-night rule: {note}{other})"
    if metrics.get("tuned_reward_accuracy") is not None:
        return _preference_gate(metrics, current["version"], theirs.get("reward_accuracy"), margin, where)
    loss, best = metrics["tuned_eval_loss"], theirs["eval_loss"]
    needed = best * (1 - margin)  # relative margin: the same rule for losses of 0.5 and of 5
    verb = "beats" if loss < needed else "does not beat"  # a NaN loss is never below, so it is rejected
    return ("promoted" if verb == "beats" else "rejected"), (
        f"tuned eval loss {loss:.4f} {verb} champion {current['version']}'s {best:.4f} {where} by more than the "
        f"{margin:.1%} margin (needed < {needed:.4f})")


def rule(metrics: dict[str, Any], current: dict[str, Any] | None) -> str:
    """Which gate rule decides: 'first', 'same-data' (the champion scored in this run) or 'cross-night'."""
    if current is None:
        return "first"
    scored = metrics.get("champion_adapter")
    return "same-data" if scored is not None and scored == identity(current) else "cross-night"


def _preference_gate(metrics: dict[str, Any], version: str, best: float | None, margin: float, where: str
                     ) -> tuple[str, str]:
    """Preference runs: the share of held-out pairs the adapter prefers the right way must beat the champion's by
    more than `margin` (absolute: 0.01 is one point). The eval loss of a DPO/KTO adapter measures something it
    was not trained for, so it does not decide."""
    accuracy = metrics["tuned_reward_accuracy"]
    if best is None:
        return "promoted", (f"tuned reward accuracy {accuracy:.3f}; champion {version} was not a preference run "
                            "(no reward accuracy to beat)")
    verb = "beats" if accuracy > best + margin else "does not beat"  # a NaN accuracy is never above
    return ("promoted" if verb == "beats" else "rejected"), (
        f"tuned reward accuracy {accuracy:.3f} {verb} champion {version}'s {best:.3f} {where} by more than the "
        f"{margin:.2f} margin (needed > {best + margin:.3f})")


def publish(root: Path, source: Path, stage_key: str, metrics: dict[str, Any], margin: float, eval_data: str,
            card: Callable[[Path, dict[str, Any]], str], lineage: dict[str, str] | None = None) -> dict[str, Any]:
    """Publish a finished export stage folder as the next version, run the gate, return the version record.

    `card(version_folder, record)` renders the version's README.md (it names its own folder and verdict).
    `lineage` is {"base_model": identity, "adapter_key": train_adapter key}: kept so that later runs can score
    this version on their own data (same base model) and find the champion it was judged against.
    """
    root.mkdir(parents=True, exist_ok=True)
    lineage = lineage or {}
    with FileLock(str(root) + ".lock"):
        for record in versions(root):
            if record["stage_key"] == stage_key:
                _keep_published(root / record["version"], Path(source))
                _ensure_champion(root, record)
                return {**record, "published_now": False}
        for stale in root.glob(".tmp-*"):  # a publisher killed mid-copy
            shutil.rmtree(stale)
        current = champion(root)
        current = current and (version_record(root, current["version"]) or current)
        number = max((int(r["version"][1:]) for r in versions(root)), default=0) + 1
        version = f"v{number:04d}"
        why = unusable(root, current, lineage["base_model"], fix=False) if current and lineage else ""
        promotion, reason = gate(metrics, current, margin, eval_data, why)
        record = {"version": version, "path": _relative(root / version, root), "promotion": promotion,
                  "reason": reason, "rule": rule(metrics, current), "margin": margin, "metrics": metrics,
                  "eval_data": eval_data, "stage_key": stage_key, "source": _relative(Path(source), root),
                  "files": adapter_hashes(Path(source)), **lineage,
                  "champion_before": current and {k: current[k] for k in ("version", "metrics", "files")
                                                  if k in current},
                  "published_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        published = Path(source) / PUBLISHED
        published.mkdir(exist_ok=True)
        (published / "README.md").write_text(card(root / version, record))
        (published / VERSION_FILE).write_text(json.dumps(record, indent=2))
        _place_version(root, Path(source), version)
        _ensure_champion(root, record)
        return {**record, "published_now": True}


def _relative(path: Path, root: Path) -> str:
    """A path under runs_dir as relative to it (portable when runs_dir moves), else as it is."""
    try:
        return str(Path(path).resolve().relative_to(root.parent.parent))
    except ValueError:
        return str(path)


def _keep_published(version_dir: Path, source: Path) -> None:
    """Copy a version's record and card into the stage folder's published/ (a stage recomputed under its key)."""
    (source / PUBLISHED).mkdir(exist_ok=True)
    for name in ("README.md", VERSION_FILE):
        shutil.copyfile(version_dir / name, source / PUBLISHED / name)


def _place_version(root: Path, source: Path, version: str, replacing: bool = False) -> None:
    """Copy a stage folder (with its published/ card and record) to root/version, atomically by rename; a copy
    that fails (a full disk) is removed. `replacing`: a damaged root/version is swapped out only once the new
    copy is whole."""
    tmp = root / f".tmp-{version}-{os.getpid()}"
    try:
        shutil.copytree(source, tmp, ignore=shutil.ignore_patterns("manifest.json", ".*", PUBLISHED),
                        copy_function=_link_or_copy)
        for name in ("README.md", VERSION_FILE):
            (tmp / name).unlink(missing_ok=True)  # may be a hard link to the stage's card: never write through
            shutil.copyfile(source / PUBLISHED / name, tmp / name)
        if replacing:
            shutil.rmtree(root / version, ignore_errors=True)
        if (root / version).exists():  # rename would replace an empty folder; never overwrite anything
            raise RuntimeError(f"{root / version} exists although no version.json names it; remove it by hand")
        os.rename(tmp, root / version)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _repairing(root: Path, stage_dir: Path) -> Any:
    """A full disk during a repair of root is the one-paragraph error: the registry is left as it was."""
    source = Path(stage_dir)
    published = [p.stat().st_size for p in (source / PUBLISHED).glob("*") if p.is_file()]
    return disk.writing(f"the repair of exports registry {root.name}", root.parent.parent, root,
                        left="nothing half-made is in the registry: a version is copied under a temporary name, "
                        "removed now, and renamed into place only when whole; champion.json is replaced whole or "
                        "not at all",
                        what="a version's record and card (its other files are hard links where the filesystem "
                        "allows) and champion.json", needed=disk.blocks(*published, *published[-1:]))


def repair(root: Path, stage_dir: Path) -> list[str]:
    """Restore what is missing of the version an export stage folder published, and champion.json; what was done."""
    record_file = Path(stage_dir) / PUBLISHED / VERSION_FILE
    if not record_file.is_file():
        return []
    record = json.loads(record_file.read_text())
    root.mkdir(parents=True, exist_ok=True)
    done: list[str] = []
    with FileLock(str(root) + ".lock"), _repairing(root, stage_dir):
        version = record["version"]
        if not (root / version / VERSION_FILE).is_file():  # gone, or a damaged copy without its version.json
            _place_version(root, Path(stage_dir), version, replacing=True)
            done.append(f"restored {version} from {stage_dir}")
        current = champion(root)
        if current is None or not (root / current["version"] / VERSION_FILE).is_file():
            newest = next((r for r in reversed(versions(root)) if r["promotion"] == "promoted"), None)
            if newest is not None:
                _write_champion(root, newest)
                done.append(f"rebuilt {CHAMPION}: champion {newest['version']}")
            else:
                (root / CHAMPION).unlink(missing_ok=True)
    return done


def current(root: Path) -> dict[str, Any]:
    """The registry as it is now: its versions and champion (version, path, tuned eval loss)."""
    now = champion(root)
    if now is not None and not (root / now["version"] / VERSION_FILE).is_file():
        now = None  # champion.json names a version that is gone
    return {"versions": [r["version"] for r in versions(root)],
            "champion_version": now and now["version"], "champion_path": now and str(root / now["version"]),
            "champion_tuned_eval_loss": now and now["metrics"]["tuned_eval_loss"]}


def _ensure_champion(root: Path, record: dict[str, Any]) -> None:
    """Point champion.json at a promoted version unless a newer one holds it (also repairs a crash in between)."""
    if record["promotion"] != "promoted":
        return
    current = champion(root)
    if current is not None and int(current["version"][1:]) >= int(record["version"][1:]):
        return
    _write_champion(root, record)


def _write_champion(root: Path, record: dict[str, Any]) -> None:
    """champion.json naming record's version, replaced whole (temp file + os.replace)."""
    keep = ("version", "path", "metrics", "eval_data", "reason", "rule", "files", "base_model", "published_at")
    disk.write_whole(root / CHAMPION, json.dumps({k: record[k] for k in keep if k in record}, indent=2))


def _link_or_copy(src: str, dst: str) -> None:
    """Hard link (no second copy of a merged model) where the filesystem allows it, else a copy.

    Safe because stage outputs are never modified in place: a recomputed stage unlinks and rewrites them.
    """
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def history(root: Path) -> list[dict[str, Any]]:
    """One row per version, oldest first: its tuned loss, the loss of the champion it was scored beside on the
    same night (same data), verdict, rule and date; the registry-history artifact and `qlora-pipeline history`."""
    rows = []
    for r in versions(root):
        m = r["metrics"]
        row = {"version": r["version"], "published": r.get("published_at", "")[:16].replace("T", " "),
               "tuned eval loss": m.get("tuned_eval_loss"), "judged against": m.get("judged_against") or "",
               "champion same-night loss": m.get("champion_eval_loss"), "verdict": r["promotion"],
               "rule": r.get("rule", "cross-night" if r.get("champion_before") else "first")}
        if m.get("tuned_reward_accuracy") is not None:
            row.update({"tuned reward accuracy": m["tuned_reward_accuracy"],
                        "champion same-night reward accuracy": m.get("champion_reward_accuracy")})
        rows.append(row)
    return rows


def promote(root: Path, version: str) -> dict[str, Any]:
    """Make an existing version the champion by hand (`qlora-pipeline promote`: a rollback), its files verified first
    (and repaired from its export stage folder if need be); the record champion.json now holds. ValueError: why not."""
    record = version_record(root, version) if _VERSION_NAME.match(version) else None
    if record is None:
        known = ", ".join(r["version"] for r in versions(root)) or "none"
        raise ValueError(f"{root} has no version {version} (versions: {known})")
    if record.get("files") and (problem := repaired(root, record)):
        raise ValueError(f"{version} cannot be champion: {problem}")
    with FileLock(str(root) + ".lock"):
        now = champion(root)
        reason = f"made champion by hand (qlora-pipeline promote; the champion was {now and now['version']})"
        _write_champion(root, {**record, "reason": reason, "rule": "by hand"})
    return champion(root)
