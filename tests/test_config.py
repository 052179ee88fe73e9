"""RunConfig validation, presets, the CLI's user-error messages, and the README's config reference."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
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


# ---- the run form (Prefect's UI renders RunConfig's JSON schema) ----------------------------------------------------

# the fields whose None means "chosen when the run starts": the form offers "auto" for them, and "auto" is None
AUTOMATIC = ["data.completion_only_loss", "train.bf16", "train.optim", "train.loss_type", "speed.offload_activations",
             "speed.offload_embeddings", "speed.use_liger_kernel", "speed.fused_lora"]


def _form_schema() -> dict:
    """The flow's parameter schema as the UI gets it (Prefect's server checks parameters against it, with an
    optional field's null allowed: prefect's validate(preprocess=True))."""
    from prefect.utilities.callables import parameter_schema

    from flows.qlora_pipeline import qlora_pipeline

    return parameter_schema(qlora_pipeline).model_dump_for_openapi()


def _properties(schema: dict) -> dict[str, dict]:
    sections = {name: prop["$ref"].rsplit("/", 1)[-1] for name, prop in
                schema["definitions"]["RunConfig"]["properties"].items() if "$ref" in prop}
    return {f"{section}.{field}": prop for section, model in sections.items()
            for field, prop in schema["definitions"][model]["properties"].items()}


@pytest.mark.parametrize("field", AUTOMATIC)
def test_automatic_fields_offer_auto_and_keep_none(field: str) -> None:
    """The form shows them as a dropdown with "auto" chosen (a switch submitted false, which is not None); "auto"
    from the form, the CLI or a YAML file is None in Python, so the stage keys are those of the default."""
    prop = _properties(_form_schema())[field]
    assert prop["enum"][0] == "auto" and prop["default"] == "auto" and prop.get("type") != "boolean", prop
    section, name = field.split(".")
    config = load_config(None, [f"{field}=auto"])
    assert getattr(getattr(config, section), name) is None
    assert config.model_dump() == RunConfig().model_dump()  # what the stage keys hash
    assert load_config(None, [f"{field}=null"]).model_dump(mode="json")[section][name] == "auto"


def test_every_field_starts_at_a_value_the_form_can_show() -> None:
    """No field renders as something that cannot express its default: no boolean without a default (a switch
    the UI submits as off), no None toggle, no union picker without readable branch titles; and the default
    dump of RunConfig (every field as the form starts) passes the server's check as it is."""
    from prefect.utilities.schema_tools.validation import validate

    schema = _form_schema()
    for field, prop in _properties(schema).items():
        assert not (prop.get("type") == "boolean" and "default" not in prop), field
        branches = prop.get("anyOf", [])  # an optional field's None is an empty input, left out of the parameters
        assert all(b.get("title") and b.get("type") != "null" for b in branches), (field, branches)
    assert not validate({"config": RunConfig().model_dump(mode="json")}, schema, raise_on_error=False)
    assert RunConfig.model_validate(RunConfig().model_dump(mode="json")) == RunConfig()


@pytest.mark.parametrize("overrides", [
    ["train.max_steps=0"], ["lora.r=0"], ["data.max_seq_length=0"], ["data.eval_fraction=1"], ["eval.max_samples=0"],
    ["train.per_device_train_batch_size=0"], ["export.name=../elsewhere"], ["lora.target_modules=[]"],
    ["export.gguf=[q8_0]"], ["track.register_model=true"], ["train.loss_type=sigmoid"],
    ["train.method=dpo", "train.loss_type=kto", "data.format=preference"],
    ["train.method=kto", "data.format=unpaired_preference", "train.per_device_train_batch_size=1"],
    ["train.method=dpo", "data.format=dolly"], ["speed.fsdp=true"], ["train.method=grpo"],
    ["train.method=grpo", "train.rewards=[format]", "data.format=dolly"],
    ["train.method=grpo", "train.rewards=[format]", "train.loss_type=sigmoid"],
    ["train.method=grpo", "train.rewards=[format]", "speed.num_gpus=2"],
    ["train.method=grpo", "train.rewards=[format]", "speed.num_nodes=2"], ["speed.num_nodes=2", "speed.num_gpus=auto"],
    ["speed.fsdp=true", "model.bnb_4bit_quant_storage=bfloat16", "model.bnb_4bit_compute_dtype=float16"],
    ["train.method=orpo", "train.loss_type=sigmoid"], ["train.method=orpo", "data.format=unpaired_preference"],
    ["train.method=orpo", "speed.fsdp=true"], ["train.method=sft", "data.format=preference"],
    ["train.method=reward_model", "export.merge=true", "export.gguf=[q8_0]"],
])
def test_the_form_refuses_what_the_config_refuses(overrides: list[str]) -> None:
    """Bounds and the rules between fields are in the schema, so Prefect's server (and the form, which shows its
    answer) refuses a run that RunConfig would refuse when it starts."""
    from prefect.utilities.schema_tools.validation import validate

    with pytest.raises(ValidationError):
        load_config(None, overrides)
    raw: dict = {}
    for item in overrides:
        dotted, _, value = item.partition("=")
        section, name = dotted.split(".")
        raw.setdefault(section, {})[name] = yaml.safe_load(value)
    assert validate({"config": raw}, _form_schema(), raise_on_error=False), raw


@pytest.mark.parametrize("overrides", [
    [], ["train.max_steps=3"], ["train.max_steps=-1"], ["export.gguf=[q8_0]", "export.merge=true"],
    ["track.register_model=true", "track.backend=mlflow"], ["train.method=dpo", "train.loss_type=ipo"],
    ["train.method=kto", "train.loss_type=apo_zero_unpaired", "train.per_device_train_batch_size=2"],
    ["train.method=grpo", "train.rewards=[format, numeric_match]", "train.loss_type=dr_grpo", "data.format=prompts"],
    ["speed.fsdp=true", "model.bnb_4bit_quant_storage=bfloat16"], ["speed.num_gpus=auto", "eval.dequantize=false"],
    ["speed.num_nodes=2", "speed.num_gpus=4", "speed.node_join_timeout_s=60"],
    ["lora.target_modules=[q_proj, v_proj]", "train.optim=adamw_torch", "train.bf16=false"],
    ["train.method=orpo", "train.beta=0.5", "data.format=preference"],
    ["train.method=reward_model", "export.merge=true"],
    ["train.method=grpo", "train.rewards=['registry:reward-model']", "data.format=prompts"],
])
def test_the_form_accepts_what_the_config_accepts(overrides: list[str]) -> None:
    """What the CLI sends for a valid config (a full dump, or only the fields set) passes the server's check."""
    from prefect.utilities.schema_tools.validation import validate

    config = load_config(None, overrides)
    for dump in (config.model_dump(mode="json"), config.model_dump(mode="json", exclude_unset=True)):
        assert not validate({"config": dump}, _form_schema(), raise_on_error=False), dump


# ---- the run form Prefect builds from RunConfig -------------------------------------------------------------------


def test_form_schema_has_no_const_and_no_null_toggle() -> None:
    from prefect.utilities.callables import parameter_schema
    from prefect.utilities.schema_tools.validation import validate

    from flows.qlora_pipeline import qlora_pipeline
    from tasks.config import RunConfig

    schema = parameter_schema(qlora_pipeline).model_dump_for_openapi()
    text = json.dumps(schema)
    assert '"const"' not in text and '{"type": "null"}' not in text
    lora = schema["definitions"]["LoraArgs"]["properties"]["target_modules"]
    branches = [{k: b[k] for k in ("enum", "type") if k in b} for b in lora["anyOf"]]  # titled for the form
    assert {"enum": ["all-linear"], "type": "string"} in branches
    assert schema["definitions"]["TrainArgs"]["properties"]["optim"]["type"] == "string"
    # a full config (its nulls included) still validates as Prefect's server validates deployment parameters
    full = load_config(None, ["train.optim=adamw_torch", "data.name=x"])
    for config in (RunConfig(), full):
        assert not validate({"config": config.model_dump(mode="json")}, schema, raise_on_error=False,
                            preprocess=True, ignore_required=True)
    assert validate({"config": {"train": {"optim": "sgd"}}}, schema, raise_on_error=False, preprocess=True,
                    ignore_required=True)


def test_run_form_has_titled_sections_readable_fields_and_visible_defaults() -> None:
    """The schema Prefect builds for the UI form (the same call `prefect deploy` makes)."""
    from prefect.utilities.callables import parameter_schema

    from flows.qlora_pipeline import qlora_pipeline

    schema = parameter_schema(qlora_pipeline).model_dump_for_openapi()
    defs = schema["definitions"]
    config = defs["RunConfig"]["properties"]
    assert {name: config[name]["title"] for name in ("lora", "speed")} == {"lora": "LoRA adapter",
                                                                          "speed": "Speed and memory (advanced)"}
    assert all(config[name].get("description") for name in config)  # every section says what it holds
    lora = defs["LoraArgs"]["properties"]
    assert lora["r"]["title"] == "LoRA rank (r)" and lora["target_modules"]["default"] == "all-linear"
    assert defs["EvalArgs"]["properties"]["lm_eval_tasks"]["default"] == []  # a default_factory, shown too
    assert defs["TrainArgs"]["properties"]["bf16"]["title"] == "bf16 mixed precision"
    assert defs["DataArgs"]["properties"]["source"]["default"] == "data/sample/instructions.jsonl"  # any checkout
    titles = [p["title"] for d in defs.values() for p in d.get("properties", {}).values()]
    assert not [t for t in titles if t in ("R", "Bf16", "Bnb 4Bit Quant Type")]


def test_a_method_with_a_registry_of_its_own_publishes_there_unless_named() -> None:
    assert load_config(None, ["train.method=reward_model"]).export.name == "reward-model"
    assert load_config(None, ["train.method=reward_model", "export.name=rm"]).export.name == "rm"
    assert load_config(None, ["train.method=orpo"]).export.name == "adapter"


# ---- the form's words for the rules between fields ------------------------------------------------------------------

# (config, field path, the sentence the form shows beside it): each rule's own words, as the CLI says them
BROKEN_RULES = [
    ({"train": {"method": "grpo", "rewards": ["format"]}, "speed": {"num_gpus": 2}}, ["speed", "num_gpus"],
     "train.method=grpo trains in one process here (several are not tried with its TRL trainer): set "
     "speed.num_gpus and speed.num_nodes to 1"),
    ({"speed": {"num_nodes": 2, "num_gpus": "auto"}}, ["speed", "num_gpus"],
     "speed.num_nodes above 1 trains on speed.num_gpus GPUs of each host, which must be a number"),
    ({"train": {"method": "dpo"}, "data": {"format": "dolly"}}, ["data", "format"],
     "train.method=dpo trains on preference data: set data.format to preference or auto"),
    ({"train": {"loss_type": "sigmoid"}}, ["train", "loss_type"],
     "train.loss_type does not go with train.method=sft: loss_type is for dpo, kto, grpo only: set it to auto"),
    ({"train": {"method": "kto", "per_device_train_batch_size": 1}, "data": {"format": "unpaired_preference"}},
     ["train", "per_device_train_batch_size"], "train.method=kto estimates its KL term from the other answers"),
    ({"train": {"method": "grpo"}, "data": {"format": "prompts"}}, ["train"],
     "train.method=grpo learns from rewards, but train.rewards is empty"),
    ({"export": {"gguf": ["q8_0"]}}, ["export"], "export.gguf needs the merged model: set export.merge=true"),
    ({"track": {"register_model": True}}, ["track"], "track.register_model registers the champion in MLflow"),
    ({"speed": {"fsdp": True}}, [], "speed.fsdp needs the 4-bit weights stored in the compute dtype"),
    ({"speed": {"fsdp": True}, "model": {"bnb_4bit_quant_storage": "bfloat16", "bnb_4bit_compute_dtype": "float16"}},
     ["model", "bnb_4bit_compute_dtype"], "with model.bnb_4bit_quant_storage=bfloat16, set "
     "model.bnb_4bit_compute_dtype to bfloat16 or auto"),
    ({"data": {"source": "http://bot:pw@127.0.0.1/d.jsonl"}}, ["data", "source"],
     "data.source must hold no credentials"),
]


def _beside(errors: dict, path: list[str]) -> list[str]:
    """The messages build_error_obj puts at `path` under config (what the form shows beside that field)."""
    level = next(e for e in errors["errors"] if isinstance(e, dict) and e.get("property") == "config")["errors"]
    for part in path:
        level = next(e for e in level if isinstance(e, dict) and e.get("property") == part)["errors"]
    return [m for m in level if isinstance(m, str)]


@pytest.mark.parametrize(("config", "path", "sentence"), BROKEN_RULES)
def test_the_form_says_each_broken_rule_in_the_clis_words(config: dict, path: list[str], sentence: str) -> None:
    """Prefect's server words a broken rule with jsonschema's message ("2 is not one of [1]"); the rules carry the
    CLI's sentence where that message quotes it, beside the field the rule is about."""
    from prefect.utilities.schema_tools.validation import build_error_obj, validate

    errors = build_error_obj(validate({"config": config}, _form_schema(), raise_on_error=False))
    shown = _beside(errors, path)
    assert any(sentence in message for message in shown), (errors, sentence)
    assert not any(" is not one of " in m or "is not of type" in m or "does not match" in m for m in shown), shown
    with pytest.raises(ValidationError) as refused:  # the CLI refuses the same config
        RunConfig.model_validate(config)
    assert refused.value.errors()


def test_the_flow_names_every_broken_rule_at_once() -> None:
    """With the form's check off ("Validate parameters" off), the flow refuses the config itself: every rule between
    sections that is broken is named, not the first alone."""
    from prefect.exceptions import ParameterTypeError

    from flows.qlora_pipeline import qlora_pipeline

    with pytest.raises(ParameterTypeError) as refused:
        qlora_pipeline.validate_parameters({"config": {"speed": {"fsdp": True, "num_nodes": 2, "num_gpus": "auto"},
                                                       "train": {"loss_type": "sigmoid"}}})
    said = str(refused.value)
    for sentence in ("train.loss_type=sigmoid does not go with train.method=sft",
                     "speed.num_nodes=2 trains on speed.num_gpus GPUs of each host",
                     "speed.fsdp needs the 4-bit weights stored in the compute dtype"):
        assert sentence in said, said


@pytest.mark.slow  # the session's Prefect server
def test_the_forms_check_on_the_server_says_every_rule_beside_its_field(prefect_env: Path) -> None:
    """What the form asks the server (POST /ui/schemas/validate, as the UI does on Submit) for a config that breaks
    three rules: each sentence beside its own field, all at once. With the deployment's schema enforced, creating the
    run is refused with a sentence too."""
    from prefect import get_client
    from prefect.utilities.callables import parameter_schema

    from flows.qlora_pipeline import qlora_pipeline

    config = {"train": {"method": "grpo", "rewards": ["format"]}, "speed": {"num_gpus": 2},
              "data": {"format": "dolly"}, "export": {"gguf": ["q8_0"]}}
    schema = parameter_schema(qlora_pipeline).model_dump_for_openapi()
    with get_client(sync_client=True) as client:
        errors = client.request("POST", "/ui/schemas/validate", json={"schema": schema,
                                                                      "values": {"config": config}}).json()
        assert not errors["valid"]
        assert any("trains in one process here" in m for m in _beside(errors, ["speed", "num_gpus"])), errors
        assert any("trains on prompts data: set data.format to prompts or auto" in m
                   for m in _beside(errors, ["data", "format"])), errors
        assert any("export.gguf needs the merged model" in m for m in _beside(errors, ["export"])), errors
        flow_id = client.create_flow_from_name("qlora-pipeline")
        deployment = client.create_deployment(flow_id, "rules-in-words", enforce_parameter_schema=True,
                                              parameter_openapi_schema=schema)
        with pytest.raises(Exception, match="409") as refused:
            client.create_flow_run_from_deployment(deployment, parameters={"config": config})
        assert "should not be valid under {'description': '" in str(refused.value), refused.value
