"""Training methods (tasks/methods.py): the table is the one place a method is declared, every row has its parts in
the stages, the keys of the methods that came before the table are those they were, and ORPO and reward modelling
(the two methods added as one row and one module per stage each) train, judge and resume like the others; a reward
model's registry version rewards GRPO."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path
from typing import Any

import pytest

from tasks import methods
from tasks.config import EMBEDDED_PREFERENCES, PROJECT_ROOT, DataArgs, ModelArgs, load_config
from tests.conftest import killed_at_a_checkpoint, run_flow, statuses

PRESETS = PROJECT_ROOT / "data" / "presets"


def test_every_row_has_its_train_unit_and_scorer_and_every_unit_its_row() -> None:
    from tasks.evaluate_adapter.scorers import SCORERS
    from tasks.train_adapter.methods import UNITS

    assert list(UNITS) == list(methods.NAMES)
    assert {m.score_with for m in methods.METHODS} <= set(SCORERS)
    assert {m.data_kind for m in methods.METHODS} <= set(methods.DATA_KINDS)
    for row in methods.METHODS:
        assert set(row.formats) <= set(methods.DATA_KINDS[row.data_kind]), row.name
        assert set(row.losses) <= set(methods.all_losses()) and set(row.requires) <= set(row.fields) | {
            "per_device_train_batch_size"}, row.name


# where a method may be spelled: its row, and the modules of the methods themselves (one per stage it changes)
METHOD_MODULES = ("tasks/methods.py", "tasks/train_adapter/methods/")


def test_method_names_are_spelled_only_in_the_table_and_the_method_modules() -> None:
    """No string in the code outside the table and the method modules names a method: nothing else asks which
    method ran (its rules, measure and metrics come from its row). Docstrings and comments may explain."""
    names = re.compile(r"\b(" + "|".join(methods.NAMES) + r")\b")
    found = []
    for path in sorted(PROJECT_ROOT.glob("*/**/*.py")):
        relative = str(path.relative_to(PROJECT_ROOT))
        if relative.split("/")[0] not in ("tasks", "flows", "deployments") or relative.startswith(METHOD_MODULES):
            continue
        tree = ast.parse(path.read_text())
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
                      and node.body and isinstance(node.body[0], ast.Expr)
                      and isinstance(node.body[0].value, ast.Constant)}
        found += [f"{relative}:{node.lineno}: {node.value[:60]!r}" for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
                  and names.search(node.value)]
    assert not found, "method names spelled outside tasks/methods.py and the method modules:\n" + "\n".join(found)


# each method's keys of prepare_data, prepare_model and train_adapter (the later stages' keys are built from these and
# their own unchanged sections) as the code before the method table computed them (commit b39048d), for the embedded
# presets without an init adapter (its bytes, trained on CPU threads, would vary from machine to machine)
KEYS_BEFORE_THE_TABLE = {
    "sft": ["66fc0df439625692", "329c1274cb4f8358", "12c6afd9ba4f8923"],
    "dpo": ["1e729090efe1467d", "329c1274cb4f8358", "431a5d8979d7382b"],
    "kto": ["1e729090efe1467d", "329c1274cb4f8358", "524dc105d678ff15"],
    "grpo": ["6dab74fc72ea188c", "329c1274cb4f8358", "4f1b1b335c587ba9"],
}


def _keys(runs: Path, preset: str | None, *overrides: str) -> list[str]:
    from tasks.prepare_data.stage import prepare_data
    from tasks.prepare_model.stage import prepare_model
    from tasks.train_adapter.stage import spec as train_spec

    config = load_config(PRESETS / f"{preset}.yaml" if preset else None,
                         [*overrides, f"runs_dir={runs}", "train.init_adapter=null"])
    data, model = prepare_data.fn(config.data, config.model, runs), prepare_model.fn(config.model, runs)
    train = train_spec(config.lora, config.train, config.speed, runs, data, model)
    return [Path(data).name, Path(model).name, train.key]


def test_stage_keys_of_the_methods_before_the_table_are_unchanged(tmp_path: Path) -> None:
    """A runs_dir written by the code before the method table is all Cached after it: every stage key of sft, dpo,
    kto and grpo is the one that code computed (kept above)."""
    got = {"sft": _keys(tmp_path, None), "dpo": _keys(tmp_path, "dpo-embedded"),
           "kto": _keys(tmp_path, "dpo-embedded", "train.method=kto"), "grpo": _keys(tmp_path, "grpo-embedded")}
    assert got == KEYS_BEFORE_THE_TABLE


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """prepare_data on the sample pairs and prepare_model (the tiny Llama), once for this module."""
    from tasks.prepare_data.stage import prepare_data
    from tasks.prepare_model.stage import prepare_model

    runs = tmp_path_factory.mktemp("method-runs")
    return {"runs": str(runs), "data": prepare_data.fn(DataArgs(source=str(EMBEDDED_PREFERENCES)), ModelArgs(), runs),
            "model": prepare_model.fn(ModelArgs(), runs)}


def _preset(name: str, runs: Path, *overrides: str) -> list[str]:
    """--set overrides that run preset `name` (its own fields, as `run --preset` takes them) into `runs`."""
    import yaml

    sections = yaml.safe_load((PRESETS / f"{name}.yaml").read_text())
    return [f"{s}.{k}={json.dumps(v)}" for s, fields in sections.items() for k, v in fields.items()] + [
        f"runs_dir={runs}", *overrides]


@pytest.mark.slow
def test_orpo_preset_raises_reward_accuracy_without_a_reference_model(prefect_env: Path, tmp_path: Path) -> None:
    """orpo-embedded from a fresh adapter: the held-out reward accuracy beats the base model's 0.5 by far, the gate
    promotes on it, the card says how ORPO is judged, and a re-run is all Cached."""
    overrides = _preset("orpo-embedded", tmp_path / "runs", "train.max_steps=30")
    summary = run_flow(overrides)
    m = summary["metrics"]
    assert summary["method"] == "orpo" and m["promotion"] == "promoted"
    assert m["base_reward_accuracy"] == 0.5 and m["tuned_reward_accuracy"] >= 0.65, m["tuned_reward_accuracy"]
    assert m["promotion_reason"].startswith("first version (no champion yet): tuned reward accuracy")
    card = (Path(summary["export_dir"]) / "README.md").read_text()
    assert "| reward accuracy (gated) |" in card and "Trained with ORPO" in card
    trained = json.loads((Path(summary["stages"]["train_adapter"]["dir"]) / "manifest.json").read_text())["metrics"]
    assert trained["method"] == "orpo" and trained["optimizer_steps"] == 30
    assert set(statuses(run_flow(overrides)).values()) == {"cached"}


@pytest.mark.slow
def test_a_reward_model_is_published_and_rewards_grpo(prefect_env: Path, tmp_path: Path) -> None:
    """reward-embedded publishes a reward model in its own registry (pairwise accuracy well above the base's tie);
    grpo-reward-embedded then learns from its champion's scores: the held-out mean reward (the reward model's score
    of greedy answers) rises, the training records the version it scored with, and a new reward model champion is
    a new training."""
    from tasks.registry import store

    runs = tmp_path / "runs"
    rm = run_flow(_preset("reward-embedded", runs))
    m = rm["metrics"]
    assert (m["export_name"], m["promotion"]) == ("reward-model", "promoted")
    assert m["base_pairwise_accuracy"] == 0.5 and m["tuned_pairwise_accuracy"] >= 0.8, m["tuned_pairwise_accuracy"]
    version = Path(m["export_path"])
    card = (version / "README.md").read_text()
    assert "AutoModelForSequenceClassification" in card and "A reward model" in card
    assert store.version_record(version.parent, version.name)["method"] == "reward_model"

    grpo = run_flow(_preset("grpo-reward-embedded", runs, "train.max_steps=30"))
    g = grpo["metrics"]
    assert g["promotion"] == "promoted" and g["tuned_mean_reward"] > g["base_mean_reward"] + 0.2, g
    trained = json.loads((Path(grpo["stages"]["train_adapter"]["dir"]) / "manifest.json").read_text())["metrics"]
    assert trained["rewards"] == [f"registry:reward-model/{version.name}"]

    again = run_flow(_preset("reward-embedded", runs, "train.seed=3", "train.max_steps=20"))
    assert again["metrics"]["export_version"] == "v0002"
    store.promote(version.parent, "v0002")  # whatever its verdict: a new reward model champion
    from tasks.train_adapter.stage import spec

    config = load_config(None, _preset("grpo-reward-embedded", runs, "train.max_steps=30"))
    key = spec(config.lora, config.train, config.speed, runs, grpo["stages"]["prepare_data"]["dir"],
               grpo["stages"]["prepare_model"]["dir"]).key
    assert key != grpo["stages"]["train_adapter"]["key"]  # the new champion's files are in the key


@pytest.mark.slow
@pytest.mark.kill
@pytest.mark.parametrize("method", ["orpo", "reward_model"])
def test_kill_9_mid_training_resumes_to_the_same_steps_and_adapter_bytes(pairs: dict[str, str], tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch,
                                                                         method: str) -> None:
    from tasks.train_adapter.stage import spec

    monkeypatch.setenv("QLORA_CPU_THREADS", "1")  # the killed, resumed and plain runs on the same threads
    steps, overrides = 12, [f"train.method={method}", "train.max_steps=12", "train.save_steps=4", "train.seed=7",
                            "train.logging_steps=1", "train.per_device_train_batch_size=4"]
    config = load_config(None, overrides)
    killed, plain = tmp_path / "killed", tmp_path / "plain"
    script = ("from pathlib import Path; from tests.test_methods import _train; "
              f"_train({overrides!r}, Path({str(killed)!r}), {pairs!r})")
    folder = spec(config.lora, config.train, config.speed, killed, pairs["data"], pairs["model"]).dir
    saved = killed_at_a_checkpoint(script, folder, tmp_path / "out")
    assert saved < steps
    resumed = _train(overrides, killed, pairs)
    manifest = json.loads((resumed / "manifest.json").read_text())
    assert manifest["resumed_from_step"] >= saved and manifest["metrics"]["optimizer_steps"] == steps
    done = _train(overrides, plain, pairs)
    weights = "adapter/adapter_model.safetensors"
    assert (resumed / weights).read_bytes() == (done / weights).read_bytes()
    assert (resumed / "loss.jsonl").read_text() == (done / "loss.jsonl").read_text()


def _train(overrides: list[str], runs: Path, stages: dict[str, Any]) -> Path:
    from tasks.train_adapter.stage import train_adapter

    config = load_config(None, overrides)
    return Path(train_adapter.fn(config.lora, config.train, config.speed, runs, stages["data"], stages["model"]))
