"""The exports registry: numbered versions of an adapter and a champion chosen by a promotion gate.

    runs_dir/exports/<name>/
        v0001/, v0002/, ...   one per published export stage, never overwritten; version.json says why
        champion.json         the current champion: its version, path and eval metrics

Paths in records are relative to runs_dir (`exports/<name>/v0003`, `export_adapter/<key>`), and a version is
always found as root/<version>, so a moved or copied runs_dir reads its own versions (records written with
absolute paths still read: their path is not used). Each record keeps the sha256 of its adapter files, the
base model's identity, the train_adapter key and what its evaluation measured, so a version can be verified on
use (also a copy of its folder elsewhere: init_adapter.py) and a champion is scored again on a later run's eval
data when it fits the same base model (evaluate_adapter's score_champion).

A version is copied under a temp name and renamed into place, so a crash leaves no half version (only
a `.tmp-*` folder, cleared by the next publish; a copy that fails, say on a full disk, removes its own);
champion.json is replaced atomically (disk.write_whole). A full disk during a repair is one paragraph
(disk.writing). A file lock beside the registry serializes publishers. Each version records the export
stage key that produced it: a stage recomputed under the same key (its manifest lost after publishing)
gets that version back instead of a second one. Nothing with non-finite adapter weights is published.

The registry repairs itself from the export stage folders: each keeps a copy of its version's record
and card in `published/` (covered by the stage's manifest hashes). `heal` runs wherever the registry is read: a
version.json that is not an intact record (truncated, empty, not JSON, of the wrong shape) is restored with its
version from the stage folder that published it, and a champion.json that is damaged, stale or missing is
rewritten (the champion is always the newest promoted version); a record that no stage folder can restore is
a UserError naming the file and the fix, never a guess. `repair` also restores a deleted version folder from the
stage folder a run used. `current` says what the registry holds now; the run summary reports that, not what the
manifest recorded when it published.
Part of the shared contract (not of export_adapter) because the run record calls it too; the promotion gate's
rules are gate.py's.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from filelock import FileLock

from tasks import methods
from tasks.errors import UserError
from tasks.hashing.files import file_sha256
from tasks.hashing.keys import cache_key
from tasks.log import logger
from tasks.on_disk import disk
from tasks.on_disk.manifest import MANIFEST, check_stage, read_manifest
from tasks.registry.gate import WEIGHTS, nothing_to_add, verdict

VERSION_FILE = "version.json"
BY_HAND = "by hand"  # the rule of a champion chosen by `qlora-pipeline promote`
CHAMPION = "champion.json"
PUBLISHED = "published"  # in the export stage folder: the version.json and README.md it was published with
_VERSION_NAME = re.compile(r"^v(\d{4,})$")
ADAPTER_FILES = ("adapter_config.json", WEIGHTS)
# what a version record must hold (old records included), and what it may hold, with their JSON types
_REQUIRED = {"version": str, "path": str, "promotion": str, "reason": str, "metrics": dict, "stage_key": str,
             "source": str}
_OPTIONAL = {"files": dict, "base_model": str, "adapter_key": str, "eval_data": str, "rule": str, "published_at": str,
             "method": str,
             "champion_before": (dict, type(None)), "measure": (dict, type(None)), "formats": list,
             "evaluation": str, "export": dict}
# read by the gate and the history: numbers (or null) where present (every method's measure: tasks/methods.py)
_METRIC_NUMBERS = tuple(dict.fromkeys(f"{who}_{m.measure.key}" for m in methods.METHODS
                                      for who in ("base", "tuned", "champion")))


def registry_dir(runs_dir: Path, name: str) -> Path:
    """runs_dir/exports/<name>: the versions and champion of one named adapter."""
    return Path(runs_dir).expanduser().resolve() / "exports" / name


def _lock(root: Path) -> FileLock:
    """The lock beside the registry that serializes publishers and repairs. One object per path in this process
    (is_singleton): a repair inside a publish takes it again instead of waiting for itself."""
    return FileLock(str(root) + ".lock", is_singleton=True)


# --- records: read, checked, repaired ---------------------------------------------------------------------------

def read_record(path: Path) -> tuple[dict[str, Any] | None, str]:
    """(record, '') for an intact version record; (None, '') when the file does not exist; (None, what is wrong)
    when it is damaged: not JSON, not an object, a field missing or of the wrong type."""
    try:
        record = json.loads(Path(path).read_bytes())
    except FileNotFoundError:
        return None, ""
    except (OSError, ValueError, RecursionError) as exc:  # a binary file: UnicodeDecodeError, a ValueError
        return None, f"is not readable JSON ({type(exc).__name__})"
    problem = _record_problem(record)
    return (None, problem) if problem else (record, "")


def _record_problem(record: Any) -> str:
    """'' for a well-formed version record, else what is wrong with it (a clause: 'lacks metrics')."""
    if not isinstance(record, dict):
        return f"holds a JSON {_kind(record)}, not a version record"
    missing = [k for k in _REQUIRED if k not in record]
    if missing:
        return f"lacks {', '.join(missing)}"
    wrong = [k for k, kind in {**_REQUIRED, **_OPTIONAL}.items() if k in record and not isinstance(record[k], kind)]
    wrong += [k for k in ("margin",) if k in record and not _is_number(record[k])]
    if wrong:
        return f"has the wrong type for {', '.join(wrong)}"
    if not _VERSION_NAME.match(record["version"]) or record["promotion"] not in ("promoted", "rejected"):
        return f"names version {record['version']!r} with verdict {record['promotion']!r}"
    metrics = record["metrics"]
    numbers = [k for k in _METRIC_NUMBERS if metrics.get(k) is not None and not _is_number(metrics[k])]
    if not _is_number(metrics.get("tuned_eval_loss")) or numbers:
        return f"has no finite number for metrics.{', metrics.'.join(numbers or ['tuned_eval_loss'])}"
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in record.get("files", {}).items()):
        return "has the wrong type for files"
    return ""


def _kind(value: Any) -> str:
    return {list: "list", str: "string", type(None): "null", bool: "boolean"}.get(type(value), "number")


def _is_number(value: Any) -> bool:
    """A finite number: a NaN or infinite metric (set by hand, or by a tool) makes a record damaged, so that no gate
    ever compares against it ("needed < nan" rejected every challenger)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _version_folders(root: Path) -> list[Path]:
    """root's vNNNN folders, oldest first."""
    found = [(int(m.group(1)), p) for p in root.glob("v*") if (m := _VERSION_NAME.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def _records(root: Path) -> tuple[list[dict[str, Any]], list[tuple[Path, str]]]:
    """Every version folder's intact record, oldest first, and the folders whose record is not intact (and why). A
    record that differs from the one its export stage folder published (a folder copied in by hand and renamed, a
    number or a hash edited) is not intact: it would be listed, compared and promoted as what it is not."""
    good, bad = [], []
    for folder in _version_folders(root):
        record, problem = read_record(folder / VERSION_FILE)
        if record is not None and record["version"] != folder.name:
            problem = f"names version {record['version']}, not {folder.name}"
        elif record is not None:
            problem = _unlike_published(root, record)
        if record is None and not problem:
            problem = "is missing"
        if problem:
            bad.append((folder, problem))
        else:
            good.append(record)
    return good, bad


def _unlike_published(root: Path, record: dict[str, Any]) -> str:
    """'' when the export stage folder that published `record` (its source) holds the same record, or cannot tell
    (gone, or from before stage folders kept it); else how the two differ."""
    try:
        source = source_dir(root, record)
    except (OSError, ValueError):
        return ""
    published, _ = read_record(source / PUBLISHED / VERSION_FILE)
    if published is None or published == record:
        return ""
    if published["version"] != record["version"]:
        return (f"claims to be {record['version']}, but its export stage folder {source} published it as "
                f"{published['version']} (a version folder copied in by hand?)")
    changed = sorted(k for k in {*published, *record} if published.get(k) != record.get(k))
    return f"differs from the record its export stage folder {source} published (in {', '.join(changed)})"


def _champion_file(root: Path) -> tuple[str | None, str]:
    """(the version champion.json names, what is wrong with the file, '' if nothing); (None, '') without one."""
    if (root / CHAMPION).is_dir():
        return None, "is a folder, not a file"
    try:
        data = json.loads((root / CHAMPION).read_bytes())
    except FileNotFoundError:
        return None, ""
    except (OSError, ValueError, RecursionError) as exc:
        return None, f"is not readable JSON ({type(exc).__name__})"
    if not isinstance(data, dict):
        return None, f"holds a JSON {_kind(data)}, not a champion record"
    version = data.get("version")
    if not isinstance(version, str) or not _VERSION_NAME.match(version):
        return None, "names no version"
    if not isinstance(data.get("path"), str) or not isinstance(data.get("metrics"), dict) or not _is_number(
            data["metrics"].get("tuned_eval_loss")):
        return version, "lacks its path or metrics, or has them of the wrong type or not finite"
    return version, ""


def _champion_problem(root: Path, records: list[dict[str, Any]]) -> str:
    """What is wrong with champion.json ('' when it names an intact promoted version, or none was promoted)."""
    version, problem = _champion_file(root)
    if problem:
        return f"{CHAMPION} {problem}"
    if version is None:
        return f"{CHAMPION} is missing" if any(r["promotion"] == "promoted" for r in records) else ""
    record = next((r for r in records if r["version"] == version), None)
    if record is None:
        return f"{CHAMPION} names {version}, which is gone"
    if changed := _unlike_record(root, record):
        return f"{CHAMPION} differs from {version}'s record (in {', '.join(changed)})"
    if record["promotion"] == "promoted" or _made_by_hand(root):  # `promote` may choose any version
        return ""
    return f"{CHAMPION} names {version}, which was rejected"


_FROM_RECORD = ("path", "metrics", "eval_data", "files", "base_model", "published_at")  # champion.json copies these


def _unlike_record(root: Path, record: dict[str, Any]) -> list[str]:
    """The fields champion.json copies from its version's record that it holds otherwise (an edit by hand)."""
    try:
        data = json.loads((root / CHAMPION).read_bytes())
    except (OSError, ValueError, RecursionError):
        return []
    return [k for k in _FROM_RECORD if data.get(k) != record.get(k)] if isinstance(data, dict) else []


def _made_by_hand(root: Path) -> bool:
    """Whether champion.json was written by `qlora-pipeline promote` (its rule), which may name a rejected version."""
    try:
        return json.loads((root / CHAMPION).read_bytes()).get("rule") == BY_HAND
    except (OSError, ValueError, AttributeError):
        return False


def heal(root: Path) -> list[str]:
    """Repair the registry's damaged records from the export stage folders they came from; what was repaired
    (each also logged as a warning).

    A version folder whose version.json is missing or not an intact record is restored whole from the export
    stage folder that published it (its published/ record, verified by the stage's manifest); champion.json, when
    damaged, stale (a version gone or rejected) or missing after a promotion, is rewritten for the version it
    names if that one is intact and promoted (restored first if its folder is gone), else for the newest promoted
    version. Nothing is written when nothing is damaged. Raises UserError, naming each file and the fix, when a
    version's record cannot be restored (no intact stage folder holds it): which version is champion would be a
    guess.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    records, bad = _records(root)
    if not bad and not _champion_problem(root, records):
        return []
    done, lost = [], []
    with _lock(root), _repairing(root):
        for folder, problem in _records(root)[1]:  # again under the lock: another process may have repaired it
            source = _publisher(root, folder.name)
            if source is None:
                lost.append(f"{folder / VERSION_FILE} {problem}")
                continue
            _place_version(root, source, folder.name, replacing=True)
            done.append(f"restored {folder.name} from {source} (its {VERSION_FILE} {problem})")
        if lost:
            raise UserError(_lost(root, lost))
        done += _heal_champion(root)
    for line in done:
        announce(root, line)
    return done


def announce(root: Path, repair: str) -> None:
    """Say what was repaired: every repair of the registry says it here, once, as a warning in the run's log (in the
    UI and the terminal), or on stderr for `history` and `promote` (tasks/log.py warnings_to_terminal)."""
    logger().warning("exports registry %s: repaired: %s", root.name, repair)


def _heal_champion(root: Path) -> list[str]:
    """Rewrite a damaged, stale or missing champion.json (heal); what was done."""
    problem = _champion_problem(root, _records(root)[0])
    if not problem:
        return []
    done = []
    if (root / CHAMPION).is_dir():  # nothing can replace a folder; an empty one holds nothing to lose
        if any((root / CHAMPION).iterdir()):
            raise UserError(f"{root / CHAMPION} is a folder, not the registry's champion record, and it holds files, "
                            "so it was left as it is. Move it away (mv it to champion.json.bad, say), then run again: "
                            "the registry writes champion.json anew for its newest promoted version.")
        (root / CHAMPION).rmdir()
        done.append(f"removed the empty folder {CHAMPION}")
    version = _champion_file(root)[0]
    if version and not (root / version).exists() and (source := _publisher(root, version)) is not None:
        _place_version(root, source, version)  # the champion's folder was deleted: its stage folder has it
        done.append(f"restored {version}, the champion, from {source}")
    record = version and version_record(root, version)
    by_hand = record and _made_by_hand(root) and _champion_by_hand(root)
    if by_hand:  # a champion chosen by `promote`, its numbers edited: the same choice, its record's numbers
        record = {**record, "reason": by_hand["reason"], "rule": BY_HAND}
    elif not record or record["promotion"] != "promoted":
        record = next((r for r in reversed(_records(root)[0]) if r["promotion"] == "promoted"), None)
    if record is None:
        (root / CHAMPION).unlink(missing_ok=True)
        return [*done, f"removed {CHAMPION} ({problem}): no version was promoted"]
    _write_champion(root, record)
    return [*done, f"rewrote {CHAMPION} ({problem}): champion {record['version']}"]


def _champion_by_hand(root: Path) -> dict[str, Any] | None:
    """champion.json as `promote` wrote it (its reason a string), else None."""
    try:
        data = json.loads((root / CHAMPION).read_bytes())
    except (OSError, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("reason"), str) else None


def _publisher(root: Path, version: str) -> Path | None:
    """The intact export stage folder that published `version` of this registry, or None. Several may hold the same
    record (a re-export of the champion with nothing to add keeps its record); of several that differ (a registry
    removed and started again reuses numbers), the one whose adapter files the version folder still holds."""
    found = []
    for copy in sorted((root.parent.parent / "export_adapter").glob(f"*/{PUBLISHED}/{VERSION_FILE}")):
        stage = copy.parent.parent
        record, _ = read_record(copy)
        if record is None or record["version"] != version or _export_name(stage) != root.name:
            continue
        if check_stage(stage)[0] is not None:
            found.append((stage, record))
    if len({json.dumps(record, sort_keys=True) for _, record in found}) > 1:
        held = adapter_hashes(root / version)
        found = [(stage, record) for stage, record in found if record.get("files") == held]
        if len({json.dumps(record, sort_keys=True) for _, record in found}) > 1:
            return None  # which one was published as this version cannot be told
    return found[0][0] if found else None


def _export_name(stage: Path) -> str | None:
    """The registry an export stage folder published into (its manifest's export.name)."""
    try:
        return json.loads((stage / MANIFEST).read_bytes())["params"]["export"]["name"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _lost(root: Path, lost: list[str]) -> str:
    return (f"the exports registry {root.name} has {len(lost)} damaged record(s) that no export stage folder can "
            f"restore: {'; '.join(lost)}. Nothing was published; no export stage folder holds those records as it "
            f"published them (runs_dir/export_adapter/<key>/{PUBLISHED}/: gone, damaged too, or a folder copied in by "
            "hand was never published as that version). Move each of those version folders "
            f"out of {root} (it then stops being a version; the registry goes on with the others), or put back an "
            "intact copy of it, then run again.")


def check_registry(name: str, runs_dir: Path) -> None:
    """Repair registry `name`'s damaged records before any stage runs, or fail with the paragraph (heal)."""
    heal(registry_dir(runs_dir, name))


def versions(root: Path) -> list[dict[str, Any]]:
    """Every published version's record, oldest first (damaged records repaired first: heal)."""
    heal(root)
    return _records(root)[0]


def version_record(root: Path, version: str) -> dict[str, Any] | None:
    """One version's intact record, or None when that version folder (or its version.json) is gone or damaged."""
    record, _ = read_record(root / version / VERSION_FILE)
    return record if record is not None and record["version"] == version else None


def champion(root: Path) -> dict[str, Any] | None:
    """The champion's version record (version, path, metrics, adapter hashes, ...), or None before the first
    promotion; damaged records are repaired first (heal)."""
    heal(root)
    version = _champion_file(root)[0]
    return version_record(root, version) if version else None


# --- adapters: identity, integrity, formats ----------------------------------------------------------------------

def base_identity(model_dir: Path) -> str:
    """The base model's identity as a version record keeps it: prepare_model's content fingerprint (its files'
    bytes or the resolved hub commit), hashed; quantization settings do not matter to loading an adapter."""
    return cache_key(read_manifest(Path(model_dir)).fingerprint)


def adapter_hashes(folder: Path) -> dict[str, str]:
    """sha256 of an adapter folder's files, as a version record keeps them."""
    return {name: file_sha256(Path(folder) / name) for name in ADAPTER_FILES if (Path(folder) / name).is_file()}


def damage_in(folder: Path, record: dict[str, Any]) -> str:
    """'' when the adapter files in `folder` have the sha256 `record` holds, else what is wrong (one file). The
    folder may be the version's own or any copy of it, renamed or not."""
    for name, recorded in record["files"].items():
        path = Path(folder) / name
        if not path.is_file():
            return f"{path} is missing"
        if file_sha256(path) != recorded:
            return f"{path} is damaged (its sha256 is not the one recorded when {record['version']} was published)"
    return ""


def damage(root: Path, record: dict[str, Any]) -> str:
    """'' when the version's adapter files have the sha256 its record holds, else what is wrong (one file)."""
    return damage_in(root / record["version"], record)


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
    with _lock(root), _repairing(root, source):
        _place_version(root, source, record["version"], replacing=True)
    announce(root, f"restored {record['version']} from {source} ({problem})")
    return damage(root, record)


def non_finite(folder: Path) -> str:
    """'' when every weight of the adapter in `folder` is finite, else which tensors hold inf or NaN values."""
    import torch
    from safetensors import safe_open

    bad = []
    with safe_open(str(Path(folder) / WEIGHTS), "pt") as weights:
        names = list(weights.keys())
        for name in names:  # one tensor at a time: an adapter of a large model is hundreds of MB
            tensor = weights.get_tensor(name)
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                bad.append(f"{name} ({int((~torch.isfinite(tensor)).sum())} of {tensor.numel()} values)")
    if not bad:
        return ""
    return f"{len(bad)} of its {len(names)} tensors hold inf or NaN values: {', '.join(bad[:3])}"


def formats(folder: Path) -> list[str]:
    """What a version (or export stage) folder carries beside the adapter: 'merged <dtype>' and each GGUF file."""
    found = []
    config = Path(folder) / "merged" / "config.json"
    if config.is_file():
        try:
            dtype = json.loads(config.read_text()).get("dtype")
        except (OSError, ValueError, AttributeError):
            dtype = None
        found.append(f"merged {dtype}" if isinstance(dtype, str) else "merged")
    return found + sorted(f"gguf {p.stem}" for p in (Path(folder) / "gguf").glob("*.gguf"))


def settings(export: dict[str, Any]) -> dict[str, Any]:
    """The export section as export_adapter's key holds it: accept_new_measure only when set, so the keys of
    exports that never set it stay what they were before the field existed."""
    return {k: v for k, v in export.items() if k != "accept_new_measure" or v}


def published_as(root: Path, evaluation: str, export: dict[str, Any]) -> dict[str, Any] | None:
    """The version that published the evaluation of key `evaluation` with these export settings, if any: its
    export stage is then cached, and no verdict is needed (score_champion has nothing to do)."""
    return next((r for r in _records(root)[0] if r.get("evaluation") == evaluation
                 and r.get("export") == settings(export)), None) if root.is_dir() else None


def source_dir(root: Path, record: dict[str, Any]) -> Path:
    """The export stage folder a version was published from: relative to runs_dir (old records: absolute, and
    then looked up under this runs_dir by its key when the runs_dir was moved)."""
    runs_dir, source = root.parent.parent, Path(record["source"])
    if not source.is_absolute():
        return runs_dir / source
    return source if source.is_dir() else runs_dir / "export_adapter" / source.name


def unusable(root: Path, record: dict[str, Any], base_model: str, fix: bool = True) -> str:
    """Why a champion cannot be scored on this run's data ('' when it can); `fix`: repair damaged files first."""
    if not record.get("files") or not record.get("base_model"):
        return f"champion {record['version']} was published before same-data gating (no recorded adapter hashes)"
    if record["base_model"] != base_model:
        return f"champion {record['version']} was trained on another base model"
    problem = repaired(root, record) if fix else damage(root, record)
    return f"champion {record['version']} fails its integrity check: {problem}" if problem else ""


def _measure(root: Path, record: dict[str, Any]) -> dict[str, Any] | None:
    """What a version's evaluation measured (record['measure']; for records without it, from the prepare_data
    manifest of its eval data when that folder is still there), or None when unknown."""
    if "measure" in record:
        return record["measure"]
    try:
        data = json.loads((root.parent.parent / "prepare_data" / record["eval_data"] / MANIFEST).read_bytes())
        return measure(data["metrics"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def record_method(root: Path, record: dict[str, Any]) -> methods.Method:
    """The method that trained a version: its record's; for records from before methods were recorded, the one its
    train_adapter manifest names (the record's adapter_key, under this runs_dir), else the first row's (what every
    run trained before there were methods)."""
    name = record.get("method")
    if name is None and isinstance(record.get("adapter_key"), str):
        made = read_manifest(root.parent.parent / "train_adapter" / record["adapter_key"])
        name = made.method().name if made is not None else None
    return methods.BY_NAME.get(name or "", methods.METHODS[0])


def measure(data_metrics: dict[str, Any]) -> dict[str, Any]:
    """What an evaluation's numbers measure, from prepare_data's metrics: the data format (text, chat, preference,
    ...), which tokens count (the answers only, or whole texts) and the chat template."""
    return {k: data_metrics.get(k) for k in ("format", "completion_only_loss", "chat_template")}


# --- publishing --------------------------------------------------------------------------------------------------

def publish(root: Path, source: Path, stage_key: str, metrics: dict[str, Any], margin: float, eval_data: str,
            card: Callable[[Path, dict[str, Any]], str], lineage: dict[str, Any] | None = None,
            accept_new_measure: bool = False) -> dict[str, Any]:
    """Publish a finished export stage folder as the next version, run the gate, return the version record.

    `card(version_folder, record)` renders the version's README.md (it names its own folder and verdict).
    `lineage` holds what later runs need of this version: base_model (identity) and adapter_key (train_adapter
    key), to score it on their own data; measure (what its evaluation measured), to compare like with like;
    evaluation and export (its evaluate_adapter key and export settings), to know it is published. The same adapter
    as the champion with the same formats is no new version: the champion's record is returned. Raises
    UserError, publishing nothing, when the adapter's weights are not all finite.
    """
    source, lineage = Path(source), lineage or {}
    if problem := non_finite(source):
        raise UserError(f"{source / WEIGHTS}: {problem}: training diverged, so the adapter was not published to the "
                        f"exports registry {root.name}. Train again with a lower train.learning_rate (or from "
                        "another train.init_adapter), then run again.")
    root.mkdir(parents=True, exist_ok=True)
    with _lock(root):
        for record in versions(root):
            if record["stage_key"] == stage_key:
                _keep_published(root / record["version"], source)
                _ensure_champion(root, record)
                return {**record, "published_now": False}
        for stale in root.glob(".tmp-*"):  # a publisher killed mid-copy
            shutil.rmtree(stale)
        current = champion(root)
        number = max((int(p.name[1:]) for p in _version_folders(root)), default=0) + 1
        version = f"v{number:04d}"
        why = unusable(root, current, lineage["base_model"], fix=False) if current and lineage.get("base_model") else ""
        record = {"version": version, "path": _relative(root / version, root), "margin": margin, "metrics": metrics,
                  "eval_data": eval_data, "stage_key": stage_key, "source": _relative(source, root),
                  "files": adapter_hashes(source), "formats": formats(source), **lineage,
                  "champion_before": current and {k: current[k] for k in ("version", "metrics", "files")
                                                  if k in current},
                  "published_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        promotion, reason, decided_by = verdict(record, current, current and formats(root / current["version"]),
                                                current and _measure(root, current), why, accept_new_measure,
                                                current and record_method(root, current))
        if decided_by == "same-adapter" and nothing_to_add(reason):  # it is the champion already
            _keep_published(root / current["version"], source)
            own = {k: v for k, v in current["metrics"].items() if not k.startswith("champion_")
                   and k != "judged_against"}  # whom the champion was judged against is not this run's verdict
            return {**current, "metrics": own, "published_now": False, "reason": f"{reason}: not published again",
                    "rule": decided_by}
        record = {**record, "promotion": promotion, "reason": reason, "rule": decided_by}
        published = source / PUBLISHED
        published.mkdir(exist_ok=True)
        (published / "README.md").write_text(card(root / version, record))
        (published / VERSION_FILE).write_text(json.dumps(record, indent=2))
        _place_version(root, source, version)
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
        if replacing and (root / version).is_symlink():  # a link put there by hand: the link goes, its target stays
            (root / version).unlink()
        elif replacing:
            shutil.rmtree(root / version, ignore_errors=True)
        if (root / version).exists() or (root / version).is_symlink():  # rename would replace an empty folder
            raise UserError(f"{root / version} is in the way of the version restored from {source}, and it could "
                            "not be removed (a file, or a folder this user cannot change). Move it out of the "
                            "registry, then run again.")
        os.rename(tmp, root / version)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _repairing(root: Path, stage_dir: Path | None = None) -> Any:
    """A full disk during a repair of root is the one-paragraph error: the registry is left as it was."""
    published = [p.stat().st_size for p in (Path(stage_dir) / PUBLISHED).glob("*") if p.is_file()] if stage_dir else []
    return disk.writing(f"the repair of exports registry {root.name}", root.parent.parent, root,
                        left="nothing half-made is in the registry: a version is copied under a temporary name, "
                        "removed now, and renamed into place only when whole; champion.json is replaced whole or "
                        "not at all",
                        what="a version's record and card (its other files are hard links where the filesystem "
                        "allows) and champion.json", needed=disk.blocks(*published, *published[-1:]) or None)


def repair(root: Path, stage_dir: Path) -> list[str]:
    """Restore the version an export stage folder published if its folder is gone, then heal the registry; what
    was done (each also logged as a warning)."""
    record, _ = read_record(Path(stage_dir) / PUBLISHED / VERSION_FILE)
    if record is None:  # not a publishing stage folder (or its copy is damaged: its manifest no longer vouches)
        return heal(root)
    root.mkdir(parents=True, exist_ok=True)
    done: list[str] = []
    with _lock(root), _repairing(root, stage_dir):
        if not (root / record["version"]).exists():
            _place_version(root, Path(stage_dir), record["version"])
            done.append(f"restored {record['version']} from {stage_dir}")
            announce(root, done[-1])
        return done + heal(root)


def current(root: Path) -> dict[str, Any]:
    """The registry as it is now: its versions and champion (version, path, tuned eval loss)."""
    now = champion(root)
    return {"versions": [r["version"] for r in versions(root)],
            "champion_version": now and now["version"], "champion_path": now and str(root / now["version"]),
            "champion_tuned_eval_loss": now and now["metrics"]["tuned_eval_loss"]}


def _ensure_champion(root: Path, record: dict[str, Any]) -> None:
    """Point champion.json at a promoted version unless a newer one holds it (also repairs a crash in between)."""
    if record["promotion"] != "promoted":
        return
    now = _champion_file(root)[0]
    if now is not None and int(now[1:]) >= int(record["version"][1:]):
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
    """One row per version with an intact record, oldest first: its tuned loss, the loss of the champion it was
    scored beside on the same night (same data), and likewise the measure its method is judged on (tasks/methods.py)
    where that is not the loss; verdict, rule and date; its regression suites and judged win rate where it had them.
    The registry-history artifact and `qlora-pipeline history` (which heal the registry first)."""
    rows = []
    for r in _records(root)[0]:
        m, measure = r["metrics"], record_method(root, r).measure
        row = {"version": r["version"], "published": r.get("published_at", "")[:16].replace("T", " "),
               "tuned eval loss": m["tuned_eval_loss"], "judged against": _text(m.get("judged_against")),
               "champion same-night loss": m.get("champion_eval_loss"), "verdict": r["promotion"],
               "rule": r.get("rule", "cross-night" if r.get("champion_before") else "first")}
        if measure != methods.LOSS:
            row.update({f"tuned {measure.label}": m.get(f"tuned_{measure.key}"),
                        f"champion same-night {measure.label}": m.get(f"champion_{measure.key}")})
        rows.append({**row, **_answers_columns(m)})
    return rows


def _answers_columns(metrics: dict[str, Any]) -> dict[str, str]:
    """A version's regression suites (its score, and the champion's on the same night or the base model's) and its
    judged win rate, for the history; {} for a version judged without them (the table of such a registry stays as
    it was)."""
    columns, suites = {}, metrics.get("suites")
    if isinstance(suites, dict) and suites:
        mine = metrics.get("tuned_suites") or {}
        theirs, who = (metrics.get("champion_suites"), "champion") if metrics.get("champion_suites") else (
            metrics.get("base_suites") or {}, "base")
        columns["suites: tuned (against)"] = "; ".join(
            f"{name} {_short(mine.get(name))} ({who} {_short(theirs.get(name))})" for name in suites)
    judge = metrics.get("judge")
    if isinstance(judge, dict):
        columns["judged win rate"] = (
            f"{judge['win_rate']:.3f} (lower bound {judge['lower_bound']:.3f}, needed {judge['min_win_rate']:g}; "
            f"against {judge['against']}, {judge['prompts']} prompts)" if judge.get("status") == "judged"
            else f"not judged: {judge.get('status')}")
    return columns


def _short(value: Any) -> str:
    return f"{value:.3f}" if _is_number(value) else "n/a"


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


def promote(root: Path, version: str) -> dict[str, Any]:
    """Make an existing version the champion by hand (`qlora-pipeline promote`: a rollback), its files verified first
    (and repaired from its export stage folder if need be); the record champion.json now holds. ValueError: why not.
    Damaged records are repaired first (heal), so a damaged record of `version` is restored, not refused."""
    heal(root)
    record = version_record(root, version) if _VERSION_NAME.match(version) else None
    if record is None:
        known = ", ".join(r["version"] for r in versions(root)) or "none"
        raise ValueError(f"{root} has no version {version} (versions: {known})")
    if record.get("files") and (problem := repaired(root, record)):
        raise ValueError(f"{version} cannot be champion: {problem}")
    with _lock(root):  # the registry's own lock object: a second FileLock on the same file inside it is a deadlock
        now = champion(root)
        reason = f"made champion by hand (qlora-pipeline promote; the champion was {now and now['version']})"
        _write_champion(root, {**record, "reason": reason, "rule": BY_HAND})
    return champion(root)
