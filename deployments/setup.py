"""One-time server setup: work pool, the GPU pool (concurrency limits), the failure automation; and deploying.

Idempotent: each step creates what is missing and leaves what exists.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from tasks import allowed
from tasks.config import PROJECT_ROOT
from tasks.pool.cpus import CPU_COUNTER_SLOTS, cpu_limit
from tasks.pool.gpus import device_limit, gpu_limit, placement_limit, visible_gpus
from tasks.pool.hosts import HOST_VARIABLE, SHARED_QUEUE, host_queue, this_host
from tasks.pool.leases import LEASE_SECONDS, repair_pool

HERE = Path(__file__).resolve().parent
WORK_POOL = "qlora-process"
NOTIFY_BLOCK = "qlora-pipeline-alerts"
ROOT_VARIABLE = "QLORA_PIPELINE_ROOT"  # the checkout a worker runs flows in (prefect.yaml's pull step)


def ensure_gpu_limit(gpus: int | None = None) -> str:
    """Create the GPU pool and the CPU counter (tasks/pool/) where missing, repair counts the server holds no
    leases for (tasks/pool/leases.py); say what happened.

    `gpus`: size the pool to that many GPUs, resizing an existing one (`setup --gpus N`; `setup` passes the
    worker's visible GPUs). None: create what is missing, sized to this machine's GPUs, and leave an existing pool
    as it is (what `qlora-pipeline run` does before a run: it may run on another machine than the worker).
    The limits are this host's (QLORA_HOST, tasks/pool/hosts.py): with several hosts, each runs `setup` itself.
    """
    from prefect import get_client

    gpu = gpu_limit()
    with get_client(sync_client=True) as client:
        existing = {limit.name: limit for limit in client.read_global_concurrency_limits(limit=200)}
        if gpus is None and gpu in existing:
            gpus = sum(device_limit(i) in existing for i in range(existing[gpu].limit))
        gpus = len(visible_gpus()) if gpus is None else gpus
        wanted = {gpu: max(gpus, 1), cpu_limit(): CPU_COUNTER_SLOTS}  # 0 GPUs: one slot, one training at a time
        if gpus:
            wanted |= {placement_limit(): 1, **{device_limit(i): 1 for i in range(gpus)}}
        done = [_ensure_limit(client, name, slots, existing.get(name)) for name, slots in wanted.items()]
        stale = [n for n in existing if _is_device_limit(n) and n not in wanted]
        for name in stale:  # devices of a larger pool before
            client.delete_global_concurrency_limit_by_name(name)
        repaired = repair_pool(client)
        storage = _lease_storage(client)
    changed = [d for d in done if d] + [f"deleted {n!r}" for n in stale]
    host = this_host()
    pool = f"{gpus} GPU(s): {gpu!r} {max(gpus, 1)} slot(s)" + (
        f", {device_limit(0)!r} .. {device_limit(gpus - 1)!r}" if gpus else " (CPU-only: one training at a time)")
    return ((f"host {host!r} ({HOST_VARIABLE}): " if host else "")
            + f"GPU pool for {pool}; {cpu_limit()!r} counts the runs sharing the host's cores"
            + (f" ({'; '.join(changed)})" if changed else " (all existed)")
            + (f"\nrepaired: the server held no leases for these slots (it restarted?), set free: "
               f"{'; '.join(repaired)}; runs still training re-claim theirs within {LEASE_SECONDS} s" if repaired
               else "") + storage)


def _is_device_limit(name: str) -> bool:
    """A device limit of this host's pool (another host's are named for that host, hosts.py)."""
    index = name.removeprefix(f"{gpu_limit()}-")
    return index != name and index.isdigit()


def _lease_storage(client: Any) -> str:
    """A line on where the server keeps its concurrency leases, when that is its memory; '' otherwise."""
    try:
        storage = client.request("GET", "/admin/settings").json()["server"]["concurrency"]["lease_storage"]
    except Exception:  # noqa: BLE001 - not an open-source Prefect server, or an older one: nothing to say
        return ""
    if not storage.endswith(".memory"):
        return ""
    return (f"\nleases: this server keeps them in memory (Prefect's default), so a restart forgets them; the pool "
            f"repairs itself within {LEASE_SECONDS} s, and trainings running then re-claim their GPUs. To keep them "
            f"across restarts, start the server with PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE={FILE_LEASES}")


FILE_LEASES = "prefect.server.concurrency.lease_storage.filesystem"


def _ensure_limit(client: Any, name: str, slots: int, existing: Any) -> str:
    """Create `name` with `slots` slots, or resize it; what was done ('' when nothing)."""
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate, GlobalConcurrencyLimitUpdate

    if existing is None:
        client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=slots))
        return f"created {name!r}"
    if existing.limit != slots:
        client.update_global_concurrency_limit(name, GlobalConcurrencyLimitUpdate(limit=slots))
        return f"resized {name!r} {existing.limit} -> {slots}"
    return ""


def ensure_work_pool(name: str = WORK_POOL) -> str:
    """Create the process work pool the deployments use, and this host's work queue in it where QLORA_HOST is set
    (runs pinned to the host go there; tasks/pool/hosts.py)."""
    from prefect import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists

    with get_client(sync_client=True) as client:
        try:
            client.create_work_pool(WorkPoolCreate(name=name, type="process"))
            said = f"created work pool {name!r} (process)"
        except ObjectAlreadyExists:
            said = f"work pool {name!r} exists"
        if (host := this_host()) is not None:
            said += f"; {_ensure_queue(client, name, host_queue(host))} for runs pinned to host {host!r}"
    return said


def _ensure_queue(client: Any, pool: str, queue: str) -> str:
    from prefect.exceptions import ObjectAlreadyExists

    try:
        client.create_work_queue(name=queue, work_pool_name=pool)
        return f"created work queue {queue!r}"
    except ObjectAlreadyExists:
        return f"work queue {queue!r} exists"


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
        # Prefect's own report repeats its generic next steps (`prefect worker start ...`) for every deployment;
        # ours says them once, with this project's commands. On a failure its whole output is the help.
        done = subprocess.run(command, cwd=PROJECT_ROOT, env=env, capture_output=True, text=True)
    if done.returncode:
        print(done.stdout, end="")
        print(done.stderr, end="", file=sys.stderr)
        return done.returncode
    print(_deployed(yaml.safe_load((HERE / "prefect.yaml").read_text())["deployments"]))
    return 0


def _deployed(specs: list[dict[str, Any]]) -> str:
    """What `deploy` registered, read back from the server, and the next steps, once."""
    from prefect import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName, WorkerFilter
    from prefect.settings import get_current_settings

    pools = sorted({spec["work_pool"]["name"] for spec in specs})
    with get_client(sync_client=True) as client:
        found = client.read_deployments(deployment_filter=DeploymentFilter(
            name=DeploymentFilterName(any_=[spec["name"] for spec in specs])))
        flows = {flow.id: flow.name for flow in client.read_flows()}
        online = {pool: len(client.read_workers_for_work_pool(
            pool, worker_filter=WorkerFilter(status={"any_": ["ONLINE"]}))) for pool in pools}
    names = sorted(f"{flows.get(d.flow_id, '?')}/{d.name}" for d in found)
    ui = get_current_settings().ui_url
    lines = [f"deployed {len(names)}: {', '.join(names)}" + (f" ({ui}/deployments)" if ui else ""),
             "start a run: qlora-pipeline start DEPLOYMENT [--set SECTION.FIELD=VALUE ...], or Run in the UI"]
    for pool, count in online.items():
        lines.append(f"{count} worker(s) online for work pool {pool!r}; start more with `qlora-pipeline worker`"
                     if count else f"no worker is online for work pool {pool!r}: start one with "
                     "`qlora-pipeline worker` in a checkout of this project on each machine that runs flow runs")
    return "\n".join(lines)


def worker(pool: str, extra: list[str]) -> int:
    """`prefect worker start --pool POOL` with QLORA_PIPELINE_ROOT set to this checkout (the pull step's directory).

    Where QLORA_HOST names this host (several GPU hosts, tasks/pool/hosts.py), the worker is that host's: named for
    it, polling the shared queue and the host's own, and taking at most as many flow runs at once as the host's
    GPU pool has GPUs (`--limit`, unless given), so a run waits in the shared queue for a host with a free GPU
    rather than on a host whose GPUs are all taken."""
    env = {**os.environ, ROOT_VARIABLE: str(PROJECT_ROOT)}
    print(_data_roots_line(), flush=True)
    if (host := this_host()) is not None:
        extra = [*_host_worker_args(pool, host, extra), *extra]
    # exec, not a child: signals meant for the worker (Ctrl-C, a service manager's stop) reach it
    os.execve(sys.executable, [sys.executable, "-m", "prefect", "worker", "start", "--pool", pool, *extra], env)


def _data_roots_line() -> str:
    """What the worker's runs may read (its operator's QLORA_DATA_ROOTS, tasks/allowed.py), said as it starts."""
    roots = allowed.data_roots()
    if roots:
        return f"runs of this worker read data only from {', '.join(roots)} ({allowed.DATA_ROOTS})"
    return (f"warning: {allowed.DATA_ROOTS} is not set, so a run started from the UI may read any file this worker can "
            f"as its data; set it to the folders (or URL prefixes) the runs' data lies in, e.g. "
            f"{allowed.DATA_ROOTS}=/data,s3://bucket/ qlora-pipeline worker")


def _host_worker_args(pool: str, host: str, extra: list[str]) -> list[str]:
    """`prefect worker start` arguments of host `host`'s worker: its name, its queues, its limit (its GPUs)."""
    from prefect import get_client

    with get_client(sync_client=True) as client:
        _ensure_queue(client, pool, SHARED_QUEUE)
        _ensure_queue(client, pool, host_queue(host))
    args = ["--name", f"qlora-{host}", "--work-queue", SHARED_QUEUE, "--work-queue", host_queue(host)]
    limit = extra[extra.index("--limit") + 1] if "--limit" in extra else str(host_gpus())
    print(f"worker of host {host!r}: work queues {SHARED_QUEUE!r} and {host_queue(host)!r}, at most {limit} flow "
          "run(s) at a time", flush=True)
    return args if "--limit" in extra else [*args, "--limit", limit]


def host_gpus() -> int:
    """GPUs of this host's pool on the server (its device limits), at least 1; `setup --gpus N` sizes it."""
    from prefect import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            size = client.read_global_concurrency_limit_by_name(gpu_limit()).limit
        except ObjectNotFound:
            return max(1, len(visible_gpus()))
    return max(1, size)
