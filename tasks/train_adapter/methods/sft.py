"""Supervised fine-tuning in train_adapter (tasks/methods.py's first row): the transformers Trainer on prepare_data's
token ids and labels, with the pipeline's own micro-batches (plan.training_batches: packed on a GPU through the
memory plan) and the pipeline's fused cross-entropy; FSDP with several GPUs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tasks.config import SpeedArgs, TrainArgs
from tasks.on_disk.parquet_dataset import ParquetExamples
from tasks.train_adapter import plan
from tasks.train_adapter.builder import Recipe, Unit
from tasks.train_adapter.levers.parallel import fsdp_settings


class Sft(Unit):
    name = "sft"
    lora_by_trainer = False  # the plain Trainer takes a model with its adapter: the builder makes it

    def dataset(self, data_dir: Path, train: TrainArgs) -> ParquetExamples:
        return ParquetExamples(data_dir / "train.parquet")

    def check_rows(self, data_dir: Path, data: ParquetExamples) -> list[tuple[list[int], list[int]]]:
        from tasks.train_adapter.divergence import CHECK_ROWS

        return [(data[i]["input_ids"], data[i]["labels"]) for i in range(min(CHECK_ROWS, len(data)))]

    def recipe(self, model: Any, train: TrainArgs, speed: SpeedArgs, data: ParquetExamples, model_dir: Path
               ) -> Recipe:
        from transformers import Trainer, TrainingArguments

        from tasks.log import logger

        dataset, collator, batches = plan.training_batches(model, data, train, speed)
        logger().info("train_adapter: micro-batches %s", batches)
        config = {"activation_checkpointing_kwargs": {"use_reentrant": False}, "remove_unused_columns": False,
                  **fsdp_settings(speed, model)}
        return Recipe(Trainer, TrainingArguments, config, dataset, collator, {"data_collator": collator},
                      batches=batches)


UNIT = Sft()
