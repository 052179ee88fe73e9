"""GRPO (train.method grpo): the prompts format and its bad rows, the config's rules, the reward functions (built-ins,
the allowed user modules, their errors, their source in train_adapter's key), and GRPO on the embedded tiny model:
the held-out reward rising and the gate promoting on it, kill -9 and resume, one step on every family."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from tasks.config import PROJECT_ROOT, DataArgs, ModelArgs, load_config
from tasks.errors import UserError
from tests.conftest import damaged_copy, killed_at_a_checkpoint, run_flow, statuses

PROMPTS = PROJECT_ROOT / "data" / "sample" / "prompts.jsonl"
# GRPO of a few seconds on 2 CPU cores: 8 answers a step (2 prompts x 4), 4 tokens each
FAST = {"train.method": "grpo", "train.rewards": "[format]", "train.per_device_train_batch_size": 8,
        "train.learning_rate": 0.01, "train.max_completion_length": 4, "train.logging_steps": 1,
        "eval.max_samples": 32, "eval.generation_samples": 4}


def _config(*overrides: str, **values: Any) -> Any:
    return load_config(None, [f"{k}={v}" for k, v in {**FAST, **values}.items()] + list(overrides))


@pytest.fixture(scope="module")
def prompt_stages(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """prepare_data on the sample prompts and prepare_model (the tiny Llama), once for this module."""
    from tasks.prepare_data.stage import prepare_data
    from tasks.prepare_model.stage import prepare_model

    runs = tmp_path_factory.mktemp("grpo-runs")
    return {"runs": str(runs), "data": prepare_data.fn(DataArgs(source=str(PROMPTS)), ModelArgs(), runs),
            "model": prepare_model.fn(ModelArgs(), runs)}


def _train(config: Any, runs: Path, stages: dict[str, str]) -> Path:
    from tasks.train_adapter.stage import train_adapter

    return Path(train_adapter.fn(config.lora, config.train, config.speed, runs, stages["data"], stages["model"]))


def _metrics(folder: str | Path) -> dict[str, Any]:
    return json.loads((Path(folder) / "manifest.json").read_text())["metrics"]


@pytest.fixture
def reward_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A user's reward module (myrewards.py) on sys.path, allowed by the deployment (QLORA_REWARD_MODULES)."""
    path = tmp_path / "mods" / "myrewards.py"
    path.parent.mkdir()
    path.write_text(textwrap.dedent("""
        def short(prompts, completions, completion_ids, answer, **_):
            return [1.0 if len(ids) < 8 else 0.0 for ids in completion_ids]

        def raises(prompts, completions, **_):
            raise KeyError("score")

        def too_few(prompts, completions, **_):
            return [0.0]

        def sleeps(prompts, completions, **_):
            import time
            time.sleep(3600)

        def not_a_number(prompts, completions, **_):
            return [float("nan")] * (len(completions) - 1) + [1.0]

        def infinite(prompts, completions, **_):
            return [float("-inf")] + [0.0] * (len(completions) - 1)
    """))
    monkeypatch.syspath_prepend(str(path.parent))
    monkeypatch.setenv("QLORA_REWARD_MODULES", "myrewards")
    sys.modules.pop("myrewards", None)
    return path


# --- data ----------------------------------------------------------------------------------------------------------

def test_prompts_are_detected_mapped_and_keep_their_columns(tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    from tasks.prepare_data.stage import prepare_data

    rows = [{"question": f"### Instruction:\nAdd {i} and 1.\n\n### Response:\n", "answer": i + 1, "tags": ["x"]}
            for i in range(20)]
    rows.append({"question": [{"role": "user", "content": "What is 2 plus 2?"}], "answer": 4, "tags": []})
    source = tmp_path / "q.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = Path(prepare_data.fn(DataArgs(source=str(source), column_mapping={"question": "prompt"},
                                        chat_template="chatml", eval_fraction=0.3), ModelArgs(), tmp_path / "runs"))
    made = _metrics(out)
    assert made["format"] == "prompts" and made["prompt_columns"] == ["answer", "tags"] and made["rows_out"] == 21
    table = pq.read_table(out / "train.parquet").to_pylist() + pq.read_table(out / "eval.parquet").to_pylist()
    assert pq.read_schema(out / "train.parquet").names == ["prompt", "prompt_ids", "columns"]
    chat = next(r for r in table if "2 plus 2" in r["prompt"])
    assert chat["prompt"].startswith("<|im_start|>user\n") and chat["prompt"].endswith("<|im_start|>assistant\n")
    assert json.loads(chat["columns"]) == {"answer": 4, "tags": []}


def test_bad_prompt_rows_are_listed_together_and_nothing_is_written(tmp_path: Path) -> None:
    from tasks.prepare_data.stage import prepare_data

    rows = [{"prompt": "Good one?", "answer": "1"}, {"prompt": "  ", "answer": "2"}, {"prompt": 7, "answer": "3"},
            {"prompt": [{"content": "no role"}], "answer": "4"}, {"prompt": "Fine?", "answer": "5"}]
    source = tmp_path / "bad.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(UserError) as caught:
        prepare_data.fn(DataArgs(source=str(source), format="prompts"), ModelArgs(), tmp_path / "runs")
    message = str(caught.value)
    assert "have an empty prompt (every row needs one): " in message and "line 2" in message
    assert "have a prompt that is neither text nor a list of messages" in message and "line 3" in message
    assert "have a prompt list that is not {role, content} messages" in message and "line 4" in message
    assert not list((tmp_path / "runs").glob("prepare_data/*/manifest.json"))
    (tmp_path / "none.jsonl").write_text(json.dumps({"question": "Q?", "answer": "1"}) + "\n")
    with pytest.raises(UserError, match="data.format='prompts' needs column\\(s\\) prompt"):
        prepare_data.fn(DataArgs(source=str(tmp_path / "none.jsonl"), format="prompts"), ModelArgs(),
                        tmp_path / "runs")


# --- config and reward functions ------------------------------------------------------------------------------------

def test_grpo_config_rules() -> None:
    assert _config().train.rewards == ["format"]
    with pytest.raises(ValueError, match="train.rewards is empty: name at least one"):
        _config(**{"train.rewards": "[]"})
    with pytest.raises(ValueError, match="train.rewards is for train.method=grpo"):
        load_config(None, ["train.rewards=[format]"])
    with pytest.raises(ValueError, match="must divide the answers of an optimizer step"):
        _config(**{"train.per_device_train_batch_size": 6})
    with pytest.raises(ValueError, match=r"train.method=grpo trains on prompts data \(prompts\), but data.format is "
                                         "dolly"):
        _config("data.format=dolly")
    with pytest.raises(ValueError, match="train.loss_type=sigmoid does not go with train.method=grpo"):
        _config("train.loss_type=sigmoid")
    assert _config("train.loss_type=dr_grpo").train.loss_type == "dr_grpo"
    with pytest.raises(ValueError, match="train.method=grpo trains in one process here"):
        _config("speed.num_gpus=2")
    with pytest.raises(ValueError, match="'\\[a' is not a regular expression"):
        _config("train.reward_pattern='[a'")


def test_train_adapter_key_of_other_methods_is_unchanged_by_grpos_fields(tmp_path: Path,
                                                                        stages: dict[str, Any]) -> None:
    from tasks.train_adapter.stage import spec

    config = load_config(None, [])
    plain = spec(config.lora, config.train, config.speed, tmp_path, stages["data"], stages["model"])
    assert "rewards" not in plain.params["train"] and "num_generations" not in plain.params["train"]
    changed = config.train.model_copy(update={"num_generations": 8, "reward_pattern": "x"})
    assert spec(config.lora, changed, config.speed, tmp_path, stages["data"], stages["model"]).key == plain.key


def test_built_in_rewards() -> None:
    from tasks import rewards

    train = _config(**{"train.rewards": "[answer_match, numeric_match, format, length_penalty]",
                       "train.reward_pattern": "^[0-9]", "train.max_completion_length": 4}).train
    funcs = rewards.load(train, Path("runs"), Path("model"))  # built-ins only: neither folder is read
    scored = rewards.score(funcs, ["p"] * 3, ["12", "it is 12.0 or 13", "twelve"],
                           [[5], [5, 6, 7, 8, 9], []], [json.dumps({"answer": "12"})] * 2 + ["{}"])
    assert scored == {"answer_match": [1.0, 0.0, None], "numeric_match": [1.0, 0.0, None],
                      "format": [1.0, 0.0, 0.0], "length_penalty": [-0.25, -1.0, 0.0]}


@pytest.mark.slow  # the command with its temporary Prefect server: ~20 s on 2 cores
def test_a_disallowed_module_fails_before_any_stage_with_exit_2(tmp_path: Path) -> None:
    from tests.conftest import cli_env

    runs = tmp_path / "runs"
    sets = [f"runs_dir={runs}", f"data.source={PROMPTS}", "train.method=grpo", "train.per_device_train_batch_size=4",
            "train.rewards=[format, os:system]"]
    done = subprocess.run([sys.executable, "-m", "deployments.cli", "run", *[a for s in sets for a in ("--set", s)]],
                          cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300,
                          env={**cli_env(tmp_path / "prefect-home"), "QLORA_REWARD_MODULES": "myrewards"})
    err = " ".join(done.stderr.split())
    assert done.returncode == 2, err[-3000:]
    assert "'os:system' is from module os, which the deployment does not allow (allowed: myrewards)" in err
    assert "environment variable QLORA_REWARD_MODULES of the worker" in err and "Traceback" not in err
    assert not (runs / "prepare_data").exists()


def test_an_allowed_modules_function_trains_and_its_source_keys_the_training(
        reward_module: Path, prompt_stages: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tasks import rewards
    from tasks.train_adapter.stage import spec

    config = _config(**{"train.rewards": "[format, 'myrewards:short']", "train.max_steps": 2})
    rewards.check(config.train, tmp_path)
    args = (config.lora, config.train, config.speed, tmp_path, prompt_stages["data"], prompt_stages["model"])
    before = spec(*args).key
    done = _train(config, tmp_path, prompt_stages)
    assert done.name == before and _metrics(done)["rewards"] == ["format", "myrewards:short"]
    logged = [json.loads(line) for line in (done / "loss.jsonl").read_text().splitlines()]
    assert [line["step"] for line in logged] == [1, 2] and all("reward" in line and "kl" in line for line in logged)
    reward_module.write_text(reward_module.read_text().replace("< 8", "< 9"))
    sys.modules.pop("myrewards", None)
    assert spec(*args).key != before  # an edited reward function retrains
    monkeypatch.delenv("QLORA_REWARD_MODULES")  # the same module, no longer allowed by the deployment
    with pytest.raises(UserError, match="which the deployment does not allow \\(allowed: none\\)"):
        rewards.check(config.train, tmp_path)


def test_per_step_reward_kl_and_length_reach_tensorboard(prompt_stages: dict[str, str], tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tasks.config import TrackArgs
    from tasks.train_adapter.stage import train_adapter

    config = _config(**{"train.rewards": "[format, length_penalty]", "train.max_steps": 2})
    done = Path(train_adapter.fn(config.lora, config.train, config.speed, tmp_path, prompt_stages["data"],
                                 prompt_stages["model"], TrackArgs(backend=["tensorboard"])))
    events = EventAccumulator(str(tmp_path / "tensorboard" / f"train_adapter-{done.name}"))
    events.Reload()
    for name in ("train/reward", "train/kl", "train/completions/mean_length", "train/rewards/format/mean",
                 "train/rewards/length_penalty/mean"):
        assert [e.step for e in events.Scalars(name)] == [1, 2], name


@pytest.mark.parametrize(("name", "message"), [
    ("myrewards:raises", "The reward function myrewards:raises raised KeyError: 'score'. Fix the function"),
    ("myrewards:too_few", "The reward function myrewards:too_few returned 1 values for 8 answers"),
    ("myrewards:sleeps", "The reward function myrewards:sleeps did not return within train.reward_timeout_s=2 s for "
                         "8 answers"),
    ("myrewards:not_a_number", "The reward function myrewards:not_a_number returned 7 value(s) that are not finite "
                               "numbers (such as nan) for 8 answers"),
    ("myrewards:infinite", "The reward function myrewards:infinite returned 1 value(s) that are not finite numbers "
                           "(such as -inf)"),
])
def test_a_failing_reward_function_stops_training_with_one_paragraph(
        reward_module: Path, prompt_stages: dict[str, str], tmp_path: Path, name: str, message: str) -> None:
    """An exception, a wrong count, a call that never returns (bounded by train.reward_timeout_s: the run does not
    wait for ever) and a NaN or infinite reward: one paragraph naming the function, nothing half-written."""
    config = _config(**{"train.rewards": f"['{name}']", "train.max_steps": 2, "train.reward_timeout_s": 2})
    started = time.monotonic()
    with pytest.raises(UserError, match=message.replace("(", "\\(").replace(")", "\\)")):
        _train(config, tmp_path, prompt_stages)
    assert time.monotonic() - started < 300
    assert not list(tmp_path.glob("train_adapter/*/manifest.json"))  # nothing half-written
    assert not list(tmp_path.glob("train_adapter/*/adapter"))


def test_a_reward_timeout_keys_nothing(prompt_stages: dict[str, str], tmp_path: Path) -> None:
    """How long a reward may take changes no adapter: the same key, and no other method reads the field."""
    from tasks.train_adapter.stage import spec

    def key(*overrides: str) -> str:
        config = _config(*overrides, **{"train.rewards": "[format]"})
        return spec(config.lora, config.train, config.speed, tmp_path, prompt_stages["data"],
                    prompt_stages["model"]).key

    assert key("train.reward_timeout_s=5") == key() == key("train.reward_timeout_s=600")


def test_rewards_that_read_a_missing_column_fail_before_training(prompt_stages: dict[str, str],
                                                                 stages: dict[str, Any], tmp_path: Path) -> None:
    from tasks.prepare_data.stage import prepare_data

    source = tmp_path / "no-answer.jsonl"
    source.write_text("".join(json.dumps({"prompt": f"Say {i}."}) + "\n" for i in range(20)))
    data = prepare_data.fn(DataArgs(source=str(source)), ModelArgs(), tmp_path / "runs")
    config = _config(**{"train.rewards": "[numeric_match]"})
    with pytest.raises(UserError, match="read the column\\(s\\) answer, which the prompts lack"):
        _train(config, tmp_path, {**prompt_stages, "data": data})
    with pytest.raises(UserError, match="train.method=grpo trains on prompts data .*, but the data is in the dolly"):
        _train(config, tmp_path, {**prompt_stages, "data": stages["data"]})


def test_gate_promotes_grpo_runs_on_their_mean_held_out_reward() -> None:
    from tasks.methods import MEAN_REWARD
    from tasks.registry.gate import gate

    def run(reward: float) -> dict[str, Any]:
        return {"version": "v0001", "eval_data": "k", "metrics": {"tuned_eval_loss": 1.0, "tuned_mean_reward": reward,
                                                                  "base_mean_reward": 0.2}}
    verdict, reason = gate(run(0.8)["metrics"], run(0.5), 0.01, "k", MEAN_REWARD)
    assert verdict == "promoted" and "tuned mean reward 0.800 beats champion v0001's 0.500" in reason
    verdict, reason = gate({**run(0.505)["metrics"], "tuned_eval_loss": 0.1}, run(0.5), 0.01, "k", MEAN_REWARD)
    assert verdict == "rejected" and "needed > 0.510" in reason  # a lower eval loss does not decide
    verdict, reason = gate(run(0.15)["metrics"], None, 0.01, "k", MEAN_REWARD)
    assert verdict == "rejected" and "the base model's 0.200" in reason
    # a sweep ranks grpo candidates by the same rule; a NaN mean reward is unranked
    from tasks.sweep.ranking import _beats

    assert _beats(run(0.6)["metrics"], run(0.5)["metrics"], "k", MEAN_REWARD)
    assert not _beats(run(0.5)["metrics"], run(0.6)["metrics"], "k", MEAN_REWARD)
    assert not _beats(run(float("nan"))["metrics"], run(0.5)["metrics"], "k", MEAN_REWARD)


# --- training -------------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_grpo_raises_the_held_out_reward_and_the_gate_promotes_on_it(prefect_env: Path, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QLORA_CPU_THREADS", "1")  # the same threads every time: sampling follows a CPU's digits
    overrides = [f"{k}={v}" for k, v in {
        "runs_dir": tmp_path / "runs", "data.source": PROMPTS, "train.max_steps": 40, "train.save_steps": 20,
        "train.logging_steps": 5, "export.name": "grpo", **{k: v for k, v in FAST.items()
                                                           if k != "train.logging_steps"}}.items()]
    first = run_flow(overrides)
    assert set(statuses(first).values()) == {"computed"}
    evaluated = _metrics(first["stages"]["evaluate_adapter"]["dir"])
    # the random-weight base writes a digit in 1 of its 32 greedy answers of 4 tokens; 40 steps teach it to in all
    assert evaluated["eval_prompts"] == 32 and evaluated["base_rewards"] == {"format": 0.03125}
    assert evaluated["tuned_mean_reward"] >= evaluated["base_mean_reward"] + 0.5
    exported = _metrics(first["stages"]["export_adapter"]["dir"])
    assert exported["promotion"] == "promoted" and "tuned mean reward" in exported["promotion_reason"]
    card = (Path(first["export_dir"]) / "README.md").read_text()
    assert "| mean reward (gated) |" in card and "| reward format |" in card and "Trained with GRPO" in card
    assert set(statuses(run_flow(overrides)).values()) == {"cached"}


@pytest.mark.slow
@pytest.mark.kill
def test_kill_9_mid_grpo_resumes_to_the_same_steps_and_adapter_bytes(prompt_stages: dict[str, str],
                                                                      tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from tasks.train_adapter.stage import spec

    monkeypatch.setenv("QLORA_CPU_THREADS", "1")  # the killed, resumed and plain runs on the same threads
    steps, overrides = 9, {"train.max_steps": 9, "train.save_steps": 3, "train.seed": 7}
    config = _config(**overrides)
    killed_runs, plain_runs = tmp_path / "killed", tmp_path / "plain"
    script = ("from pathlib import Path; from tests.test_grpo import _config, _train; "
              f"_train(_config(**{overrides!r}), Path({str(killed_runs)!r}), {prompt_stages!r})")
    folder = spec(config.lora, config.train, config.speed, killed_runs, prompt_stages["data"],
                  prompt_stages["model"]).dir
    saved = killed_at_a_checkpoint(script, folder, tmp_path / "out")
    assert saved < steps
    resumed = _train(config, killed_runs, prompt_stages)
    manifest = json.loads((resumed / "manifest.json").read_text())
    assert manifest["resumed_from_step"] >= saved and manifest["metrics"]["optimizer_steps"] == steps
    logged = [json.loads(line)["step"] for line in (resumed / "loss.jsonl").read_text().splitlines()]
    assert logged == list(range(1, steps + 1))
    plain = _train(config, plain_runs, prompt_stages)
    weights = "adapter/adapter_model.safetensors"
    assert (resumed / weights).read_bytes() == (plain / weights).read_bytes()
    assert (resumed / "loss.jsonl").read_text() == (plain / "loss.jsonl").read_text()


@pytest.mark.slow
def test_every_family_trains_one_grpo_step(prompt_stages: dict[str, str], tmp_path: Path) -> None:
    from tasks.prepare_model.stage import prepare_model
    from tests.families import FAMILIES, TUPLE_LAYER_FAMILIES, build_family_model

    config = _config(**{"train.max_steps": 1, "train.per_device_train_batch_size": 4, "train.num_generations": 2,
                        "train.max_completion_length": 4})
    for family in FAMILIES + TUPLE_LAYER_FAMILIES:
        model = build_family_model(family, tmp_path / "models" / family)
        built = prepare_model.fn(ModelArgs(base_model=str(model)), tmp_path)
        done = _train(config, tmp_path, {**prompt_stages, "model": built})
        made = _metrics(done)
        assert made["method"] == "grpo" and made["optimizer_steps"] == 1, family
        assert (done / "adapter" / "adapter_model.safetensors").is_file(), family


def test_a_damaged_init_adapter_is_refused_before_grpo_training(prompt_stages: dict[str, str], tmp_path: Path
                                                                ) -> None:
    """GRPO starts from train.init_adapter through the same trainer builder as every method, so a damaged one is
    refused before the first step (checked on the first prompts, all their tokens scored)."""
    trained = _train(_config(**{"train.max_steps": 1, "lora.r": 4}), tmp_path, prompt_stages) / "adapter"
    start = damaged_copy(trained, tmp_path / "copied")
    with pytest.raises(UserError, match=rf"^train\.init_adapter='{start}' is damaged: on the first 4 training "
                                        r"examples the base model with it"):
        _train(_config(**{"train.max_steps": 2, "train.init_adapter": str(start)}), tmp_path, prompt_stages)
    assert len(list(tmp_path.glob("train_adapter/*/manifest.json"))) == 1  # the first training's only
