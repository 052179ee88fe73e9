"""train_adapter: 4-bit base + tokenized data -> LoRA adapter.

Reads prepare_model's 4-bit checkpoint and modules.json and prepare_data's train.parquet. Trains LoRA
adapters (peft) with the transformers Trainer: k-bit training preparation, gradient checkpointing,
gradient accumulation, bf16 where supported, paged 8-bit AdamW, a learning-rate schedule. Writes into
runs_dir/train_adapter/<key>/: adapter/ (PEFT format), loss.jsonl (one line per logged step) and
manifest.json. While it runs, checkpoints/checkpoint-N/ are written every `save_steps` optimizer
steps; an interrupted run resumes from the latest complete one (adapter, optimizer, scheduler, RNG
and data position), and they are removed once the adapter is saved. With track.backend, .tracking.json
names the tracking runs the Trainer reports into (tasks/reporting/tracking), kept so a resumed training goes on in them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from prefect import task

from tasks import methods, rewards
from tasks.config import LoraArgs, SpeedArgs, TrackArgs, TrainArgs
from tasks.errors import UserError
from tasks.hashing.files import files_fingerprint
from tasks.models.memory import allocator_restored
from tasks.on_disk.caching import stage_task_options
from tasks.on_disk.folders import StageSpec, open_stage
from tasks.on_disk.manifest import DataMetrics, read_manifest
from tasks.pool.cpus import cpu_share
from tasks.pool.gpus import gpu_slot, held_devices
from tasks.pool.hosts import this_host
from tasks.registry.init_adapter import ADAPTER_FILES as INIT_ADAPTER_FILES
from tasks.registry.init_adapter import resolve_adapter
from tasks.reporting import tracking
from tasks.train_adapter import builder, launch, nodes
from tasks.train_adapter.levers import liger, parallel
from tasks.train_adapter.methods import unit
from tasks.train_adapter.resume import latest_checkpoint, remove_half_written

VERSION = "2"  # 2: the fused loss applies Gemma 2's logit soft-capping (adapters trained before were off)
ADAPTER_FILES = ["adapter/adapter_config.json", "adapter/adapter_model.safetensors"]


def spec(lora: LoraArgs, train: TrainArgs, speed: SpeedArgs, runs_dir: Path, data_dir: str, model_dir: str,
         track: TrackArgs | None = None) -> StageSpec:
    """Cache-key inputs: LoRA, training and speed settings, prepare_model, the bytes of prepare_data's train.parquet
    (all this stage reads of it: a new data.eval_source leaves training reused) and the init adapter's files.

    Not `track`: tracking changes where the training's numbers are sent, not the adapter (tasks/reporting/tracking)."""
    data = read_manifest(Path(data_dir))
    if data is None:
        raise RuntimeError(f"{data_dir} has no valid manifest.json: its stage did not finish")
    keyed = {"train_data": data.hashes["train.parquet"]}
    if methods.method(train.method).rewards:  # the reward functions' code (a reward model's files): editing retrains
        keyed.update({f"reward:{name}": digest for name, digest in rewards.fingerprint(train, runs_dir).items()})
    if train.init_adapter:  # its content, not its name: a new champion is a new starting point
        folder = resolve_adapter(train.init_adapter, runs_dir)
        keyed["init_adapter"] = files_fingerprint([folder / f for f in INIT_ADAPTER_FILES])
    return StageSpec(stage="train_adapter", version=VERSION, runs_dir=runs_dir, located=("train.init_adapter",),
                     checks=("train.reward_timeout_s",),  # how long a reward may take: it trains the same adapter
                     params={"lora": lora.model_dump(), "train": _train_params(train), "speed": _speed_params(speed)},
                     upstream={"prepare_model": Path(model_dir)}, fingerprint=keyed)


def _speed_params(speed: SpeedArgs) -> dict[str, Any]:
    """speed as keyed: num_nodes only above 1 (adding it left every one-host key unchanged), and never how long a
    training across hosts waits for them (node_join_timeout_s changes nothing trained)."""
    return speed.model_dump(exclude={"node_join_timeout_s", *(("num_nodes",) if speed.num_nodes == 1 else ())})


def _train_params(train: TrainArgs) -> dict[str, Any]:
    """train as keyed: a method's own fields only for the methods that read them (tasks/methods.py keyed_fields), so
    that adding a method's fields left the other methods' keys unchanged."""
    return train.model_dump(exclude=methods.keyed_fields(methods.method(train.method)) or None)


@task(name="train_adapter", **stage_task_options(spec))
def train_adapter(lora: LoraArgs, train: TrainArgs, speed: SpeedArgs, runs_dir: Path, data_dir: str, model_dir: str,
                  track: TrackArgs | None = None) -> str:
    """Train a LoRA adapter on the 4-bit base model, resuming from the latest checkpoint."""
    if not train.init_adapter:  # an init adapter brings its own target modules
        check_target_modules(lora.target_modules, Path(model_dir))
    check_method(train, Path(data_dir))
    keep = ("checkpoints", "loss.jsonl", tracking.REFS)  # an interrupted run resumes from these (in the same runs)
    with open_stage(spec(lora, train, speed, runs_dir, data_dir, model_dir), keep=keep, tidy=remove_half_written
                    ) as stage:
        if stage.done:
            return str(stage.dir)
        resume = latest_checkpoint(stage.dir / "checkpoints")
        if train.init_adapter:  # the ranks get the folder itself
            train = train.model_copy(update={"init_adapter": str(resolve_adapter(train.init_adapter, runs_dir))})
        if methods.method(train.method).rewards:  # a reward model: the version of now, also for the evaluation
            train = rewards.pinned(train, runs_dir)
        processes = parallel.world_size(speed)
        asked = time.monotonic()
        with _resources(speed, processes) as (hosts, devices, threads):
            waited = round(time.monotonic() - asked, 1)  # the stage's time less this is its work (its artifact)
            refs = tracking.open_training(track, runs_dir, stage.dir)  # not before: a waiting run is not running
            if hosts:  # node 0 of a training across hosts
                metrics = nodes.train(lora, train, speed, data_dir, model_dir, stage.dir, hosts, devices, threads)
            elif processes > 1 or devices:  # children that see only these GPUs
                metrics = launch.launch(lora, train, speed, data_dir, model_dir, stage.dir, processes, devices,
                                        threads)
            else:
                # evaluate_adapter and export_adapter may run next in this process: put its state back
                with allocator_restored(), liger.patches_undone():
                    metrics = builder.fit_and_save(unit(train.method), lora, train, speed, data_dir, model_dir,
                                                   stage.dir)
        resumed = int(resume.name.split("-")[-1]) if resume else None
        stage.finish([*ADAPTER_FILES, "loss.jsonl"], {**metrics, "gpu_wait_seconds": waited, "devices": devices,
                                                      "host": this_host() if devices else None,
                                                      **({"tracking": refs} if refs else {})},
                     resumed_from_step=resumed)
        return str(stage.dir)


@contextmanager
def _resources(speed: SpeedArgs, processes: int) -> Iterator[tuple[list[str] | None, list[str] | None, int]]:
    """What the training holds while it runs: with speed.num_nodes, the GPUs of that many hosts (nodes.fleet; the
    hosts, this one first), else GPUs of this host's pool that no other run on the Prefect server holds; this host's
    devices; its share of this host's cores (threads per process)."""
    with ExitStack() as held:
        hosts = held.enter_context(nodes.fleet(speed)) if speed.num_nodes > 1 else None
        devices = held.enter_context(held_devices(processes) if hosts else gpu_slot(processes))
        threads = held.enter_context(cpu_share("train_adapter", processes))
        yield hosts, devices, threads


def check_target_modules(target_modules: list[str] | str, model_dir: Path) -> None:
    """Fail before training if LoRA targets modules the base model does not have ('all-linear' fits any)."""
    if isinstance(target_modules, str):
        return
    report = json.loads((model_dir / "modules.json").read_text())
    missing = [m for m in target_modules if m not in report["targetable"]]
    if missing:
        made = read_manifest(model_dir)
        base = made.params["model"]["base_model"] if made else model_dir
        raise UserError(
            f"lora.target_modules names {', '.join(missing)}, which {base} does not have. "
            f"Its layers LoRA can target are: {', '.join(report['targetable'])}. "
            "Set lora.target_modules to some of these."
        )


def check_method(train: TrainArgs, data_dir: Path) -> None:
    """Fail before training when the data's format is not one train.method trains on (tasks/methods.py), or the
    method's own check of the data fails (the columns GRPO's built-in rewards read)."""
    made = read_manifest(data_dir)
    metrics = made.metrics if made is not None and isinstance(made.metrics, DataMetrics) else None
    if metrics is None:
        return
    row, fmt = methods.method(train.method), metrics.format
    if fmt not in row.formats:
        takes = [m.name for m in methods.METHODS if fmt in m.formats]
        raise UserError(f"train.method={row.name} trains on {row.data_kind} data (format {', '.join(row.formats)}), "
                        f"but the data is in the {fmt} format ({methods.data_kind(fmt)} data). Set train.method to "
                        f"one that trains on it ({', '.join(takes)}), or point data.source at {row.data_kind} data "
                        "(docs/data.md, docs/preference.md).")
    if problem := unit(train.method).check_data(train, metrics):
        raise UserError(problem)
