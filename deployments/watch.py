"""`qlora-pipeline start DEPLOYMENT --watch`: start a deployment run from a terminal and follow it, artifacts included.

Prints state changes and each artifact's content as text when it appears or changes: markdown with inline
images replaced by a note, tables as aligned columns, progress as a percentage.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from typing import Any

FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
FAILURE_ARTIFACT = "run-failure"  # tasks/reporting/artifacts.py failure_summary
FAILURE_WAIT_S = 60.0  # how long after a failed or crashed state to wait for it
_ESCAPED = re.compile(r"\\([\\`*_{}\[\]<>#|~])")  # tasks/reporting/artifacts.py escapes these for the UI's markdown
_INLINE_IMAGE = re.compile(r"!\[([^\]]*)\]\(data:image/[a-z]+;base64,([A-Za-z0-9+/=]+)\)")


FLOWS = ("qlora-pipeline", "qlora-sweep")  # a bare deployment name is looked up under these flows, in order


def start(deployment: str, config: dict[str, Any], host: str | None = None) -> Any:
    """Create a flow run of `deployment` ("flow/deployment", or a bare name of a qlora flow's deployment) with the
    deployment's config overridden by the fields in `config`, as the UI's Run button does with an edited form.
    `host`: pinned to that GPU host (its work queue, tasks/pool/hosts.py)."""
    from prefect import get_client
    from prefect.exceptions import ObjectNotFound

    from tasks.pool.hosts import placement

    names = [deployment] if "/" in deployment else [f"{flow}/{deployment}" for flow in FLOWS]
    with get_client(sync_client=True) as client:
        for name in names:
            try:
                dep = client.read_deployment_by_name(name)
                break
            except ObjectNotFound:
                if name == names[-1]:
                    raise
        # Prefect merges run parameters into the deployment's at the top level only: {"config": {...}} alone would
        # replace the deployment's whole config (its data, method, registry) with the defaults
        merged = overridden(dep.parameters.get("config") or {}, config)
        placed = placement(client, dep.work_pool_name, host)
        return client.create_flow_run_from_deployment(dep.id, parameters={**dep.parameters, "config": merged},
                                                      **placed)


def overridden(base: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """A config dump with `fields` (a dump of only the fields set) put over it, section by section: a field set
    replaces the deployment's value, the section's other fields stay."""
    out = dict(base)
    for name, value in fields.items():
        section = out.get(name)
        out[name] = {**section, **value} if isinstance(section, dict) and isinstance(value, dict) else value
    return out


def watch(flow_run_id: Any, out: Callable[[str], None] = print, poll_seconds: float = 2.0) -> str:
    """Follow a flow run until it ends, printing states and artifacts; the final state's type (COMPLETED, ...)."""
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId
    from prefect.client.schemas.sorting import ArtifactSort

    seen: dict[Any, Any] = {}
    last_state, ended = None, None
    with get_client(sync_client=True) as client:
        while True:
            run = client.read_flow_run(flow_run_id)
            artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(
                flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])), sort=ArtifactSort.CREATED_DESC)
            # ours all have a key; those without are Prefect's result records (storage keys, not for people)
            for artifact in reversed([a for a in artifacts if a.key]):
                if seen.get(artifact.id) != (artifact.data, artifact.description):
                    seen[artifact.id] = (artifact.data, artifact.description)
                    out(render(artifact))
            state = run.state
            if state is not None and (state.name, state.message) != last_state:
                last_state = (state.name, state.message)
                out(f"state: {state.name}" + (f": {state.message}" if state.message else ""))
            if state is not None and state.type.value in FINAL and state.name != "AwaitingRetry":
                ended = ended or time.monotonic()
                # a failed or crashed run's reason comes a few seconds later, from its hook (the worker's, after a
                # crash): wait for it rather than leave a terminal user without it
                explained = any(a.key == FAILURE_ARTIFACT for a in artifacts)
                if state.type.value in ("COMPLETED", "CANCELLED") or explained or \
                        time.monotonic() - ended > FAILURE_WAIT_S:
                    return state.type.value
            time.sleep(poll_seconds)


def render(artifact: Any) -> str:
    """An artifact as terminal text."""
    head = f"--- {artifact.key or artifact.type}: {artifact.description or ''}".rstrip(": ")
    if artifact.type == "progress":
        return f"{artifact.key}: {float(artifact.data):.0f}% {artifact.description or ''}".rstrip()
    if artifact.type == "table":
        rows = json.loads(artifact.data) if isinstance(artifact.data, str) else artifact.data
        return f"{head}\n{_table(rows)}"
    if artifact.type == "markdown":
        text = _INLINE_IMAGE.sub(lambda m: f"[image: {m.group(1)}, {len(m.group(2)) * 3 // 4 // 1024} KiB PNG; "
                                 "see the run in the UI]", str(artifact.data))
        return f"{head}\n{_unescape(text).strip()}"
    return f"{head}\n{artifact.data}"


def _unescape(text: str) -> str:
    return _ESCAPED.sub(r"\1", text)


def _table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "(empty)"
    columns = list(rows[0])
    cells = [[_unescape(str(row.get(c, ""))) for c in columns] for row in rows]
    widths = [min(40, max(len(c), *(len(r[i]) for r in cells))) for i, c in enumerate(columns)]
    line = lambda values: "  ".join(v[:w].ljust(w) for v, w in zip(values, widths, strict=True))  # noqa: E731
    return "\n".join([line(columns), *(line(r) for r in cells)])
