"""Prefect's side of stage caching: a cache policy that returns the stage key, and retry rules.

The manifest on disk stays the truth. The policy hands Prefect the same key the stage folder is named
by, so the UI shows reused stages as Cached and a Retry of a failed flow run skips finished stages.
If Prefect holds a result for that key but the folder is gone or broken, the policy returns no key:
Prefect then runs the task, which recomputes the folder (the old result record, a folder path,
becomes right again once the folder is rebuilt).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prefect.cache_policies import CachePolicy
from prefect.context import TaskRunContext

from tasks.errors import UserError
from tasks.hashing.keys import cache_key
from tasks.on_disk.folders import StageSpec
from tasks.on_disk.manifest import read_manifest

_TRANSIENT_NAMES = ("Connect", "Timeout", "TransportError", "RemoteProtocolError", "ChunkedEncoding")


@dataclass
class StageCache(CachePolicy):
    """Cache key = the stage key computed by `spec_fn` from the task's inputs."""

    spec_fn: Callable[..., StageSpec] | None = field(default=None)

    def compute_key(
        self, task_ctx: TaskRunContext, inputs: dict[str, Any], flow_parameters: dict[str, Any], **kwargs: Any
    ) -> str | None:
        try:
            spec = self.spec_fn(**inputs)
        except UserError:
            return None  # no key; the task body raises the same error, once, without a cache-key traceback
        # runs_dir in the key: each runs_dir has its own records, pointing at its own folders; the settings that only
        # pass or fail the stage too, so that a changed one runs the stage, which checks its reused folder again
        place = str(spec.runs_dir) if not spec.checks else [str(spec.runs_dir), spec.checked()]
        key = f"{spec.stage}-{spec.key}-{cache_key(place, digits=8)}"
        if read_manifest(spec.dir) is None and task_ctx.result_store.exists(key):
            return None  # Prefect remembers a folder that is gone or broken: recompute it
        return key


def is_transient(exc: BaseException) -> bool:
    """Network trouble worth a retry; never a user error or a deterministic bug."""
    if isinstance(exc, UserError):
        return False
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    status = getattr(getattr(exc, "response", None), "status_code", None)
    if isinstance(status, int) and (status >= 500 or status == 429):
        return True
    return any(any(n in cls.__name__ for n in _TRANSIENT_NAMES) for cls in type(exc).__mro__)


def retry_if_transient(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect retry_condition_fn: retry only network failures."""
    try:
        state.result()
    except BaseException as exc:  # noqa: BLE001 - we classify whatever the stage raised
        return is_transient(exc)
    return False


def stage_task_options(spec_fn: Callable[..., StageSpec], retries: int = 0) -> dict[str, Any]:
    """Options shared by every stage task: the stage cache policy, persisted results, retries."""
    return {
        "cache_policy": StageCache(spec_fn=spec_fn),
        "persist_result": True,
        "retries": retries,
        "retry_delay_seconds": [10, 60, 300][:retries] if retries else 0,
        "retry_condition_fn": retry_if_transient,
    }
