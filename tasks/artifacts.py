"""What the Prefect UI shows of a run: per-stage summaries, training progress, the loss curve, failures.

Every function here is a no-op outside a flow run (a stage called through .fn() has no server).
"""

from __future__ import annotations

import base64
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


def _upsert(key: str, kind: str, data: Any, description: str, flow_run_id: Any = None) -> Any:
    """Update this flow run's artifact under `key` (a retry finds the earlier attempt's), else create it; its id.

    One artifact per key and run, updated in place, so a retried run has one progress bar, not a frozen one
    beside a live one.
    """
    from prefect import get_client
    from prefect.client.schemas.actions import ArtifactCreate, ArtifactUpdate
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort
    from prefect.runtime import flow_run, task_run

    flow_run_id = flow_run_id or flow_run.id
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]), key=ArtifactFilterKey(any_=[key])),
            sort=ArtifactSort.CREATED_DESC, limit=1)
        if found:
            client.update_artifact(found[0].id, ArtifactUpdate(data=data, description=description))
            return found[0].id
        return client.create_artifact(ArtifactCreate(key=key, type=kind, data=data, description=description,
                                                     flow_run_id=flow_run_id,
                                                     task_run_id=task_run.id or None)).id


class TrainingProgress:
    """A progress artifact updated while training (step / total, loss, tokens/s, ETA); one per flow run."""

    def __init__(self) -> None:
        self.artifact_id = None

    def update(self, step: int, total: int, text: str) -> None:
        if not _in_run() or total <= 0:
            return
        from prefect import get_client
        from prefect.client.schemas.actions import ArtifactUpdate

        percent = min(100.0, 100.0 * step / total)
        if self.artifact_id is None:
            self.artifact_id = _upsert("train-progress", "progress", percent, text)
            return
        with get_client(sync_client=True) as client:
            client.update_artifact(self.artifact_id, ArtifactUpdate(data=percent, description=text))


def loss_curve(loss_jsonl: Path, png: Path | None = None, title: str = "Training loss per optimizer step"
               ) -> bytes | None:
    """Plot loss.jsonl (to `png` when given) and show it in the run as a markdown artifact with the image inline.

    Inline (a data: URI) because the browser then loads it from the Prefect server's own page; a file:// link
    to the worker's disk is refused by browsers. Called during training too: the run's one `loss-curve`
    artifact is updated in place. The PNG bytes, or None when there is nothing to plot yet.
    """
    import io

    import matplotlib

    matplotlib.use("Agg")  # no display on servers and workers
    import matplotlib.pyplot as plt

    entries = [json.loads(line) for line in loss_jsonl.read_text().splitlines() if line.strip()]
    if not entries:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=80)
    ax.plot([e["step"] for e in entries], [e["loss"] for e in entries], marker="." if len(entries) < 50 else None)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    image = buffer.getvalue()
    if png is not None:
        png.write_bytes(image)
    if _in_run():
        last = entries[-1]
        markdown = (f"## {title}\n\n![training loss](data:image/png;base64,{base64.b64encode(image).decode()})"
                    f"\n\nStep {last['step']}: loss {last['loss']:.4f} ({len(entries)} logged steps)."
                    + (f" PNG on the worker: `{png}`\n" if png is not None else "\n"))
        _upsert("loss-curve", "markdown", markdown, f"{title} (step {last['step']})")
    return image

def history_markdown(rows: list[dict[str, Any]]) -> str:
    """The registry's versions as a markdown table (also what `qlora-pipeline history` prints)."""
    if not rows:
        return "No versions published yet.\n"
    columns = list(dict.fromkeys(c for row in rows for c in row))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _cell(value: Any) -> str:
    return "n/a" if value is None else f"{value:.4f}" if isinstance(value, float) else str(value)


def registry_history(name: str, rows: list[dict[str, Any]], png: Path | None = None) -> bytes | None:
    """The `registry-history` artifact: each version's tuned loss and its champion's same-night loss, plotted
    (inline PNG, as loss_curve) and tabled; the PNG bytes, or None with no versions."""
    if not rows:
        return None
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = list(range(len(rows)))
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=80)
    ax.plot(x, [r["tuned eval loss"] for r in rows], marker="o", label="tuned (the version)")
    same = [(i, r["champion same-night loss"]) for i, r in enumerate(rows) if r["champion same-night loss"] is not None]
    if same:
        ax.scatter(*zip(*same, strict=True), marker="x", color="tab:red", label="champion, same night's data")
    for i, r in enumerate(rows):
        ax.annotate(r["verdict"][0].upper(), (i, r["tuned eval loss"]), textcoords="offset points", xytext=(0, 6))
    ax.set_xticks(x, [r["version"] for r in rows])
    ax.set_ylabel("eval loss")
    ax.set_title(f"{name}: versions (P promoted, R rejected)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    image = buffer.getvalue()
    if png is not None:
        png.write_bytes(image)
    if _in_run():
        from prefect.artifacts import create_markdown_artifact

        markdown = (f"## Registry `{name}`: every version\n\n![registry history](data:image/png;base64,"
                    f"{base64.b64encode(image).decode()})\n\n{history_markdown(rows)}")
        create_markdown_artifact(markdown=markdown, key="registry-history",
                                 description=f"{name}: {len(rows)} versions, tuned vs same-night champion loss")
    return image


def failure_summary(flow: Any, flow_run: Any, state: Any) -> None:
    """Flow on_failure and on_crashed hook: end the run's unfinished task runs; say what failed and how to resume.

    A crash (the flow-run process killed: OOM killer, pre-empted node, kill -9) leaves no process to finish
    its task runs, so the worker runs this hook: the task runs still Pending or Running become Crashed, and
    the artifact names the stage that was running. Written through the client with the flow run's id, because
    in the worker there is no flow-run context.
    """
    from prefect import get_client
    from prefect.client.schemas.actions import ArtifactCreate

    message = state.message or "no message"
    with get_client(sync_client=True) as client:
        interrupted = _end_task_runs(client, flow_run.id, message) if state.is_crashed() else []
        verb = "crashed" if state.is_crashed() else "failed"
        during = f" during {', '.join(interrupted)}" if interrupted else ""
        markdown = (
            f"## qlora-pipeline run `{flow_run.name}` {verb}{during}\n\n{message}\n\n"
            "Stages that finished keep their folders (runs_dir/<stage>/<key>/, each with manifest.json) and are "
            "reused. Fix the cause (the message above says what to change), then press **Retry** on this run, run "
            f"`prefect flow-run retry {flow_run.id}`, or start the same config again: training resumes from "
            "its latest checkpoint.\n"
        )
        client.create_artifact(ArtifactCreate(key="run-failure", type="markdown", data=markdown,
                                              description=f"Why this run {verb}", flow_run_id=flow_run.id))


def _end_task_runs(client: Any, flow_run_id: Any, message: str) -> list[str]:
    """Set the flow run's task runs that are not in a final state to Crashed; the names of those that were Running."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.states import Crashed

    runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    running = []
    for run in runs:
        if run.state is None or run.state.is_final():
            continue
        if run.state.is_running():
            running.append(run.name.rsplit("-", 1)[0])
        client.set_task_run_state(run.id, Crashed(message=f"The flow run crashed: {message}"), force=True)
    return running
