"""One sweep candidate's training as a flow run of its own, so that it can run on any GPU host of the fleet
(flows/sweep_runner.py fleet_training; deployments/prefect.yaml deploys it as qlora-train/candidate)."""

from __future__ import annotations

from pathlib import Path

from prefect import flow

from tasks.config import LoraArgs, SpeedArgs, TrackArgs, TrainArgs
from tasks.log import quiet_user_errors
from tasks.reporting.artifacts import failure_summary
from tasks.train_adapter.stage import train_adapter


@flow(name="qlora-train", on_running=[quiet_user_errors], on_failure=[failure_summary], on_crashed=[failure_summary])
def train_candidate(lora: LoraArgs, train: TrainArgs, speed: SpeedArgs, runs_dir: Path, data_dir: str,
                    model_dir: str, track: TrackArgs | None = None) -> str:
    """train_adapter of one sweep candidate, on whichever host took this run: its GPUs come from that host's pool.
    The stage folder is on the runs_dir every host shares; the sweep evaluates it."""
    return train_adapter(lora, train, speed, runs_dir, data_dir, model_dir, track)
