"""Training in this process (alone, or as one rank of a data-parallel group): the 4-bit base with LoRA, the
Trainer, the out-of-memory back-off; the main process saves the adapter."""

from __future__ import annotations

import gc
import shutil
from pathlib import Path
from typing import Any

from tasks.config import LoraArgs, SpeedArgs, TrainArgs
from tasks.errors import UserError
from tasks.log import logger
from tasks.models.loading import device, load_quantized, read_model_metrics
from tasks.on_disk.parquet_dataset import ParquetExamples
from tasks.reporting import tracking
from tasks.train_adapter import plan
from tasks.train_adapter.levers.parallel import fsdp_settings, save_sharded_adapter
from tasks.train_adapter.resume import latest_checkpoint


def host_sync_free() -> dict[str, Any]:
    """TrainingArguments that turn off the Trainer's defaults which make the host wait for the GPU at every
    micro-step (so that it cannot queue the next step's kernels while the GPU runs this one): a blocking copy of
    each batch to the GPU, and a check of every micro-step's loss for NaN that only tidies the logged average (a
    NaN step is logged as NaN instead)."""
    import torch

    copies = {"accelerator_config": {"non_blocking": True}}  # from pinned batches (dataloader_pin_memory's default)
    return {"logging_nan_inf_filter": False, **(copies if torch.cuda.is_available() else {})}


def fit_and_save(lora: LoraArgs, train: TrainArgs, speed: SpeedArgs, data_dir: str, model_dir: str, out: Path
                 ) -> dict[str, Any]:
    """Train here (alone, or as one rank of a data-parallel group); the main process saves the adapter."""
    examples = ParquetExamples(Path(data_dir) / "train.parquet")
    model, trainer, result, used, batches = _fit_with_backoff(lora, train, speed, examples, out, Path(model_dir))
    throughput = progress(trainer).summary()  # every rank takes part: the figures are gathered over all
    if trainer.is_fsdp_enabled:  # every rank sends its shard; rank 0 writes
        save_sharded_adapter(trainer.model, out / "adapter")
    elif trainer.is_world_process_zero():
        model.save_pretrained(out / "adapter")
    if trainer.is_world_process_zero():
        (out / "adapter" / "README.md").unlink(missing_ok=True)  # peft's empty card; export writes ours
        (out / "adapter" / "training_args.bin").unlink(missing_ok=True)
        shutil.rmtree(out / "checkpoints", ignore_errors=True)
    return {**throughput, **outcome(trainer, model, result, len(examples), used),
            "memory_plan": batches.memory_plan}


def outcome(trainer: Any, model: Any, result: Any, examples: int, used: TrainArgs) -> dict[str, Any]:
    """What a finished training reports in train_adapter's metrics (beside the throughput): loss, steps, and
    the micro-batches and processes it actually used."""
    return {"train_loss": result.training_loss, "optimizer_steps": trainer.state.global_step,
            "train_examples": examples, "train_seconds": result.metrics.get("train_runtime"),
            "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "per_device_train_batch_size": used.per_device_train_batch_size,
            "gradient_accumulation_steps": used.gradient_accumulation_steps, "processes": trainer.args.world_size,
            "sharding": "fsdp" if trainer.is_fsdp_enabled else "ddp" if trainer.args.world_size > 1 else "none"}


def progress(trainer: Any) -> Any:
    """The trainer's Progress callback (throughput and peak memory)."""
    from tasks.train_adapter.callbacks import Progress

    return next(c for c in trainer.callback_handler.callbacks if isinstance(c, Progress))


def _fit_with_backoff(lora: LoraArgs, train: TrainArgs, speed: SpeedArgs, examples: ParquetExamples, out: Path,
                      model_dir: Path) -> tuple[Any, Any, Any, TrainArgs, plan.MicroBatches]:
    """Train from the latest checkpoint; on CUDA out-of-memory, retry with a smaller micro-batch."""
    import torch

    while True:
        model = _peft_model(model_dir, lora, train, speed, examples)
        trainer, batches = _trainer(model, examples, train, speed, out, model_dir)
        resume = latest_checkpoint(out / "checkpoints")
        if resume is not None:
            logger().info("train_adapter: resuming from %s", resume.name)
        try:
            result = trainer.train(resume_from_checkpoint=str(resume) if resume else None)
            return model, trainer, result, train, batches
        except torch.OutOfMemoryError as exc:
            train, speed = smaller_micro_batch(train, speed, batches, exc)
            del model, trainer
            gc.collect()
            torch.cuda.empty_cache()


def smaller_micro_batch(train: TrainArgs, speed: SpeedArgs, batches: plan.MicroBatches, exc: BaseException
                        ) -> tuple[TrainArgs, SpeedArgs]:
    """The settings to retry with after running out of memory with `batches`: packs of half the tokens, or half
    the micro-batch (or less), with proportionally more accumulation, so an optimizer step sees about as much; where
    the memory plan chose, its choice for a smaller budget."""
    if batches.max_tokens_per_batch or batches.memory_plan:  # packs sized in tokens
        return plan.smaller_packs(train, speed, batches, exc)
    batch, accum = train.per_device_train_batch_size, train.gradient_accumulation_steps
    if batch == 1:
        raise UserError(
            "train_adapter ran out of GPU memory at micro-batch 1. Lower data.max_seq_length, lora.r or the "
            "number of lora.target_modules, keep train.gradient_checkpointing on, or use a GPU with more "
            f"memory. ({exc})".strip()
        ) from exc
    smaller = max(d for d in range(1, batch // 2 + 1) if batch % d == 0)
    logger().warning("train_adapter: out of memory at micro-batch %d; retrying from the latest checkpoint with "
                     "micro-batch %d x %d accumulation (same effective batch %d)", batch, smaller,
                     accum * batch // smaller, batch * accum)
    return train.model_copy(update={"per_device_train_batch_size": smaller,
                                    "gradient_accumulation_steps": accum * batch // smaller}), speed


def _peft_model(model_dir: Path, lora: LoraArgs, train: TrainArgs, speed: SpeedArgs,
                examples: ParquetExamples | None = None) -> Any:
    """The 4-bit base with its LoRA adapter (a new one, or train.init_adapter checked on the first `examples`: the
    benches build models without data, and start no init adapter)."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import set_seed

    from tasks.train_adapter.divergence import CHECK_ROWS, check_init_adapter

    model = load_quantized(model_dir)
    if speed.upcast_frozen_to_fp32:  # checkpointing is enabled later, by plan.training_batches
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    applied = plan.prepare_base(model, speed)
    logger().info("train_adapter: %s", ", ".join(applied) or "no speed levers apply on this device")
    set_seed(train.seed)  # LoRA's A matrices are drawn here
    if train.init_adapter:  # an exported adapter, with its own LoRA settings
        from peft import PeftModel

        logger().info("train_adapter: starting from %s (its own LoRA settings)", train.init_adapter)
        model = PeftModel.from_pretrained(model, train.init_adapter, is_trainable=True)
        if examples is None:
            raise ValueError("train.init_adapter is checked on the training examples: pass them")
        rows = [(examples[i]["input_ids"], examples[i]["labels"]) for i in range(min(CHECK_ROWS, len(examples)))]
        check_init_adapter(model, rows, train.init_adapter)  # before the first optimizer step
        return plan.prepare_peft(model, speed)
    return plan.prepare_peft(get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **lora.model_dump())), speed)


def _trainer(model: Any, examples: ParquetExamples, train: TrainArgs, speed: SpeedArgs, out: Path,
             model_dir: Path) -> tuple[Any, plan.MicroBatches]:
    from transformers import PrinterCallback, Trainer, TrainingArguments

    from tasks.train_adapter.callbacks import LossLog, Progress, mark_complete
    from tasks.train_adapter.divergence import FiniteLoss, guarded

    compute = read_model_metrics(model_dir).compute_dtype
    settings = plan.trainer_settings(train, speed)
    if settings["bf16"] is None:  # bnb needs compute dtype == training dtype
        settings["bf16"] = compute == "bfloat16"
    args = TrainingArguments(
        output_dir=str(out / "checkpoints"), save_strategy="steps", save_total_limit=2,
        fp16=compute == "float16", activation_checkpointing_kwargs={"use_reentrant": False},
        use_cpu=device() == "cpu", report_to=[], disable_tqdm=True, remove_unused_columns=False,
        dataloader_num_workers=0, **host_sync_free(), **{**settings, **fsdp_settings(speed, model)},
    )
    if args.world_size == 1 and args.n_gpu > 1:
        # one process on a machine with several GPUs: the Trainer would wrap the 4-bit model in nn.DataParallel
        # (which bitsandbytes layers do not survive); the model lives on one GPU, and so does the training
        args._n_gpu = 1
    dataset, collator, batches = plan.training_batches(model, examples, train, speed)
    logger().info("train_adapter: micro-batches %s", batches)
    callbacks = [FiniteLoss(train, compute), LossLog(out / "loss.jsonl"), Progress(collator), mark_complete(),
                 *tracking.trainer_callbacks(out)]
    trainer = guarded(Trainer)(model=model, args=args, train_dataset=dataset, data_collator=collator,
                               callbacks=callbacks)
    trainer.remove_callback(PrinterCallback)  # it prints raw dicts to stdout; Progress logs instead
    return trainer, batches
