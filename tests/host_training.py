"""A flow that runs only the real train_adapter stage on prepared data and model, for tests that need many short
trainings through real workers (tests/test_hosts.py): the pool, the CPU share and the manifest are the stage's."""

from __future__ import annotations

from pathlib import Path

from prefect import flow

from tasks.config import LoraArgs, SpeedArgs, TrainArgs
from tasks.train_adapter.stage import train_adapter


def host_train_args(seed: int, max_steps: int = 3, per_device: int = 4, learning_rate: float = 1e-3,
                    save_steps: int = 100) -> TrainArgs:
    return TrainArgs(max_steps=max_steps, save_steps=save_steps, logging_steps=1, seed=seed,
                     per_device_train_batch_size=per_device, learning_rate=learning_rate)


HOST_LORA = LoraArgs(r=4, lora_alpha=8)


@flow(name="host-training")
def host_training(runs_dir: str, data_dir: str, model_dir: str, seed: int, max_steps: int = 3, num_nodes: int = 1,
                  per_device: int = 4, learning_rate: float = 1e-3, join_timeout: int = 600,
                  save_steps: int = 100) -> str:
    speed = SpeedArgs(packing=False, num_nodes=num_nodes, node_join_timeout_s=join_timeout)
    return train_adapter(HOST_LORA, host_train_args(seed, max_steps, per_device, learning_rate, save_steps), speed,
                         Path(runs_dir), data_dir, model_dir)
