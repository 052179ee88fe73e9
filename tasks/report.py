"""Prefect artifacts from stage code, skipped where there is no run to attach them to."""

from __future__ import annotations

from typing import Any

from tasks.log import logger
from tasks.manifest import current_run_attempt


def table_artifact(key: str, rows: list[dict[str, Any]], description: str) -> None:
    """A table artifact in the Prefect UI; outside a flow or task run (a stage called through .fn()) a no-op."""
    if current_run_attempt() is None:
        # outside a run there is no run page to show it on, and creating one would need an API server
        logger().debug("no Prefect run: table artifact %s not created", key)
        return
    from prefect.artifacts import create_table_artifact

    create_table_artifact(table=rows, key=key, description=description)
