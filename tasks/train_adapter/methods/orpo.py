"""ORPO in train_adapter (Odds Ratio Preference Optimization, tasks/methods.py's row): TRL's ORPOTrainer on the 4-bit
base, on prepare_data's preference pairs as token ids.

ORPO needs no reference model: its loss is the chosen answers' language-modelling loss plus train.beta times an
odds-ratio term that favours the chosen answer over the rejected one, both from the one policy forward. So no
second pass and no frozen copy: less memory and time per pair than DPO. TRL's trainer tokenizes text; here its rows
are built from prepare_data's ids (prompt + answer, the prompt masked out of the labels), and its padded batches
(prompt + chosen and prompt + rejected as one batch) run as they are: the pipeline's packing and memory plan are
DPO's (methods.py says so for this row).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from tasks.config import SpeedArgs, TrainArgs
from tasks.train_adapter.builder import CountingCollator, PaddedUnit, Recipe


class Orpo(PaddedUnit):
    name = "orpo"
    # the builder makes the fresh adapter: given peft_config, TRL's ORPO trainer would run
    # prepare_model_for_kbit_training (float32 copies of the frozen layers) where the pipeline's levers decide
    lora_by_trainer = False

    def dataset(self, data_dir: Path, train: TrainArgs) -> Any:
        """Each pair as TRL's ORPO columns: prompt, prompt + chosen and prompt + rejected, labels on the answers."""
        import pyarrow.parquet as pq
        from datasets import Dataset

        rows = pq.read_table(data_dir / "train.parquet", columns=["prompt_ids", "chosen_ids", "rejected_ids"])
        return Dataset.from_list([_columns(*row) for row in zip(*rows.to_pydict().values(), strict=True)])

    def check_rows(self, data_dir: Path, data: Any) -> list[tuple[list[int], list[int]]]:
        from tasks.train_adapter.divergence import CHECK_ROWS

        head = data[:CHECK_ROWS]
        return list(zip(head["chosen_input_ids"], head["chosen_labels"], strict=True))

    def recipe(self, model: Any, train: TrainArgs, speed: SpeedArgs, data: Any, model_dir: Path) -> Recipe:
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer
        from trl.experimental.utils import DPODataCollatorWithPadding

        from tasks.models.loading import load_tokenizer

        collator = CountingCollator(DPODataCollatorWithPadding(pad_token_id=model.config.pad_token_id or 0),
                                    ("chosen_attention_mask", "rejected_attention_mask"))
        return Recipe(_PreTokenized(ORPOTrainer), ORPOConfig, {"beta": train.beta, "remove_unused_columns": False},
                      data, collator, {"data_collator": collator, "processing_class": load_tokenizer(model_dir)},
                      settings_speed=self.base_speed(speed))


UNIT = Orpo()


def _columns(prompt: list[int], chosen: list[int], rejected: list[int]) -> dict[str, list[int]]:
    row = {"prompt_input_ids": prompt, "prompt_attention_mask": [1] * len(prompt)}
    for key, answer in (("chosen", chosen), ("rejected", rejected)):
        row.update({f"{key}_input_ids": prompt + answer, f"{key}_attention_mask": [1] * (len(prompt) + len(answer)),
                    f"{key}_labels": [-100] * len(prompt) + answer})
    return row


@functools.cache
def _PreTokenized(base: type) -> type:  # noqa: N802 - a class factory (trl imported lazily)
    class PreTokenizedORPOTrainer(base):
        """TRL's ORPO trainer on rows that are token ids already (_columns): its text tokenization adds nothing."""

        def tokenize_row(self, feature: dict[str, Any], model: Any = None) -> dict[str, Any]:
            return {}

    return PreTokenizedORPOTrainer

