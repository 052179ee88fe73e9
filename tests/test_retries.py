"""Retries only where they can help: network failures are retried, user errors never."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.config import ModelArgs
from tasks.errors import UserError
from tasks.on_disk.caching import is_transient


class _HubHTTPError(OSError):
    def __init__(self, status: int) -> None:
        super().__init__(f"HTTP {status}")
        self.response = type("Response", (), {"status_code": status})()


@pytest.mark.parametrize(("exc", "expected"), [
    (ConnectionError("reset by peer"), True),
    (TimeoutError("read timed out"), True),
    (_HubHTTPError(503), True),
    (_HubHTTPError(429), True),
    (_HubHTTPError(404), False),
    (UserError("bad config"), False),
    (FileNotFoundError("no such file"), False),
    (ValueError("bug"), False),
])
def test_only_network_failures_count_as_transient(exc: BaseException, expected: bool) -> None:
    assert is_transient(exc) is expected


def _flow_with(stage_calls: list[str], failure: BaseException, tmp_path: Path) -> tuple[str, int]:
    from prefect import flow

    import tasks.prepare_model.stage as stage

    real = stage.model_path

    def flaky(source: str, revision: str | None) -> Path:
        stage_calls.append(source)
        if len(stage_calls) == 1:
            raise failure
        return real(source, revision)

    stage.model_path = flaky
    try:
        @flow
        def one_stage() -> str:
            return stage.prepare_model.with_options(retry_delay_seconds=0)(ModelArgs(), tmp_path / "runs")

        state = one_stage(return_state=True)
        return state.type.value, len(stage_calls)
    finally:
        stage.model_path = real


def test_a_network_failure_is_retried_and_the_stage_completes(prefect_env: Path, tmp_path: Path) -> None:
    calls: list[str] = []
    assert _flow_with(calls, ConnectionError("connection reset"), tmp_path) == ("COMPLETED", 2)


def test_a_user_error_fails_at_once_without_retry(prefect_env: Path, tmp_path: Path) -> None:
    calls: list[str] = []
    assert _flow_with(calls, UserError("model.base_model is wrong"), tmp_path) == ("FAILED", 1)
