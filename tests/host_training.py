"""A flow that runs only the real train_adapter stage on prepared data and model, for tests that need many short
trainings through real workers (tests/test_hosts.py): the pool, the CPU share and the manifest are the stage's."""

from __future__ import annotations

from pathlib import Path

from prefect import flow

from tasks.config import LoraArgs, SpeedArgs, TrainArgs
from tasks.train_adapter.stage import train_adapter


@flow(name="host-training")
def host_training(runs_dir: str, data_dir: str, model_dir: str, seed: int, max_steps: int = 3) -> str:
    train = TrainArgs(max_steps=max_steps, save_steps=100, logging_steps=1, per_device_train_batch_size=4, seed=seed)
    return train_adapter(LoraArgs(r=4, lora_alpha=8), train, SpeedArgs(packing=False), Path(runs_dir), data_dir,
                         model_dir)
