"""An exported adapter named by folder or as `champion:NAME` (train.init_adapter), resolved to its folder through
the exports registry (store.py) and verified before use.

A folder holding a version record (version.json) is checked against the sha256 the record holds, wherever it lies:
a registry's own version folder, or a copy of one elsewhere, renamed or not; a copy whose version.json is damaged
cannot be verified and is refused. A damaged champion is first restored from its export stage folder, as the
registry repairs itself (a copy elsewhere is not the registry's to repair). An export stage folder is checked
against its manifest. Any other folder has no recorded hashes: only its safetensors header is checked to load, so
a same-size corruption inside the weights cannot be seen there.
"""

from __future__ import annotations

from pathlib import Path

from tasks.errors import UserError
from tasks.on_disk.manifest import MANIFEST, check_stage
from tasks.registry.store import ADAPTER_FILES, VERSION_FILE, champion, damage_in, read_record, registry_dir, repaired

_FIX = ("Publish it again (re-run the pipeline that exported it), or name another adapter folder "
        "(runs_dir/exports/NAME/vNNNN) or 'champion:NAME'.")


def resolve_adapter(spec: str, runs_dir: Path) -> Path:
    """The adapter folder that `spec` names, verified: a folder holding adapter_config.json (or its adapter/
    subfolder), or `champion:NAME`, the current champion of registry NAME under runs_dir."""
    root = None  # the registry whose champion the folder is
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
    problem = _damage(folder, champion_of=root)
    if problem:
        raise UserError(f"train.init_adapter={spec!r} cannot be used: {problem}. Nothing was trained from it. {_FIX}")
    return folder.resolve()


def _damage(folder: Path, champion_of: Path | None) -> str:
    """What is wrong with an adapter folder's files, by the strongest check its kind allows ('' if none);
    `champion_of`: the registry whose champion this folder is (then repaired from its export stage folder)."""
    record, problem = read_record(folder / VERSION_FILE)
    if problem:
        return (f"{folder / VERSION_FILE} {problem}, so the folder's files cannot be verified against the sha256 "
                "it recorded")
    if record is not None and record.get("files"):
        return repaired(champion_of, record) if champion_of is not None else damage_in(folder, record)
    if (folder / MANIFEST).is_file():  # an export stage folder (or a train_adapter one) vouches for its files
        manifest, why = check_stage(folder)
        return "" if manifest is not None else f"{folder}: {why}"
    if (folder.parent / MANIFEST).is_file() and folder.name == "adapter":  # train_adapter/<key>/adapter
        manifest, why = check_stage(folder.parent)
        return "" if manifest is not None else f"{folder.parent}: {why}"
    return _header_damage(folder / ADAPTER_FILES[1])


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
