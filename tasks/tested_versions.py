"""The library versions the project is tested with, and the warning a run logs when its own differ.

constraints.txt at the checkout's root pins every package that `pip install -e ".[dev,tracking,serving]"`
resolves to (.ci/lock writes it; CI and the README's install line install through it), so a worker runs what CI
tested. A worker installed otherwise still runs, and its log says which key libraries differ.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from tasks.config import PROJECT_ROOT, TrackArgs
from tasks.log import logger

CONSTRAINTS = PROJECT_ROOT / "constraints.txt"
# the libraries whose release can change what a run computes or whether it starts
KEY_LIBRARIES = ("prefect", "torch", "transformers", "peft", "bitsandbytes", "trl", "datasets", "pandas", "pyarrow")
TRACKING_LIBRARIES = {"mlflow": "mlflow", "tensorboard": "tensorboard"}  # track.backend -> its library


def tested_versions(path: Path | None = None) -> dict[str, str]:
    """Package (canonical name) -> the version a constraints file (constraints.txt) pins with `==`."""
    pinned = {}
    for line in (path or CONSTRAINTS).read_text(encoding="utf-8").splitlines():
        try:
            requirement = Requirement(line.split("#", 1)[0].strip())
        except InvalidRequirement:  # blank lines, comments, pip options
            continue
        specs = list(requirement.specifier)
        if len(specs) == 1 and specs[0].operator == "==":
            pinned[canonicalize_name(requirement.name)] = specs[0].version
    return pinned


def _public(version: str) -> str:
    """The version without its local label: torch 2.13.0+cu130 is the tested 2.13.0, built for CUDA."""
    try:
        return Version(version).public
    except InvalidVersion:
        return version


def version_drift(track: TrackArgs | None = None, path: Path | None = None) -> list[str]:
    """One entry per key library whose installed version is not the one the constraints file pins."""
    path = path or CONSTRAINTS
    tested = tested_versions(path)
    names = [*KEY_LIBRARIES, *(TRACKING_LIBRARIES[b] for b in (track.backend if track else []))]
    drift = []
    for name in names:
        pinned = tested.get(canonicalize_name(name))
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            installed = None
        if pinned is None:
            drift.append(f"{name} {installed or 'not installed'} (not in {path.name})")
        elif installed is None or _public(installed) != _public(pinned):
            drift.append(f"{name} {installed or 'not installed'} (tested {pinned})")
    return drift


def warn_untested_versions(track: TrackArgs | None = None, path: Path | None = None) -> None:
    """Log one warning naming every key library whose version differs from the tested one; nothing when equal."""
    path = path or CONSTRAINTS
    if not path.is_file():
        logger().warning("library versions not checked: no %s in %s (it comes with the checkout)", path.name,
                         path.parent)
        return
    if drift := version_drift(track, path):
        logger().warning("libraries differ from the tested versions in %s: %s. Results and failures may differ from "
                         "what CI tested; install with `pip install -c %s ...` (README: set-up) to run the tested "
                         "set.", path, ", ".join(drift), path.name)
