"""An exported adapter named by folder or as `champion:NAME` (train.init_adapter), resolved to its folder through
the exports registry (tasks/registry.py) and verified before use.

A registry version (and so a champion) is checked against the sha256 its version record holds; a damaged champion
is first restored from its export stage folder, as the registry repairs itself. An export stage folder is checked
against its manifest. Any other folder has no recorded hashes: only its safetensors header is checked to load, so a
same-size corruption inside the weights cannot be seen there.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tasks.errors import UserError
from tasks.manifest import MANIFEST, check_stage
from tasks.registry import ADAPTER_FILES, VERSION_FILE, champion, damage, registry_dir, repaired

_FIX = ("Publish it again (re-run the pipeline that exported it), or name another adapter folder "
        "(runs_dir/exports/NAME/vNNNN) or 'champion:NAME'.")


def resolve_adapter(spec: str, runs_dir: Path) -> Path:
    """The adapter folder that `spec` names, verified: a folder holding adapter_config.json (or its adapter/
    subfolder), or `champion:NAME`, the current champion of registry NAME under runs_dir."""
    if spec.startswith("champion:"):
        name = spec.removeprefix("champion:")
        root = registry_dir(runs_dir, name)
        current = champion(root)
        if current is None:
            raise UserError(f"train.init_adapter={spec!r}: the registry {name!r} under {runs_dir}/exports has no "
                            f"champion yet. Run the pipeline with export.name={name} first (e.g. the SFT preset), "
                            "or name an adapter folder.")
        folder = root / current["version"]  # never the recorded path: runs_dir may have moved or been copied
    else:
        folder = Path(spec).expanduser()
        if (folder / "adapter" / ADAPTER_FILES[0]).is_file():
            folder = folder / "adapter"
    missing = [f for f in ADAPTER_FILES if not (folder / f).is_file()]
    if missing:
        raise UserError(f"train.init_adapter={spec!r}: {folder} lacks {', '.join(missing)}. Name an exported "
                        "adapter folder (runs_dir/exports/NAME/vNNNN) or 'champion:NAME'.")
    problem = _damage(folder, repair=spec.startswith("champion:"))
    if problem:
        raise UserError(f"train.init_adapter={spec!r} cannot be used: {problem}. Nothing was trained from it. {_FIX}")
    return folder.resolve()


def _damage(folder: Path, repair: bool) -> str:
    """What is wrong with an adapter folder's files, by the strongest check its kind allows ('' if none)."""
    record = _record(folder)
    if record is not None and record.get("files"):
        return repaired(folder.parent, record) if repair else damage(folder.parent, record)
    if (folder / MANIFEST).is_file():  # an export stage folder (or a train_adapter one) vouches for its files
        manifest, why = check_stage(folder)
        return "" if manifest is not None else f"{folder}: {why}"
    if (folder.parent / MANIFEST).is_file() and folder.name == "adapter":  # train_adapter/<key>/adapter
        manifest, why = check_stage(folder.parent)
        return "" if manifest is not None else f"{folder.parent}: {why}"
    return _header_damage(folder / ADAPTER_FILES[1])


def _record(folder: Path) -> dict[str, Any] | None:
    """The version record of a registry version folder, else None."""
    try:
        record = json.loads((folder / VERSION_FILE).read_text())
    except (FileNotFoundError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("version") == folder.name else None


def _header_damage(weights: Path) -> str:
    """A folder without recorded hashes: its safetensors header must load and cover the file (no hash to compare)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(weights), "pt") as f:
            f.keys()
    except (SafetensorError, OSError) as exc:
        return (f"{weights} does not load as safetensors ({exc}); this folder has no recorded sha256 (it is not a "
                "registry version or stage folder), so only its header could be checked")
    return ""


def check_init_adapter(init_adapter: str | None, runs_dir: Path) -> None:
    """Fail before any stage runs when train.init_adapter names a missing or damaged adapter."""
    if init_adapter:
        resolve_adapter(init_adapter, runs_dir)
