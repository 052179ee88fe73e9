"""Where models come from and what they run on: hub or local sources, device, dtype, 4-bit loading."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks.errors import UserError
from tasks.hashing.files import files_fingerprint
from tasks.log import logger
from tasks.on_disk.manifest import ModelMetrics, read_manifest

if TYPE_CHECKING:
    import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "chat_template.jinja", "added_tokens.json")


def is_local(source: str) -> bool:
    """A source is a local path if it exists or is written like one (not like `org/name`)."""
    return Path(source).expanduser().exists() or source.startswith(("/", ".", "~")) or "\\" in source


def _check_local_model(source: str, weights: bool = True) -> Path:
    path = Path(source).expanduser()
    fix = "Give a folder written by save_pretrained, or a Hugging Face hub id such as meta-llama/Llama-3.1-8B."
    if not (path / "config.json").is_file():
        raise UserError(f"model.base_model={source!r} is not a model folder (no config.json there). {fix}")
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UserError(f"model.base_model={source!r}: its config.json cannot be read as JSON ({exc}). Restore the "
                        f"file (save_pretrained writes it) or download the model again. {fix}") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise UserError(f"model.base_model={source!r}: its config.json has no model_type, so transformers cannot "
                        f"tell the architecture. Restore the file or download the model again. {fix}")
    if weights and not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        raise UserError(f"model.base_model={source!r} has no weights (no *.safetensors or *.bin files beside "
                        f"config.json). Copy the weight files there or download the model again. {fix}")
    return path.resolve()


def max_positions(model_folder: Path) -> int | None:
    """The longest sequence the model's position embeddings cover (config.json), None when it does not say."""
    try:
        config = json.loads((model_folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        if isinstance(config.get(key), int) and config[key] > 0:
            return config[key]
    return None


def resolve_hub_revision(repo_id: str, revision: str | None, repo_type: str = "model") -> str:
    """The commit sha a hub revision points to now (from the local cache when HF_HUB_OFFLINE=1).

    Every failure is a UserError, never retried: a wrong id or revision does not heal, and without network
    a retry only delays the message (HF_HUB_OFFLINE=1 reads the local cache instead).
    """
    import huggingface_hub
    from huggingface_hub import HfApi, snapshot_download

    field = "model.base_model" if repo_type == "model" else "data.source"
    offline = huggingface_hub.constants.HF_HUB_OFFLINE
    try:
        if offline:
            folder = snapshot_download(repo_id, revision=revision, repo_type=repo_type, local_files_only=True)
            return Path(folder).name  # snapshots/<commit sha>
        return HfApi().repo_info(repo_id, revision=revision, repo_type=repo_type, timeout=10).sha
    except Exception as exc:  # noqa: BLE001 - sorted below into a message with its fix
        name = type(exc).__name__
        what = f"{field}={repo_id!r} (revision {revision or 'default'})"
        if offline:
            why = (f"HF_HUB_OFFLINE=1 and the {repo_type} is not in the local hub cache. Fetch it first "
                   f"(hf download {repo_id}{' --repo-type dataset' if repo_type == 'dataset' else ''}) or give "
                   "a local path")
        elif "NotFound" in name or "Gated" in name or name == "HfHubHTTPError":
            why = (f"the hub says: {str(exc).splitlines()[0]}. Check the id and revision, and your access "
                   "(hf auth login)")
        else:
            why = (f"the hub cannot be reached ({name}). Check the network, or set HF_HUB_OFFLINE=1 to use the "
                   "local hub cache, or give a local path")
        raise UserError(f"{what} cannot be resolved: {why}.") from None


def model_fingerprint(source: str, revision: str | None, only: tuple[str, ...] | None = None,
                      runs_dir: Path | None = None) -> dict[str, str]:
    """Content identity of a base model: its files' bytes (their hashes memoised in runs_dir), or the resolved hub
    commit."""
    if is_local(source):
        path = _check_local_model(source, weights=only is None)  # a tokenizer alone needs no weights
        files = [p for p in path.iterdir() if p.is_file() and (only is None or p.name in only)]
        return {"files_sha256": files_fingerprint(files, runs_dir=runs_dir)}
    return {"hub_repo": source, "hub_commit": resolve_hub_revision(source, revision)}


def model_path(source: str, revision: str | None, weights: bool = True) -> Path:
    """A local folder with the model's files, downloading a hub model at its resolved commit."""
    if is_local(source):
        return _check_local_model(source, weights)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(source, revision=resolve_hub_revision(source, revision)))


def load_tokenizer(path: Path) -> Any:
    """The model's tokenizer with a pad token (the eos token when it has none: pads are never labels)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    return tokenizer


def device() -> str:
    """'cuda' when a GPU is visible, else 'cpu'."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def compute_dtype(choice: str) -> torch.dtype:
    """The matmul dtype: the user's choice, or bf16 on GPUs that support it, fp16 on older GPUs, fp32 on CPU."""
    import torch

    if choice != "auto":
        return getattr(torch, choice)
    if not torch.cuda.is_available():
        reason, dtype = "no GPU: float32 on CPU (bf16 autocast is slower than fp32 on most CPUs)", torch.float32
    elif torch.cuda.is_bf16_supported():
        reason, dtype = "GPU supports bf16", torch.bfloat16
    else:
        reason, dtype = "GPU lacks bf16: float16", torch.float16
    logger().info("compute dtype %s (%s)", str(dtype).removeprefix("torch."), reason)
    return dtype


# Keyword arguments of every from_pretrained that builds the model to train or evaluate. transformers 5.25 turned
# `use_kernels` on by default: after loading, the model's layers are swapped for kernels downloaded from the Hub
# (kernels-community/rotary for Llama, so a machine without network fails to load). That is a network fetch at run
# time, and layers train_adapter did not choose beside the ones it does (the fused LoRA layers, Liger's kernels, the
# memory plan's recomputation); so they stay off.
LOAD_KWARGS = {"use_kernels": False}


# transformers' bitsandbytes integration quantizes only layers whose type is exactly nn.Linear (replace_with_bnb_linear,
# transformers 5.24). Falcon builds its projections from FalconLinear, an nn.Linear subclass that computes the same
# input @ weight.T + bias, so its "4-bit" checkpoint kept every layer in bf16 (modules.json counted no 4-bit
# layer). While such a model is built, the subclass's name in its modeling module stands for nn.Linear itself. Other
# nn.Linear subclasses in transformers (routers, grouped or decoupled layers) compute something else and are not
# listed.
SAME_AS_LINEAR = {"falcon": ("transformers.models.falcon.modeling_falcon", "FalconLinear")}


@contextmanager
def plain_linear_layers(model_folder: Path) -> Iterator[None]:
    """While the model in `model_folder` is built: its family's nn.Linear subclasses of the same maths (SAME_AS_LINEAR)
    are built as nn.Linear, so bitsandbytes quantizes them and a 4-bit checkpoint of them loads."""
    import importlib

    import torch

    try:
        model_type = json.loads((Path(model_folder) / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError):
        model_type = None  # from_pretrained reports the folder's problem itself
    if model_type not in SAME_AS_LINEAR:
        yield
        return
    module_name, name = SAME_AS_LINEAR[model_type]
    module = importlib.import_module(module_name)
    original = getattr(module, name)
    setattr(module, name, torch.nn.Linear)
    try:
        yield
    finally:
        setattr(module, name, original)


def load_quantized(model_dir: Path) -> Any:
    """The 4-bit checkpoint written by prepare_model, on this machine's device, ready for training."""
    import torch
    from transformers import AutoModelForCausalLM

    made = read_model_metrics(model_dir)
    # bnb needs the non-quantized weights' dtype == the 4-bit layers' compute dtype
    with plain_linear_layers(model_dir):
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=getattr(torch, made.compute_dtype),  # one GPU per data-parallel rank (LOCAL_RANK)
            device_map={"": int(os.environ.get("LOCAL_RANK", 0))} if device() == "cuda" else "cpu",
            attn_implementation=made.attn_implementation, **LOAD_KWARGS,
        )
    keep_cpu_repacking_to_fitting_shapes(model)
    return model


CPU_PACK_ROWS = 32  # bitsandbytes' CPU inference layout packs the output rows in blocks of this many


def keep_cpu_repacking_to_fitting_shapes(model: Any) -> int:
    """Turn off bitsandbytes' CPU inference repacking for the 4-bit layers whose shapes it cannot take.

    On a CPU with AVX512-BF16, a Linear4bit in eval mode without gradients repacks its weight for a faster kernel
    on its first forward, asserting `N % block_n == 0` (bitsandbytes 0.50: output features in blocks of 32, input
    features in whole quantization blocks). stories260K's MLP (172 wide) failed there, in evaluation, and only on
    such CPUs. Those layers keep the plain 4-bit matmul, the others the fast path. Returns how many were turned off."""
    import bitsandbytes as bnb

    count = 0
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit) and getattr(module, "support_avx512bf16_for_cpu", False):
            state = getattr(module.weight, "quant_state", None)
            block = state.blocksize if state is not None else 64
            if module.out_features % CPU_PACK_ROWS or module.in_features % block:
                module.support_avx512bf16_for_cpu = False  # Linear4bit.forward reads it before repacking
                count += 1
    return count


def read_model_metrics(model_dir: Path) -> ModelMetrics:
    """How prepare_model made the 4-bit checkpoint in model_dir (compute dtype, attention implementation)."""
    manifest = read_manifest(model_dir)
    if manifest is None or not isinstance(manifest.metrics, ModelMetrics):
        raise RuntimeError(f"{model_dir} is not a finished prepare_model folder")
    return manifest.metrics


DEQUANTIZE_MARGIN = 0.15  # share of the memory left free beside the dequantized copy: activations, logits, KV cache


def dequantized_extra_bytes(model: Any) -> int:
    """Bytes the 4-bit layers of `model` grow by when dequantized to their compute dtype."""
    import bitsandbytes as bnb

    extra = 0
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            state = module.weight.quant_state
            extra += module.in_features * module.out_features * state.dtype.itemsize - module.weight.nbytes
    return extra


def free_memory(on: str) -> tuple[int, int]:
    """(free, total) bytes of the GPU, or of the host's memory on CPU (MemAvailable, MemTotal)."""
    import torch

    if on == "cuda":
        return torch.cuda.mem_get_info()
    pages = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in
             Path("/proc/meminfo").read_text().splitlines() if line.startswith(("MemAvailable", "MemTotal"))}
    return pages.get("MemAvailable", 0), pages.get("MemTotal", 0)


def dequantize_decision(model: Any, choice: bool | str) -> tuple[bool, str]:
    """(whether to dequantize the 4-bit model for inference, why) for eval.dequantize true/false/auto."""
    extra = dequantized_extra_bytes(model)
    if extra <= 0:
        return False, "no 4-bit layers"
    # auto dequantizes on CPU too when the copy fits: the 4-bit layer dequantizes every weight on every forward
    # (docs/performance.md, "Evaluation", has the CPU figures)
    if choice is not True and choice is not False:  # auto: the copy must fit with a margin
        on = next(model.parameters()).device.type
        free, total = free_memory(on)
        fits = extra + DEQUANTIZE_MARGIN * total <= free
        where = "GPU" if on == "cuda" else "host"
        return fits, (f"auto: the dequantized copy adds {extra / 2**30:.2f} GiB, {free / 2**30:.1f} GiB of "
                       f"{total / 2**30:.1f} GiB {where} memory free ({'fits' if fits else 'does not fit'} with a "
                       f"{DEQUANTIZE_MARGIN:.0%} margin)")
    return bool(choice), f"eval.dequantize={str(choice).lower()}"


def dequantize_in_place(model: Any) -> Any:
    """Replace every bnb 4-bit Linear by a plain Linear holding its weight dequantized to the layer's compute dtype,
    one layer at a time (peak: the 4-bit model plus one layer). A 4-bit layer computes exactly this: it dequantizes
    the same NF4 weight to the compute dtype and runs the same matmul, on every forward. Not transformers'
    model.dequantize() (which export_adapter's merge uses): that one dequantizes each weight twice, casts to the
    config's dtype rather than each layer's compute dtype, and cannot tell a weight bnb repacked for its CPU kernel."""
    import bitsandbytes as bnb
    import torch

    for name, module in list(model.named_modules()):
        if not isinstance(module, bnb.nn.Linear4bit):
            continue
        if getattr(module.weight.quant_state, "packing_format_for_cpu", False):
            raise RuntimeError(f"{name}: bitsandbytes already repacked this weight for its CPU kernel; dequantize "
                               "before the model's first forward")
        weight = bnb.functional.dequantize_4bit(module.weight.data, module.weight.quant_state)
        linear = torch.nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                                 device="meta")
        linear.weight = torch.nn.Parameter(weight.to(module.compute_dtype or weight.dtype), requires_grad=False)
        if module.bias is not None:
            linear.bias = module.bias
        model.set_submodule(name, linear)
    model.is_loaded_in_4bit = False  # peft then attaches LoRA to plain Linear layers
    return model


@contextmanager
def allocator_restored() -> Iterator[None]:
    """Run training, then put back the CUDA allocator setting it changed: training turns on expandable segments
    (train_adapter/plan.py prepare_base: reserved memory stays near allocated), a process-wide setting that
    evaluate_adapter and export_adapter, in the same process in a run without the GPU pool, did not choose (in a
    fresh process neither setting changes evaluation's time: docs/performance.md, "Evaluation")."""
    try:
        yield
    finally:
        import torch

        if torch.cuda.is_available():
            release_device_memory()  # the segments are unmapped before the allocator changes mode
            conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", os.environ.get("PYTORCH_ALLOC_CONF", ""))
            set_expandable_segments("expandable_segments:True" in conf)


def set_expandable_segments(on: bool) -> None:
    """Turn the CUDA caching allocator's expandable segments on or off for this process (new segments only)."""
    import torch

    # torch 2.10 moved the setter (the old name warns, FutureWarning, on every call)
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or torch.cuda.memory._set_allocator_settings
    setter(f"expandable_segments:{on}")


def freeze_startup_objects(*_hook_args: object, **_hook_kwargs: object) -> None:
    """A flow on_running hook: every object alive when the flow starts (the imported modules, their classes and
    functions) leaves the garbage collector's reach (gc.freeze), once per process.

    Why: release_device_memory's gc.collect(), which frees a model held in reference cycles, scanned them all at
    every call, three to four calls per run (docs/performance.md, "Evaluation", has the seconds). Frozen objects
    that later become garbage in a cycle are never freed: harmless for what exists at a flow's start, unless a
    GPU already holds tensors (a notebook with a model loaded), and then the freeze steps aside."""
    import gc
    import sys

    torch = sys.modules.get("torch")
    if gc.get_freeze_count() or (torch is not None and torch.cuda.is_initialized()
                                 and torch.cuda.memory_allocated() > 0):
        return
    gc.freeze()


def release_device_memory() -> None:
    """Hand the GPU memory torch cached for freed tensors back (no-op on CPU), so later stages see it free."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def load_for_evaluation(model_dir: Path, choice: bool | str) -> Any:
    """The prepare_model checkpoint for inference: dequantized once when eval.dequantize says so (true, or auto
    and it fits), else the 4-bit model; one log line says which, why, and the load's seconds."""
    import time

    start = time.perf_counter()
    # a stage that ran before in this process (train_adapter without the GPU pool's child process) leaves its
    # memory in torch's cache, which would make the dequantized copy look as if it did not fit
    release_device_memory()
    model = load_quantized(model_dir)
    dequantized, why = dequantize_decision(model, choice)
    if dequantized:
        dequantize_in_place(model)
    logger().info("evaluate_adapter: model loaded (%.1fs), evaluated %s (%s)", time.perf_counter() - start,
                  "dequantized to its compute dtype" if dequantized else "in 4 bits", why)
    return model
