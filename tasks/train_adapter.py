"""train_adapter: 4-bit base + tokenized data -> LoRA adapter.

Reads prepare_model's 4-bit checkpoint and modules.json and prepare_data's train.parquet. Trains LoRA
adapters (peft) with the transformers Trainer: k-bit training preparation, gradient checkpointing,
gradient accumulation, bf16 where supported, paged 8-bit AdamW, a learning-rate schedule. Writes into
runs_dir/train_adapter/<key>/: adapter/ (PEFT format), loss.jsonl (one line per logged step) and
manifest.json. While it runs, checkpoints/checkpoint-N/ are written every `save_steps` optimizer
steps; an interrupted run resumes from the latest complete one (adapter, optimizer, scheduler, RNG
and data position), and they are removed once the adapter is saved.
"""

from __future__ import annotations

import gc
import json
import shutil
from pathlib import Path
from typing import Any

from prefect import task

from tasks import distributed
from tasks.batches import ParquetExamples, latest_checkpoint
from tasks.caching import stage_task_options
from tasks.config import LoraArgs, TrainArgs
from tasks.errors import UserError
from tasks.limits import gpu_slot
from tasks.log import logger
from tasks.manifest import StageSpec, open_stage, read_manifest
from tasks.runtime import device, load_quantized

VERSION = "1"
ADAPTER_FILES = ["adapter/adapter_config.json", "adapter/adapter_model.safetensors"]


def spec(lora: LoraArgs, train: TrainArgs, runs_dir: Path, data_dir: str, model_dir: str) -> StageSpec:
    """Cache-key inputs: LoRA and training settings and the two upstream stages."""
    return StageSpec(stage="train_adapter", version=VERSION, runs_dir=runs_dir,
                     params={"lora": lora.model_dump(), "train": train.model_dump()},
                     upstream={"prepare_data": Path(data_dir), "prepare_model": Path(model_dir)})


@task(name="train_adapter", **stage_task_options(spec))
def train_adapter(lora: LoraArgs, train: TrainArgs, runs_dir: Path, data_dir: str, model_dir: str) -> str:
    """Train a LoRA adapter on the 4-bit base model, resuming from the latest checkpoint."""
    check_target_modules(lora.target_modules, Path(model_dir))
    with open_stage(spec(lora, train, runs_dir, data_dir, model_dir), keep=("checkpoints", "loss.jsonl")) as stage:
        if stage.done:
            return str(stage.dir)
        resume = latest_checkpoint(stage.dir / "checkpoints")
        processes = distributed.world_size(train)
        with gpu_slot():  # one training on the GPU at a time, across all runs on this Prefect server
            if processes > 1:
                metrics = distributed.launch(lora, train, data_dir, model_dir, stage.dir, processes)
            else:
                metrics = fit_and_save(lora, train, data_dir, model_dir, stage.dir)
        resumed = int(resume.name.split("-")[-1]) if resume else None
        stage.finish([*ADAPTER_FILES, "loss.jsonl"], metrics, resumed_from_step=resumed)
        return str(stage.dir)


def fit_and_save(lora: LoraArgs, train: TrainArgs, data_dir: str, model_dir: str, out: Path) -> dict[str, Any]:
    """Train here (alone, or as one rank of a data-parallel group); the main process saves the adapter."""
    examples = ParquetExamples(Path(data_dir) / "train.parquet")
    model, trainer, result, used = _fit_with_backoff(lora, train, examples, out, Path(model_dir))
    throughput = progress(trainer).summary()  # every rank takes part: the figures are gathered over all
    if trainer.is_fsdp_enabled:  # every rank sends its shard; rank 0 writes
        distributed.save_sharded_adapter(trainer.model, out / "adapter")
    elif trainer.is_world_process_zero():
        model.save_pretrained(out / "adapter")
    if trainer.is_world_process_zero():
        (out / "adapter" / "README.md").unlink(missing_ok=True)  # peft's empty card; export writes ours
        (out / "adapter" / "training_args.bin").unlink(missing_ok=True)
        shutil.rmtree(out / "checkpoints", ignore_errors=True)
    return {**throughput, "train_loss": result.training_loss, "optimizer_steps": trainer.state.global_step,
            "train_examples": len(examples), "train_seconds": result.metrics.get("train_runtime"),
            "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "per_device_train_batch_size": used.per_device_train_batch_size,
            "gradient_accumulation_steps": used.gradient_accumulation_steps, "processes": trainer.args.world_size,
            "sharding": "fsdp" if trainer.is_fsdp_enabled else "ddp" if trainer.args.world_size > 1 else "none"}


def progress(trainer: Any) -> Any:
    from tasks.callbacks import Progress

    return next(c for c in trainer.callback_handler.callbacks if isinstance(c, Progress))


def check_target_modules(target_modules: list[str], model_dir: Path) -> None:
    """Fail before training if LoRA targets modules the base model does not have."""
    report = json.loads((model_dir / "modules.json").read_text())
    missing = [m for m in target_modules if m not in report["targetable"]]
    if missing:
        base = (read_manifest(model_dir) or {}).get("params", {}).get("model", {}).get("base_model", model_dir)
        raise UserError(
            f"lora.target_modules names {', '.join(missing)}, which {base} does not have. "
            f"Its layers LoRA can target are: {', '.join(report['targetable'])}. "
            "Set lora.target_modules to some of these."
        )


def _fit_with_backoff(lora: LoraArgs, train: TrainArgs, examples: ParquetExamples, out: Path, model_dir: Path
                      ) -> tuple[Any, Any, Any, TrainArgs]:
    """Train from the latest checkpoint; on CUDA out-of-memory, retry with a smaller micro-batch."""
    import torch

    while True:
        model = _peft_model(model_dir, lora, train)
        trainer = _trainer(model, examples, train, out, model_dir)
        resume = latest_checkpoint(out / "checkpoints")
        if resume is not None:
            logger().info("train_adapter: resuming from %s", resume.name)
        try:
            return model, trainer, trainer.train(resume_from_checkpoint=str(resume) if resume else None), train
        except torch.OutOfMemoryError as exc:
            train = smaller_micro_batch(train, exc)
            del model, trainer
            gc.collect()
            torch.cuda.empty_cache()


def smaller_micro_batch(train: TrainArgs, exc: BaseException) -> TrainArgs:
    """Half the micro-batch (or less) and proportionally more accumulation: the same effective batch."""
    from tasks import speed

    if train.packing and speed.LAST_CHOICE.get("max_tokens_per_batch"):  # packs sized in tokens
        return speed.smaller_packs(train, exc)
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
                                    "gradient_accumulation_steps": accum * batch // smaller})


def _peft_model(model_dir: Path, lora: LoraArgs, train: TrainArgs) -> Any:
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import set_seed

    from tasks import speed

    model = load_quantized(model_dir)
    if train.upcast_frozen_to_fp32:  # checkpointing is enabled later, by speed.training_batches
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    applied = speed.prepare_base(model, train)
    logger().info("train_adapter: %s", ", ".join(applied) or "no speed levers apply on this device")
    set_seed(train.seed)  # LoRA's A matrices are drawn here
    return speed.prepare_peft(get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **lora.model_dump())), train)


def _trainer(model: Any, examples: ParquetExamples, train: TrainArgs, out: Path, model_dir: Path) -> Any:
    from transformers import PrinterCallback, Trainer, TrainingArguments

    from tasks import speed
    from tasks.callbacks import LossLog, Progress, mark_complete

    compute = (read_manifest(model_dir) or {}).get("metrics", {}).get("compute_dtype", "float32")
    settings = speed.trainer_settings(train)
    if settings["bf16"] is None:  # bnb needs compute dtype == training dtype
        settings["bf16"] = compute == "bfloat16"
    args = TrainingArguments(
        output_dir=str(out / "checkpoints"), save_strategy="steps", save_total_limit=2,
        fp16=compute == "float16", gradient_checkpointing_kwargs={"use_reentrant": False},
        use_cpu=device() == "cpu", report_to=[], disable_tqdm=True, remove_unused_columns=False,
        dataloader_num_workers=0, **{**settings, **distributed.fsdp_settings(train, model)},
    )
    if args.world_size == 1 and args.n_gpu > 1:
        # one process on a machine with several GPUs: the Trainer would wrap the 4-bit model in nn.DataParallel
        # (which bitsandbytes layers do not survive); the model lives on one GPU, and so does the training
        args._n_gpu = 1
    dataset, collator, choice = speed.training_batches(model, examples, train)
    logger().info("train_adapter: micro-batches %s", choice)
    callbacks = [LossLog(out / "loss.jsonl"), Progress(collator), mark_complete()]
    trainer = Trainer(model=model, args=args, train_dataset=dataset, data_collator=collator, callbacks=callbacks)
    trainer.remove_callback(PrinterCallback)  # it prints raw dicts to stdout; Progress logs instead
    return trainer
