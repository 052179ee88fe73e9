"""What the Prefect UI shows of a run: training progress, the loss curve, tables, failures (a stage's own summary:
tasks/on_disk/summary.py).

Every function here is a no-op outside a flow run (a stage called through .fn() has no server).
"""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path
from typing import Any

from tasks.log import current_run_attempt, for_candidate
from tasks.on_disk import disk


def _in_run() -> bool:
    return current_run_attempt() is not None


def table(key: str, rows: list[dict[str, Any]], description: str) -> None:
    """A table artifact (eval metrics, samples); text cells are shown as text, one line, at most CELL_CHARS."""
    if not _in_run():
        return
    from prefect.artifacts import create_table_artifact

    cells = [{k: _cell(v) if isinstance(v, str) else v for k, v in row.items()} for row in rows]
    key, description = for_candidate(key, description)
    create_table_artifact(table=cells, key=key, description=description)


def eval_samples(rows: list[dict[str, Any]], description: str) -> None:
    """The eval-samples table: the answers first (tuned, base, champion), then the reference, the scores and the
    prompt last, under names a reader knows; the prompt column held the answers off-screen when it came first."""
    models = ("tuned", "base", "champion")
    columns = {**{f"{who}_output": f"{who} answer" for who in models}, "reference": "reference answer",
               **{f"{who}_rouge_l": f"{who} ROUGE-L" for who in models},
               **{f"{who}_exact_match": f"{who} exact match" for who in models}, "prompt": "prompt"}
    shown = [{label: row[name] for name, label in columns.items() if name in row} for row in rows]
    table("eval-samples", shown, description)


CELL_CHARS = 300  # the UI's table does not wrap long cells; whole samples are in the stage folder's files
# the UI renders table cells and markdown as markdown: a prompt's "### Instruction:" became a heading, and
# "<stage>" an HTML tag that disappears
_MARKDOWN = re.compile(r"([\\`*_{}\[\]<>#|~])")


def _escape(text: str) -> str:
    return _MARKDOWN.sub(r"\\\1", text)


def _cell(text: str) -> str:
    short = text if len(text) <= CELL_CHARS else text[:CELL_CHARS] + " ..."
    return _escape(" ⏎ ".join(line.strip() for line in short.splitlines() if line.strip()))


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
        key, text = for_candidate("train-progress", text)
        if self.artifact_id is None:
            self.artifact_id = _upsert(key, "progress", percent, text)
            return
        with get_client(sync_client=True) as client:
            client.update_artifact(self.artifact_id, ArtifactUpdate(data=percent, description=text))


def run_completed(train_status: str, steps: int | None) -> None:
    """At the end of a successful run: a train-progress bar also when training was cached (one per run, as
    docs/operations.md says), and a run-failure card of an earlier attempt of this run (before a Retry) marked
    resolved."""
    if not _in_run():
        return
    from prefect import get_client
    from prefect.client.schemas.actions import ArtifactUpdate
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey
    from prefect.runtime import flow_run

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run.id]),
            key=ArtifactFilterKey(any_=["run-failure", "train-progress"])))
        for card in (a for a in found if a.key == "run-failure" and not str(a.data).startswith("## Resolved")):
            client.update_artifact(card.id, ArtifactUpdate(
                data=f"## Resolved: the run completed on a later attempt\n\nThe earlier attempt's card:\n\n{card.data}",
                description="Resolved: the run completed after a retry"))
    if train_status == "cached" and not any(a.key == "train-progress" for a in found):
        _upsert("train-progress", "progress", 100.0, f"cached: trained by an earlier run ({steps} optimizer steps)")


_VERDICTS = ("promoted", "rejected")  # the promotion gate's (tasks/registry/gate.py)
NOT_UPDATED = "not updated"  # serving's status (tasks/export_adapter/serving.py) when the server kept what it served
NOT_SERVED = "not-served"  # the tag of a run whose serve.url server does not serve the champion
UNCHANGED = "unchanged"  # the tag of a run that published nothing (verdict)


class NotServed(Exception):
    """What a run ends with when serve.url's server does not serve the champion although the run did its work (the
    version is published): its final state is Failed with this as its message; `summary` is the run's summary."""

    def __init__(self, message: str, summary: dict[str, Any]) -> None:
        super().__init__(message)
        self.summary = summary


def verdict(summary: dict[str, Any], metrics: dict[str, Any], who: str = "") -> Any:
    """The run's final state: what this run did to the registry as its message (on the run's page) and as a tag (in
    the runs list), so the result is seen without opening an artifact; `summary` is the flow's result. The tag is the
    verdict of the version this run published (promoted, rejected), or unchanged when it published nothing (every
    stage cached, or the champion's own adapter again): a night on unchanged data does not look like a promotion.
    Completed, unless serve.url's server was not updated (summary["serving"]): then Failed, the message saying why,
    the tag not-served, so that a schedule, the failure alert and the UI tell it from a run whose champion is served.
    `who`: whose verdict it is, for a sweep its winner."""
    from prefect.states import Completed, Failed

    serving = summary.get("serving") or {}
    message, tags = "", []
    if "promotion" in metrics and metrics.get("export_published") == "by an earlier run":
        message = (f"{who}{metrics['export_name']}: nothing new published; this run's adapter is "
                   f"{metrics['export_version']}, published by an earlier run ({metrics['promotion']} then: "
                   f"{metrics['promotion_reason']}); champion now {metrics.get('champion_version') or 'none'}")
        tags = [UNCHANGED]
    elif "promotion" in metrics:
        message = (f"{who}{metrics['export_name']} {metrics['export_version']} {metrics['promotion']}: "
                   f"{metrics['promotion_reason']}")
        tags = [metrics["promotion"]]
    if serving.get("status") == NOT_UPDATED:
        message, tags = "; ".join(filter(None, [message, serving["message"]])), [*tags, NOT_SERVED]
    if _in_run() and tags:
        from prefect import get_client
        from prefect.runtime import flow_run

        with get_client(sync_client=True) as client:  # a Retry's tags replace the attempt's before
            kept = [t for t in client.read_flow_run(flow_run.id).tags if t not in (*_VERDICTS, UNCHANGED, NOT_SERVED)]
            client.update_flow_run(flow_run.id, tags=[*kept, *tags])
    if NOT_SERVED in tags:
        return Failed(message=message, data=NotServed(message, summary))
    return Completed(message=message or None, data=summary)


def figure(columns: int = 1, size: tuple[float, float] = (6, 3.5)) -> tuple[Any, Any]:
    """A matplotlib figure and its axes for an artifact's plot (the Agg backend: no display on servers)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, columns, figsize=size, dpi=80)


def png_bytes(fig: Any, png: Path | None = None) -> bytes:
    """The figure as PNG bytes (also written whole to `png` when given), its axes gridded; the figure is closed."""
    import io

    import matplotlib.pyplot as plt

    for ax in fig.axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    if png is not None:
        disk.write_whole(png, buffer.getvalue())
    return buffer.getvalue()


def inline_png(image: bytes, alt: str) -> str:
    """Markdown that shows the PNG inline: a data: URI, which the browser loads from the Prefect server's own page
    (a file:// link to the worker's disk is refused by browsers)."""
    return f"![{alt}](data:image/png;base64,{base64.b64encode(image).decode()})"


def loss_curve(loss_jsonl: Path, png: Path | None = None, title: str = "Training loss per optimizer step",
               write: bool = True) -> bytes | None:
    """Plot loss.jsonl (to `png` when given; `write=False`: the caller writes it there) and show it in the run as
    a markdown artifact with the image inline.

    Inline (a data: URI) because the browser then loads it from the Prefect server's own page; a file:// link
    to the worker's disk is refused by browsers. Called during training too: the run's one `loss-curve`
    artifact is updated in place. The PNG bytes, or None when there is nothing to plot yet.
    """
    entries = [json.loads(line) for line in loss_jsonl.read_text().splitlines() if line.strip()]
    if not entries:
        return None
    fig, ax = figure()
    ax.plot([e["step"] for e in entries], [e["loss"] for e in entries], marker="." if len(entries) < 50 else None)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss")
    image = png_bytes(fig, png if write else None)
    if _in_run():
        last = entries[-1]
        markdown = (f"## {title}\n\n{inline_png(image, 'training loss')}"
                    f"\n\nStep {last['step']}: loss {last['loss']:.4f} ({len(entries)} logged steps)."
                    + (f" PNG on the worker: `{png}`\n" if png is not None else "\n"))
        key, description = for_candidate("loss-curve", f"{title} (step {last['step']})")
        _upsert(key, "markdown", markdown, description)
    return image

def history_markdown(rows: list[dict[str, Any]]) -> str:
    """The registry's versions as a markdown table (also what `qlora-pipeline history` prints)."""
    if not rows:
        return "No versions published yet.\n"
    columns = list(dict.fromkeys(c for row in rows for c in row))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_history_cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _history_cell(value: Any) -> str:
    return "n/a" if value is None else f"{value:.4f}" if isinstance(value, float) else str(value)


def registry_history(name: str, rows: list[dict[str, Any]], png: Path | None = None, write: bool = True
                     ) -> bytes | None:
    """The `registry-history` artifact: each version's tuned loss and its champion's same-night loss, plotted
    (inline PNG, as loss_curve) and tabled; the PNG bytes, or None with no versions. `write=False`: the caller
    writes the bytes to `png` itself (the run record writes its files together)."""
    if not rows:
        return None
    x = list(range(len(rows)))
    fig, ax = figure()
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
    image = png_bytes(fig, png if write else None)
    if _in_run():
        from prefect.artifacts import create_markdown_artifact

        markdown = (f"## Registry `{name}`: every version\n\n{inline_png(image, 'registry history')}\n\n"
                    f"{history_markdown(rows)}")
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
            f"## qlora-pipeline run `{flow_run.name}` {verb}{during}\n\n{_escape(message)}\n\n"
            "Stages that finished keep their folders (`runs_dir/<stage>/<key>/`, each with manifest.json) and are "
            f"reused. {_next_step(message, flow_run.id, _new_run(client, flow_run, message))}\n"
        )
        client.create_artifact(ArtifactCreate(key="run-failure", type="markdown", data=markdown,
                                              description=f"Why this run {verb}", flow_run_id=flow_run.id))
    from prefect.logging.loggers import flow_run_logger

    # the flow run's own logger: a hook may run outside the run's context (the worker runs it after a crash)
    flow_run_logger(flow_run, flow).info("run %s %s%s: its run-failure artifact says what to do next",
                                         flow_run.name, verb, during)


def _next_step(message: str, flow_run_id: Any, new_run: str) -> str:
    """What to do now. Retry runs the same parameters again: right after a crash or once bad data is fixed in
    place, useless for a mistake in the configuration. deployments/automations.yaml gives the same advice in the
    failure alert, told apart by the same words of the message (failure_advice)."""
    retry = (f"press **Retry** on this run (or run `prefect flow-run retry {flow_run_id}`), or start the same config "
             "again: finished stages are reused and training resumes from its latest checkpoint.")
    new_run = f"start a new run with the field changed: {new_run}; Retry would run the same parameters and fail the "\
              "same way."
    advice = failure_advice(message)
    if advice in ("serving", "serving-fix"):
        return serving_advice(message, retry)
    if advice == "config":
        return f"The run's configuration was refused: {new_run}"
    if advice == "input":
        return (f"This is a mistake in the input (the message names it and the fix). If it names a config field, "
                f"{new_run} If it names the data or another file, fix that, then {retry}")
    return f"Fix the cause if there is one (the message says what happened), then {retry}"


# Prefect's messages for parameters that do not validate against RunConfig
_CONFIG_REFUSED = ("Validation of flow parameters failed", "ParameterTypeError")


# serving's words for a server that was down or slow (tasks/export_adapter/vllm_api.py): the same run may succeed later
_SERVER_AWAY = ("cannot be reached", "did not answer")


def failure_advice(message: str) -> str:
    """Whether Retry can help a failed run, from its state message: "config" (the parameters were refused: it
    cannot), "input" (a UserError: only once the data or file it names is fixed), "serving" (the champion is not
    served because the server was away: once it is back), "serving-fix" (the server refused: only once it is fixed)
    or "retry"."""
    if "serving not updated: " in message:
        return "serving" if any(text in message for text in _SERVER_AWAY) else "serving-fix"
    if any(text in message for text in _CONFIG_REFUSED):
        return "config"
    return "input" if "UserError" in message else "retry"


def serving_advice(message: str, retry: str) -> str:
    """What to do when the run did its work but serve.url's server does not serve the champion (NotServed)."""
    done = ("The version is published and the registry's champion changed as the message says; the server still "
            "serves what it served before. ")
    promote = ("Or serve the champion without a run: `qlora-pipeline promote NAME VERSION --set serve.url=URL` "
               "(docs/serving.md).")
    if failure_advice(message) == "serving":
        return f"{done}Once the server is up and answering, {retry} Only serving runs again. {promote}"
    return (f"{done}Fix the server first as the message says (its start command, its API key in VLLM_API_KEY, its "
            f"--max-lora-rank, its base model); Retry alone would be refused the same way. Then {retry} Only serving "
            f"runs again. {promote}")


def _new_run(client: Any, flow_run: Any, message: str) -> str:
    """How to start the run again with the fields the message names changed: the deployment's form and the
    `qlora-pipeline start` command for a deployment run, the command line's own command otherwise."""
    from prefect.utilities.urls import url_for

    fields = " ".join(f"--set {name}=<new value>" for name in fields_named(message)) or "--set <field>=<new value>"
    flow = client.read_flow(flow_run.flow_id).name
    if flow_run.deployment_id is None:  # started by `qlora-pipeline run` or `sweep`
        command = "run" if flow == "qlora-pipeline" else "sweep --grid GRID"
        return f"`qlora-pipeline {command} {fields}` with the rest of the command as before"
    deployment = client.read_deployment(flow_run.deployment_id)
    name = deployment.name if flow == "qlora-pipeline" else f"{flow}/{deployment.name}"  # as `start` looks it up
    link = url_for(deployment, url_type="ui")
    form = f"[{deployment.name}]({link}/run)" if link else f"the deployment {deployment.name}"
    return f"**Run** on {form} (its form), or `qlora-pipeline start {name} {fields}`"


def fields_named(message: str) -> list[str]:
    """The RunConfig fields a message names (section.field, or runs_dir), in order: pydantic's error locations
    (`config.train.max_steps`) and our own messages (`data.source='...'`) both spell them so."""
    from tasks.config import RunConfig

    sections = {name: info.annotation for name, info in RunConfig.model_fields.items() if name != "runs_dir"}
    known = {"runs_dir", *(f"{section}.{name}" for section, model in sections.items() for name in model.model_fields)}
    found = re.findall(r"(?<![\w.])(?:config\.)?([a-z]+(?:\.[a-z0-9_]+|_dir))\b", message)
    return list(dict.fromkeys(name for name in found if name in known))


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
            running.append(run.name.split("-", 1)[0])  # "train_adapter-a1f", or a candidate's "train_adapter-c2 (...)"
        client.set_task_run_state(run.id, Crashed(message=f"The flow run crashed: {message}"), force=True)
    return running


def tracking_report(done: dict[str, dict[str, str]]) -> None:
    """A markdown artifact: where each tracking backend holds this run, or what it did not take and why."""
    if not _in_run():
        return
    from prefect.artifacts import create_markdown_artifact

    lines = ["| backend | where | logged |", "|---|---|---|"]
    for name, ref in done.items():
        where = ref.get("url") or ref.get("log_dir") or ref.get("tracking_uri", "")
        logged = ref["logged"] + (f" ({ref['reason']})" if ref.get("reason") else "") + (
            f"; {ref['steps_sent']} training steps it lacked sent now" if ref.get("steps_sent") else "") + (
            f"; model {ref['registered']}" if ref.get("registered") else "")
        lines.append(f"| {name} | {_cell(where)} | {_cell(logged)} |")
    unsent = [name for name, ref in done.items() if ref.get("reason")]
    note = (f"\n\nNot sent to {', '.join(unsent)}: this run's files keep all of it (loss.jsonl, the stage folders, "
            "run.json), noted in runs_dir/tracking-pending/; the next run that reaches the server sends it."
            if unsent else "")
    create_markdown_artifact(markdown="## Tracking\n\n" + "\n".join(lines) + note, key="tracking",
                             description="where this run is tracked" + (": not all sent" if unsent else ""))

