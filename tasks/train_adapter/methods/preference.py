"""Preference tuning in train_adapter (train.method dpo or kto): TRL's DPOTrainer / KTOTrainer on the same 4-bit
base, with the pipeline's checkpoints, loss log, progress, out-of-memory back-off and adapter layout.

The reference model is never a second copy of the base: with a fresh adapter TRL computes the reference
log-probabilities with the adapter turned off (peft's disable_adapter); starting from train.init_adapter, TRL
keeps a frozen copy of that adapter ("ref", adapter-sized) and the reference is base + it. The data comes
pre-tokenized from prepare_data in TRL's own columns, so TRL's tokenization step is skipped.

Speed levers, SFT's where they fit TRL's loss (docs/preference.md has the reasoning and the measurements):
- padding-free batches (speed.packing, on by default): TRL's trainers pad each row to the longest of the
  micro-batch, and TRL 1.16 turns its own DPOConfig.padding_free off; levers/padding_free.py runs the real tokens as one
  row (varlen attention on a GPU, a block-diagonal mask elsewhere) under TRL's loss, for the policy, reference and
  KL passes alike. Where a token budget is set (the memory plan's on a GPU, speed.max_tokens_per_batch), DPO's
  micro-batches are groups of whole pairs sized in tokens (prompt + chosen and prompt + rejected), like SFT's
  packs, and a step's loss is the mean over its pairs (one process only: _grouped); without one, or with several
  processes, per_device_train_batch_size pairs drawn as TRL's padded path draws them (the same pairs in every
  step). KTO keeps per_device_train_batch_size answers per micro-batch (its KL term pairs neighbours within one).
- the memory plan (memory_plan.py, on a GPU with packing): DPO's group size, the recomputed layers and the
  offloads for speed.gpu_memory_budget_gb; for KTO the recomputed layers and offloads at its micro-batch. The
  output layer stays on the GPU (TRL's fused LM head reads it there).
- TRL's own fused LM head computes the log-probabilities a vocabulary tile at a time, of the answers' tokens only,
  so the pipeline's fused cross-entropy steps aside; Liger's kernels, MLP chunks, fused LoRA layers and the
  host-side embedding table apply as for SFT.
- the reference log-probabilities are computed in each step (TRL's default, one no-grad forward with the adapter
  disabled), not precomputed: for one epoch both cost one forward per pair, and precomputing only moves it ahead
  of training (and into a datasets cache file outside the run folder).
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

from tasks.config import SpeedArgs, TrainArgs
from tasks.log import logger
from tasks.train_adapter import plan
from tasks.train_adapter.builder import CountingCollator, Recipe, Unit


class _Preference(Unit):
    """DPO's and KTO's part: TRL's trainer on prepare_data's token ids, padding-free, through the memory plan."""

    def dataset(self, data_dir: Path, train: TrainArgs) -> Any:
        return _dataset(data_dir / "train.parquet", train)

    def check_rows(self, data_dir: Path, data: Any) -> list[tuple[list[int], list[int]]]:
        return _answer_rows(data)

    def base_speed(self, speed: SpeedArgs) -> SpeedArgs:
        logger().info("train_adapter (%s): the fused cross-entropy steps aside: TRL computes the log-probabilities "
                      "with its own fused LM head (a tile of the vocabulary at a time, the answers' tokens only)",
                      self.name)
        return speed.model_copy(update={"fused_cross_entropy": False})

    def recipe(self, model: Any, train: TrainArgs, speed: SpeedArgs, data: Any, model_dir: Path) -> Recipe:
        from tasks.models.loading import load_tokenizer

        grouped = _grouped(train, speed)
        collator = _CountingCollator(_collator(train, model.config.pad_token_id or 0))
        trainer_type, config_type = _trl(train.method)
        config = {"beta": train.beta, **({"loss_type": train.loss_type} if train.loss_type else {}),
                  "max_length": None,  # data.max_seq_length cut already
                  "remove_unused_columns": not grouped}
        return Recipe(trainer_type, config_type, config, data, collator,
                      {"data_collator": collator, "processing_class": load_tokenizer(model_dir)},
                      settings_speed=speed.model_copy(update={"packing": grouped}))

    def after(self, trainer: Any, train: TrainArgs, speed: SpeedArgs, recipe: Recipe) -> plan.MicroBatches:
        from tasks.train_adapter.levers.padding_free import unpad_forward

        batches = _micro_batches(trainer, train, speed, recipe.dataset)
        # after TRL added its fused LM head, which this wraps
        unpadded = speed.packing and unpad_forward(trainer.model.get_base_model())
        logger().info("train_adapter (%s): micro-batches %s%s", train.method, batches,
                      ", padding-free" if unpadded else ", padded by TRL")
        return dataclasses.replace(batches, padding_free=unpadded)

    def metrics(self, trainer: Any, train: TrainArgs, batches: plan.MicroBatches | None) -> dict[str, Any]:
        return {"padding_free": batches.padding_free, "micro_batches_per_epoch": batches.packs}


class Dpo(_Preference):
    name = "dpo"


class Kto(_Preference):
    name = "kto"


DPO, KTO = Dpo(), Kto()


def _dataset(path: Path, train: TrainArgs) -> Any:
    """train.parquet as a datasets.Dataset in TRL's columns; for KTO, pairs become one row per answer, shuffled."""
    import pyarrow.parquet as pq
    from datasets import Dataset

    table = pq.read_table(path)
    if train.method == KTO.name and "chosen_ids" in table.column_names:  # TRL's unpair_preference_dataset, on token ids
        import random

        rows = table.to_pylist()
        unpaired = [{"prompt_ids": r["prompt_ids"], "completion_ids": r[k], "label": k == "chosen_ids"}
                    for r in rows for k in ("chosen_ids", "rejected_ids")]
        # KTO samples in order (its KL term pairs neighbours): a fixed shuffle mixes good and bad answers
        random.Random(train.seed).shuffle(unpaired)
        return Dataset.from_list(unpaired)
    return Dataset(table)


def _answer_rows(dataset: Any) -> list[tuple[list[int], list[int]]]:
    """The first rows as language-model examples for check_init_adapter: the prompt, then the chosen answer (DPO)
    or the answer (KTO), only the answer scored."""
    from tasks.train_adapter.divergence import CHECK_ROWS

    head = dataset[:CHECK_ROWS]
    answers = head["chosen_ids"] if "chosen_ids" in head else head["completion_ids"]
    return [(prompt + answer, [-100] * len(prompt) + answer) for prompt, answer in zip(head["prompt_ids"], answers,
                                                                                        strict=True)]


def _grouped(train: TrainArgs, speed: SpeedArgs) -> bool:
    """Whether DPO's micro-batches are groups of pairs sized in tokens: with speed.packing where a token budget
    sizes them (the memory plan's on a GPU, speed.max_tokens_per_batch elsewhere). Without a budget (a CPU by
    default) the micro-batch is per_device_train_batch_size pairs drawn by the Trainer's own sampler, as TRL's
    padded path draws them, so both train on the same pairs in every optimizer step and log the same losses
    (padding-free still runs each micro-batch as one row). Fixed groups of that many pairs from levers/packs.py's
    shuffle were no faster and trained on other pairs, with the 1-pair remainder group anywhere in the epoch. KTO keeps
    its micro-batch of per_device_train_batch_size answers: its KL term pairs each answer with a neighbour's prompt.
    Neither with several processes (speed.num_gpus): TRL gathers each step's per-pair metrics (rewards, margins,
    accuracies) from every process with all_gather, which needs as many pairs on each, and groups sized in tokens
    hold different numbers (two gloo processes failed there, on shapes 3 against 2)."""
    import torch

    budget = torch.cuda.is_available() or speed.max_tokens_per_batch is not None
    return speed.packing and train.method == "dpo" and budget and not plan.several_processes()


def _micro_batches(trainer: Any, train: TrainArgs, speed: SpeedArgs, dataset: Any) -> plan.MicroBatches:
    """Choose and apply the micro-batch size, the recomputed layers and the offloads: on a GPU with packing
    through the memory plan (DPO's pairs of a micro-batch are its "pack": the tokens of prompt + chosen and prompt +
    rejected; KTO's micro-batch is pinned, per_device_train_batch_size times the longest answer with its prompt),
    elsewhere every layer recomputed while train.gradient_checkpointing is on, as before."""
    import torch

    from tasks.models.dims import model_dims
    from tasks.train_adapter.levers.mlp import decoder_layers, recompute_mlps
    from tasks.train_adapter.levers.recompute import enable_checkpointing, offload_embeddings

    model = trainer.model
    base = model.get_base_model()
    lengths = _lengths(dataset, train.method)
    grouped = _grouped(train, speed)
    if speed.packing and train.method == "dpo" and plan.several_processes():
        logger().info("train_adapter (dpo): micro-batches of %d pairs on every process, not groups sized in tokens "
                      "(TRL gathers per-pair metrics across processes, which needs as many pairs on each)",
                      train.per_device_train_batch_size)
    memory = None
    if torch.cuda.is_available() and speed.packing:
        pinned = None if grouped else train.per_device_train_batch_size * max(lengths)
        memory = plan.memory_plan(model, base, train, speed, max(lengths), tokens=pinned, output_layer_movable=False)
        logger().info("train_adapter (%s): %s (the output layer stays on the GPU: TRL's fused LM head reads it "
                      "there)", train.method, memory.describe())
        recompute, offload, wanted, tokens = (memory.recompute_layers, memory.offload_activations,
                                              memory.offload_embeddings, memory.tokens)
        mlp_only, chunks = memory.recompute_mlp_layers, memory.mlp_chunks()
    else:
        layers = len(decoder_layers(base)) or model_dims(base.config).layers
        recompute = 0 if not train.gradient_checkpointing else (
            speed.recompute_layers if speed.recompute_layers is not None else layers)
        offload = bool(recompute) and (speed.offload_activations if speed.offload_activations is not None
                                       else torch.cuda.is_available() and not plan.several_processes())
        wanted = speed.offload_embeddings if speed.offload_embeddings is not None else offload
        tokens = speed.max_tokens_per_batch
        mlp_only = min(speed.recompute_mlp_layers or 0, layers - recompute) if train.gradient_checkpointing else 0
        chunks = None
    embeddings = bool(wanted) and offload_embeddings(model)
    enable_checkpointing(base, offload, recompute)
    mlp_only = recompute_mlps(base, recompute, mlp_only, chunks)
    if mlp_only and memory is None:  # the plan's log line names the modes it chose
        logger().info("train_adapter (%s): decoder layers %d-%d recompute only their MLP (speed.recompute_mlp_layers)",
                      train.method, recompute, recompute + mlp_only - 1)
    if recompute:
        _keep_checkpoint_function(base, offload, recompute)
    groups = None
    if grouped:  # a token budget is set here (_grouped)
        trainer.train_dataset = _PairGroups(dataset, lengths, tokens, train.seed)
        trainer.loss_is_scaled_for_ga = True  # weighted by pairs: _PreTokenizedDPO.compute_loss
        groups = len(trainer.train_dataset)
    return plan.MicroBatches(grouped, offload, embeddings, tokens if grouped else None, groups,
                             recompute_layers=recompute if train.gradient_checkpointing or recompute else None,
                             recompute_mlp_layers=mlp_only,
                             memory_plan=memory.as_dict() if memory is not None else None)


def _lengths(dataset: Any, method: str) -> list[int]:
    """Tokens per dataset row as the model sees them: DPO, prompt + chosen and prompt + rejected; KTO, prompt +
    answer (its KL pass, under no_grad, is not counted)."""
    prompts = [len(ids) for ids in dataset["prompt_ids"]]
    if method == "dpo":
        return [2 * p + len(c) + len(r) for p, c, r in zip(prompts, dataset["chosen_ids"], dataset["rejected_ids"],
                                                            strict=True)]
    return [p + len(c) for p, c in zip(prompts, dataset["completion_ids"], strict=True)]


class _PairGroups:
    """DPO's pairs as micro-batches of whole pairs of at most max_tokens tokens: levers/packs.py's seeded shuffle, then
    greedy; a pair longer than max_tokens goes alone. One item per micro-batch.

    By design an optimizer step then holds gradient_accumulation_steps groups of however many pairs fit the budget,
    not per_device_train_batch_size x gradient_accumulation_steps pairs (the budget is the speed lever: fewer,
    fuller micro-steps), and an epoch has len(groups) / gradient_accumulation_steps steps, which the learning-rate
    schedule follows. What stays the padded path's is the loss of a step: the mean over its pairs (see
    _PreTokenizedDPO), not the mean of its micro-batches' means."""

    def __init__(self, dataset: Any, lengths: list[int], max_tokens: int, seed: int) -> None:
        from tasks.train_adapter.levers.packs import plan_packs

        self.dataset, self.groups = dataset, plan_packs(lengths, max_tokens, None, seed)

    def __len__(self) -> int:
        return len(self.groups)

    def __getitem__(self, i: int) -> dict[str, list[dict[str, Any]]]:
        return {"pairs": [self.dataset[j] for j in self.groups[i]]}


def _keep_checkpoint_function(model: Any, offload: bool, recompute: int | None) -> None:
    """TRL turns checkpointing off around its no-grad reference pass and back on with transformers' default
    function, in every layer; this makes "back on" mean the pipeline's (offloaded) checkpointing again, in the
    layers the plan recomputes, hooks untouched. "Off" is ours too: TRL calls it by the name transformers 5
    deprecates (gradient_checkpointing_disable), which warned on every reference pass."""
    import torch.utils.checkpoint
    from transformers.modeling_layers import GradientCheckpointingLayer

    from tasks.train_adapter.levers.recompute import offloaded_checkpoint

    func = offloaded_checkpoint if offload else functools.partial(torch.utils.checkpoint.checkpoint,
                                                                  use_reentrant=False)
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]

    def enable(*_: Any, **__: Any) -> None:
        model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=func)
        for index, layer in enumerate(layers):
            layer.gradient_checkpointing = recompute is None or index < recompute

    def disable(*_: Any, **__: Any) -> None:
        model._set_gradient_checkpointing(enable=False)

    model.gradient_checkpointing_enable = enable
    model.gradient_checkpointing_disable = disable


def _trl(method: str) -> tuple[type, type]:
    """The TRL trainer (taking prepare_data's token ids as they are) and config for a method."""
    from trl import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer

    if method == "dpo":
        return _PreTokenizedDPO(DPOTrainer), DPOConfig
    return _PreTokenizedKTO(KTOTrainer), KTOConfig


@functools.cache
def _PreTokenizedDPO(base: type) -> type:  # noqa: N802 - a class factory (trl imported lazily)
    class PreTokenizedDPOTrainer(base):
        """TRL's DPO trainer on prepare_data's token ids. With _PairGroups (loss_is_scaled_for_ga set), each
        micro-batch's loss is weighted by its share of the optimizer step's pairs: TRL's loss is a mean over a
        micro-batch's pairs, and the Trainer's division by gradient_accumulation_steps would give a pair of a
        small group more weight than one of a large group; weighted, a step's loss and gradient are the mean over
        all its pairs, what TRL's padded path computes for equal micro-batches."""

        def _prepare_dataset(self, dataset: Any, *_: Any) -> Any:
            return dataset  # prompt_ids, chosen_ids, rejected_ids from prepare_data

        def _get_num_items_in_batch(self, batch_samples: list, device: Any) -> Any:
            if not self.loss_is_scaled_for_ga:
                return super()._get_num_items_in_batch(batch_samples, device)
            return sum(_pairs(batch) for batch in batch_samples)  # this optimizer step's pairs (this process's)

        def compute_loss(self, model: Any, inputs: dict[str, Any], return_outputs: bool = False,
                         num_items_in_batch: Any = None) -> Any:
            result = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            if not (self.loss_is_scaled_for_ga and self.model.training and num_items_in_batch):
                return result
            share = _pairs(inputs) / num_items_in_batch
            return (result[0] * share, *result[1:]) if return_outputs else result * share

    return PreTokenizedDPOTrainer


def _pairs(batch: dict[str, Any]) -> int:
    """Pairs in one of TRL's DPO micro-batches: its rows are the chosen answers, then the rejected ones."""
    return len(batch["input_ids"]) // 2


@functools.cache
def _PreTokenizedKTO(base: type) -> type:  # noqa: N802
    class PreTokenizedKTOTrainer(base):
        def _prepare_dataset(self, dataset: Any, processing_class: Any, args: Any, dataset_name: str) -> Any:
            if not self.calculate_KL:
                return dataset

            def add_kl(batch: dict[str, list]) -> dict[str, list]:  # TRL's: rotate the answers by one per batch
                batch["KL_completion_ids"] = [batch["completion_ids"][-1], *batch["completion_ids"][:-1]]
                return batch

            return dataset.map(add_kl, batched=True, batch_size=args.per_device_train_batch_size)

    return PreTokenizedKTOTrainer


def _collator(train: TrainArgs, pad_id: int) -> Any:
    if train.method == "dpo":
        from trl.trainer.dpo_trainer import DataCollatorForPreference

        return DataCollatorForPreference(pad_token_id=pad_id)
    from trl.trainer.kto_trainer import DataCollatorForUnpairedPreference

    return DataCollatorForUnpairedPreference(pad_token_id=pad_id)


class _CountingCollator(CountingCollator):
    """TRL's collator, counting the real (non-padding) tokens it hands out, for Progress: chosen + rejected (DPO),
    the answers (KTO; its KL pass is not counted); a _PairGroups micro-batch is its pairs."""

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        if examples and "pairs" in examples[0]:  # _PairGroups: one group of pairs per micro-batch
            examples = [pair for group in examples for pair in group["pairs"]]
        return super().__call__(examples)
