"""An exported adapter named by folder or as `champion:NAME` (train.init_adapter), resolved to its folder through
the exports registry (tasks/registry.py)."""

from __future__ import annotations

from pathlib import Path

from tasks.errors import UserError
from tasks.registry import champion, registry_dir

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def resolve_adapter(spec: str, runs_dir: Path) -> Path:
    """The adapter folder that `spec` names: a folder holding adapter_config.json (or its adapter/ subfolder),
    or `champion:NAME`, the current champion of registry NAME under runs_dir."""
    if spec.startswith("champion:"):
        name = spec.removeprefix("champion:")
        current = champion(registry_dir(runs_dir, name))
        if current is None:
            raise UserError(f"train.init_adapter={spec!r}: the registry {name!r} under {runs_dir}/exports has no "
                            f"champion yet. Run the pipeline with export.name={name} first (e.g. the SFT preset), "
                            "or name an adapter folder.")
        folder = Path(current["path"])
    else:
        folder = Path(spec).expanduser()
        if (folder / "adapter" / ADAPTER_FILES[0]).is_file():
            folder = folder / "adapter"
    missing = [f for f in ADAPTER_FILES if not (folder / f).is_file()]
    if missing:
        raise UserError(f"train.init_adapter={spec!r}: {folder} lacks {', '.join(missing)}. Name an exported "
                        "adapter folder (runs_dir/exports/NAME/vNNNN) or 'champion:NAME'.")
    return folder.resolve()
