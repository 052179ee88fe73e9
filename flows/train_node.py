"""One host's node of a training across hosts (speed.num_nodes; tasks/train_adapter/nodes.py): a flow run that the
run's train_adapter starts on that host's work queue (deployments/prefect.yaml deploys it as qlora-node/train)."""

from __future__ import annotations

from pathlib import Path

from prefect import flow

from tasks.log import quiet_user_errors
from tasks.train_adapter import nodes


@flow(name="qlora-node", on_running=[quiet_user_errors])
def train_node(stage_dir: str, node: int) -> str:
    """Node `node` of the training whose stage folder (on the runs_dir every host shares) is `stage_dir`: its ranks
    on this host's GPUs of the pool, until they end or the run it trains for does."""
    return nodes.run_node(Path(stage_dir), node)
