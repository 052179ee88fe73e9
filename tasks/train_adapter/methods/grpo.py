"""Online RL in train_adapter (train.method grpo): TRL's GRPOTrainer on the same 4-bit base, with the pipeline's
checkpoints, loss log, progress and adapter layout, as preference.py does for DPO and KTO.

Each optimizer step TRL samples train.num_generations answers per prompt (format prompts from prepare_data) with the
policy, the 4-bit base plus the LoRA adapter as it is: peft's forward with the adapter applied beside the frozen
4-bit weights, never merged into them (merging LoRA into NF4 weights re-quantizes them and corrupts the policy). The
reward functions (tasks/rewards: train.rewards, summed) score the answers, and the adapter learns from each answer's
reward relative to its group's. The reference model is the base with the adapter turned off (peft's
disable_adapter) while train.beta > 0; from train.init_adapter, TRL keeps a frozen copy of it ("ref") instead, as
for DPO. A prompt row's other columns reach the reward functions as keyword lists (rewards.for_trl).

Resuming: the Trainer's checkpoint holds the adapter, optimizer, scheduler, the data position and the RNG states
(torch's included, which the sampling draws from), and a step generates its own answers (steps_per_generation =
gradient_accumulation_steps), so a resumed run samples what the uninterrupted one would have.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from tasks import rewards
from tasks.config import SpeedArgs, TrainArgs
from tasks.train_adapter import plan
from tasks.train_adapter.builder import Recipe, Unit
from tasks.train_adapter.levers import generation


class Grpo(Unit):
    name = "grpo"

    def dataset(self, data_dir: Path, train: TrainArgs) -> Any:
        """train.parquet's prompts and their other columns (JSON) as a datasets.Dataset: TRL tokenizes the
        prompts."""
        import pyarrow.parquet as pq
        from datasets import Dataset

        return Dataset(pq.read_table(data_dir / "train.parquet", columns=["prompt", "columns"]))

    def check_rows(self, data_dir: Path, data: Any) -> list[tuple[list[int], list[int]]]:
        """The first prompts as prepare_data tokenized them, all their tokens scored (the policy continues them: a
        damaged adapter shows there)."""
        import pyarrow.parquet as pq

        from tasks.train_adapter.divergence import CHECK_ROWS

        ids = pq.read_table(data_dir / "train.parquet", columns=["prompt_ids"]).slice(0, CHECK_ROWS)
        return [(row, row) for row in ids.column("prompt_ids").to_pylist()]

    def check_data(self, train: TrainArgs, data: Any) -> str:
        """The columns train.rewards' built-ins read, which the prompts must have."""
        if missing := sorted(rewards.needs(train) - set(data.prompt_columns or ())):
            return (f"train.rewards {', '.join(train.rewards)} read the column(s) {', '.join(missing)}, which the "
                    f"prompts lack (they have: {', '.join(data.prompt_columns or ()) or 'none'}). Add the column, map "
                    "one onto it with data.column_mapping, or choose other rewards.")
        return ""

    def base_speed(self, speed: SpeedArgs) -> SpeedArgs:
        # TRL's padded generation and its own log-probabilities: no packed attention, no fused cross-entropy
        return speed.model_copy(update={"packing": False, "fused_cross_entropy": False})

    def recipe(self, model: Any, train: TrainArgs, speed: SpeedArgs, data: Any, model_dir: Path) -> Recipe:
        from trl import GRPOConfig, GRPOTrainer

        from tasks.models.loading import load_tokenizer

        config = {"beta": train.beta, "num_generations": train.num_generations, "temperature": train.temperature,
                  "max_completion_length": train.max_completion_length,
                  **({"loss_type": train.loss_type} if train.loss_type else {}),
                  "remove_unused_columns": False, "log_completions": False}
        counter = _TokenCounter()
        runs_dir = model_dir.parents[1]  # prepare_model's folder is runs_dir/prepare_model/<key>
        funcs = [rewards.for_trl(f) for f in rewards.load(train, runs_dir, model_dir)]
        return Recipe(_Counting(GRPOTrainer), GRPOConfig, config, data, counter,
                      {"processing_class": load_tokenizer(model_dir), "reward_funcs": funcs},
                      settings_speed=self.base_speed(speed))

    def after(self, trainer: Any, train: TrainArgs, speed: SpeedArgs, recipe: Recipe) -> None:
        trainer.tokens = recipe.counter
        _checkpointing(trainer.model.get_base_model(), train)
        generation.install(trainer, speed)  # the answers sampled on the dequantized base where it fits
        return None

    def metrics(self, trainer: Any, train: TrainArgs, batches: plan.MicroBatches | None) -> dict[str, Any]:
        return {"rewards": list(train.rewards), **_last_rewards(trainer)}


UNIT = Grpo()


def _checkpointing(base: Any, train: TrainArgs) -> None:
    """Every decoder layer recomputed while train.gradient_checkpointing is on; TRL turns it off around generation
    and back on, which preference._keep_checkpoint_function makes mean the pipeline's checkpointing again."""
    from tasks.train_adapter.levers.recompute import enable_checkpointing
    from tasks.train_adapter.methods.preference import _keep_checkpoint_function

    if train.gradient_checkpointing:
        enable_checkpointing(base, False, None)
        _keep_checkpoint_function(base, False, None)


def _last_rewards(trainer: Any) -> dict[str, Any]:
    """The mean reward and KL of the last logged step, for the manifest (the whole curve is in loss.jsonl)."""
    logged = [h for h in trainer.state.log_history if "reward" in h]
    last = logged[-1] if logged else {}
    return {"last_reward": last.get("reward"), "last_kl": last.get("kl")}


class _TokenCounter:
    """Progress's token count: each step's real prompt and answer tokens (GRPO has no collator to count them)."""

    def __init__(self) -> None:
        self.real_tokens = 0


@functools.cache
def _Counting(base: type) -> type:  # noqa: N802 - a class factory (trl imported lazily)
    class CountingGRPOTrainer(base):
        """TRL's GRPOTrainer, counting the real tokens of the answers it samples and their prompts."""

        def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
            batch = super()._generate_and_score_completions(inputs)
            self.tokens.real_tokens += int(batch["prompt_mask"].sum()) + int(batch["completion_mask"].sum())
            return batch

    return CountingGRPOTrainer
