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
from tasks.config import LoraArgs, SpeedArgs, TrainArgs
from tasks.log import logger
from tasks.models.loading import device, load_quantized, read_model_metrics
from tasks.reporting import tracking
from tasks.train_adapter import plan
from tasks.train_adapter.levers import generation
from tasks.train_adapter.resume import latest_checkpoint


def fit_and_save(lora: LoraArgs, train: TrainArgs, speed: SpeedArgs, data_dir: str, model_dir: str, out: Path
                 ) -> dict[str, Any]:
    """Train with GRPO here (alone, or as one rank of a data-parallel group); the main process saves."""
    from tasks.train_adapter.fit import outcome, progress
    from tasks.train_adapter.preference import save_adapter

    dataset = _dataset(Path(data_dir) / "train.parquet")
    trainer = _trainer(lora, train, speed, dataset, out, Path(model_dir))
    resume = latest_checkpoint(out / "checkpoints")
    if resume is not None:
        logger().info("train_adapter: resuming from %s", resume.name)
    result = trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    throughput = progress(trainer).summary()
    save_adapter(trainer, out)
    return {**throughput, **outcome(trainer, trainer.model, result, len(dataset), train), "method": "grpo",
            "rewards": list(train.rewards), **_last_rewards(trainer)}


def _dataset(path: Path) -> Any:
    """train.parquet's prompts and their other columns (JSON) as a datasets.Dataset: TRL tokenizes the prompts."""
    import pyarrow.parquet as pq
    from datasets import Dataset

    return Dataset(pq.read_table(path, columns=["prompt", "columns"]))


def _trainer(lora: LoraArgs, train: TrainArgs, speed: SpeedArgs, dataset: Any, out: Path, model_dir: Path) -> Any:
    from peft import LoraConfig, PeftModel, prepare_model_for_kbit_training
    from transformers import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    from tasks.train_adapter.callbacks import LossLog, Progress, mark_complete
    from tasks.train_adapter.divergence import FiniteLoss, guarded
    from tasks.train_adapter.fit import host_sync_free

    model = load_quantized(model_dir)
    if speed.upcast_frozen_to_fp32:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    # TRL's padded generation and its own log-probabilities: no packed attention, no fused cross-entropy
    speed = speed.model_copy(update={"packing": False, "fused_cross_entropy": False})
    applied = plan.prepare_base(model, speed)
    logger().info("train_adapter (grpo): %s", ", ".join(applied) or "no speed levers apply on this device")
    peft_config = None
    if train.init_adapter:
        logger().info("train_adapter: starting from %s (its own LoRA settings; also the reference model)",
                      train.init_adapter)
        model = PeftModel.from_pretrained(model, train.init_adapter, is_trainable=True)
    else:
        peft_config = LoraConfig(task_type="CAUSAL_LM", **lora.model_dump())
    compute = read_model_metrics(model_dir).compute_dtype
    settings = plan.trainer_settings(train, speed)
    settings.update(beta=train.beta, num_generations=train.num_generations, temperature=train.temperature,
                    max_completion_length=train.max_completion_length,
                    **({"loss_type": train.loss_type} if train.loss_type else {}))
    if settings["bf16"] is None:
        settings["bf16"] = compute == "bfloat16"
    args = GRPOConfig(output_dir=str(out / "checkpoints"), save_strategy="steps", save_total_limit=2,
                      fp16=compute == "float16", use_cpu=device() == "cpu", report_to=[], disable_tqdm=True,
                      dataloader_num_workers=0, remove_unused_columns=False, log_completions=False,
                      **host_sync_free(), **settings)
    counter = _TokenCounter()
    trainer = guarded(_Counting(GRPOTrainer))(
        model=model, args=args, train_dataset=dataset, processing_class=_tokenizer(model_dir),
        reward_funcs=[rewards.for_trl(f) for f in rewards.load(train)], peft_config=peft_config,
        callbacks=[FiniteLoss(train, compute), LossLog(out / "loss.jsonl"), Progress(counter), mark_complete(),
                   *tracking.trainer_callbacks(out)])
    trainer.tokens = counter
    trainer.remove_callback(PrinterCallback)
    if compute == "float32":  # as preference._trainer: TRL's bf16 LoRA weights are the slow part on a CPU
        for param in trainer.model.parameters():
            if param.requires_grad:
                param.data = param.data.float()
    plan.prepare_peft(trainer.model, speed)
    _checkpointing(trainer.model.get_base_model(), train)
    generation.install(trainer, speed)  # the answers sampled on the dequantized base where it fits (a GPU)
    return trainer


def _checkpointing(base: Any, train: TrainArgs) -> None:
    """Every decoder layer recomputed while train.gradient_checkpointing is on; TRL turns it off around generation
    and back on, which preference._keep_checkpoint_function makes mean the pipeline's checkpointing again."""
    from tasks.train_adapter.levers.recompute import enable_checkpointing
    from tasks.train_adapter.preference import _keep_checkpoint_function

    if train.gradient_checkpointing:
        enable_checkpointing(base, False, None)
        _keep_checkpoint_function(base, False, None)


def _last_rewards(trainer: Any) -> dict[str, Any]:
    """The mean reward and KL of the last logged step, for the manifest (the whole curve is in loss.jsonl)."""
    logged = [h for h in trainer.state.log_history if "reward" in h]
    last = logged[-1] if logged else {}
    return {"last_reward": last.get("reward"), "last_kl": last.get("kl")}


def _tokenizer(model_dir: Path) -> Any:
    from tasks.models.loading import load_tokenizer

    return load_tokenizer(model_dir)


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
