"""GGUF files of the merged model for llama.cpp and Ollama, and the Ollama Modelfile beside them.

Reads merged/ (safetensors, config.json, tokenizer.json: the stage's merged model) and writes gguf/model-<type>.gguf
per requested type and gguf/Modelfile; reads the adapter (adapter_config.json, adapter_model.safetensors) and writes
gguf/lora-f32.gguf, the adapter for `llama-server -m BASE.gguf --lora lora-f32.gguf`; writes the base model as the
adapter was trained against it (the 4-bit weights dequantized, given by the stage) as gguf/base-<first type>.gguf with
gguf/Modelfile.adapter, Ollama's adapter form (FROM that base GGUF, ADAPTER the LoRA), usable as exported.
The `gguf` package (llama.cpp's gguf-py) names the tensors
(TensorNameMap), quantizes them (gguf.quants) and writes the file (GGUFWriter); it ships no HF converter
(convert_hf_to_gguf.py is only in llama.cpp's source tree), so the few per-family facts it needs are in FAMILIES.
A family not listed there gets one log line and no GGUF.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from tasks.errors import UserError
from tasks.log import logger
from tasks.on_disk import disk

# model_type -> (gguf architecture name, whether q/k rows are permuted to llama.cpp's interleaved rope layout:
# llama.cpp's converter does it for Llama-style models, Qwen2 uses the NeoX layout unchanged)
FAMILIES = {"llama": ("llama", True), "mistral": ("llama", True), "qwen2": ("qwen2", False)}
FLOAT_TYPES = {"f32": "F32", "f16": "F16", "bf16": "BF16"}
# bytes per weight of each type (a quantized block: 32 weights and their scales), for the disk-space check
BYTES_PER_WEIGHT = {"f32": 4, "f16": 2, "bf16": 2, "q8_0": 34 / 32, "q4_0": 18 / 32, "q4_1": 20 / 32,
                    "q5_0": 22 / 32, "q5_1": 24 / 32}
FILE_TYPES = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0",
              "q4_0": "MOSTLY_Q4_0", "q4_1": "MOSTLY_Q4_1", "q5_0": "MOSTLY_Q5_0", "q5_1": "MOSTLY_Q5_1"}


def write_gguf(merged: Path, out: Path, types: list[str]) -> list[str]:
    """Write merged/ as out/model-<type>.gguf per type and out/Modelfile; the files written, relative to out's parent
    (none for a family the writer does not know)."""
    if not types:
        return []
    config = json.loads((merged / "config.json").read_text())
    family = _family(config, types)
    if family is None:
        return []
    if not _byte_level_bpe(merged / "tokenizer.json"):
        logger().info("export_adapter: no GGUF: the tokenizer is not byte-level BPE, the one vocabulary the GGUF "
                      "export writes (sentencepiece-style tokenizers are not supported yet)")
        return []
    weights = _weight_count(merged, config)
    disk.require("export_adapter", out.parents[2], out, int(sum(weights * BYTES_PER_WEIGHT[t] for t in types)),
                 f"the GGUF files ({', '.join(types)})")  # out: runs/export_adapter/key/gguf
    out.mkdir(parents=True, exist_ok=True)
    names = [_write_one(config, family, merged, out / f"model-{kind}.gguf", kind) for kind in types]
    (out / "Modelfile").write_text(modelfile(names[0], merged))
    logger().info("export_adapter: GGUF %s in %s", ", ".join(names), out)
    return [f"{out.name}/{name}" for name in [*names, "Modelfile"]]


def _family(config: dict[str, Any], types: list[str]) -> tuple[str, bool] | None:
    """The family's (GGUF architecture, permute q/k); None, with one log line, for a family the export does not know."""
    family = FAMILIES.get(config.get("model_type", ""))
    if family is None:
        logger().info("export_adapter: no GGUF: family %r is not one the GGUF export knows (%s)",
                      config.get("model_type"), ", ".join(FAMILIES))
        return None
    if importlib.util.find_spec("gguf") is None:
        raise UserError(f"export.gguf={types} needs the gguf package, which is not installed: install the serving "
                        "extra (pip install -e \".[serving]\") or set export.gguf=[]")
    return family


def _weight_count(merged: Path, config: dict[str, Any]) -> int:
    """About how many weights merged/ holds: its safetensors bytes over the merged dtype's size."""
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "float32")
    size = 4 if dtype == "float32" else 2
    return sum(f.stat().st_size for f in merged.glob("*.safetensors")) // size


def _byte_level_bpe(tokenizer_json: Path) -> bool:
    """Whether gguf's BpeVocab (llama.cpp's "gpt2" tokenizer model) reads this tokenizer."""
    import gguf

    try:
        gguf.vocab.BpeVocab(tokenizer_json.parent)
    except (FileNotFoundError, ValueError, KeyError):
        return False
    return True


def _tensors(folder: Path) -> Iterator[tuple[str, Any]]:
    """The merged model's tensors as float32 numpy arrays, one at a time (the f32 copy of a whole 8B model is 32 GB)."""
    from safetensors import safe_open

    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:  # torch: numpy has no bfloat16
            for name in f.keys():
                yield name, f.get_tensor(name).float().numpy()


def _write_one(config: dict[str, Any], family: tuple[str, bool], merged: Path, path: Path, kind: str,
               tensors: Iterable[tuple[str, Any]] | None = None) -> str:
    """One GGUF file of `kind`: the vocabulary and hyperparameters of merged/, the weights of `tensors` (name, float32
    numpy array), by default merged/'s own."""
    import gguf

    arch_name, permute = family
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name)
    layers = config["num_hidden_layers"]
    names = gguf.get_tensor_name_map(arch, layers)
    writer = gguf.GGUFWriter(path, arch_name)
    _add_hparams(writer, config, getattr(gguf.LlamaFileType, FILE_TYPES[kind]))
    _add_vocab(writer, merged, config["vocab_size"])
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    for hf_name, data in _tensors(merged) if tensors is None else tensors:
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ValueError(f"GGUF export: no {arch_name} GGUF name for tensor {hf_name}")
        if permute and name.endswith(("attn_q.weight", "attn_k.weight")):
            data = _permute(data, heads if ".attn_q." in name else kv_heads)
        _add_tensor(writer, name, data, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.name


def _permute(weights: Any, heads: int) -> Any:
    """HF's rotate-half q/k rows to llama.cpp's interleaved pairs (transformers' GGUF loader undoes it)."""
    half = weights.shape[0] // heads // 2
    return weights.reshape(heads, 2, half, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def _add_tensor(writer: Any, name: str, data: Any, kind: str) -> None:
    import gguf
    import numpy as np

    # llama.cpp keeps 1-D tensors (norms, biases) in f32; a row that is not a whole number of blocks stays f16
    qtype = gguf.GGMLQuantizationType[FLOAT_TYPES.get(kind, kind.upper())]
    if data.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
        writer.add_tensor(name, data)
        return
    if qtype == gguf.GGMLQuantizationType.F16:
        writer.add_tensor(name, data.astype(np.float16))
        return
    try:
        writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    except gguf.quants.QuantError:
        logger().info("export_adapter: GGUF %s: %s %s stays f16 (rows not whole %s blocks)", kind, name,
                      list(data.shape), kind)
        writer.add_tensor(name, data.astype(np.float16))


def _add_hparams(writer: Any, config: dict[str, Any], file_type: int) -> None:
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    rope = config.get("rope_parameters") or {}
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.get("num_key_value_heads") or heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type(file_type)


def _add_vocab(writer: Any, merged: Path, vocab_size: int) -> None:
    """The tokenizer as llama.cpp's gpt2 (byte-level BPE) vocabulary, special tokens marked as control tokens."""
    import gguf

    tokenizer = json.loads((merged / "tokenizer.json").read_text())
    vocab = gguf.vocab.BpeVocab(merged)
    special = {t["id"] for t in tokenizer.get("added_tokens", []) if t.get("special")}
    tokens = [text if isinstance(text, bytes) else text.encode() for text, _, _ in vocab.all_tokens()]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
                            for i in range(len(tokens))])
    gguf.SpecialVocab(merged, load_merges=True, n_vocab=vocab_size).add_to_gguf(writer, quiet=True)


def modelfile(gguf_name: str, merged: Path) -> str:
    """An Ollama Modelfile: FROM the GGUF beside it, the tokenizer's end-of-sequence token as stop."""
    # the chat template travels in the GGUF's tokenizer.chat_template key, which Ollama reads itself
    return "\n".join([f"FROM ./{gguf_name}", *_stops(merged)]) + "\n"


def base_name(types: list[str]) -> str:
    """The base model's GGUF beside the LoRA: in the first export.gguf type, as Modelfile's merged GGUF."""
    return f"base-{types[0]}.gguf"


def adapter_modelfile(lora_name: str, base_gguf: str, merged: Path) -> str:
    """Ollama's adapter form: FROM the base model's GGUF, ADAPTER the GGUF LoRA, both beside it."""
    return "\n".join([
        "# FROM: the base model as the adapter was trained against it (model.base_model's 4-bit weights,",
        "# dequantized), written by the export; an Ollama model of that same base takes the adapter too.",
        f"FROM ./{base_gguf}", f"ADAPTER ./{lora_name}", *_stops(merged)]) + "\n"


def write_base_gguf(tensors: Iterable[tuple[str, Any]], merged: Path, out: Path, types: list[str]) -> list[str]:
    """Write the base model's `tensors` (the 4-bit base dequantized, with merged/'s tensor names) as
    out/base-<first type>.gguf, and out/Modelfile.adapter naming it and out/lora-f32.gguf (which must exist); the files
    written, relative to out's parent."""
    config = json.loads((merged / "config.json").read_text())
    family, kind = FAMILIES[config["model_type"]], types[0]
    disk.require("export_adapter", out.parents[2], out, int(_weight_count(merged, config) * BYTES_PER_WEIGHT[kind]),
                 f"the base model's GGUF ({kind})")
    name = _write_one(config, family, merged, out / base_name(types), kind, tensors)
    (out / "Modelfile.adapter").write_text(adapter_modelfile("lora-f32.gguf", name, merged))
    logger().info("export_adapter: GGUF base %s for Modelfile.adapter in %s", name, out)
    return [f"{out.name}/{name}", f"{out.name}/Modelfile.adapter"]


def _stops(merged: Path) -> list[str]:
    config = merged / "tokenizer_config.json"
    tokenizer = json.loads(config.read_text()) if config.is_file() else {}
    return [f'PARAMETER stop "{t}"' for t in (tokenizer.get("eos_token"),) if isinstance(t, str)]


def write_lora_gguf(adapter: Path, base_config: Path, out: Path, types: list[str]) -> list[str]:
    """Write the adapter folder's LoRA as out/lora-f32.gguf for llama.cpp's --lora (on a GGUF of the base model with
    llama.cpp's tensor names and q/k layout, as write_gguf and llama.cpp's converter write it); the file written,
    relative to out's parent (none for a family or an adapter llama.cpp's LoRA loader does not take)."""
    if not types:
        return []
    config = json.loads(base_config.read_text())
    family = _family(config, types)
    lora = json.loads((adapter / "adapter_config.json").read_text())
    alpha = None if family is None else _llama_cpp_alpha(lora)
    pairs = None if alpha is None else _lora_pairs(adapter / "adapter_model.safetensors")
    if family is None or alpha is None or pairs is None:
        return []
    import gguf

    arch_name, permute = family
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name)
    names = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    out.mkdir(parents=True, exist_ok=True)
    path = out / "lora-f32.gguf"
    writer = gguf.GGUFWriter(path, arch_name)
    # what llama.cpp's adapter loader checks: general.type, the base architecture, adapter.type; alpha scales
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for module, (a, b) in sorted(pairs.items()):
        name = names.get_name(f"{module}.weight", try_suffixes=(".weight",))
        if name is None:
            raise ValueError(f"GGUF LoRA export: no {arch_name} GGUF name for {module}")
        if permute and name.endswith(("attn_q.weight", "attn_k.weight")):
            # the base's q/k rows are permuted (write_gguf); the update B @ A permutes with B's rows
            b = _permute(b, heads if ".attn_q." in name else kv_heads)
        # PEFT's A (r x in) and B (out x r) are already the shapes llama.cpp's loader expects (ggml's ne[0] is
        # numpy's last axis): lora_a ne = (in, r), lora_b ne = (r, out)
        writer.add_tensor(f"{name}.lora_a", a)
        writer.add_tensor(f"{name}.lora_b", b)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    logger().info("export_adapter: GGUF LoRA %s (%d layers, alpha %s)", path, len(pairs), alpha)
    return [f"{out.name}/{path.name}"]


def _llama_cpp_alpha(lora: dict[str, Any]) -> float | None:
    """The adapter.lora.alpha giving PEFT's scale under llama.cpp's rule (scale = alpha / rank of each layer);
    None, with one log line, for adapters that rule cannot express."""
    why = ("DoRA" if lora.get("use_dora") else "per-module ranks or alphas" if lora.get("rank_pattern")
           or lora.get("alpha_pattern") else "trained modules_to_save" if lora.get("modules_to_save") else None)
    if why:
        logger().info("export_adapter: no GGUF LoRA: llama.cpp's LoRA loader does not take %s (the merged GGUF "
                      "carries the adapter)", why)
        return None
    alpha, rank = float(lora["lora_alpha"]), lora["r"]
    # rsLoRA scales by alpha / sqrt(r): the same scale under llama.cpp's alpha / r
    return alpha * rank**0.5 if lora.get("use_rslora") else alpha


def _lora_pairs(weights: Path) -> dict[str, tuple[Any, Any]] | None:
    """PEFT's lora_A/lora_B weights as float32 numpy, by the base module's name (model.layers.0.self_attn.q_proj);
    None, with one log line, when the adapter has other tensors."""
    from safetensors import safe_open

    pairs: dict[str, dict[str, Any]] = {}
    with safe_open(weights, framework="pt") as f:
        for key in f.keys():
            stem, _, part = key.removeprefix("base_model.model.").removesuffix(".weight").rpartition(".")
            if part not in ("lora_A", "lora_B"):
                # lora_embedding_A/B (an adapted embedding) follow a layout llama.cpp's converter only knows from
                # mergekit; trained biases have no place in a GGUF LoRA
                logger().info("export_adapter: no GGUF LoRA: %s is not a Linear layer's lora_A/lora_B weight (the "
                              "merged GGUF carries the adapter)", key)
                return None
            pairs.setdefault(stem, {})[part] = f.get_tensor(key).float().numpy()
    return {stem: (ab["lora_A"], ab["lora_B"]) for stem, ab in pairs.items()}
