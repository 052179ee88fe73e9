"""RunConfig: the flow's one parameter, one `*Args` section per stage.

Imports pydantic only (and tasks.credentials, which needs only `re`), so the Prefect UI form renders where torch
is not installed. Field names are the downstream library's own (peft's LoraConfig, transformers' TrainingArguments and
BitsAndBytesConfig), so a section hands over with `**args.model_dump()` and needs no renaming layer.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PlainSerializer, field_validator, model_validator

from tasks import credentials

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


def _form_friendly(schema: dict[str, Any], model: type[BaseModel]) -> None:
    """Shape the JSON schema for the Prefect UI form, whatever the fields' types are.

    `X | None` becomes plain X: the form showed a type toggle whose None side reads 'Property is type "None"'.
    An empty input is left out of the parameters, so the field's default (None) applies; the null default is
    dropped from the schema too, so Prefect's parameter validation still accepts an explicit null (it allows
    null for an optional property without a default). A `const` (a one-value Literal such as 'all-linear')
    becomes a one-value enum: the form showed "is a const and cannot be changed" until the type was switched.
    """
    _show_factory_defaults(schema, model)
    for prop in schema.get("properties", {}).values():
        branches = prop.get("anyOf", [])
        kept = [b for b in branches if b.get("type") != "null"]
        if branches and len(kept) == 1 and len(kept) < len(branches):
            del prop["anyOf"]
            prop.update({k: v for k, v in kept[0].items() if k not in prop})
            if prop.get("default", 0) is None:
                del prop["default"]
            if "enum" in prop:  # the null a full config dump holds must still validate
                prop["enum"] = [*prop["enum"], None]
        for part in [prop, *prop.get("anyOf", [])]:
            if "const" in part:
                part["enum"] = [part.pop("const")]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, field_title_generator=_title,
                              json_schema_extra=_form_friendly)


class DataArgs(_Section):
    """The dataset: where it is, its format, how it is cut and split (stage prepare_data)."""

    source: InCheckout = Field(
        str(EMBEDDED_DATA.relative_to(PROJECT_ROOT)), validate_default=True,
        description="A local .jsonl/.json/.csv/.parquet/.txt file, a folder or glob of them, an fsspec URL "
        "(s3://bucket/data/*.jsonl), or a Hugging Face hub dataset id.",
    )
    eval_source: InCheckout | None = Field(
        None, description="A fixed evaluation set, in the forms data.source takes (read with the same settings): "
        "when set, every example of it is evaluated and every example of data.source is trained on (no "
        "eval_fraction split). Its content is in the keys of prepare_data, evaluate_adapter and export_adapter, "
        "not train_adapter's (README: Nightly retraining).",
    )
    name: str | None = Field(None, description="Hub dataset config name (e.g. wikitext-2-raw-v1).")
    split: str = Field("train", description="Hub split, with slicing: 'train', 'train[:1000]'.")
    revision: str | None = Field(None, description="Hub dataset revision; None = the default branch.")
    format: Literal["auto", "preference", "unpaired_preference", "dolly", "alpaca", "prompt_completion", "chat",
                    "text"] = Field(
        "auto", description="Record format; 'auto' detects it from the column names (README: Data formats)."
    )
    column_mapping: dict[str, str] = Field(
        default_factory=dict,
        description="Rename columns before the format is detected, {column in the data: column the format "
        "expects}, e.g. {question: instruction, answer: response}.",
    )
    chat_template: Literal["tokenizer", "chatml", "llama3"] = Field(
        "tokenizer", description="How the chat format renders `messages`: the tokenizer's own chat template, "
        "or a named one for tokenizers that have none.",
    )
    completion_only_loss: bool | None = Field(
        None, description="Mask prompt tokens from the loss. None: yes for instruction and chat formats, no for text."
    )
    max_seq_length: int = Field(
        256, gt=0, le=1 << 20, description="Tokens per example; longer ones are truncated. At most the base "
        "model's max_position_embeddings.",
    )
    eval_fraction: float = Field(
        0.1, gt=0.0, lt=1.0, description="Share of examples held out for evaluation (split by content hash); "
        "evaluate_adapter needs some.",
    )
    max_empty_fraction: float = Field(
        0.1, ge=0.0, le=1.0, description="Rows with an empty or whitespace-only response are dropped; fail when "
        "more than this share of the rows is empty (a sign of a wrong column). Blank lines of text data are "
        "dropped without limit.",
    )
    allowed_roots: list[str] | None = Field(
        None, description="If set, data.source must lie inside one of these folders (symbolic links resolved) or "
        "start with one of these URL prefixes (s3://bucket/); hub dataset ids stay allowed. Set it in "
        "deployments so a run started from the UI cannot read other files of the worker.",
    )
    pack_examples: bool = Field(
        False, description="Pack whole examples into rows of up to max_seq_length tokens at data time, with "
        "position_ids restarting at each example. Off: speed.packing packs per micro-batch at train time instead.",
    )


class ModelArgs(_Section):
    """The base model and its 4-bit quantization (stage prepare_model)."""

    base_model: InCheckout = Field(str(EMBEDDED_MODEL.relative_to(PROJECT_ROOT)), validate_default=True,
                                   description="A local model folder or a hub model id.")
    revision: str | None = Field(None, description="Hub model revision; None = the default branch.")
    bnb_4bit_quant_type: Literal["nf4", "fp4"] = Field("nf4", description="4-bit data type.")
    bnb_4bit_use_double_quant: bool = Field(True, description="Quantize the quantization constants too.")
    bnb_4bit_compute_dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="Matmul dtype; 'auto' = bfloat16 on GPUs that support it, else float32."
    )
    attn_implementation: Literal["auto", "sdpa", "eager"] = Field(
        "auto", description="Attention kernel; 'auto' = what transformers picks for the model (sdpa where the "
        "model supports it, else eager, e.g. Gemma 2). One the model does not support falls back to 'auto' with a "
        "warning. On GPUs, training with speed.packing runs flash varlen attention whatever this says.",
    )
    bnb_4bit_quant_storage: Literal["uint8", "bfloat16", "float16", "float32"] = Field(
        "uint8", description="Element type the packed 4-bit weights are stored in (the bits are the same). "
        "speed.fsdp needs it equal to the compute dtype (bfloat16 on recent GPUs), so FSDP can shard the 4-bit "
        "layers together with the rest of each decoder layer.",
    )


class LoraArgs(_Section):
    """The LoRA adapters: peft's LoraConfig fields."""

    r: int = Field(16, gt=0, description="LoRA rank.")
    lora_alpha: int = Field(32, gt=0, description="LoRA scaling numerator (scale = lora_alpha / r).")
    lora_dropout: float = Field(
        0.0, ge=0.0, lt=1.0, description="Dropout on the LoRA input (0.05 in the QLoRA paper; 0 trained 5% faster "
        "with 1.6 GiB less peak memory on an H200, Llama-3.1-8B shape).",
    )
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="Module names that get adapters, or 'all-linear': every Linear (and GPT-2 "
        "Conv1D) layer except the output layer, whatever the family calls them (peft's own rule). prepare_model "
        "lists the names the model has (modules.json); names it lacks fail before training.",
    )
    bias: Literal["none", "all", "lora_only"] = Field("none", description="Which biases to train.")


# DPO's and KTO's losses as TRL names them (DPOConfig.loss_type, KTOConfig.loss_type)
DPO_LOSSES = ("sigmoid", "hinge", "ipo", "robust", "bco_pair", "sppo_hard", "nca_pair", "apo_zero", "apo_down")
KTO_LOSSES = ("kto", "apo_zero_unpaired")
# TrainArgs fields that are the pipeline's, not TrainingArguments'/DPOConfig's/KTOConfig's keywords
PIPELINE_TRAIN_FIELDS = ("method", "init_adapter")
PREFERENCE_TRAIN_FIELDS = ("beta", "loss_type")  # DPOConfig/KTOConfig keywords; not TrainingArguments'


class TrainArgs(_Section):
    """Training: the transformers Trainer's own TrainingArguments fields (stage train_adapter), and for preference
    tuning (method dpo or kto) TRL's DPOConfig/KTOConfig fields of the same names.

    Why flat and not a nested `preference` section: DPOConfig and KTOConfig subclass TrainingArguments, so for a
    preference run this whole section (less `method` and `init_adapter`) still hands over as one
    `**model_dump()`; SFT drops the TRL-only fields (PREFERENCE_TRAIN_FIELDS). One section also keeps the UI form
    and the train_adapter cache key as they were, and `train.method: dpo` reads as the issue writes it.
    TRL 1.16 has no max_prompt_length / max_completion_length (only max_length, truncating prompt + completion
    from the end): data.max_seq_length plays that part at prepare_data time, where prompt-filling pairs are
    dropped and counted.
    """

    method: Literal["sft", "dpo", "kto"] = Field(
        "sft", description="sft: supervised fine-tuning on instruction/chat/text data. dpo: Direct Preference "
        "Optimization on preference pairs (data format preference). kto: Kahneman-Tversky Optimization on "
        "unpaired thumbs-up/down answers (format unpaired_preference; pairs are split into one of each). Both "
        "through TRL, the reference model being the 4-bit base with the adapter turned off (or the init_adapter).",
    )
    init_adapter: str | None = Field(
        None, description="Start from an exported adapter instead of a fresh LoRA: a folder with "
        "adapter_config.json (e.g. runs/exports/adapter/v0003), 'champion' (the champion of export.name's "
        "registry) or 'champion:NAME' (of registry NAME). Its files are part of the cache key. Its own LoRA "
        "settings replace the lora section. For dpo/kto it is also the reference model.",
    )
    beta: float = Field(
        0.1, gt=0, description="dpo/kto (TRL's beta): how far the tuned model may move from the reference; higher "
        "stays closer.",
    )
    loss_type: Literal[DPO_LOSSES + KTO_LOSSES] | None = Field(  # type: ignore[valid-type]
        None, description="dpo/kto (TRL's loss_type): None = TRL's default, sigmoid for dpo, kto for kto. dpo takes "
        f"{', '.join(DPO_LOSSES)}; kto takes {', '.join(KTO_LOSSES)}.",
    )

    max_steps: int = Field(-1, ge=-1, description="Optimizer steps (1 or more); -1 = train by num_train_epochs.")
    num_train_epochs: float = Field(1.0, gt=0, description="Epochs when max_steps is -1.")
    per_device_train_batch_size: int = Field(8, gt=0, description="Micro-batch (examples).")
    gradient_accumulation_steps: int = Field(1, gt=0, description="Micro-batches per optimizer step.")
    learning_rate: float = Field(1e-3, gt=0, description="Peak learning rate.")
    lr_scheduler_type: Literal["linear", "cosine", "constant", "constant_with_warmup"] = Field(
        "cosine", description="Learning-rate schedule after warmup."
    )
    warmup_steps: float = Field(
        0.03, ge=0, description="Warmup: a number of steps, or a fraction of all steps when below 1."
    )
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay on the LoRA weights.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    optim: Literal["paged_adamw_8bit", "adamw_8bit", "paged_adamw_32bit", "adamw_torch", "adamw_torch_fused"] | None = (
        Field(None, description="Optimizer. None: adamw_torch_fused (torch's fused AdamW) on a GPU, adamw_torch with "
              "speed.fsdp, adamw_8bit (bitsandbytes' 8-bit AdamW; its paged variant falls back to it there) "
              "elsewhere. On an H200 the fused one trains an 8B model 11% faster than paged_adamw_8bit for 0.28 "
              "GiB more (fp32 state of the LoRA weights): bitsandbytes' optimizers wait for the GPU after each "
              "LoRA tensor (448 waits per step).")
    )
    gradient_checkpointing: bool = Field(True, description="Recompute activations to save memory.")
    bf16: bool | None = Field(None, description="bf16 mixed precision; None = where the device supports it.")
    save_steps: int = Field(50, gt=0, description="Optimizer steps between checkpoints.")
    logging_steps: int = Field(10, gt=0, description="Optimizer steps between loss log lines.")
    seed: int = Field(42, description="Seed for LoRA init, data order and dropout.")

    @field_validator("max_steps")
    @classmethod
    def _some_steps(cls, value: int) -> int:
        if value == 0:
            raise ValueError("0 steps would train nothing: give 1 or more, or -1 to train for num_train_epochs")
        return value


class SpeedArgs(_Section):
    """How train_adapter runs, not what it computes: speed and memory levers, data parallelism (README: Performance).

    TrainArgs holds the transformers Trainer's own fields only; these are the pipeline's.
    """

    num_gpus: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        1, description="Data-parallel processes (torchrun + DDP), one per GPU; 'auto' = every visible GPU. "
        "On a machine without GPUs, N > 1 runs N CPU processes with the gloo backend.",
    )
    fsdp: bool = Field(
        False, description="With num_gpus > 1: shard the 4-bit base model, the LoRA weights, their gradients and "
        "optimizer state across the GPUs (FSDP2) instead of a full copy per GPU (DDP), for models whose training "
        "does not fit one GPU. Needs model.bnb_4bit_quant_storage equal to the compute dtype; GPUs only; trains with "
        "optim adamw_torch (bitsandbytes' optimizers cannot update sharded parameters).",
    )
    packing: bool = Field(
        True, description="Pack whole examples into each micro-batch, each with its own position ids: no padding, "
        "and no example attends to another (varlen attention on GPUs, a block-diagonal mask elsewhere). DPO/KTO: TRL's "
        "loss on the real tokens only, DPO's micro-batches whole pairs sized in tokens (docs/preference.md).",
    )
    max_tokens_per_batch: int | None = Field(
        None, gt=0, description="Tokens per packed micro-batch. None: on a GPU, the memory plan's choice (the "
        "fastest training that fits gpu_memory_budget_gb, up to 32,768 or the longest example); on CPU, "
        "per_device_train_batch_size examples per micro-batch.",
    )
    gpu_memory_budget_gb: float | None = Field(
        None, gt=0, description="GPU memory (GiB) training may use, model included. On a GPU with packing, the memory "
        "plan picks the pack size, the layers to recompute and the offloads that train fastest within it (the log "
        "and the train_adapter manifest say what it chose and the peak it predicted). None: the GPU's own memory, "
        "less 1 GiB for other processes.",
    )
    recompute_layers: int | None = Field(
        None, ge=0, description="Decoder layers (the first ones) that recompute all their activations in the backward "
        "pass instead of keeping them (activation checkpointing; the rest keep theirs). None: on a GPU with packing, "
        "as few as the memory budget allows; elsewhere every layer while train.gradient_checkpointing is on.",
    )
    recompute_mlp_layers: int | None = Field(
        None, ge=0, description="Decoder layers, after the recompute_layers ones, that recompute only their MLP's "
        "activations in the backward pass (selective recomputation: attention keeps its own; for Llama-3.1-8B the MLP "
        "holds two thirds of a layer's activations and does four fifths of its matmul FLOPs). A family whose layers "
        "have no .mlp steps aside (logged). None: on a GPU with packing, the memory plan chooses; elsewhere 0.",
    )
    offload_activations: bool | None = Field(
        None, description="Keep the recomputed layers' inputs in pinned CPU memory, copied on a side stream (2 "
        "GiB for 8k tokens of an 8B model). None: the memory plan decides on a GPU with packing (single-process "
        "runs only), else on with gradient checkpointing on a GPU in single-process runs.",
    )
    offload_embeddings: bool | None = Field(
        None, description="Keep the frozen input-embedding table in CPU memory and look tokens up there (1 GiB "
        "for a 128k-token vocabulary in bf16; per micro-batch, the ids go to the host and the rows come back), and "
        "where the fused cross-entropy computes the loss, the frozen output layer too (copied to the GPU for the "
        "loss, then freed: another 1 GiB off the peak). Untied tables only; single-process runs only. None: the memory "
        "plan decides on a GPU with packing, else when the activations are offloaded.",
    )
    upcast_frozen_to_fp32: bool = Field(
        False, description="Cast the frozen embeddings, norms and lm_head to float32 (peft's "
        "prepare_model_for_kbit_training). Off keeps them in the compute dtype: less memory, same loss.",
    )
    fused_cross_entropy: bool = Field(
        True, description="Compute the loss and its gradient from the hidden states a chunk at a time, never "
        "holding all (tokens x vocabulary) float32 logits.",
    )
    use_liger_kernel: bool | None = Field(
        None, description="Liger's fused RMSNorm, SwiGLU and RoPE kernels. None: where liger-kernel is installed "
        "(the 'gpu' extra) and a GPU is present.",
    )
    mlp_chunk_tokens: int = Field(
        16384, ge=0, description="Run each MLP over at most this many tokens at a time, each chunk checkpointed: "
        "long sequences fit in less memory for one more MLP forward. Where the memory plan chooses (a GPU with "
        "packing), only the MLPs that recompute anyway run in chunks, and the whole-recomputed layers' only where "
        "the plan says so; the layers that keep their activations run whole. 0 = never.",
    )
    fused_lora: bool | None = Field(
        None, description="Run each LoRA layer, its 4-bit base matmul included, as one autograd function (tasks/"
        "train_adapter/fused_lora.py): the same maths with about a quarter fewer ops and half the autograd nodes "
        "per step, the host-side work that small micro-batches on a GPU wait for. Layers with lora_dropout > 0 "
        "in training keep peft's path. None: on, except with speed.fsdp.",
    )
    recompute_skip: bool = Field(
        True, description="With fused_lora: a recomputed layer skips the LoRA layers whose output its recomputation "
        "never reads (tasks/train_adapter/recompute_skip.py; found in the autograd graph: in Llama-style layers the "
        "MLP's down projection, 27% of an 8B layer's matmul FLOPs). Same gradients, bit for bit.",
    )


class EvalArgs(_Section):
    """Evaluation of base and base + adapter on the held-out split (stage evaluate_adapter)."""

    max_samples: int | None = Field(
        None, gt=0, description="Evaluate on at most this many eval examples; None = all."
    )
    per_device_eval_batch_size: int = Field(
        8, gt=0, description="Memory size of an eval batch, in examples of the longest length: a loss batch holds "
        "at most this many times the longest eval example's tokens, a generation batch this many times the longest "
        "prompt plus max_new_tokens; examples are sorted by length, so short ones share a batch (fewer, fuller "
        "batches, peak memory as a batch of this many longest examples).",
    )
    dequantize: Literal["auto"] | bool = Field(
        "auto", description="Evaluate on the 4-bit base dequantized once to the compute dtype (plain matmuls, the "
        "adapters attached by name) instead of the 4-bit layers, which dequantize every weight on every forward; "
        "same numbers within rounding. auto = when the dequantized copy fits the free GPU memory (on CPU: the "
        "available host memory) with a margin; false = always 4-bit (least memory).",
    )
    generation_samples: int = Field(
        32, ge=0, description="Answer the first this many eval prompts by greedy generation, with the base model "
        "and with the adapter, and score the answers (exact match, ROUGE-L); 0 = no generation.",
    )
    max_new_tokens: int = Field(32, gt=0, description="Most tokens generated per answer (stops earlier at eos).")
    lm_eval_tasks: list[str] = Field(
        default_factory=list, description="lm-evaluation-harness task names (e.g. [hellaswag, arc_easy]) run on "
        "base and tuned; needs `pip install lm-eval` and the tasks' datasets, skipped with a note otherwise.",
    )
    limit: int | None = Field(
        None, gt=0, description="lm-evaluation-harness: at most this many examples per task; None = all.",
    )


class ExportArgs(_Section):
    """Export and the registry: versions, the promotion gate, the merged model (stage export_adapter)."""

    name: str = Field(
        "adapter", max_length=100,
        description="Registry name: versions go to `runs_dir/exports/<name>/vNNNN/`, the champion to champion.json.",
    )
    promotion_margin: float = Field(
        0.01, ge=0.0, lt=1.0, description="Promote a new version to champion only if its tuned eval loss is below "
        "the champion's by more than this fraction (0.01: more than 1% lower); for preference runs (dpo, kto) only "
        "if its tuned reward accuracy is above the champion's by more than this (0.01: one point); otherwise keep "
        "it as rejected.",
    )
    merge: bool = Field(
        False, description="Also write merged/: the 4-bit base dequantized, the adapter merged in, saved as "
        "safetensors with the tokenizer (loads with AutoModelForCausalLM, no peft needed).",
    )
    merged_dtype: Literal["bfloat16", "float16", "float32"] = Field(
        "bfloat16", description="dtype of the merged model's weights.",
    )
    # 2GB, not transformers' 5GB: the manifest hashes one file per thread, so the largest shard bounds the hash
    # (docs/performance.md, "The whole job")
    max_shard_size: str = Field("2GB", description="Largest safetensors shard of the merged model (save_pretrained).")
    gguf: list[Literal["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1"]] = Field(
        default_factory=list, description="Also write the merged model as GGUF files for llama.cpp and Ollama, one per "
        "type (e.g. [q8_0] or [f16, q4_0]), with an Ollama Modelfile and the adapter as a GGUF LoRA for llama.cpp's "
        "--lora (lora-f32.gguf), in gguf/; needs merge. The types are those the "
        "gguf package quantizes itself; for k-quants (q4_k_m) run llama.cpp's llama-quantize on the f16 file.",
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
            raise ValueError("export.gguf needs the merged model: set export.merge=true as well (or export.gguf=[])")
        return self


TRACKING_BACKENDS = ("mlflow", "tensorboard")  # one module each in tasks/tracking/


class TrackArgs(_Section):
    """Experiment tracking (README: Experiment tracking). Part of no stage's cache key: tracking changes no output."""

    backend: list[Literal[TRACKING_BACKENDS]] = Field(  # type: ignore[valid-type]
        default_factory=list, description="Where runs are logged: mlflow, tensorboard, or both; [] (or 'none') = "
        "no tracking. A single name is taken as a list of one. mlflow and tensorboard need the 'tracking' extra.",
    )
    mlflow_tracking_uri: str | None = Field(
        None, description="MLflow tracking server or store (http://host:5000, sqlite:///mlflow.db). None: MLflow's "
        "own default (the MLFLOW_TRACKING_URI environment variable, else a local store).",
        # Prefect's server checks a deployment run's parameters against this before it stores them
        json_schema_extra={"pattern": credentials.NO_CREDENTIALS},
    )
    experiment_name: str = Field("qlora-pipeline", description="MLflow experiment the runs go into (created if "
                                 "missing).")
    tensorboard_dir: str | None = Field(
        None, description="TensorBoard log folder (one subfolder per trained adapter). None: runs_dir/tensorboard.",
    )
    parent_run_id: str | None = Field(
        None, description="MLflow run id to file this run under as a child run (a sweep passes its own run).",
    )
    register_model: bool = Field(
        False, description="mlflow: also register the registry's champion as a version of an MLflow registered "
        "model with the alias 'champion' (the exports registry stays the source of truth).",
    )
    registered_model_name: str | None = Field(None, description="MLflow registered model name; None = export.name.")

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
            raise ValueError("track.register_model registers the champion in MLflow: add mlflow to track.backend, "
                             "or set track.register_model=false")
        return self


SERVE_API_KEY_ENV = "VLLM_API_KEY"  # the variable vLLM's own server reads its --api-key from


class ServeArgs(_Section):
    """The running vLLM server the champion is loaded into (docs/serving.md). Part of no stage's cache key."""

    url: str | None = Field(
        None, description="Root URL of a running vLLM server (http://host:8000) started with --enable-lora and "
        f"VLLM_ALLOW_RUNTIME_LORA_UPDATING=True; after each run its adapter_name serves the registry's champion, "
        f"checked against the champion's own evaluation first. None: no server is updated. Its API key comes from "
        f"the {SERVE_API_KEY_ENV} environment variable, never from the config.",
        json_schema_extra={"pattern": credentials.NO_CREDENTIALS},
    )
    adapter_name: str | None = Field(
        None, max_length=100, description="The model name clients ask the server for; None = export.name. Each "
        "version is also loaded as <adapter_name>-vNNNN while it is checked and served.",
    )
    timeout_s: float = Field(120.0, gt=0, description="Seconds to wait for one answer of the server (a load, a "
                             "greedy answer).")
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


class RunConfig(_Section):
    """Everything one pipeline run needs; the Prefect UI renders it as the run form."""

    runs_dir: Path = Field(Path("runs"), description="Folder for stage outputs, shared between runs.")
    data: DataArgs = Field(default_factory=DataArgs, title="Data", description="What to train on: the source, its "
                           "format and how examples are cut; source is the field most runs change.")
    model: ModelArgs = Field(default_factory=ModelArgs, title="Base model", description="The model to adapt and how "
                             "it is quantized to 4 bits; the quantization fields rarely need changing.")
    lora: LoraArgs = Field(default_factory=LoraArgs, title="LoRA adapter", description="Which layers get adapters "
                           "and their size (peft's LoraConfig).")
    train: TrainArgs = Field(default_factory=TrainArgs, title="Training", description="Steps, batch size, learning "
                             "rate, checkpoints (the transformers Trainer's own fields).")
    speed: SpeedArgs = Field(default_factory=SpeedArgs, title="Speed and memory (advanced)", description="How "
                             "training runs, not what it computes: GPUs, packing, offloading, fused kernels. The "
                             "defaults pick what the hardware supports; change them only to tune speed or memory.")
    eval: EvalArgs = Field(default_factory=EvalArgs, title="Evaluation", description="Held-out loss, greedy answers "
                           "scored against references, optional lm-evaluation-harness tasks.")
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
    def _check_target_modules(self) -> RunConfig:
        if not self.lora.target_modules:
            raise ValueError("lora.target_modules is empty: name at least one module, e.g. q_proj")
        return self

    @model_validator(mode="after")
    def _check_preference(self) -> RunConfig:
        method, loss = self.train.method, self.train.loss_type
        allowed = {"dpo": DPO_LOSSES, "kto": KTO_LOSSES}.get(method, ())
        if loss is not None and loss not in allowed:
            raise ValueError(f"train.loss_type={loss} does not go with train.method={method}: "
                             + (f"use one of {', '.join(allowed)}, or null for TRL's default" if allowed
                                else "loss_type is for dpo and kto only; set it to null"))
        if method != "sft" and self.data.format not in ("auto", "preference", "unpaired_preference"):
            raise ValueError(f"train.method={method} trains on preference data, but data.format is "
                             f"{self.data.format}; set data.format to preference, unpaired_preference or auto")
        if method != "sft" and self.speed.fsdp:
            raise ValueError(f"train.method={method} does not run with speed.fsdp (TRL's preference trainers are "
                             "not tried with FSDP here); set speed.fsdp=false (DDP with speed.num_gpus works)")
        if method == "kto" and self.train.per_device_train_batch_size < 2:
            raise ValueError("train.method=kto estimates its KL term from the other answers of a micro-batch: "
                             "set train.per_device_train_batch_size to 2 or more")
        if self.train.init_adapter == "champion":  # the champion of this run's own registry
            self.train.init_adapter = f"champion:{self.export.name}"
        return self

    @model_validator(mode="after")
    def _check_fsdp(self) -> RunConfig:
        storage, compute = self.model.bnb_4bit_quant_storage, self.model.bnb_4bit_compute_dtype
        if self.speed.fsdp and (storage == "uint8" or compute not in ("auto", storage)):
            raise ValueError(
                f"speed.fsdp needs the 4-bit weights stored in the compute dtype, so FSDP can shard them with the "
                f"rest of each layer; model.bnb_4bit_quant_storage is {storage} and model.bnb_4bit_compute_dtype "
                f"{compute}. Set model.bnb_4bit_quant_storage={compute if compute != 'auto' else 'bfloat16'}."
            )
        return self


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
        raw = loaded
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


def reference_table() -> str:
    """The config reference as a Markdown table (docs/configuration.md holds it; a test keeps the two equal)."""
    lines = ["| field | default | description |", "|---|---|---|"]
    sections = {"": RunConfig, **{name: f.annotation for name, f in RunConfig.model_fields.items()
                                  if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel)}}
    for prefix, model in sections.items():
        for name, info in model.model_fields.items():
            if prefix == "" and name in sections:
                continue
            default = info.get_default(call_default_factory=True)
            shown = str(default).replace(str(PROJECT_ROOT) + "/", "") if default is not None else "null"
            lines.append(f"| `{prefix + '.' if prefix else ''}{name}` | `{shown}` | {info.description or ''} |")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m tasks.config: the table in docs/configuration.md
    print(reference_table())
