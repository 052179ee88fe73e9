"""What the Prefect UI shows of a run: per-stage summaries, training progress, the loss curve, failures.

Every function here is a no-op outside a flow run (a stage called through .fn() has no server).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tasks.log import current_run_attempt


def _in_run() -> bool:
    return current_run_attempt() is not None


def stage_summary(manifest: dict[str, Any]) -> None:
    """A markdown artifact per computed stage: what it read, what it wrote, how long it took."""
    if not _in_run():
        return
    from prefect.artifacts import create_markdown_artifact

    upstream = "".join(f"- {name} `{u['key']}`\n" for name, u in manifest["upstream"].items()) or "- none\n"
    written = "".join(f"| `{name}` | {size:,} |\n" for name, size in manifest["outputs"].items())
    metrics = "".join(f"| {k} | {_fmt(v)} |\n" for k, v in manifest["metrics"].items())
    markdown = (
        f"## {manifest['stage']} `{manifest['key']}`\n\nTook {manifest['seconds']:.1f} s.\n\n"
        f"### Read\n{upstream}\nSettings: `{json.dumps(manifest['params'])}`\n\n"
        f"Content fingerprints: `{json.dumps(manifest['fingerprint'])}`\n\n"
        f"### Wrote\n| file | bytes |\n|---|---|\n{written}\n"
        + (f"### Metrics\n| metric | value |\n|---|---|\n{metrics}" if metrics else "")
    )
    create_markdown_artifact(markdown=markdown, key=manifest["stage"].replace("_", "-"),
                             description=f"{manifest['stage']}: inputs, outputs, timing")


def table(key: str, rows: list[dict[str, Any]], description: str) -> None:
    """A table artifact (eval metrics, samples)."""
    if not _in_run():
        return
    from prefect.artifacts import create_table_artifact

    create_table_artifact(table=rows, key=key, description=description)


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


class TrainingProgress:
    """A progress artifact updated while training (step / total, loss, tokens/s, ETA)."""

    def __init__(self) -> None:
        self.artifact_id = None

    def update(self, step: int, total: int, text: str) -> None:
        if not _in_run() or total <= 0:
            return
        from prefect.artifacts import create_progress_artifact, update_progress_artifact

        percent = 100.0 * step / total
        if self.artifact_id is None:
            self.artifact_id = create_progress_artifact(progress=percent, key="train-progress", description=text)
        else:
            update_progress_artifact(self.artifact_id, progress=percent, description=text)


def loss_curve(loss_jsonl: Path, png: Path) -> Path | None:
    """Plot loss.jsonl to a PNG and link it from the run; None when there is nothing to plot."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and workers
    import matplotlib.pyplot as plt

    entries = [json.loads(line) for line in loss_jsonl.read_text().splitlines() if line.strip()]
    if not entries:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot([e["step"] for e in entries], [e["loss"] for e in entries])
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)
    if _in_run():
        from prefect.artifacts import create_link_artifact

        create_link_artifact(link=png.resolve().as_uri(), link_text=str(png), key="loss-curve",
                             description="Training loss per optimizer step (PNG in the run folder)")
    return png


def failure_summary(flow: Any, flow_run: Any, state: Any) -> None:
    """Flow on_failure hook: a markdown artifact that says what failed and how to resume."""
    from prefect.artifacts import create_markdown_artifact

    message = state.message or "no message"
    markdown = (
        f"## qlora-pipeline run `{flow_run.name}` failed\n\n{message}\n\n"
        "Stages that finished keep their folders (runs_dir/<stage>/<key>/, each with manifest.json) and are "
        "reused. Fix the cause (the message above says what to change), then press **Retry** on this run, run "
        "`prefect flow-run retry " + str(flow_run.id) + "`, or start the same config again: training resumes from "
        "its latest checkpoint.\n"
    )
    create_markdown_artifact(markdown=markdown, key="run-failure", description="Why this run failed")
