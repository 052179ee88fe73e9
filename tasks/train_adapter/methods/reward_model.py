"""Reward modelling in train_adapter (tasks/methods.py's reward_model row): TRL's RewardTrainer on the 4-bit base
loaded as a sequence scorer, a LoRA adapter and a new scalar score head trained together (peft task SEQ_CLS keeps
the head among the adapter's saved modules), on prepare_data's preference pairs.

Each pair becomes prompt + chosen and prompt + rejected; the loss is Bradley-Terry's, -log sigmoid(score(chosen) -
score(rejected)). The score head is drawn at load time from train.seed, so a run is repeatable and a resumed run
takes the head from its checkpoint. The model reads the last token that is not padding (prepare_data ends every
answer with eos; the tokenizer pads with its pad token). Its registry version can score GRPO's answers
(tasks/rewards/reward_model.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tasks.config import SpeedArgs, TrainArgs
from tasks.train_adapter.builder import CountingCollator, PaddedUnit, Recipe


class RewardModel(PaddedUnit):
    name = "reward_model"
    task_type = "SEQ_CLS"
    lora_by_trainer = False  # the builder makes the adapter (peft adds the score head to its saved modules)

    def dataset(self, data_dir: Path, train: TrainArgs) -> Any:
        """Each pair as TRL's reward columns: prompt + chosen, prompt + rejected (token ids)."""
        import pyarrow.parquet as pq
        from datasets import Dataset

        table = pq.read_table(data_dir / "train.parquet", columns=["prompt_ids", "chosen_ids", "rejected_ids"])
        return Dataset.from_list([{"chosen_ids": p + c, "rejected_ids": p + r} for p, c, r in
                                  zip(*table.to_pydict().values(), strict=True)])

    def check_rows(self, data_dir: Path, data: Any) -> list[tuple[list[int], list[int]]]:
        # a scorer has no next-token predictions to check an init adapter by: its files' hashes (the registry's)
        # are what vouches for it
        return []

    def load(self, model_dir: Path, train: TrainArgs) -> Any:
        from tasks.models.loading import load_quantized

        return load_quantized(model_dir, head="score")

    def recipe(self, model: Any, train: TrainArgs, speed: SpeedArgs, data: Any, model_dir: Path) -> Recipe:
        from trl import RewardConfig, RewardTrainer
        from trl.trainer.reward_trainer import DataCollatorForPreference

        from tasks.models.loading import load_tokenizer

        collator = CountingCollator(DataCollatorForPreference(pad_token_id=model.config.pad_token_id))
        return Recipe(RewardTrainer, RewardConfig, {"max_length": None}, data, collator,
                      {"data_collator": collator, "processing_class": load_tokenizer(model_dir)},
                      settings_speed=self.base_speed(speed))


UNIT = RewardModel()

