"""What the worker's operator allows a run, and a run cannot widen: the places its data may be read from and the
modules its reward functions may load from.

Both are environment variables of the process that runs the flow, set by whoever runs the worker (`QLORA_DATA_ROOTS=
/data,s3://bucket/ qlora-pipeline worker`), or in the work pool's or a deployment's job variables (`env`). Never a
run parameter: the run form is anyone's who can start a run, and a form that could name what the worker may read
would let them read it. A run's own job variables (the form's "Job variables", `job_variables` of a flow run) could
set the same environment variables, so a run whose job variables set one to anything but what its deployment sets is
refused before any stage (check_run_overrides).

Entries are comma-separated: folders (links resolved) or URL prefixes (s3://bucket/data/) for QLORA_DATA_ROOTS; module
names (`pkg` allows pkg and its submodules) for QLORA_REWARD_MODULES. Unset: any source, and no reward module.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tasks.errors import UserError

DATA_ROOTS = "QLORA_DATA_ROOTS"
REWARD_MODULES = "QLORA_REWARD_MODULES"
OPERATOR_VARIABLES = (DATA_ROOTS, REWARD_MODULES)


def listed(variable: str) -> list[str]:
    """The comma-separated entries of environment variable `variable`, [] when it is unset or empty."""
    return [entry.strip() for entry in os.environ.get(variable, "").split(",") if entry.strip()]


def data_roots() -> list[str] | None:
    """The places the operator allows data to be read from (QLORA_DATA_ROOTS), or None: no restriction."""
    return listed(DATA_ROOTS) or None


def inside(place: str, roots: list[str]) -> bool:
    """Whether `place` (a local path, links resolved, or a URL) lies in one of `roots` (folders or URL prefixes)."""
    if "://" in place:
        return any(place.startswith(root) for root in roots if "://" in root)
    resolved = Path(place).expanduser().resolve()
    return any(resolved.is_relative_to(Path(root).expanduser().resolve()) for root in roots if "://" not in root)


def check_run_overrides() -> None:
    """Before any stage of a flow run: a UserError when the run's own job variables set an operator's variable
    (QLORA_DATA_ROOTS, QLORA_REWARD_MODULES) to anything its deployment does not. Outside a flow run, or a run of no
    deployment (a command in a terminal, whose environment is its user's), nothing to check."""
    from prefect.runtime import flow_run

    run_id = flow_run.id
    if not run_id:
        return
    from prefect import get_client

    with get_client(sync_client=True) as client:
        run = client.read_flow_run(run_id)
        deployment = client.read_deployment(run.deployment_id) if run.deployment_id else None
    asked = _env(run.job_variables)
    allowed = _env(deployment.job_variables if deployment is not None else None)
    widened = [name for name in OPERATOR_VARIABLES if name in asked and asked[name] != allowed.get(name)]
    if widened:
        raise UserError(
            f"this run's job variables set {', '.join(widened)} in its environment; what a worker may read and run "
            "is its operator's to allow (the worker's environment, the work pool's or the deployment's job variables), "
            f"never a run's. Start the run without {' and '.join(widened)} in its job variables; to allow more, ask "
            "whoever runs the worker (docs/data.md, \"What a run may read\").")


def _env(job_variables: dict[str, Any] | None) -> dict[str, Any]:
    env = (job_variables or {}).get("env")
    return env if isinstance(env, dict) else {}
