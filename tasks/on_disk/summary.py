"""The summary of a finished stage folder in the Prefect UI: what it read, what it wrote, how long it took.

StageRun.finish (tasks/on_disk/folders.py) shows it as the stage's markdown artifact, from the manifest it wrote; a
no-op outside a flow run (a stage called through .fn() has no server).
"""

from __future__ import annotations

import json
from typing import Any

from tasks.log import current_run_attempt, for_candidate


def stage_summary(manifest: dict[str, Any]) -> None:
    """A markdown artifact per computed stage: what it read, what it wrote, how long it took."""
    if current_run_attempt() is None:
        return
    from prefect.artifacts import create_markdown_artifact

    upstream = "".join(f"- {name} `{u['key']}`\n" for name, u in manifest["upstream"].items()) + _sources(manifest)
    upstream = upstream or "- nothing recorded\n"
    written = "".join(f"| `{name}` | {size:,} |\n" for name, size in manifest["outputs"].items())
    metrics = "".join(f"| {k} | {_fmt(v)} |\n" for k, v in manifest["metrics"].items())
    markdown = (
        f"## {manifest['stage']} `{manifest['key']}`\n\n{_took(manifest)}\n\n"
        f"### Read\n{upstream}\nSettings: `{json.dumps(manifest['params'])}`\n\n"
        f"### Wrote\n| file | bytes |\n|---|---|\n{written}\n"
        + (f"### Metrics\n| metric | value |\n|---|---|\n{metrics}" if metrics else "")
    )
    key, description = for_candidate(manifest["stage"].replace("_", "-"), f"{manifest['stage']}: inputs, outputs, "
                                     "timing")
    create_markdown_artifact(markdown=markdown, key=key, description=description)


def _took(manifest: dict[str, Any]) -> str:
    seconds, waited = manifest["seconds"], manifest["metrics"].get("gpu_wait_seconds") or 0
    if waited < 1:
        return f"Took {seconds:.1f} s."
    return (f"Took {seconds:.1f} s: {waited:.1f} s waiting for the GPU slot (other runs' training), then "
            f"{seconds - waited:.1f} s of its own work.")


def _sources(manifest: dict[str, Any]) -> str:
    """What a stage read besides upstream stages: the files and hub revisions its fingerprints hold."""
    named = {f"{section}.{field}": value for section, fields in manifest["params"].items() if isinstance(fields, dict)
             for field, value in fields.items() if field in _SOURCE_FIELDS and value}
    lines = [f"- `{field}`: `{value}`\n" for field, value in named.items()]
    lines += [f"- {name.removesuffix('_sha256').replace('_', ' ')}: content `{str(digest)[:16]}`\n"
              for name, digest in manifest["fingerprint"].items()]
    return "".join(lines)


_SOURCE_FIELDS = ("source", "base_model", "init_adapter")  # config fields that name what a stage reads


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
