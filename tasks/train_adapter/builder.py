"""One trainer builder for every training method (tasks/methods.py): training in this process, alone or as one rank
of a data-parallel group.

The builder does what every method needs, the same way for each: load prepare_model's 4-bit base, apply the speed
levers the method allows, start from train.init_adapter (checked on the first training examples before any step:
a damaged one is refused) or a fresh LoRA adapter, the trainer's common arguments, the callbacks (divergence guard,
loss log, progress, checkpoint markers, tracking), resume from the latest complete checkpoint, the out-of-memory
back-off, saving the adapter and the metrics every method reports. A method's module (methods/, one entry each in
methods.UNITS) gives only what is its own: the trainer and config classes with its keywords, its dataset, and what
it arranges once its trainer exists (micro-batches, the memory plan).
"""

from __future__ import annotations

import gc
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasks import methods
from tasks.config import LoraArgs, SpeedArgs, TrainArgs
from tasks.errors import UserError
from tasks.log import logger
from tasks.models.loading import device, read_model_metrics
from tasks.reporting import tracking
from tasks.train_adapter import plan
from tasks.train_adapter.levers.parallel import save_sharded_adapter
from tasks.train_adapter.resume import latest_checkpoint


@dataclass
class Recipe:
    """What a method's module hands the builder for one trainer."""

    trainer_type: type  # the transformers Trainer or a TRL trainer (the builder adds the divergence guard)
    config_type: type  # TrainingArguments or a TRL config
    config: dict[str, Any]  # the method's own config keywords (beside the common ones)
    dataset: Any  # what the trainer trains on
    counter: Any  # has .real_tokens, counted as training goes (a collator, or a counter the trainer feeds)
    trainer_kwargs: dict[str, Any] = field(default_factory=dict)  # data_collator, processing_class, reward_funcs
    settings_speed: SpeedArgs | None = None  # the speed settings the trainer's arguments follow (default: the run's)
    batches: plan.MicroBatches | None = None  # the micro-batches, where chosen before the trainer exists


class CountingCollator:
    """A trainer's collator, counting the real (non-padding) tokens it hands out for Progress: the sum of each batch's
    `masks`."""

    def __init__(self, inner: Any, masks: tuple[str, ...] = ("attention_mask",)) -> None:
        self.inner, self.masks, self.real_tokens = inner, masks, 0

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        batch = self.inner(examples)
        self.real_tokens += sum(int(batch[mask].sum()) for mask in self.masks)
        return batch


class Unit:
    """A method's part in train_adapter; its module subclasses this and overrides what differs."""

    name: str = ""  # its row in tasks/methods.py
    lora_by_trainer = True  # a fresh adapter is made by the TRL trainer from peft_config (False: by the builder)
    task_type = "CAUSAL_LM"  # peft's task type of its adapter

    def dataset(self, data_dir: Path, train: TrainArgs) -> Any:
        """What it trains on, from prepare_data's train.parquet (len() is the train_examples metric)."""
        raise NotImplementedError

    def check_rows(self, data_dir: Path, data: Any) -> list[tuple[list[int], list[int]]]:
        """The first training examples as (token ids, labels -100 where not scored), to check an init adapter on."""
        raise NotImplementedError

    def check_data(self, train: TrainArgs, data: Any) -> str:
        """What is wrong with prepare_data's metrics `data` (DataMetrics) for this method beyond its format; ''."""
        return ""

    def load(self, model_dir: Path, train: TrainArgs) -> Any:
        """The 4-bit base this method trains on."""
        from tasks.models.loading import load_quantized

        return load_quantized(model_dir)

    def base_speed(self, speed: SpeedArgs) -> SpeedArgs:
        """The speed settings the base model's levers are applied with."""
        return speed

    def recipe(self, model: Any, train: TrainArgs, speed: SpeedArgs, data: Any, model_dir: Path) -> Recipe:
        raise NotImplementedError

    def after(self, trainer: Any, train: TrainArgs, speed: SpeedArgs, recipe: Recipe) -> plan.MicroBatches | None:
        """Once the trainer exists: the micro-batches it trains on, where the method chooses them."""
        return recipe.batches

    def metrics(self, trainer: Any, train: TrainArgs, batches: plan.MicroBatches | None) -> dict[str, Any]:
        """The method's own entries of train_adapter's metrics."""
        return {}


class PaddedUnit(Unit):
    """A method that trains on its TRL trainer's padded batches and computes its own log-probabilities: neither
    packing nor the pipeline's fused loss applies, and every decoder layer recomputes its activations while
    train.gradient_checkpointing is on (the memory plan is for the methods that pack)."""

    def base_speed(self, speed: SpeedArgs) -> SpeedArgs:
        return speed.model_copy(update={"packing": False, "fused_cross_entropy": False})

    def after(self, trainer: Any, train: TrainArgs, speed: SpeedArgs, recipe: Recipe) -> plan.MicroBatches | None:
        from tasks.train_adapter.levers.recompute import enable_checkpointing

        if train.gradient_checkpointing:
            enable_checkpointing(trainer.model.get_base_model(), False, None)
        return None


def fit_and_save(unit: Unit, lora: LoraArgs, train: TrainArgs, speed: SpeedArgs, data_dir: str, model_dir: str,
                 out: Path) -> dict[str, Any]:
    """Train with `unit`'s method here (alone, or as one rank of a data-parallel group) from the latest checkpoint;
    the main process saves the adapter. Its metrics."""
    import torch

    data = unit.dataset(Path(data_dir), train)
    rows = unit.check_rows(Path(data_dir), data) if train.init_adapter else None
    while True:
        trainer, batches = build(unit, lora, train, speed, data, out, Path(model_dir), rows)
        resume = latest_checkpoint(out / "checkpoints")
        if resume is not None:
            logger().info("train_adapter: resuming from %s", resume.name)
        try:
            result = trainer.train(resume_from_checkpoint=str(resume) if resume else None)
            break
        except torch.OutOfMemoryError as exc:
            train, speed = smaller_micro_batch(train, speed, batches, exc)
            del trainer
            gc.collect()
            torch.cuda.empty_cache()
    throughput = progress(trainer).summary()  # every rank takes part: the figures are gathered over all
    save_adapter(trainer, out)
    return {**throughput, **outcome(trainer, result, len(data), train), "method": unit.name,
            "memory_plan": batches.memory_plan if batches else None, **unit.metrics(trainer, train, batches)}


def build(unit: Unit, lora: LoraArgs, train: TrainArgs, speed: SpeedArgs, data: Any, out: Path, model_dir: Path,
          rows: list[tuple[list[int], list[int]]] | None = None) -> tuple[Any, plan.MicroBatches | None]:
    """The trainer of one attempt, and the micro-batches it trains on (`rows`: what an init adapter is checked on)."""
    model, peft_config = adapted(unit, model_dir, lora, train, speed, rows)
    return trainer_for(unit, model, peft_config, train, speed, data, out, model_dir)


def adapted(unit: Unit, model_dir: Path, lora: LoraArgs, train: TrainArgs, speed: SpeedArgs,
            rows: list[tuple[list[int], list[int]]] | None = None) -> tuple[Any, Any]:
    """The 4-bit base with the levers the method allows, and its adapter: train.init_adapter checked on `rows` (the
    first training examples: Unit.check_rows), or a fresh one (made here, or given to the trainer as peft_config: the
    second value)."""
    from peft import LoraConfig, PeftModel, get_peft_model, prepare_model_for_kbit_training
    from transformers import set_seed

    from tasks.train_adapter.divergence import check_init_adapter

    set_seed(train.seed)  # a score head is drawn as the model loads, LoRA's A matrices below
    model = unit.load(model_dir, train)
    if speed.upcast_frozen_to_fp32:  # checkpointing is enabled later, by the method's micro-batches
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    applied = plan.prepare_base(model, unit.base_speed(speed))
    logger().info("train_adapter (%s): %s", unit.name, ", ".join(applied) or "no speed levers apply on this device")
    set_seed(train.seed)
    if train.init_adapter:  # an exported adapter, with its own LoRA settings (for TRL also the reference model)
        logger().info("train_adapter: starting from %s (its own LoRA settings)", train.init_adapter)
        model = PeftModel.from_pretrained(model, train.init_adapter, is_trainable=True)
        if rows is None:
            raise ValueError("train.init_adapter is checked on the training examples: pass them")
        check_init_adapter(model, rows, train.init_adapter)  # before the first optimizer step
        return (model, None) if unit.lora_by_trainer else (plan.prepare_peft(model, speed), None)
    config = LoraConfig(task_type=unit.task_type, **lora.model_dump())
    if unit.lora_by_trainer:
        return model, config
    return plan.prepare_peft(get_peft_model(model, config), speed), None


def trainer_for(unit: Unit, model: Any, peft_config: Any, train: TrainArgs, speed: SpeedArgs, data: Any, out: Path,
                model_dir: Path) -> tuple[Any, plan.MicroBatches | None]:
    """The method's trainer on `model` (peft_config: a fresh adapter the trainer makes), with the callbacks and
    arguments every method shares; the micro-batches it trains on."""
    from transformers import PrinterCallback

    from tasks.train_adapter.callbacks import LossLog, Progress, mark_complete
    from tasks.train_adapter.divergence import FiniteLoss, guarded

    recipe = unit.recipe(model, train, speed, data, model_dir)
    compute = read_model_metrics(model_dir).compute_dtype
    settings = plan.trainer_settings(train, recipe.settings_speed or speed)
    if settings["bf16"] is None:  # bnb needs compute dtype == training dtype
        settings["bf16"] = compute == "bfloat16"
    args = recipe.config_type(
        output_dir=str(out / "checkpoints"), save_strategy="steps", save_total_limit=2, fp16=compute == "float16",
        use_cpu=device() == "cpu", report_to=[], disable_tqdm=True, dataloader_num_workers=0, **host_sync_free(),
        **{**settings, **recipe.config})
    if args.world_size == 1 and args.n_gpu > 1:
        # one process on a machine with several GPUs: the Trainer would wrap the 4-bit model in nn.DataParallel
        # (which bitsandbytes layers do not survive); the model lives on one GPU, and so does the training
        args._n_gpu = 1
    callbacks = [FiniteLoss(train, compute), LossLog(out / "loss.jsonl"), Progress(recipe.counter), mark_complete(),
                 *tracking.trainer_callbacks(out)]
    trainer = guarded(recipe.trainer_type)(model=model, args=args, train_dataset=recipe.dataset, callbacks=callbacks,
                                           **recipe.trainer_kwargs,
                                           **({"peft_config": peft_config} if peft_config is not None else {}))
    trainer.remove_callback(PrinterCallback)  # it prints raw dicts to stdout; Progress logs instead
    if compute == "float32":  # TRL casts the LoRA weights to bf16 (the QLoRA paper's choice for GPUs); on a CPU
        for param in trainer.model.parameters():  # computing in float32, bf16 LoRA matmuls are the slow part
            if param.requires_grad:
                param.data = param.data.float()
    if unit.lora_by_trainer:  # the trainer made (or wrapped) the adapter: its layers exist only now
        plan.prepare_peft(trainer.model, speed)
    return trainer, unit.after(trainer, train, speed, recipe)


def host_sync_free() -> dict[str, Any]:
    """TrainingArguments that turn off the Trainer's defaults which make the host wait for the GPU at every
    micro-step (so that it cannot queue the next step's kernels while the GPU runs this one): a blocking copy of
    each batch to the GPU, and a check of every micro-step's loss for NaN that only tidies the logged average (a
    NaN step is logged as NaN instead)."""
    import torch

    copies = {"accelerator_config": {"non_blocking": True}}  # from pinned batches (dataloader_pin_memory's default)
    return {"logging_nan_inf_filter": False, **(copies if torch.cuda.is_available() else {})}


def save_adapter(trainer: Any, out: Path) -> None:
    """The trained adapter into out/adapter (FSDP: every rank sends its shard, rank 0 writes; otherwise the main
    process), and the checkpoints removed."""
    if trainer.is_fsdp_enabled:
        save_sharded_adapter(trainer.model, out / "adapter")
    elif trainer.is_world_process_zero():
        trainer.model.save_pretrained(out / "adapter", selected_adapters=["default"])  # not TRL's frozen "ref" copy
    if trainer.is_world_process_zero():
        (out / "adapter" / "README.md").unlink(missing_ok=True)  # peft's empty card; export writes ours
        (out / "adapter" / "training_args.bin").unlink(missing_ok=True)
        shutil.rmtree(out / "checkpoints", ignore_errors=True)


def outcome(trainer: Any, result: Any, examples: int, used: TrainArgs) -> dict[str, Any]:
    """What a finished training reports in train_adapter's metrics (beside the throughput): loss, steps, and
    the micro-batches and processes it actually used."""
    return {"train_loss": result.training_loss, "optimizer_steps": trainer.state.global_step,
            "train_examples": examples, "train_seconds": result.metrics.get("train_runtime"),
            "trainable_parameters": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
            "per_device_train_batch_size": used.per_device_train_batch_size,
            "gradient_accumulation_steps": used.gradient_accumulation_steps, "processes": trainer.args.world_size,
            "sharding": "fsdp" if trainer.is_fsdp_enabled else "ddp" if trainer.args.world_size > 1 else "none"}


def progress(trainer: Any) -> Any:
    """The trainer's Progress callback (throughput and peak memory)."""
    from tasks.train_adapter.callbacks import Progress

    return next(c for c in trainer.callback_handler.callbacks if isinstance(c, Progress))


def smaller_micro_batch(train: TrainArgs, speed: SpeedArgs, batches: plan.MicroBatches | None, exc: BaseException
                        ) -> tuple[TrainArgs, SpeedArgs]:
    """The settings to retry with after running out of memory with `batches`: packs of half the tokens, or half
    the micro-batch (or less), with proportionally more accumulation, so an optimizer step sees about as much; where
    the memory plan chose, its choice for a smaller budget. A micro-batch the method's rules refuse (tasks/methods.py)
    is the one-paragraph error."""
    if batches is not None and (batches.max_tokens_per_batch or batches.memory_plan):  # packs sized in tokens
        return plan.smaller_packs(train, speed, batches, exc)
    batch, accum = train.per_device_train_batch_size, train.gradient_accumulation_steps
    smaller = max((d for d in range(1, batch // 2 + 1) if batch % d == 0), default=0)
    row = methods.method(train.method)
    retry = train.model_copy(update={"per_device_train_batch_size": smaller,
                                     "gradient_accumulation_steps": accum * batch // max(smaller, 1)})
    if smaller == 0 or (why := _refused(row, retry)):
        raise UserError(
            f"train_adapter ran out of GPU memory at micro-batch {batch}"
            + (f", and {smaller} is too small for train.method={row.name} ({why})" if smaller else "")
            + ". Lower data.max_seq_length, lora.r or the number of lora.target_modules, keep "
            f"train.gradient_checkpointing on, or use a GPU with more memory. ({exc})".strip()) from exc
    logger().warning("train_adapter: out of memory at micro-batch %d; retrying from the latest checkpoint with "
                     "micro-batch %d x %d accumulation (same effective batch %d)", batch, smaller,
                     retry.gradient_accumulation_steps, batch * accum)
    return retry, speed


def _refused(row: methods.Method, train: TrainArgs) -> str:
    """What of the method's rules (tasks/methods.py) `train` breaks, '' if nothing."""
    for name, (schema, message) in row.requires.items():
        if getattr(train, name) < schema.get("minimum", 0):
            return message
    return row.check(train) if row.check else ""
