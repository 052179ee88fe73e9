"""One-time server setup: work pool, the GPU concurrency limit, the failure automation; and deploying.

Idempotent: each step creates what is missing and leaves what exists.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from tasks.config import PROJECT_ROOT
from tasks.limits import GPU_LIMIT

HERE = Path(__file__).resolve().parent
WORK_POOL = "qlora-process"
NOTIFY_BLOCK = "qlora-pipeline-alerts"
ROOT_VARIABLE = "QLORA_PIPELINE_ROOT"  # the checkout a worker runs flows in (prefect.yaml's pull step)


def ensure_gpu_limit() -> str:
    """Create the global concurrency limit (1 slot) that train_adapter takes; say what happened."""
    from prefect import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(GPU_LIMIT)
            return f"concurrency limit {GPU_LIMIT!r} exists"
        except ObjectNotFound:
            client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=GPU_LIMIT, limit=1))
            return f"created concurrency limit {GPU_LIMIT!r} (1 slot)"


def ensure_work_pool(name: str = WORK_POOL) -> str:
    """Create the process work pool the deployments use."""
    from prefect import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists

    with get_client(sync_client=True) as client:
        try:
            client.create_work_pool(WorkPoolCreate(name=name, type="process"))
            return f"created work pool {name!r} (process)"
        except ObjectAlreadyExists:
            return f"work pool {name!r} exists"


def apply_automations(notify_url: str) -> str:
    """Create (or replace) the failure automation, notifying notify_url through a webhook block."""
    from prefect import get_client
    from prefect.blocks.notifications import CustomWebhookNotificationBlock
    from prefect.events.schemas.automations import AutomationCore

    # the whole URL is a secret (credentials may sit in its user part, path or query): the plain url field only
    # names it, and Prefect masks the secrets field in the API, the UI and events
    block = CustomWebhookNotificationBlock(
        name=NOTIFY_BLOCK, url="{{notify_url}}", method="POST", secrets={"notify_url": notify_url},
        json_data={"subject": "{{subject}}", "body": "{{body}}"},
    )
    block_id = block.save(NOTIFY_BLOCK, overwrite=True)
    text = (HERE / "automations.yaml").read_text().replace("{{ notify_block }}", str(block_id))
    done = []
    with get_client(sync_client=True) as client:
        for spec in yaml.safe_load(text)["automations"]:
            automation = AutomationCore.model_validate(spec)
            for old in client.read_automations_by_name(automation.name):
                client.delete_automation(old.id)
            client.create_automation(automation)
            done.append(automation.name)
    return f"automation(s) {', '.join(done)} notify {redact(notify_url)} (the URL is kept in the block's secrets)"


def redact(url: str) -> str:
    """The URL's scheme and host only, for messages: its user part, path and query may hold credentials."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    host = parts.hostname or "?"
    return f"{parts.scheme}://{host}{':' + str(parts.port) if parts.port else ''}/***"


def deploy(git: str | None = None, branch: str | None = None) -> int:
    """Register the deployments in deployments/prefect.yaml (from the repository root).

    With `git`, each flow run clones that repository (at `branch`) instead of running in the worker's checkout.
    """
    prefect_file = HERE / "prefect.yaml"
    with tempfile.TemporaryDirectory() as tmp:
        if git:
            spec = yaml.safe_load(prefect_file.read_text())
            spec["pull"] = [{"prefect.deployments.steps.git_clone": {"repository": git,
                                                                     **({"branch": branch} if branch else {})}}]
            prefect_file = Path(tmp) / "prefect.yaml"
            prefect_file.write_text(yaml.safe_dump(spec, sort_keys=False))
        command = [sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--all", "--prefect-file",
                   str(prefect_file)]
        # QLORA_PIPELINE_ROOT unset: `prefect deploy` then stores the placeholder, resolved by each worker
        env = {k: v for k, v in os.environ.items() if k != ROOT_VARIABLE}
        return subprocess.call(command, cwd=PROJECT_ROOT, env=env)


def worker(pool: str, extra: list[str]) -> int:
    """`prefect worker start --pool POOL` with QLORA_PIPELINE_ROOT set to this checkout (the pull step's directory)."""
    env = {**os.environ, ROOT_VARIABLE: str(PROJECT_ROOT)}
    # exec, not a child: signals meant for the worker (Ctrl-C, a service manager's stop) reach it
    os.execve(sys.executable, [sys.executable, "-m", "prefect", "worker", "start", "--pool", pool, *extra], env)
