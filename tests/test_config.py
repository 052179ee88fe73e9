"""RunConfig validation, presets, the CLI's user-error messages, and the README's config reference."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from tasks.config import PRESETS_DIR, PROJECT_ROOT, RunConfig, load_config, reference_table


def test_defaults_validate_and_point_at_the_embedded_default() -> None:
    config = RunConfig()
    assert Path(config.data.source).is_file()
    assert (Path(config.model.base_model) / "config.json").is_file()
    assert config.train.max_steps == -1 and config.runs_dir == Path("runs")
    assert config.eval.max_samples is None and config.train.save_steps > 0


def test_overrides_parse_as_yaml_and_reach_the_right_section(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  learning_rate: 0.0005\nlora:\n  r: 4\n")
    config = load_config(path, ["train.max_steps=7", "lora.target_modules=[q_proj, v_proj]", "eval.max_samples=null"])
    assert (config.train.max_steps, config.train.learning_rate, config.lora.r) == (7, 5e-4, 4)
    assert config.lora.target_modules == ["q_proj", "v_proj"]


@pytest.mark.parametrize("preset", sorted(p.stem for p in PRESETS_DIR.glob("*.yaml")))
def test_presets_validate(preset: str) -> None:
    load_config(PRESETS_DIR / f"{preset}.yaml")


def test_reference_recipe_preset_matches_the_published_recipe() -> None:
    c = load_config(PRESETS_DIR / "reference-recipe.yaml")
    assert (c.model.base_model, c.data.source, c.data.split) == (
        "meta-llama/Llama-3.1-8B", "databricks/databricks-dolly-15k", "train[:1000]")
    assert (c.model.bnb_4bit_quant_type, c.model.bnb_4bit_use_double_quant, c.model.bnb_4bit_compute_dtype) == (
        "nf4", True, "bfloat16")
    assert (c.lora.r, c.lora.lora_alpha, c.lora.lora_dropout) == (16, 32, 0.05)
    assert c.lora.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj"]
    t = c.train
    assert (t.per_device_train_batch_size, t.gradient_accumulation_steps, t.learning_rate) == (1, 16, 2e-4)
    assert (t.optim, t.gradient_checkpointing, t.num_train_epochs, c.data.max_seq_length) == (
        "paged_adamw_8bit", True, 1, 512)
    assert not c.speed.packing  # a micro-batch of one example, as the recipe trains


def test_every_bad_field_is_reported_at_once() -> None:
    with pytest.raises(ValidationError) as err:
        load_config(None, ["train.max_steps=-5", "lora.r=0", "train.optim=sgd", "train.colour=red"])
    locations = {".".join(map(str, e["loc"])) for e in err.value.errors()}
    assert locations == {"train.max_steps", "lora.r", "train.optim", "train.colour"}


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deployments.cli", *args], cwd=PROJECT_ROOT, capture_output=True,
                          text=True, timeout=120)


def test_cli_config_errors_are_one_paragraph_with_exit_2() -> None:
    result = _cli("validate", "--set", "train.max_steps=abc", "--set", "lora.bias=some")
    assert result.returncode == 2
    assert "Invalid configuration, 2 problem(s):" in " ".join(result.stderr.split())
    assert "train.max_steps: Input should be a valid integer" in " ".join(result.stderr.split())
    assert "lora.bias: Input should be 'none', 'all' or 'lora_only'" in " ".join(result.stderr.split())
    assert "Traceback" not in result.stderr
    bad_set = _cli("validate", "--set", "train.max_steps")
    assert bad_set.returncode == 2 and "expected SECTION.FIELD=VALUE" in bad_set.stderr
    missing = _cli("validate", "--config", "/nonexistent/config.yaml")
    assert missing.returncode == 2 and "config file /nonexistent/config.yaml does not exist" in missing.stderr
    preset = _cli("validate", "--preset", "nope")
    assert preset.returncode == 2 and "no preset named 'nope'; presets: dpo-embedded, embedded-default" in preset.stderr


@pytest.mark.slow  # the CLI with a temporary server
def test_cli_missing_data_file_is_a_user_error_without_traceback(tmp_path: Path) -> None:
    result = _cli("run", "--set", f"runs_dir={tmp_path}", "--set", "data.source=/nonexistent/data.jsonl")
    assert result.returncode == 2, result.stderr
    message = " ".join(result.stderr.split())
    assert "error: data.source='/nonexistent/data.jsonl': no such file." in message
    assert message.count("/nonexistent/data.jsonl") == 1, result.stderr  # the last paragraph only, not the log too
    assert "Traceback" not in result.stderr and "Running hook" not in result.stderr
    assert not list(tmp_path.glob("*/*/manifest.json"))  # nothing marked complete


def test_validate_suggests_the_field_meant() -> None:
    result = _cli("validate", "--set", "lora.rank=4", "--set", "max_steps=3", "--set", "train.lr=0.1",
                  "--set", "lora.learning_rate=0.1", "--set", "train.colour=red")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    message = " ".join(result.stderr.split())
    for wrong, value, meant in (("lora.rank", "4", "lora.r"), ("max_steps", "3", "train.max_steps"),
                                ("train.lr", "0.1", "train.learning_rate"),
                                ("lora.learning_rate", "0.1", "train.learning_rate")):
        assert f"{wrong}: Extra inputs are not permitted (got {value}), did you mean {meant}?" in message, message
    assert "train.colour: Extra inputs are not permitted (got 'red');" in message  # nothing near: no guess


def test_presets_lists_each_preset_with_its_description() -> None:
    result = _cli("presets")
    assert result.returncode == 0, result.stderr
    lines = dict(line.split(maxsplit=1) for line in result.stdout.splitlines()[:-2])
    for path in sorted(PRESETS_DIR.glob("*.yaml")):
        first = path.read_text().splitlines()[0]
        assert first.startswith("# ") and len(first) <= 120, f"{path.name}: its first line is its description"
        assert lines[path.stem] == first[2:]
    assert "--preset NAME" in result.stdout


NIGHTLY = """\
# the nightly deployment's parameters (deployments/prefect.yaml), or a --config file
config:
  data:
    source: {shards}/          # a folder (or glob, or s3://bucket/prefix/) gaining a shard a night
    eval_source: {golden} # the held-out set every night is judged on; never trained on
"""


def test_a_deployments_parameters_are_a_config_file(tmp_path: Path) -> None:
    """A file with `config:` above the sections (a deployment's parameters, the README's nightly YAML) is read as
    the config it wraps; anything beside `config:` is refused with what to do."""
    import json

    import yaml

    nightly = tmp_path / "nightly.yaml"
    nightly.write_text(NIGHTLY.format(shards=tmp_path / "shards", golden=tmp_path / "golden.jsonl"))
    result = _cli("validate", "--config", str(nightly))
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)["data"]
    assert (data["source"], data["eval_source"]) == (f"{tmp_path / 'shards'}/", str(tmp_path / "golden.jsonl"))
    spec = yaml.safe_load((PROJECT_ROOT / "deployments" / "prefect.yaml").read_text())
    parameters = next(d["parameters"] for d in spec["deployments"] if d["name"] == "dpo-embedded")
    copied = tmp_path / "dpo.yaml"
    copied.write_text(yaml.safe_dump(parameters))  # as the deployment's parameters: {config: {...}}
    assert load_config(copied) == RunConfig.model_validate(parameters["config"])
    copied.write_text(yaml.safe_dump({**parameters, "grid": {"lora.r": [4, 8]}}))
    both = _cli("validate", "--config", str(copied))
    assert both.returncode == 2 and "Traceback" not in both.stderr
    assert "the file also has grid; put config fields under `config:`, and give a sweep's grid with --grid" in (
        " ".join(both.stderr.split()))


def test_config_reference_is_current() -> None:
    """docs/configuration.md holds `python -m tasks.config`'s table as it is now."""
    assert reference_table() in (PROJECT_ROOT / "docs" / "configuration.md").read_text()


def test_speed_fields_under_train_say_where_they_moved() -> None:
    with pytest.raises(ValueError, match=r"train.num_gpus -> speed.num_gpus, train.packing -> speed.packing"):
        load_config(None, ["train.packing=false", "train.num_gpus=1"])
