"""RunConfig: the flow's one parameter, one `*Args` section per stage.

Imports pydantic only (and tasks.credentials, which needs only `re`), so the Prefect UI form renders where torch
is not installed. Field names are the downstream library's own (peft's LoraConfig, transformers' TrainingArguments and
BitsAndBytesConfig), so a section hands over with `**args.model_dump()` and needs no renaming layer.
"""

from __future__ import annotations

import copy
import difflib
import re
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic.json_schema import SkipJsonSchema

from tasks import credentials, methods

PROJECT_ROOT = Path(__file__).resolve().parent.parent
EMBEDDED_DATA = PROJECT_ROOT / "data" / "sample" / "instructions.jsonl"
EMBEDDED_PREFERENCES = PROJECT_ROOT / "data" / "sample" / "preferences.jsonl"
EMBEDDED_MODEL = PROJECT_ROOT / "data" / "tiny-llama"
PRESETS_DIR = PROJECT_ROOT / "data" / "presets"


def _in_checkout(value: str) -> str:
    """A relative path that exists in this checkout but not in the working directory: this checkout's file.

    The defaults name the embedded model and data relative to the repository, so the UI form of a deployment
    shows the same defaults whichever path the repository was deployed from, and the worker resolves them in
    its own checkout.
    """
    path, ours = Path(value).expanduser(), PROJECT_ROOT / value
    if not path.is_absolute() and ours.exists() and (not path.exists() or path.resolve() == ours.resolve()):
        return str(ours)
    return value


def _as_in_checkout(value: str) -> str:
    """Written back relative when it is in this checkout's data/: the UI form's defaults (from a dump of the
    default config) and the cache keys then hold no path of the machine that made them."""
    path = Path(value)
    if path.is_absolute() and path.is_relative_to(PROJECT_ROOT / "data"):
        return str(path.relative_to(PROJECT_ROOT))
    return value


InCheckout = Annotated[str, AfterValidator(_in_checkout), PlainSerializer(_as_in_checkout, return_type=str)]


# Titles the UI form shows (pydantic would show "R", "Bf16", "Bnb 4Bit Quant Type"); other fields get their
# name in words. The YAML and --set names stay the field names.
_TITLES = {
    "runs_dir": "Runs folder", "source": "Data source", "max_seq_length": "Max tokens per example",
    "base_model": "Base model", "bnb_4bit_quant_type": "4-bit quantization type",
    "bnb_4bit_use_double_quant": "Double quantization", "bnb_4bit_compute_dtype": "Compute dtype",
    "bnb_4bit_quant_storage": "4-bit storage dtype", "attn_implementation": "Attention kernel",
    "r": "LoRA rank (r)", "lora_alpha": "LoRA alpha", "lora_dropout": "LoRA dropout", "bias": "Trained biases",
    "max_steps": "Max optimizer steps", "num_train_epochs": "Epochs", "per_device_train_batch_size": "Micro-batch size",
    "per_device_eval_batch_size": "Eval batch size", "optim": "Optimizer", "bf16": "bf16 mixed precision",
    "lr_scheduler_type": "Learning-rate schedule", "num_gpus": "GPUs", "fsdp": "FSDP sharding",
    "lm_eval_tasks": "lm-evaluation-harness tasks", "limit": "lm-evaluation-harness limit per task",
    "gpu_memory_budget_gb": "GPU memory budget (GiB)", "mlp_chunk_tokens": "MLP chunk (tokens)",
    "recompute_layers": "Recomputed layers", "recompute_mlp_layers": "MLP-recomputed layers",
    "completion_only_loss": "Loss on answers only", "use_liger_kernel": "Liger kernels",
    "dequantize": "Dequantized evaluation", "max_samples": "Max eval examples",
}
_WORDS = {"lora": "LoRA", "gpu": "GPU", "gpus": "GPUs", "fsdp": "FSDP", "mlp": "MLP", "lm": "LM", "rouge": "ROUGE",
          "fp32": "fp32", "bf16": "bf16"}


def _title(name: str, _info: object) -> str:
    words = [_WORDS.get(w, w) for w in name.split("_")]
    return _TITLES.get(name) or " ".join([words[0][:1].upper() + words[0][1:], *words[1:]])


def _show_factory_defaults(schema: dict[str, Any], model: type[BaseModel]) -> None:
    """Put list and dict defaults (default_factory) into the JSON schema, so the UI form shows them filled in
    (pydantic leaves them out: the form showed "No items in this list" for target_modules)."""
    for name, info in model.model_fields.items():
        if info.default_factory is not None and name in schema.get("properties", {}):
            value = info.get_default(call_default_factory=True)
            if isinstance(value, (list, dict)):
                schema["properties"][name]["default"] = value


def _auto_is_none(value: Any) -> Any:
    return None if isinstance(value, str) and value == "auto" else value


def _none_is_auto(value: Any) -> Any:
    return "auto" if value is None else value


def automatic(kind: Any, choices: tuple[Any, ...]) -> Any:
    """The type of a field that is `kind`, or None for "chosen when the run starts" (from the device, the data or
    a library's own default), which the UI form and the JSON/YAML dumps spell "auto".

    The value stays None in Python, so the stage cache keys (built from `model_dump()`) are those of a None
    field. The form shows one dropdown, "auto" preselected: a plain `bool` schema became a switch that the UI
    submitted as false (off), which is not what None means. "auto" is accepted everywhere a value is (--set,
    YAML, the form), and a JSON dump writes None as "auto" so that what the CLI sends to Prefect's server
    (which checks parameters against this schema) is one of the form's choices.
    """
    words = {"type": "string"} if all(isinstance(c, str) for c in choices) else {}  # a dropdown of words
    return Annotated[kind | None, BeforeValidator(_auto_is_none), PlainSerializer(_none_is_auto, when_used="json"),
                     WithJsonSchema({**words, "enum": ["auto", *choices]})]


AutoBool = automatic(bool, (True, False))


def _tree(fields: dict[str, dict[str, Any]], required: bool) -> dict[str, Any]:
    """A JSON schema under which each dotted field ("train.method") matches its own schema; with `required`, the
    field (and its section) must also be present."""
    tree: dict[str, Any] = {}
    for dotted, leaf in fields.items():
        node = tree
        for part in dotted.split("."):
            if required and part not in node.setdefault("required", []):
                node["required"].append(part)
            node = node.setdefault("properties", {}).setdefault(part, {})
        node.update(leaf)
    return tree


def _rule(when: dict[str, dict[str, Any]], then: dict[str, dict[str, Any]], when_absent: bool = False,
          then_required: bool = False, says: str = "") -> dict[str, Any]:
    """A rule between fields, as the UI form and Prefect's server check it: when every field in `when` matches its
    schema, every field in `then` must match its own. A field left out of the parameters has its default:
    `when_absent` when that default meets the condition, `then_required` when it breaks the requirement. `says`: the
    sentence the form shows when a then_required rule is broken (a field's own schema says it with _says)."""
    then_schema = _tree(then, required=then_required)
    return {"if": _tree(when, required=not when_absent), "then": _says(then_schema, says) if says else then_schema}


def _says(schema: dict[str, Any], sentence: str) -> dict[str, Any]:
    """`schema` as the form checks it, with the CLI's sentence for when it is broken. Prefect's server words a broken
    rule with jsonschema's own message ("2 is not one of [1]", "'auto' is not of type 'integer'"), except for `not`,
    whose message quotes the schema it holds: a description there (first, as the server sorts the keys) is what the
    form's user reads ("2 should not be valid under {'description': 'train.method=grpo trains in one process here:
    ...', ...}"). The same check: not not."""
    return {"not": {"description": sentence, "not": schema}}


def _form_friendly(schema: dict[str, Any], model: type[BaseModel]) -> None:
    """Shape the JSON schema for the Prefect UI form, whatever the fields' types are.

    `X | None` becomes plain X: the form showed a type toggle whose None side reads 'Property is type "None"'.
    An empty input is left out of the parameters, so the field's default (None) applies; the null default is
    dropped from the schema too, so Prefect's parameter validation still accepts an explicit null (it allows
    null for an optional property without a default). A field of `automatic` type gets "auto" as its default.
    A union whose branches carry their own defaults loses the field's: the V2 form starts a branch picked in its
    tab at that branch's default, and the V1 form lays the field's default over every branch. A `const` (a
    one-value Literal such as 'all-linear') becomes a one-value enum: the form showed "is a const and cannot be
    changed" until the type was switched. The model's FORM_RULES (rules between fields) go to `allOf`.
    """
    _show_factory_defaults(schema, model)
    if getattr(model, "FORM_RULES", None):
        schema["allOf"] = copy.deepcopy(model.FORM_RULES)
    for prop in schema.get("properties", {}).values():
        branches = prop.get("anyOf", [])
        kept = [b for b in branches if b.get("type") != "null"]
        if branches and len(kept) == 1 and len(kept) < len(branches):
            del prop["anyOf"]
            prop.update({k: v for k, v in kept[0].items() if k not in prop})
            if prop.get("default", 0) is None:
                del prop["default"]
        if all("default" in b for b in prop.get("anyOf", [{}])):  # each branch starts at its own (num_gpus)
            prop.pop("default", None)
        if "auto" in prop.get("enum", ()) and prop.get("default", 0) is None:
            prop["default"] = "auto"
        for part in [prop, *prop.get("anyOf", [])]:
            if "const" in part:
                part["enum"] = [part.pop("const")]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, field_title_generator=_title,
                              json_schema_extra=_form_friendly)
    # the model validators' rules between fields, for the form (_form_friendly); a test keeps the two in step
    FORM_RULES: ClassVar[list[dict[str, Any]]] = []


class DataArgs(_Section):
    """The dataset: where it is, its format, how it is cut and split (stage prepare_data)."""

    source: InCheckout = Field(
        str(EMBEDDED_DATA.relative_to(PROJECT_ROOT)), validate_default=True,
        description="The training data: a local .jsonl, .json, .csv, .parquet or .txt file, a folder or glob of "
        "such files, an fsspec URL (s3://bucket/data/*.jsonl), or a Hugging Face hub dataset id. No credentials in "
        "a URL: the worker's environment holds them (docs/data.md).",
        # Prefect's server checks a deployment run's parameters against this before it stores them
        json_schema_extra=credentials.form_rule("data.source", credentials.FORM_DATA),
    )
    eval_source: InCheckout | None = Field(
        None, description="A fixed evaluation set, in any form data.source takes. When set, all of data.source is "
        "trained on and all of this set is evaluated; a new evaluation set re-evaluates without retraining. "
        "Empty: a share of data.source (eval_fraction) is held out for evaluation.",
        json_schema_extra=credentials.form_rule("data.eval_source", credentials.FORM_DATA),
    )
    name: str | None = Field(None, description="Hub dataset configuration name (e.g. wikitext-2-raw-v1). Empty: the "
                             "dataset's default configuration.")
    split: str = Field("train", description="Hub split to read; slices work too: train, train[:1000].")
    revision: str | None = Field(None, description="Hub dataset revision: a branch, tag or commit. Empty: the "
                                 "default branch.")
    format: Literal["auto", "preference", "unpaired_preference", "dolly", "alpaca", "prompt_completion", "chat",
                    "text", "prompts"] = Field(
        "auto", description="How the records are laid out. auto: detected from the column names. preference: "
        "prompt, chosen and rejected; unpaired_preference: prompt, completion and label; prompts: a prompt column, "
        "its other columns handed to the reward functions. The formats each train.method takes: "
        + "; ".join(f"{m.name}: {', '.join(m.formats)}" for m in methods.METHODS) + ".",
    )
    column_mapping: dict[str, str] = Field(
        default_factory=dict,
        description="Rename columns before the format is detected, {column in the data: column the format "
        "expects}, e.g. {question: instruction, answer: response}.",
    )
    chat_template: Literal["tokenizer", "chatml", "llama3"] = Field(
        "tokenizer", description="How chat records (a list of messages) become text: with the tokenizer's own chat "
        "template, or with a named one for tokenizers that have none.",
    )
    completion_only_loss: AutoBool = Field(
        None, description="Learn from the answers only, not from the prompts. auto: yes for instruction and chat "
        "data, no for plain text.",
    )
    max_seq_length: int = Field(
        256, gt=0, le=1 << 20, description="Most tokens per example; longer examples are cut. At most the length "
        "the base model supports.",
    )
    eval_fraction: float = Field(
        0.1, gt=0.0, lt=1.0, description="Share of the examples held out for evaluation. Which ones is decided by "
        "their content, so the same examples stay held out from run to run.",
    )
    max_empty_fraction: float = Field(
        0.1, ge=0.0, le=1.0, description="Records with an empty answer are dropped; the run stops if more than this "
        "share of them is empty, which usually means a wrong column. Blank lines of plain text are dropped without "
        "limit.",
    )
    max_eval_overlap: float = Field(
        0.1, ge=0.0, le=1.0, description="With eval_source: the share of its examples that may also be training "
        "examples of data.source (identical after formatting) before the run fails; any overlap is a warning with the "
        "count and a few examples, and prepare_data's metrics hold the count (eval_overlap). 1 only warns.",
    )
    max_record_bytes: int = Field(
        8 << 20, gt=0, le=1 << 30, description="Most bytes one record (a line of a .jsonl or .txt file, a row) may "
        "hold; a longer one fails the run before it is tokenized, with its line number. Tokenizing a record takes "
        "about a hundred times its size in memory. Changes no cache key.",
    )
    # not in the form: what a worker may read is its operator's (QLORA_DATA_ROOTS, tasks/allowed.py), which a run
    # form could otherwise widen; configs that still carry it are read, and it can only narrow (sources.py). Left out
    # of dumps, so parameters sent to Prefect's server (which refuses a field the form lacks) never hold it.
    allowed_roots: SkipJsonSchema[list[str] | None] = Field(
        None, exclude=True, description="Not in the run form, and it can only narrow: the folders (or URL prefixes) "
        "a worker may read are its operator's, set in the environment variable QLORA_DATA_ROOTS of the worker "
        "(docs/data.md). A config that still names folders here reads from those only, and a run that names a place "
        "outside QLORA_DATA_ROOTS is refused before any stage. Empty: QLORA_DATA_ROOTS alone.",
    )
    pack_examples: bool = Field(
        False, description="Pack whole examples into rows of up to max_seq_length tokens when the data is prepared. "
        "Off: speed.packing packs each micro-batch during training instead.",
    )

    @field_validator("source", "eval_source")
    @classmethod
    def _no_credentials(cls, value: str | None, info: Any) -> str | None:
        # refused, not masked: a secret kept in the config reaches Prefect's database, run.json, the manifests and
        # the model card
        if value is not None and (why := credentials.refusal(f"data.{info.field_name}", value,
                                                              credentials.DATA_INSTEAD)):
            raise ValueError(why)
        return value


class ModelArgs(_Section):
    """The base model and its 4-bit quantization (stage prepare_model)."""

    base_model: InCheckout = Field(str(EMBEDDED_MODEL.relative_to(PROJECT_ROOT)), validate_default=True,
                                   description="The model to adapt: a local model folder or a Hugging Face hub "
                                   "model id.")
    revision: str | None = Field(None, description="Hub model revision: a branch, tag or commit. Empty: the default "
                                 "branch.")
    bnb_4bit_quant_type: Literal["nf4", "fp4"] = Field(
        "nf4", description="4-bit data type of the base model's weights: nf4 (the QLoRA paper's) or fp4.")
    bnb_4bit_use_double_quant: bool = Field(True, description="Also quantize the quantization constants: a little "
                                            "less memory, the same results.")
    bnb_4bit_compute_dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="Precision of the matrix multiplications. auto: bfloat16 on GPUs that support it, else "
        "float32."
    )
    attn_implementation: Literal["auto", "sdpa", "eager"] = Field(
        "auto", description="Attention kernel. auto: the one transformers picks for the model. A kernel the model "
        "does not support falls back to auto with a warning. Packed training on a GPU uses flash attention for "
        "variable-length sequences whatever this says.",
    )
    bnb_4bit_quant_storage: Literal["uint8", "bfloat16", "float16", "float32"] = Field(
        "uint8", description="Element type that holds the packed 4-bit weights (the weights are the same either "
        "way). speed.fsdp needs it equal to the compute dtype (bfloat16 on recent GPUs).",
    )


class LoraArgs(_Section):
    """The LoRA adapters: peft's LoraConfig fields."""

    r: int = Field(16, gt=0, description="LoRA rank: the adapters' size. Higher can learn more and costs more "
                   "memory.")
    lora_alpha: int = Field(32, gt=0, description="LoRA scaling: the adapters' output is multiplied by "
                            "lora_alpha / r.")
    lora_dropout: float = Field(
        0.0, ge=0.0, lt=1.0, description="Dropout on the adapters' input during training (the QLoRA paper uses "
        "0.05). 0: no dropout, which trains faster and with less memory.",
    )
    target_modules: Annotated[list[str], Field(title="Named modules", json_schema_extra={"minItems": 1})] | Annotated[
        Literal["all-linear"], Field(title="Every linear layer")] = Field(
        "all-linear", description="Layers that get adapters: every linear layer except the output layer "
        "(all-linear), or a list of module names such as q_proj and v_proj. Names the model does not have stop "
        "the run before training starts.",
    )
    bias: Literal["none", "all", "lora_only"] = Field("none", description="Which biases are trained along with the "
                                                      "adapters.")


OPTIMIZERS = ("paged_adamw_8bit", "adamw_8bit", "paged_adamw_32bit", "adamw_torch", "adamw_torch_fused")
# TrainArgs fields that are the pipeline's, not TrainingArguments' or a TRL config's keywords
PIPELINE_TRAIN_FIELDS = ("method", "init_adapter", "rewards", "reward_pattern", "reward_timeout_s")


def _users(name: str) -> str:
    """The methods that read train field `name` (tasks/methods.py), as its help text names them."""
    return "/".join(m.name for m in methods.METHODS if name in m.fields)


def _losses_help() -> str:
    offered = [m for m in methods.METHODS if m.losses]
    return (f"{_users('loss_type')}: the loss TRL optimizes. auto: "
            + ", ".join(f"{m.default_loss} for {m.name}" for m in offered) + ". "
            + "; ".join(f"{m.name} takes {', '.join(m.losses)}" for m in offered) + ".")


def _method_rules() -> list[dict[str, Any]]:
    """TrainArgs' form rules of each method (RunConfig._check_rules' within this section): its losses and the
    rules it sets on train fields."""
    rules = []
    for row in methods.METHODS:
        when = {"method": {"enum": [row.name]}}
        losses = (f"use one of {', '.join(row.losses)}, or auto for TRL's default" if row.losses else
                  f"loss_type is for {_users('loss_type').replace('/', ', ')} only: set it to auto")
        rules.append(_rule(when, {"loss_type": _says({"enum": ["auto", *row.losses]},
                                                     f"train.loss_type does not go with train.method={row.name}: "
                                                     f"{losses}")}, when_absent=row.name == DEFAULT_METHOD))
        rules += [_rule(when, {name: schema}, then_required=True, says=message) if schema.get("minItems") else
                  _rule(when, {name: _says(schema, message)}) for name, (schema, message) in row.requires.items()]
    return rules


DEFAULT_METHOD = methods.METHODS[0].name  # train.method's default: the table's first row


class TrainArgs(_Section):
    """Training: the transformers Trainer's own TrainingArguments fields (stage train_adapter), and for the methods
    built on TRL (tasks/methods.py) their TRL config's fields of the same names.

    Why flat and not a section per method: TRL's configs subclass TrainingArguments, so for any method this whole
    section (less the pipeline's own fields and the fields of other methods) still hands over as one
    `**model_dump()`. One section also keeps the UI form and the train_adapter cache key as they were, and
    `train.method: NAME` reads as users write it. A tab per method in the run form (the section as a union of
    per-method branches, each with only its own fields) was tried in real Chromium: Prefect's V2 form switched tabs
    as chosen, but the V1 form (the one Prefect's own links open) picks a branch by the shape of the fields (KTO's
    tab showed DPO, ORPO's showed DPO, the reward model's SFT), and the server's message for a wrong value of any
    train field became "is not valid under any of the given schemas" (the form lost "0 trains nothing"). So the
    form shows every field, each naming the methods that read it, and the rules between fields refuse the rest.
    TRL 1.16 has no max_prompt_length (only max_length, truncating prompt + completion from the end):
    data.max_seq_length plays that part at prepare_data time, where prompt-filling pairs are dropped and counted.
    """

    FORM_RULES: ClassVar[list[dict[str, Any]]] = []  # the methods' (_method_rules), set below the class

    method: Literal[methods.NAMES] = Field(  # type: ignore[valid-type]
        DEFAULT_METHOD, description=" ".join(f"{m.name}: {m.summary}" for m in methods.METHODS)
        + " " + ", ".join(m.name for m in methods.METHODS if m.reference_model) + " compare the tuned model with "
        "the base model (or with init_adapter) while training.",
    )
    init_adapter: str | None = Field(
        None, description="Start from an exported adapter instead of a new one: a folder with adapter_config.json "
        "(e.g. runs/exports/adapter/v0003), champion (the champion of export.name's registry) or champion:NAME (of "
        "registry NAME). Its own LoRA settings replace the lora section. Empty: a new adapter.",
    )
    beta: float = Field(
        0.1, gt=0, description=f"{_users('beta')}: how strongly the preference term pulls; for the methods that "
        "compare with a reference model, how far the tuned model may move away from it (higher stays closer); "
        "for methods without one, the weight of the preference term beside the loss on the chosen answers.",
    )
    loss_type: automatic(Literal[methods.all_losses()], methods.all_losses()) = Field(  # type: ignore[valid-type]
        None, description=_losses_help(),
    )
    rewards: list[str] = Field(
        default_factory=list, description=f"{_users('rewards')}: the reward functions, summed. Built in: "
        "answer_match (the answer equals the data's answer column), numeric_match (its last number equals the "
        "answer's), format (the answer matches reward_pattern), length_penalty (minus the share of "
        "max_completion_length used). A reward model of the exports registry: registry:NAME (its champion) or "
        "registry:NAME/vNNNN. Your own: module:function, from a module the deployment allows (environment variable "
        "QLORA_REWARD_MODULES).",
    )
    reward_pattern: str = Field(
        r"\d", description=f"{_users('reward_pattern')}: the regular expression the format reward looks for in an "
        "answer (Python re.search).",
    )
    reward_timeout_s: float = Field(
        60.0, gt=0, description=f"{_users('reward_timeout_s')}: seconds one call of a reward function may take (one "
        "call scores a micro-batch's answers); a function that takes longer fails the run with its name, and "
        "training resumes from its latest checkpoint once it is fixed. Changes no cache key.",
    )
    num_generations: int = Field(
        4, ge=2, description=f"{_users('num_generations')}: answers sampled per prompt; per_device_train_batch_size "
        "x gradient_accumulation_steps (answers) must be a multiple of it.",
    )
    max_completion_length: int = Field(32, gt=0, description=f"{_users('max_completion_length')}: most tokens per "
                                       "sampled answer.")
    temperature: float = Field(1.0, gt=0, description=f"{_users('temperature')}: sampling temperature of the "
                               "answers.")

    max_steps: int = Field(
        # the form shows the server's message, which quotes this schema: its title says what to do
        -1, ge=-1, json_schema_extra={"not": {"enum": [0], "title": "0 trains nothing: 1 or more, or -1"}},
        description="Optimizer steps to train: 1 or more, or -1 to train for num_train_epochs instead.",
    )
    num_train_epochs: float = Field(1.0, gt=0, description="Passes over the training data, when max_steps is -1.")
    per_device_train_batch_size: int = Field(8, gt=0, description="Examples per micro-batch on each device.")
    gradient_accumulation_steps: int = Field(1, gt=0, description="Micro-batches per optimizer step: each step "
                                             "learns from this many micro-batches (on each GPU).")
    learning_rate: float = Field(1e-3, gt=0, description="Peak learning rate.")
    lr_scheduler_type: Literal["linear", "cosine", "constant", "constant_with_warmup"] = Field(
        "cosine", description="How the learning rate changes after warmup."
    )
    warmup_steps: float = Field(
        0.03, ge=0, description="Warmup: a number of steps, or a fraction of all steps when below 1."
    )
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay on the adapter weights.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradients are clipped to this norm.")
    optim: automatic(Literal[OPTIMIZERS], OPTIMIZERS) = Field(  # type: ignore[valid-type]
        None, description="Optimizer. auto: torch's fused AdamW (adamw_torch_fused) on a GPU, where it is the "
        "fastest; adamw_torch with speed.fsdp; bitsandbytes' 8-bit AdamW (adamw_8bit) on a CPU, where the paged "
        "variants fall back to it.",
    )
    gradient_checkpointing: bool = Field(True, description="Recompute activations in the backward pass instead of "
                                         "keeping them: less memory for some more compute.")
    bf16: AutoBool = Field(None, description="Train in bf16 mixed precision. auto: where the device supports it.")
    save_steps: int = Field(50, gt=0, description="Optimizer steps between checkpoints; a run that stops resumes "
                            "from the latest one.")
    logging_steps: int = Field(10, gt=0, description="Optimizer steps between points of the loss log and curve.")
    seed: int = Field(42, description="Seed for the adapters' initial values, the data order and dropout.")

    @field_validator("reward_pattern")
    @classmethod
    def _a_pattern(cls, value: str) -> str:
        try:
            re.compile(value)
        except re.error as exc:
            raise ValueError(f"{value!r} is not a regular expression ({exc}); give one Python's re reads, e.g. "
                             r"\d or ^Answer:") from None
        return value

    @field_validator("max_steps")
    @classmethod
    def _some_steps(cls, value: int) -> int:
        if value == 0:
            raise ValueError("0 steps would train nothing: give 1 or more, or -1 to train for num_train_epochs")
        return value


TrainArgs.FORM_RULES = _method_rules()


class SpeedArgs(_Section):
    """How train_adapter runs, not what it computes: speed and memory levers, data parallelism (README: Performance).

    TrainArgs holds the transformers Trainer's own fields only; these are the pipeline's.
    """

    num_gpus: Annotated[int, Field(ge=1, title="A number of GPUs", json_schema_extra={"default": 1})] | Annotated[
        Literal["auto"], Field(title="Every visible GPU", json_schema_extra={"default": "auto"})] = Field(
        1, description="Training processes, one per GPU, each with a copy of the adapter (data parallel): a number, "
        "or every visible GPU (auto). Without GPUs, a number above 1 runs that many CPU processes.",
    )
    num_nodes: int = Field(
        1, ge=1, description="GPU hosts to train this one adapter across, speed.num_gpus processes on each (DDP, or "
        "FSDP with fsdp): hosts of one Prefect server with a shared runs_dir, whose workers start one node of the "
        "training each (docs/multi-gpu.md, \"Several hosts\"). 1: the host that runs the flow.",
    )
    node_join_timeout_s: int = Field(
        600, ge=10, description="With num_nodes above 1: how long the training waits for every host's node to start "
        "and join before it fails, naming the hosts that did not, and frees every GPU it took.",
    )
    fsdp: bool = Field(
        False, description="With several GPUs: split the 4-bit base model, the adapters and their optimizer state "
        "across the GPUs (FSDP) instead of a full copy on each, for models whose training does not fit one GPU. "
        "GPUs only; needs model.bnb_4bit_quant_storage equal to the compute dtype, and trains with optim "
        "adamw_torch.",
    )
    packing: bool = Field(
        True, description="Pack whole examples into each micro-batch instead of padding them to the same length; "
        "each example still attends only to itself. Methods that train on pairs or rated answers keep each pair or "
        "answer whole; " + ", ".join(m.name for m in methods.METHODS if not m.packing) + " train on padded "
        "micro-batches whatever this says.",
    )
    max_tokens_per_batch: int | None = Field(
        None, gt=0, description="Tokens per packed micro-batch. Empty: on a GPU, the largest that the memory plan "
        "finds fastest within gpu_memory_budget_gb; on a CPU, per_device_train_batch_size examples.",
    )
    gpu_memory_budget_gb: float | None = Field(
        None, gt=0, description="GPU memory (GiB) training may use, model included. On a GPU with packing, the "
        "memory plan picks the micro-batch size, the layers to recompute and what to keep in CPU memory so that "
        "training is fastest within it, and logs what it chose. Empty: the GPU's memory less 1 GiB for other "
        "processes.",
    )
    recompute_layers: int | None = Field(
        None, ge=0, description="How many decoder layers (the first ones) recompute all their activations in the "
        "backward pass instead of keeping them. Empty: on a GPU with packing, as few as the memory budget allows; "
        "elsewhere every layer while train.gradient_checkpointing is on.",
    )
    recompute_mlp_layers: int | None = Field(
        None, ge=0, description="How many decoder layers, after the recompute_layers ones, recompute only their MLP's "
        "activations, which are most of a layer's. Models whose layers have no MLP block skip it, with a log line. "
        "Empty: on a GPU with packing, the memory plan chooses; elsewhere none.",
    )
    offload_activations: AutoBool = Field(
        None, description="Keep the inputs of the recomputed layers in CPU memory instead of GPU memory, copied "
        "while the GPU computes. Single-process runs only. auto: the memory plan decides on a GPU with packing; "
        "otherwise on with gradient checkpointing on a GPU.",
    )
    offload_embeddings: AutoBool = Field(
        None, description="Keep the frozen input embedding table, and with fused_cross_entropy the output layer "
        "too, in CPU memory: less GPU memory for models with a large vocabulary. Models with separate input and "
        "output tables, single-process runs only. auto: the memory plan decides on a GPU with packing; otherwise on "
        "when the activations are offloaded.",
    )
    upcast_frozen_to_fp32: bool = Field(
        False, description="Cast the frozen embeddings, norms and output layer to float32 (peft's "
        "prepare_model_for_kbit_training). Off keeps them in the compute dtype: less memory, the same loss.",
    )
    fused_cross_entropy: bool = Field(
        True, description="Compute the loss a chunk of tokens at a time, never holding the logits of all tokens "
        "at once: much less memory for models with a large vocabulary.",
    )
    use_liger_kernel: AutoBool = Field(
        None, description="Use Liger's fused GPU kernels for RMSNorm, SwiGLU and RoPE. auto: where liger-kernel is "
        "installed (the gpu extra) and a GPU is present.",
    )
    mlp_chunk_tokens: int = Field(
        16384, ge=0, description="Run each MLP over at most this many tokens at a time, so that long sequences fit "
        "in less memory for one more MLP pass; 0 = never. Where the memory plan chooses, only the layers that "
        "recompute run in chunks.",
    )
    fused_lora: AutoBool = Field(
        None, description="Run each adapted layer, its 4-bit matrix multiplication included, as one operation: the "
        "same maths with less overhead per step, which matters most for small micro-batches on a GPU. Layers with "
        "lora_dropout above 0 keep peft's own path while training. auto: on, except with fsdp.",
    )
    recompute_skip: bool = Field(
        True, description="With fused_lora: a recomputed layer skips the adapters whose output the backward pass "
        "never reads (in Llama-style layers, the MLP's down projection). The same gradients, bit for bit.",
    )


class SuiteArgs(_Section):
    """One regression suite of the promotion gate: an lm-evaluation-harness task the challenger must not score worse
    on than the champion (or, for a first version, the base model) by more than its tolerance."""

    task: str = Field(
        ..., min_length=1, description="An lm-evaluation-harness task: a built-in one by name (arc_easy; its dataset "
        "must be reachable or in the Hugging Face cache) or a local task file (a path ending in .yaml) whose "
        "data files (JSONL, Parquet), named relative to it, lie on this machine. Its content is part of the "
        "evaluation's cache key.",
    )
    metric: str | None = Field(None, description="The task's metric the gate compares (acc, acc_norm, "
                               "exact_match, ...). Empty: the task's first.")
    tolerance: float = Field(
        0.0, ge=0.0, description="How much worse than the champion's (or the base model's) score the challenger may "
        "score, in the metric's own units (0.02: two points of an accuracy); 0: no worse at all.",
    )
    limit: int | None = Field(None, gt=0, description="At most this many of the task's examples. Empty: all.")


JUDGE_LABELS = ("A", "B", "tie")  # the verdicts a judge may give: answer A, answer B, or neither


class JudgeArgs(_Section):
    """A pairwise judge of the promotion gate: an LLM behind an OpenAI-compatible endpoint compares the challenger's
    and the champion's (or, for a first version, the base model's) answers to the same held-out prompts."""

    url: str | None = Field(
        None, description="The judge's OpenAI-compatible API (http://host:8000/v1 for a vLLM server; "
        "https://api.openai.com/v1), without credentials. Empty: no judge.",
        json_schema_extra=credentials.form_rule("eval.judge.url", "in the environment variable eval.judge.api_key_env "
                                               "names"),
    )
    model: str = Field("", max_length=200, description="The judge model's name, as the endpoint serves it.")
    api_key_env: str | None = Field(
        None, max_length=100, description="The NAME of the environment variable that holds the endpoint's API key "
        "(e.g. OPENAI_API_KEY), read by the process that runs the flow; never the key itself. Empty: no key.",
    )
    prompts: int = Field(16, gt=0, description="Held-out prompts judged: the first of the eval.generation_samples "
                         "prompts answered greedily (so at most that many).")
    rubric: str | None = Field(
        None, description="A template file for the judge's prompt, with {prompt}, {answer_a} and {answer_b} in it; "
        "its content is part of the cache key. Empty: the built-in rubric (docs/registry.md).",
    )
    api: Literal["chat", "completions"] = Field(
        "chat", description="chat: /chat/completions (an instruction-tuned judge); completions: /completions, the "
        "rubric as a plain prompt (a base model, or a server without a chat template).",
    )
    constrain: Literal["json_schema", "choice", "none"] = Field(
        "json_schema", description="How the verdict is held to A, B or tie: json_schema (OpenAI's response_format, "
        "which vLLM, OpenAI and llama.cpp's server take), choice (vLLM's structured_outputs), none (free text, read "
        "by a strict parser; anything else counts as unparseable, never as a win).",
    )
    max_tokens: int = Field(32, gt=0, description="Most tokens of one verdict.")
    min_win_rate: float = Field(
        0.5, ge=0.0, le=1.0, description="The gate promotes only when the lower confidence bound of the challenger's "
        "win rate (ties count half) is at least this.",
    )
    confidence: float = Field(0.95, gt=0.5, lt=1.0, description="Confidence of that lower bound (Wilson score "
                              "interval, one-sided).")
    timeout_s: float = Field(60.0, gt=0, description="Seconds to wait for one verdict.")
    retries: int = Field(2, ge=0, le=10, description="Retries of a verdict the judge did not give (down, timed out, "
                         "an error or an unreadable answer), with a pause that doubles; then the run keeps the "
                         "champion.")

    @field_validator("url")
    @classmethod
    def _api_root(cls, value: str | None) -> str | None:
        return None if value is None else judge_root(value)

    @field_validator("api_key_env")
    @classmethod
    def _a_name(cls, value: str | None) -> str | None:
        # a name, not a secret: keys have dashes, dots or more than a name's length; a name is letters, digits, _
        if value is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,63}", value):
            raise ValueError("must be the NAME of an environment variable (letters, digits and _, e.g. "
                             "OPENAI_API_KEY), not the key itself: put the key in that variable")
        return value


def judge_root(url: str) -> str:
    """eval.judge.url as scheme://host[:port]/path (a trailing / dropped; /v1 when no path is given); ValueError with
    the fix for one with credentials or that is not an API root."""
    from urllib.parse import urlsplit

    # refused, not masked: a secret kept in the config reaches Prefect's database, run.json and the manifests
    if kinds := credentials.found(url):
        raise ValueError(f"eval.judge.url={credentials.mask(url)} holds credentials ({' and '.join(kinds)}), which "
                         "would be written into the run's records and Prefect's flow-run parameters. Give the URL "
                         "without them, put the key in an environment variable of the process that runs the flow "
                         "and name that variable in eval.judge.api_key_env")
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        raise ValueError(f"eval.judge.url={url!r} is not the root of an OpenAI-compatible API: give "
                         "http(s)://host:port/v1, e.g. http://127.0.0.1:8000/v1, without a query")
    path = parts.path.rstrip("/") or "/v1"
    return f"{parts.scheme}://{parts.netloc}{path}"


class EvalArgs(_Section):
    """Evaluation of base and base + adapter on the held-out split (stage evaluate_adapter)."""

    max_samples: int | None = Field(
        None, gt=0, description="Evaluate on at most this many held-out examples. Empty: all of them."
    )
    per_device_eval_batch_size: int = Field(
        8, gt=0, description="Evaluation batch size, counted in examples of the longest length: examples are sorted "
        "by length, so that short ones share a batch while the peak memory stays that of this many of the longest.",
    )
    dequantize: Annotated[Literal["auto"] | bool, WithJsonSchema({"enum": ["auto", True, False]})] = Field(
        "auto", description="Evaluate on a copy of the base model converted once from 4 bits to the compute "
        "dtype: faster, and the same numbers within rounding. auto: when the copy fits in the free memory with a "
        "margin; false: always the 4-bit model (least memory).",
    )
    generation_samples: int = Field(
        32, ge=0, description="Answer this many held-out prompts by greedy generation, with the base model and with "
        "the adapter, and score the answers (exact match, ROUGE-L); 0 = no generation.",
    )
    max_new_tokens: int = Field(32, gt=0, description="Most tokens generated per answer (fewer where the model ends "
                                "its answer).")
    lm_eval_tasks: list[str] = Field(
        default_factory=list, description="lm-evaluation-harness tasks (e.g. hellaswag, arc_easy) run on the base "
        "and the tuned model, reported beside the metrics (eval.suites gates on them). Needs the eval extra (lm-eval) "
        "and the tasks' datasets: a run without them stops before any stage.",
    )
    limit: int | None = Field(
        None, gt=0, description="lm-evaluation-harness: at most this many examples per task. Empty: all.",
    )
    suites: list[SuiteArgs] = Field(
        default_factory=list, description="Regression suites of the promotion gate: lm-evaluation-harness tasks "
        "(built-in, or local task files) scored on base, tuned and the champion; a version is promoted only when it "
        "scores no lower than the champion (for a first version, the base model) by more than each suite's "
        "tolerance. Needs the eval extra (lm-eval). Empty: none.",
    )
    judge: JudgeArgs = Field(
        default_factory=JudgeArgs, description="A pairwise judge of the promotion gate (an LLM behind an "
        "OpenAI-compatible endpoint): it compares the challenger's and the champion's answers to held-out prompts in "
        "both orders; a version is promoted only when the lower bound of its win rate is at least min_win_rate. "
        "Off while url is empty.",
    )

    @field_validator("suites")
    @classmethod
    def _distinct_tasks(cls, value: list[SuiteArgs]) -> list[SuiteArgs]:
        twice = sorted({s.task for s in value if [t.task for t in value].count(s.task) > 1})
        if twice:
            raise ValueError(f"names the task {', '.join(twice)} more than once: one suite per task")
        return value

    @model_validator(mode="after")
    def _judge_reads_the_answers(self) -> EvalArgs:
        judge = self.judge
        if judge.url is not None and not judge.model:
            raise ValueError("eval.judge.url is set but eval.judge.model is empty: name the judge model as the "
                             "endpoint serves it")
        if judge.url is not None and judge.prompts > self.generation_samples:
            raise ValueError(f"eval.judge.prompts={judge.prompts} is more than eval.generation_samples="
                             f"{self.generation_samples}: the judge reads the greedy answers evaluation gives; raise "
                             "eval.generation_samples or lower eval.judge.prompts")
        return self


_MEASURES = tuple(dict.fromkeys(m.measure for m in methods.METHODS))
_GGUF_NEEDS_MERGE = "export.gguf needs the merged model: set export.merge=true as well (or export.gguf=[])"
_REGISTER_NEEDS_MLFLOW = ("track.register_model registers the champion in MLflow: add mlflow to track.backend, or set "
                          "track.register_model=false")


class ExportArgs(_Section):
    """Export and the registry: versions, the promotion gate, the merged model (stage export_adapter)."""

    FORM_RULES: ClassVar[list[dict[str, Any]]] = [
        _rule({"gguf": {"minItems": 1}}, {"merge": {"enum": [True]}}, then_required=True, says=_GGUF_NEEDS_MERGE),
    ]

    name: str = Field(
        "adapter", max_length=100, json_schema_extra={"pattern": "^[A-Za-z0-9_-][A-Za-z0-9._-]*$"},
        description="Registry name: versions are published to runs_dir/exports/<name>/vNNNN/, where the champion "
        "is recorded too. One folder name: letters, digits, '.', '_' and '-'.",
    )
    promotion_margin: float = Field(
        0.01, ge=0.0, lt=1.0, description="A new version becomes champion only if its measure (train.method's) beats "
        "the champion's (for a first version, the base model's) by more than this; otherwise it is kept as "
        "rejected. " + "; ".join(f"{', '.join(m.name for m in methods.METHODS if m.measure == measure)}: "
                                 f"{measure.describe_margin()}" for measure in _MEASURES)
        + " (0.01: 1% of a loss, one point of an accuracy, 0.01 reward).",
    )
    merge: bool = Field(
        False, description="Also write merged/: the base model with the adapter merged in, saved with the "
        "tokenizer, which loads without peft.",
    )
    merged_dtype: Literal["bfloat16", "float16", "float32"] = Field(
        "bfloat16", description="Data type of the merged model's weights.",
    )
    # 2GB, not transformers' 5GB: the manifest hashes one file per thread, so the largest shard bounds the hashing
    # (docs/performance.md, "The whole job")
    max_shard_size: str = Field("2GB", description="Largest weights file of the merged model (smaller files are "
                                "checked in parallel).")
    accept_new_measure: bool = Field(
        False, description="Compare with the champion even when this run's evaluation measures something else than "
        "the champion's did (another data format, loss mask or chat template): the champion is scored the new way on "
        "this run's eval data and the better one wins. Off: such a version is not promoted, and its verdict says why.",
    )
    gguf: list[Literal["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1"]] = Field(
        default_factory=list, description="Also write the merged model as GGUF files for llama.cpp and Ollama, one "
        "per type (e.g. [q8_0] or [f16, q4_0]), with an Ollama Modelfile and the adapter as a GGUF LoRA, in gguf/. "
        "Needs merge. For k-quants (q4_k_m), run llama.cpp's llama-quantize on the f16 file.",
    )

    @field_validator("name")
    @classmethod
    def _one_folder_name(cls, value: str) -> str:
        # the name is a folder under runs_dir/exports/: '.', '..' or a '/' would publish elsewhere
        if not re.fullmatch(r"[A-Za-z0-9_-][A-Za-z0-9._-]*", value):
            raise ValueError("must be one folder name: letters, digits, '.', '_' and '-', not starting with '.' "
                             "(e.g. support-bot)")
        return value

    @model_validator(mode="after")
    def _gguf_needs_merge(self) -> ExportArgs:
        # the GGUF files are written from merged/: without it there is nothing to convert
        if self.gguf and not self.merge:
            raise ValueError(_GGUF_NEEDS_MERGE)
        return self


TRACKING_BACKENDS = ("mlflow", "tensorboard")  # one module each in tasks/reporting/tracking/


class TrackArgs(_Section):
    """Experiment tracking (README: Experiment tracking). Part of no stage's cache key: tracking changes no output."""

    FORM_RULES: ClassVar[list[dict[str, Any]]] = [
        _rule({"register_model": {"enum": [True]}}, {"backend": {"contains": {"enum": ["mlflow"]}}},
              then_required=True, says=_REGISTER_NEEDS_MLFLOW),
    ]

    backend: list[Literal[TRACKING_BACKENDS]] = Field(  # type: ignore[valid-type]
        default_factory=list, description="Where runs are logged: mlflow, tensorboard, or both. Empty: no "
        "tracking. Both need the tracking extra.",
    )
    mlflow_tracking_uri: str | None = Field(
        None, description="MLflow tracking server or store (http://host:5000, sqlite:///mlflow.db). Empty: MLflow's "
        "own default (the MLFLOW_TRACKING_URI environment variable, else a local store).",
        # Prefect's server checks a deployment run's parameters against this before it stores them
        json_schema_extra=credentials.form_rule("track.mlflow_tracking_uri", credentials.FORM_MLFLOW),
    )
    experiment_name: str = Field("qlora-pipeline", description="MLflow experiment the runs are logged to (created "
                                 "if missing).")
    tensorboard_dir: str | None = Field(
        None, description="TensorBoard log folder, one subfolder per trained adapter. Empty: runs_dir/tensorboard.",
    )
    parent_run_id: str | None = Field(
        None, description="MLflow run to file this run under, as a child run (a sweep sets it to its own run). "
        "Empty: a run of its own.",
    )
    register_model: bool = Field(
        False, description="mlflow: also register the champion as a version of an MLflow registered model, with "
        "the alias champion (the exports registry stays the source of truth).",
    )
    registered_model_name: str | None = Field(None, description="Name of the MLflow registered model. Empty: "
                                              "export.name.")

    @field_validator("backend", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        if isinstance(value, str):  # --set track.backend=mlflow, or "mlflow,tensorboard"
            return [] if value.strip() in ("", "none") else [v.strip() for v in value.split(",")]
        return value

    @field_validator("mlflow_tracking_uri")
    @classmethod
    def _no_credentials(cls, value: str | None) -> str | None:
        # refused, not masked: a secret kept in the config reaches Prefect's database, run.json and MLflow's params
        if value is not None and (why := credentials.refusal("track.mlflow_tracking_uri", value)):
            raise ValueError(why)
        return value

    @model_validator(mode="after")
    def _register_needs_mlflow(self) -> TrackArgs:
        if self.register_model and "mlflow" not in self.backend:
            raise ValueError(_REGISTER_NEEDS_MLFLOW)
        return self


_FSDP = {"speed.fsdp": {"enum": [True]}}
_STORAGE_DTYPES = ("bfloat16", "float16", "float32")


SERVE_API_KEY_ENV = "VLLM_API_KEY"  # the variable vLLM's own server reads its --api-key from


class ServeArgs(_Section):
    """The running vLLM server the champion is loaded into (docs/serving.md). Part of no stage's cache key."""

    url: str | None = Field(
        None, description="Root URL of a running vLLM server (http://host:8000) started as docs/serving.md says "
        "(--enable-lora, VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, the model_aliases middleware); after each run its "
        "adapter_name serves the registry's champion, "
        f"checked against the champion's own evaluation first. None: no server is updated. Its API key comes from "
        f"the {SERVE_API_KEY_ENV} environment variable, never from the config.",
        json_schema_extra=credentials.form_rule("serve.url", f"in {SERVE_API_KEY_ENV} of the worker"),
    )
    adapter_name: str | None = Field(
        None, max_length=100, description="The model name clients ask the server for; None = export.name. Each "
        "version is loaded as <adapter_name>-vNNNN, and adapter_name is switched to the champion's with no failed "
        "request.",
    )
    timeout_s: float = Field(120.0, gt=0, description="Seconds to wait for one answer of the server (a load, a "
                             "greedy answer), and at most for the requests still answered by the previous champion "
                             "before it is unloaded.")
    tolerance: float = Field(
        0.5, ge=0, description="Where the served answer parts from the evaluated one, the server's two most likely "
        "tokens must be within this many nats (log-probability), a choice that the base's precision can flip: the "
        "server applies the adapter to the full-precision base, evaluate_adapter to the 4-bit one it was trained "
        "against. 0: the answers must be equal.",
    )

    @field_validator("url")
    @classmethod
    def _server_root(cls, value: str | None) -> str | None:
        return None if value is None else server_root(value)

    @field_validator("adapter_name")
    @classmethod
    def _one_name(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"[A-Za-z0-9_-][A-Za-z0-9._-]*", value):
            raise ValueError("must be a model name of letters, digits, '.', '_' and '-' (e.g. support-bot)")
        return value


def server_root(url: str) -> str:
    """serve.url as scheme://host[:port], a trailing / or /v1 dropped; ValueError with the fix otherwise."""
    from urllib.parse import urlsplit

    # refused, not masked: a secret kept in the config reaches Prefect's database and run.json
    if kinds := credentials.found(url):
        raise ValueError(f"serve.url={credentials.mask(url)} holds credentials ({' and '.join(kinds)}), which would "
                         "be written into the run's records and Prefect's flow-run parameters. Give the URL without "
                         f"them and put the server's API key in the {SERVE_API_KEY_ENV} environment variable of the "
                         "process that runs the flow")
    parts = urlsplit(url.strip())
    path = parts.path.rstrip("/").removesuffix("/v1")
    if parts.scheme not in ("http", "https") or not parts.hostname or path or parts.query or parts.fragment:
        raise ValueError(f"serve.url={url!r} is not the root URL of a vLLM server: give http(s)://host:port, "
                         "e.g. http://127.0.0.1:8000, without a path or query")
    return f"{parts.scheme}://{parts.netloc}"


def _loss_problem(row: methods.Method, loss: str | None) -> str:
    if loss is None or loss in row.losses:
        return ""
    fix = (f"use one of {', '.join(row.losses)}, or auto for TRL's default" if row.losses
           else f"loss_type is for {_users('loss_type').replace('/', ', ')} only; set it to auto")
    return f"train.loss_type={loss} does not go with train.method={row.name}: {fix}"


def _format_problem(row: methods.Method, fmt: str) -> str:
    if fmt == "auto" or fmt in row.formats:
        return ""
    return (f"train.method={row.name} trains on {row.data_kind} data ({', '.join(row.formats)}), but data.format is "
            f"{fmt}; set data.format to {', '.join(row.formats)} or auto")


def _field_problems(row: methods.Method, train: TrainArgs) -> list[str]:
    """The row's rules on train fields, its own check, and list fields of other methods that are set."""
    problems = [message for name, (schema, message) in row.requires.items()
                if not _meets(getattr(train, name), schema)]
    problems.append(row.check(train) if row.check else "")
    for name in methods.method_fields():
        if name not in row.fields and isinstance(getattr(train, name), list) and getattr(train, name):
            users = _users(name)
            problems.append(f"train.{name} is for train.method={users}, but train.method is {row.name}; leave "
                            f"train.{name} empty or set train.method={users}")
    return problems


def _meets(value: Any, schema: dict[str, Any]) -> bool:
    """Whether `value` meets a requirement's JSON schema (the keywords the method table uses)."""
    return value >= schema.get("minimum", value) and len(value if isinstance(value, list) else []) >= schema.get(
        "minItems", 0)


def _parallel_problem(row: methods.Method, speed: SpeedArgs) -> str:
    if not row.several_gpus and (speed.num_gpus != 1 or speed.num_nodes != 1):
        return (f"train.method={row.name} trains in one process here (several are not tried with its TRL trainer), "
                f"but speed.num_gpus is {speed.num_gpus} and speed.num_nodes {speed.num_nodes}; set both to 1")
    if not row.across_hosts and speed.num_nodes != 1:
        return f"train.method={row.name} trains on one host here; set speed.num_nodes to 1"
    if not row.fsdp and speed.fsdp:
        fsdp = ", ".join(m.name for m in methods.METHODS if m.fsdp)
        return (f"train.method={row.name} does not run with speed.fsdp (only {fsdp} is tried with FSDP here); set "
                "speed.fsdp=false (DDP with speed.num_gpus works)")
    return ""


def _export_problem(row: methods.Method, export: ExportArgs) -> str:
    if row.head != "causal_lm" and export.gguf:  # llama.cpp's GGUF holds language models, not a score head
        return (f"train.method={row.name} trains a {row.head} head, which GGUF files (llama.cpp, Ollama) cannot "
                "hold; set export.gguf=[] (export.merge still writes the merged model)")
    return ""


def _method_run_rules() -> list[dict[str, Any]]:
    """RunConfig's form rules of each method (_check_rules' across sections): its data formats, and FSDP, GPUs
    and hosts where it does not allow them."""
    rules = []
    for row in methods.METHODS:
        method = f"train.method={row.name}"
        then = {"data.format": _says({"enum": ["auto", *row.formats]}, f"{method} trains on {row.data_kind} data: set "
                                     f"data.format to {', '.join(row.formats)} or auto")}
        fsdp = ", ".join(m.name for m in methods.METHODS if m.fsdp)
        then.update({} if row.fsdp else {"speed.fsdp": _says({"enum": [False]}, (
            f"{method} does not run with speed.fsdp (only {fsdp} is tried with FSDP here): set speed.fsdp=false (DDP "
            "with speed.num_gpus works)"))})
        one_process = (f"{method} trains in one process here (several are not tried with its TRL trainer): set "
                       "speed.num_gpus and speed.num_nodes to 1")
        then.update({} if row.several_gpus else {"speed.num_gpus": _says({"enum": [1]}, one_process),
                                                 "speed.num_nodes": _says({"enum": [1]}, one_process)})
        then.update({} if row.across_hosts or not row.several_gpus else {"speed.num_nodes": _says(
            {"enum": [1]}, f"{method} trains on one host here: set speed.num_nodes to 1")})
        then.update({} if row.head == "causal_lm" else {"export.gguf": _says({"maxItems": 0}, (
            f"{method} trains a {row.head} head, which GGUF files (llama.cpp, Ollama) cannot hold: set "
            "export.gguf=[]"))})
        rules.append(_rule({"train.method": {"enum": [row.name]}}, then, when_absent=row.name == DEFAULT_METHOD))
    return rules


class RunConfig(_Section):
    """Everything one pipeline run needs; the Prefect UI renders it as the run form."""

    FORM_RULES: ClassVar[list[dict[str, Any]]] = [  # _check_rules' (the methods', nodes', FSDP's)
        *_method_run_rules(),
        _rule({"speed.num_nodes": {"minimum": 2}}, {"speed.num_gpus": _says(  # _nodes_problem
            {"type": "integer"}, "speed.num_nodes above 1 trains on speed.num_gpus GPUs of each host, which must be a "
            "number: the hosts other than this one are not asked how many they have. Set speed.num_gpus to 1 or "
            "more")}),
        _rule(_FSDP, {"model.bnb_4bit_quant_storage": {"enum": list(_STORAGE_DTYPES)}}, then_required=True,
              says="speed.fsdp needs the 4-bit weights stored in the compute dtype, so FSDP can shard them with the "
              "rest of each layer: set model.bnb_4bit_quant_storage to bfloat16, float16 or float32"),
        *[_rule({**_FSDP, "model.bnb_4bit_quant_storage": {"enum": [dtype]}},
                {"model.bnb_4bit_compute_dtype": _says({"enum": ["auto", dtype]}, (
                    f"speed.fsdp needs the 4-bit weights stored in the compute dtype: with "
                    f"model.bnb_4bit_quant_storage={dtype}, set model.bnb_4bit_compute_dtype to {dtype} or auto"))})
          for dtype in _STORAGE_DTYPES],
    ]

    runs_dir: Path = Field(Path("runs"), description="Folder that every stage writes its output to; runs that share "
                           "it reuse each other's finished stages.")
    data: DataArgs = Field(default_factory=DataArgs, title="Data", description="What to train on: the source, its "
                           "format and how examples are cut; source is the field most runs change.")
    model: ModelArgs = Field(default_factory=ModelArgs, title="Base model", description="The model to adapt and how "
                             "it is quantized to 4 bits; the quantization fields rarely need changing.")
    lora: LoraArgs = Field(default_factory=LoraArgs, title="LoRA adapter", description="Which layers get adapters "
                           "and their size (peft's LoraConfig).")
    train: TrainArgs = Field(default_factory=TrainArgs, title="Training", description="Steps, batch size, learning "
                             "rate, checkpoints (the transformers Trainer's own fields).")
    speed: SpeedArgs = Field(default_factory=SpeedArgs, title="Speed and memory (advanced)", description="How "
                             "training runs, not what it learns: GPUs, packing, memory, fused kernels. The defaults "
                             "pick what the hardware supports; change them only to tune speed or memory "
                             "(docs/performance.md).")
    eval: EvalArgs = Field(default_factory=EvalArgs, title="Evaluation", description="Held-out loss, greedy answers "
                           "scored against references, optional lm-evaluation-harness tasks, and what the gate judges "
                           "besides: regression suites and a pairwise judge.")
    export: ExportArgs = Field(default_factory=ExportArgs, title="Export and promotion", description="The registry "
                               "name the adapter is published under and the gate that makes it champion.")
    track: TrackArgs = Field(default_factory=TrackArgs, title="Experiment tracking", description="MLflow and "
                             "TensorBoard logging of each run; off by default, and part of no cache key.")
    serve: ServeArgs = Field(default_factory=ServeArgs, title="Serving", description="A running vLLM server that "
                             "serves the champion: loaded, checked and switched to after each run; off by default.")

    @model_validator(mode="before")
    @classmethod
    def _speed_fields_moved(cls, data: Any) -> Any:
        """Configs written before the speed section named its fields under train: say where they went."""
        train = data.get("train") if isinstance(data, dict) else None
        moved = sorted(k for k in train if k in SpeedArgs.model_fields) if isinstance(train, dict) else []
        if moved:
            raise ValueError("these fields moved from train to the speed section: " + ", ".join(
                f"train.{k} -> speed.{k}" for k in moved))
        return data

    @model_validator(mode="after")
    def _check_rules(self) -> RunConfig:
        """The rules between fields of several sections, every broken one in one message (the run form's allOf says
        each beside its field): target modules, train.method's row in tasks/methods.py, nodes, FSDP."""
        row = methods.method(self.train.method)
        if row.registry and "name" not in self.export.model_fields_set:  # a registry of its own kind by default
            self.export.name = row.registry
        problems = [p for p in (self._target_modules_problem(), _loss_problem(row, self.train.loss_type),
                                _format_problem(row, self.data.format), *_field_problems(row, self.train),
                                _parallel_problem(row, self.speed), self._nodes_problem(), self._fsdp_problem(),
                                _export_problem(row, self.export)) if p]
        if problems:
            raise ValueError("; ".join(problems))
        if self.train.init_adapter == "champion":  # the champion of this run's own registry
            self.train.init_adapter = f"champion:{self.export.name}"
        return self

    def _target_modules_problem(self) -> str:
        return "" if self.lora.target_modules else "lora.target_modules is empty: name at least one module, e.g. q_proj"

    def _nodes_problem(self) -> str:
        if self.speed.num_nodes > 1 and self.speed.num_gpus == "auto":
            return (f"speed.num_nodes={self.speed.num_nodes} trains on speed.num_gpus GPUs of each host, which must be "
                    "a number: the hosts other than this one are not asked how many they have. Set speed.num_gpus to "
                    "1 or more.")
        return ""

    def _fsdp_problem(self) -> str:
        storage, compute = self.model.bnb_4bit_quant_storage, self.model.bnb_4bit_compute_dtype
        if self.speed.fsdp and (storage == "uint8" or compute not in ("auto", storage)):
            return (f"speed.fsdp needs the 4-bit weights stored in the compute dtype, so FSDP can shard them with the "
                    f"rest of each layer; model.bnb_4bit_quant_storage is {storage} and model.bnb_4bit_compute_dtype "
                    f"{compute}. Set model.bnb_4bit_quant_storage={compute if compute != 'auto' else 'bfloat16'}.")
        return ""


# A config is a few KiB; Prefect stores it as the flow run's parameters, which its server caps at 524,288 bytes
# (server.api.max_parameter_size), so a larger file or --set value cannot run anyway: refuse it before parsing
# (a 50 MB value took minutes to be refused, a 1.1 M-entry column_mapping hours of the server's time).
MAX_CONFIG_BYTES = 524_288


def _check_size(path: Path | None, overrides: list[str]) -> None:
    sizes = ([(str(path), Path(path).stat().st_size)] if path is not None else []) + [
        (f"--set {item[:40]!r}{'...' if len(item) > 40 else ''}", len(item.encode())) for item in overrides]
    total = sum(size for _, size in sizes)
    if total > MAX_CONFIG_BYTES:
        largest = ", ".join(f"{name}: {size:,} bytes" for name, size in sorted(sizes, key=lambda s: -s[1])[:3])
        raise ValueError(f"the config is {total:,} bytes ({largest}), more than the limit of {MAX_CONFIG_BYTES:,} "
                         "bytes (what Prefect stores as a flow run's parameters); a config names its data and "
                         "model, it does not hold them: put large values (a long column_mapping, a list of files) "
                         "in the data itself or a glob")


def _parse_yaml(text: str, where: str) -> Any:
    try:
        return yaml.safe_load(text)
    except RecursionError:
        raise ValueError(f"{where} is nested too deeply to read (a config is a mapping of sections of fields, a "
                         "few levels deep); look for runaway brackets or indentation") from None


def load_config(path: Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """RunConfig from an optional YAML file plus `section.field=value` overrides (values parsed as YAML)."""
    raw: dict[str, Any] = {}
    _check_size(path, overrides or [])
    if path is not None:
        loaded = _parse_yaml(Path(path).read_text(), str(path))
        if not isinstance(loaded, dict):
            raise ValueError(f"{path}: expected a mapping of config sections, got {type(loaded).__name__}")
        raw = _unwrapped(loaded, path)
    for item in overrides or []:
        dotted, sep, value = item.partition("=")
        if not sep or not dotted:
            raise ValueError(f"--set {item!r}: expected SECTION.FIELD=VALUE, e.g. train.max_steps=20")
        node = raw
        *parents, leaf = dotted.strip().split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"--set {item!r}: {part} is not a config section")
        node[leaf] = _parse_yaml(value, f"--set {dotted.strip()}")
    try:
        return RunConfig.model_validate(raw)
    except RecursionError:
        raise ValueError(f"{path or 'the --set values'}: a value is nested too deeply to check; a config field "
                         "holds a string, a number, or a short list or mapping of them") from None


def _unwrapped(loaded: dict[str, Any], path: Path) -> dict[str, Any]:
    """The config of a file that holds a deployment's parameters (`config:` above the sections, as
    deployments/prefect.yaml writes them), or the file's mapping as it is."""
    if "config" not in loaded:
        return loaded
    others = sorted(map(str, set(loaded) - {"config"}))
    if others:
        raise ValueError(f"{path}: `config:` holds the whole config (a deployment's parameters), so nothing else "
                         f"belongs beside it, but the file also has {', '.join(others)}; put config fields under "
                         "`config:`" + (", and give a sweep's grid with --grid" if "grid" in others else ""))
    inner = loaded["config"]
    if inner is not None and not isinstance(inner, dict):
        raise ValueError(f"{path}: `config:` should hold a mapping of config sections, got {type(inner).__name__}")
    return inner or {}


# names other tools give these fields, which no spelling distance finds
_OTHER_NAMES = {"rank": "r", "alpha": "lora_alpha", "dropout": "lora_dropout", "lr": "learning_rate",
                "epochs": "num_train_epochs", "batch_size": "per_device_train_batch_size", "steps": "max_steps"}


def closest_field(dotted: str) -> str | None:
    """The RunConfig field nearest in name to `dotted` (SECTION.FIELD, or a top-level field or section), or None:
    in the section it names first, then in any section (lora.learning_rate: train.learning_rate; max_steps:
    train.max_steps)."""
    sections = {name: info.annotation for name, info in RunConfig.model_fields.items()
                if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel)}
    section, _, name = dotted.rpartition(".")
    name = _OTHER_NAMES.get(name, name)
    if section in sections and (near := difflib.get_close_matches(name, sections[section].model_fields, n=1)):
        return f"{section}.{near[0]}"
    by_name: dict[str, str] = {} if section else {n: n for n in RunConfig.model_fields}
    for other, model in sections.items():
        for field in model.model_fields:
            by_name.setdefault(field, f"{other}.{field}")
    near = difflib.get_close_matches(name, by_name, n=1)
    return by_name[near[0]] if near else None


def reference_table() -> str:
    """The config reference as a Markdown table (docs/configuration.md holds it; a test keeps the two equal)."""
    lines = ["| field | default | description |", "|---|---|---|"]
    sections = {"": RunConfig, **{name: f.annotation for name, f in RunConfig.model_fields.items()
                                  if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel)}}
    for prefix, model in sections.items():
        lines += _reference_rows(prefix, model, skip=set(sections) if prefix == "" else set())
    return "\n".join(lines)


def _reference_rows(prefix: str, model: type[BaseModel], skip: set[str]) -> list[str]:
    """The table's rows of one section, a field holding a section of its own (eval.judge) or a list of them
    (eval.suites) followed by that section's fields (eval.judge.url, eval.suites[].task)."""
    lines = []
    defaults = {name: info.get_default(call_default_factory=True) for name, info in model.model_fields.items()
                if not info.is_required()}
    shown_defaults = model.model_construct(**defaults).model_dump(mode="json")  # as YAML or the form spells them
    shown_defaults = {**defaults, **shown_defaults}  # a field left out of dumps (data.allowed_roots) shows its own
    for name, info in model.model_fields.items():
        if name in skip:
            continue
        inner = info.annotation
        shown = ("required" if info.is_required() else "the fields below" if isinstance(inner, type) and issubclass(
            inner, _Section) else "null" if shown_defaults[name] is None else str(shown_defaults[name]))
        dotted = f"{prefix + '.' if prefix else ''}{name}"
        lines.append(f"| `{dotted}` | `{shown}` | {info.description or ''} |")
        item = next(iter(getattr(inner, "__args__", ())), None) if getattr(inner, "__origin__", None) is list else None
        for nested, suffix in ((inner, ""), (item, "[]")):
            if isinstance(nested, type) and issubclass(nested, _Section):
                lines += _reference_rows(dotted + suffix, nested, skip=set())
    return lines


if __name__ == "__main__":  # python -m tasks.config: the table in docs/configuration.md
    print(reference_table())
