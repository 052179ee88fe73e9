"""A training whose loss goes non-finite stops at that step, and a damaged init adapter is refused before training;
neither leaves an adapter, a loss line of its own or a manifest (tasks/train_adapter/divergence.py)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from tasks.config import LoraArgs, SpeedArgs, TrainArgs
from tasks.errors import TrainingDiverged, UserError
from tasks.train_adapter.stage import train_adapter
from tests.conftest import cli, cli_env, finish, small_overrides

LORA = LoraArgs(r=4, lora_alpha=8)
# a learning rate a million times the default: the LoRA weights blow up within a few steps and the loss turns NaN
DIVERGING = {"learning_rate": 1e6, "logging_steps": 1, "save_steps": 2}


def _stopped_at(message: str) -> int:
    found = re.match(r"train_adapter stopped at optimizer step (\d+) of (\d+): the training loss there was nan, not "
                     r"a finite number", message)
    assert found, message
    return int(found[1])


def _nothing_kept_from(folder: Path, step: int) -> None:
    """Loss lines and checkpoints of the steps before `step` only, all finite; no adapter, no manifest."""
    logged = [json.loads(line) for line in (folder / "loss.jsonl").read_text().splitlines()]
    assert [entry["step"] for entry in logged] == list(range(1, step))
    assert all(entry["loss"] == entry["loss"] for entry in logged)  # no NaN
    saved = [int(p.name.split("-")[1]) for p in (folder / "checkpoints").glob("checkpoint-*")]
    assert saved and max(saved) < step
    assert not (folder / "adapter").exists() and not (folder / "manifest.json").exists()


def test_a_loss_that_goes_non_finite_stops_training_at_that_step(stages: dict[str, Any], tmp_path: Path) -> None:
    train = TrainArgs(max_steps=12, **DIVERGING)
    with pytest.raises(TrainingDiverged) as info:
        train_adapter.fn(LORA, train, SpeedArgs(), tmp_path, stages["data"], stages["model"])
    message = str(info.value)
    step = _stopped_at(message)
    assert 1 < step < 12
    assert "a learning rate too high for this model and data (train.learning_rate=1e+06: try 100000" in message
    assert "nothing of that step or later was written (no loss line, checkpoint, adapter or manifest)" in message
    _nothing_kept_from(next((tmp_path / "train_adapter").glob("*/")), step)
    assert isinstance(info.value, UserError)  # one paragraph and exit 2 in the CLI, never retried


@pytest.mark.slow
def test_every_rank_of_a_data_parallel_training_stops_at_the_same_step(stages: dict[str, Any],
                                                                       tmp_path: Path) -> None:
    """Two gloo processes under torchrun: they agree on the first non-finite step (an all-reduce) and stop
    together; the parent reports the ranks' paragraph."""
    train = TrainArgs(max_steps=12, **DIVERGING)
    with pytest.raises(UserError) as info:
        train_adapter.fn(LORA, train, SpeedArgs(num_gpus=2), tmp_path, stages["data"], stages["model"])
    step = _stopped_at(str(info.value))
    folder = next((tmp_path / "train_adapter").glob("*/"))
    _nothing_kept_from(folder, step)
    ranks = (folder / "distributed.log").read_text()
    assert ranks.count(f"stopped at optimizer step {step} of 12") == 2, ranks[-3000:]


def _damaged(adapter: Path, into: Path, value: float) -> Path:
    """A copy of an exported adapter whose last layer's MLP LoRA B matrix holds `value` everywhere."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(adapter, into)
    weights = load_file(into / "adapter_model.safetensors")
    save_file({k: v.fill_(value) if "layers.3.mlp.down_proj.lora_B" in k else v for k, v in weights.items()},
              into / "adapter_model.safetensors")
    return into


@pytest.fixture(scope="module")
def start(stages: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An adapter trained for two steps, to start from."""
    runs = tmp_path_factory.mktemp("start")
    return Path(train_adapter.fn(LORA, TrainArgs(max_steps=2), SpeedArgs(), runs, stages["data"], stages["model"])
                ) / "adapter"


@pytest.mark.parametrize(("value", "said"), [
    (1e28, "predicts the same for every token at every position (a uniform guess), which the base model does not "
           "(loss 6.9315;"),  # the issue's: finite, every hidden state overflows in the norm, eval loss ln 1024
    (float("nan"), "computes logits that are not finite numbers"),
])
def test_a_damaged_init_adapter_is_refused_before_training(stages: dict[str, Any], start: Path, tmp_path: Path,
                                                           value: float, said: str) -> None:
    damaged = _damaged(start, tmp_path / "damaged", value)
    with pytest.raises(UserError) as info:
        train_adapter.fn(LORA, TrainArgs(max_steps=2, init_adapter=str(damaged)), SpeedArgs(), tmp_path / "runs",
                         stages["data"], stages["model"])
    message = str(info.value)
    assert message.startswith(f"train.init_adapter={str(damaged)!r} is damaged: on the first 4 training examples the "
                              f"base model with it {said}"), message
    assert "Nothing was trained from it. Start from another adapter" in message
    folder = next((tmp_path / "runs" / "train_adapter").glob("*/"))
    assert not (folder / "checkpoints").exists() and not (folder / "adapter").exists()
    assert not (folder / "manifest.json").exists()


def test_a_sound_init_adapter_trains_on(stages: dict[str, Any], start: Path, tmp_path: Path) -> None:
    folder = Path(train_adapter.fn(LORA, TrainArgs(max_steps=2, logging_steps=10, init_adapter=str(start)),
                                   SpeedArgs(), tmp_path, stages["data"], stages["model"]))
    assert (folder / "manifest.json").is_file()
    # a training shorter than logging_steps still logs its last step (the empty loss.jsonl)
    assert [json.loads(line)["step"] for line in (folder / "loss.jsonl").read_text().splitlines()] == [2]


@pytest.mark.slow
def test_a_run_from_a_damaged_init_adapter_exits_2_before_training_and_publishes_nothing(
        small_data: Path, start: Path, tmp_path: Path) -> None:
    damaged = _damaged(start, tmp_path / "damaged", 1e28)
    runs = tmp_path / "runs"
    args = ["run", *sum((["--set", o] for o in small_overrides(small_data, runs, **{
        "train.init_adapter": str(damaged), "export.name": "nightly"})), [])]
    proc = cli(args, cli_env(tmp_path / "prefect"), tmp_path / "run")
    _, err = finish(proc, tmp_path / "run", timeout=900)
    assert proc.returncode == 2, err[-3000:]
    paragraph = " ".join(err.split())
    assert f"train.init_adapter={str(damaged)!r} is damaged" in paragraph and "Traceback" not in err
    assert not list(runs.glob("train_adapter/*/manifest.json")) and not (runs / "exports").exists()
