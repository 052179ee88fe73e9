"""The memory plan of train_adapter: the fastest training that fits a GPU memory budget.

A plan is: tokens per packed micro-batch, how many decoder layers recompute their activations in the backward pass
(the first ones; the rest keep theirs), whether the recomputed layers' saved inputs live in host memory, and whether
the frozen embedding table and output layer do. choose_plan predicts each candidate's peak memory from the model's
dimensions and what is already allocated, and its time per token from a cost model; it takes the fastest candidate
that fits. The settings a user pins (speed.max_tokens_per_batch, speed.recompute_layers, the offloads,
train.gradient_checkpointing) narrow the candidates instead of being overridden.

Why an enumeration and not a greedy order of levers: there are at most a few thousand candidates and the cost model
is a formula, so the best one under the model is found exactly; a greedy order (kept layers first, then offloads,
then packs) can stop at a worse corner when a bigger pack with one more recomputed layer beats a smaller pack.

Both models were fitted to measurements of the Llama-3.1-8B shape on an H200 (bf16, LoRA r=16 on all seven
projections, fused AdamW; bench/README.md "Issue 24" has the runs and how close each prediction came):

- memory per token: a layer that keeps its activations holds about 2 x (8 h + 2 kv + 3 i) bytes per token (h the
  hidden size, kv the key/value width, i the MLP width; 152 KB measured for 8B, 156 predicted); a recomputed layer
  holds its input, 2 h bytes, on the GPU unless offloaded; the backward of a recomputed layer needs about
  2 x (14 h + 3 i) bytes per token at once (197 KB measured at 8k-token packs, 201 predicted; 116 KB per token
  between 32k and 64k tokens, where the MLP runs in chunks, 115 predicted). Fixed: what is allocated when the plan
  is made (4-bit weights, LoRA weights), LoRA gradients and AdamW state (16 bytes per trainable parameter), one
  chunk of the fused loss's fp32 logits (0.92 GiB measured for these two, 0.87 predicted), less the embedding table
  and output layer when they are offloaded.
- time per token, relative: (1 + HOST_TOKENS / tokens) x (1 + RECOMPUTE_COST x recomputed / layers), plus small
  costs for each offload. HOST_TOKENS is the per-micro-step work (launches, optimizer step) in tokens' worth of
  compute; RECOMPUTE_COST the share of a step one more forward pass costs.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

GIB = 2**30
HOST_TOKENS = 3940  # 8B, H200: 12,964 real tokens/s at 8,192-token packs and 15,476 at 16,384, nothing recomputed
RECOMPUTE_COST = 0.376  # 8B, H200: 11,254 tokens/s with every layer recomputed at 16,384 tokens, against 15,476
OFFLOAD_ACTIVATIONS_COST = 0.02  # the side-stream copies of recomputed layers' inputs, per recomputed share
OFFLOAD_EMBEDDINGS_TOKENS = 480  # per micro-step: the output layer's copy to the GPU (~20 ms) and a host wait
TRAINABLE_BYTES = 16  # per trainable parameter: fp32 gradient, AdamW's two fp32 moments, the bf16 cast of the weight
LOSS_ROWS = 512  # the fused loss's largest chunk of rows: its fp32 logits (rows x vocabulary) exist at once
ALLOCATOR_SLACK = 0.05  # share of the budget kept free for fragmentation: the plan fits 95% of it
PACK_SIZES = (1024, 2048, 3072, 4096, 6144, 8192, 12288, 16384, 24576, 32768)  # candidate tokens per micro-batch


class Dims(NamedTuple):
    hidden: int
    intermediate: int
    layers: int
    vocab: int
    kv: int = 0  # key/value width (heads x head dim); 0 = hidden (no grouped-query attention)


# each family's names for the same sizes, first match wins: Llama/Qwen/Gemma/Mistral/Phi/GPT-NeoX, GPT-2, OPT,
# Falcon, MPT/T5-style
HIDDEN_NAMES = ("hidden_size", "n_embd", "d_model")
INTERMEDIATE_NAMES = ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size", "d_ff")
LAYER_NAMES = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
HEAD_NAMES = ("num_attention_heads", "n_head", "num_heads")


def model_dims(config: Any) -> Dims:
    """Hidden size, MLP width, layer count, vocabulary and key/value width of any decoder-only config, whatever
    its field names. A missing or None MLP width means the transformer default of 4 x hidden (GPT-2's n_inner,
    Falcon); a missing key/value head count means as many as query heads."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = _first(config, HIDDEN_NAMES)
    layers = _first(config, LAYER_NAMES)
    if hidden is None or layers is None:
        raise ValueError(f"{type(config).__name__} names its hidden size or layer count none of "
                         f"{HIDDEN_NAMES + LAYER_NAMES}")
    intermediate = _first(config, INTERMEDIATE_NAMES) or 4 * hidden
    heads, kv_heads = _first(config, HEAD_NAMES), getattr(config, "num_key_value_heads", None)
    head_dim = getattr(config, "head_dim", None) or (hidden // heads if heads else None)
    kv = kv_heads * head_dim if kv_heads and head_dim else hidden
    return Dims(hidden, intermediate, layers, config.vocab_size, kv)


def _first(config: Any, names: tuple[str, ...]) -> int | None:
    return next((v for v in (getattr(config, n, None) for n in names) if v is not None), None)


@dataclass(frozen=True)
class MemoryPlan:
    """One way to train within the budget, with its predicted peak and relative time per token."""

    tokens: int  # per packed micro-batch (an example longer than this trains alone)
    recompute_layers: int  # the first this many decoder layers recompute their activations in the backward pass
    layers: int
    offload_activations: bool  # recomputed layers' saved inputs in pinned host memory
    offload_embeddings: bool  # the frozen embedding table (and output layer, where the fused loss runs) on the host
    predicted_peak_gib: float
    budget_gib: float
    relative_time: float  # predicted time per token; 1.0 = nothing recomputed or offloaded, endless packs

    def describe(self) -> str:
        """One line for the log: what was chosen and the predicted peak."""
        kept = self.layers - self.recompute_layers
        where = "host" if self.offload_activations else "GPU"
        recompute = (f"{self.recompute_layers} of {self.layers} layers recomputed (inputs on the {where}), {kept} "
                     "keep their activations" if self.recompute_layers else f"all {self.layers} layers keep their "
                     "activations (no recomputation)")
        return (f"memory plan: packs of {self.tokens:,} tokens, {recompute}, embeddings and output layer on the "
                f"{'host' if self.offload_embeddings else 'GPU'}; predicted peak {self.predicted_peak_gib:.2f} GiB "
                f"of the {self.budget_gib:.2f} GiB budget")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Fixed:
    """What the plan cannot change: bytes already allocated, and what offloading could take off."""

    allocated: int  # GPU bytes allocated now (the model, LoRA weights)
    trainable_parameters: int
    embedding_bytes: int  # the input embedding table, if it is on the GPU and can move to the host (else 0)
    output_layer_bytes: int  # the same for the output layer


@dataclass(frozen=True)
class Choices:
    """The candidates the settings leave open (None: the plan chooses)."""

    tokens: int | None = None
    recompute_layers: int | None = None
    offload_activations: bool | None = None
    offload_embeddings: bool | None = None
    longest_example: int = 1
    mlp_chunk: int = 0  # speed.mlp_chunk_tokens (0: never); the plan's own packs stay within it, where the MLP
    # keeps its activations whole (a chunked MLP recomputes them: no faster than recomputing the layer)


def predicted_peak(dims: Dims, fixed: Fixed, tokens: int, recompute: int, offload_activations: bool,
                   offload_embeddings: bool, mlp_chunk: int = 0) -> int:
    """Peak GPU bytes allocated while training with this plan: the larger of the end of the forward pass (every
    saved activation, and the output layer back on the GPU for the loss when it lives on the host) and the start of
    the backward pass (the same, plus the backward's own working memory). Past `mlp_chunk` tokens
    (speed.mlp_chunk_tokens) the MLP runs in checkpointed chunks: its activations then exist a chunk at a time."""
    h, i, kv = dims.hidden, dims.intermediate, dims.kv or dims.hidden
    chunked = bool(mlp_chunk) and tokens > mlp_chunk
    mlp_tokens = mlp_chunk if chunked else tokens
    kept_layer = tokens * 2 * (6 * h + 2 * kv) + (tokens * 2 * 2 * h if chunked else tokens * 2 * (2 * h + 3 * i))
    kept = dims.layers - recompute
    # the top kept layer's backward holds about half a layer's activations more while it runs
    kept_backward = (kept + 0.5) * kept_layer + (2 * 3 * i * mlp_tokens if chunked else 0) if kept else 0
    working = 2 * (14 * h * tokens + 3 * i * mlp_tokens) if recompute else 0  # the backward of a recomputed layer
    saved = 0 if offload_activations else recompute * tokens * 2 * h
    head_copy = fixed.output_layer_bytes if offload_embeddings else 0  # on the GPU while the fused loss runs
    activations = saved + max(kept * kept_layer + head_copy, kept_backward, working)
    offloaded = fixed.embedding_bytes + fixed.output_layer_bytes if offload_embeddings else 0
    state = TRAINABLE_BYTES * fixed.trainable_parameters + 4 * LOSS_ROWS * dims.vocab
    return fixed.allocated - offloaded + state + activations


def relative_time(dims: Dims, tokens: int, recompute: int, offload_activations: bool, offload_embeddings: bool
                  ) -> float:
    """Predicted time per token of a plan, relative to no recomputation, no offload and endless packs."""
    share = recompute / dims.layers
    time = (1 + HOST_TOKENS / tokens) * (1 + RECOMPUTE_COST * share)
    if offload_activations and recompute:
        time += OFFLOAD_ACTIVATIONS_COST * share
    if offload_embeddings:
        time += OFFLOAD_EMBEDDINGS_TOKENS / tokens
    return time


def candidates(dims: Dims, choices: Choices) -> Iterator[tuple[int, int, bool, bool]]:
    """(tokens, recomputed layers, offload activations, offload embeddings) the settings allow."""
    sizes = [choices.tokens] if choices.tokens else sorted(
        {max(s, choices.longest_example) for s in PACK_SIZES if not choices.mlp_chunk or s <= choices.mlp_chunk})
    layers = [choices.recompute_layers] if choices.recompute_layers is not None else range(dims.layers + 1)
    acts = [choices.offload_activations] if choices.offload_activations is not None else [False, True]
    embs = [choices.offload_embeddings] if choices.offload_embeddings is not None else [False, True]
    for tokens in sizes:
        for recompute in layers:
            for act in acts:
                if act and not recompute:
                    continue  # nothing is saved to offload
                for emb in embs:
                    yield tokens, recompute, act, emb


def choose_plan(dims: Dims, fixed: Fixed, budget_gib: float, choices: Choices) -> MemoryPlan | None:
    """The fastest predicted plan whose peak fits (1 - ALLOCATOR_SLACK) of the budget; None if none does."""
    room = budget_gib * GIB * (1 - ALLOCATOR_SLACK)
    best: MemoryPlan | None = None
    for tokens, recompute, act, emb in candidates(dims, choices):
        peak = predicted_peak(dims, fixed, tokens, recompute, act, emb, choices.mlp_chunk)
        if peak > room:
            continue
        plan = MemoryPlan(tokens, recompute, dims.layers, act, emb, round(peak / GIB, 2), round(budget_gib, 2),
                          round(relative_time(dims, tokens, recompute, act, emb), 4))
        if best is None or (plan.relative_time, plan.predicted_peak_gib) < (best.relative_time,
                                                                              best.predicted_peak_gib):
            best = plan
    return best


def smallest_peak_gib(dims: Dims, fixed: Fixed, choices: Choices) -> float:
    """The least memory any plan the settings allow needs (for the message when none fits)."""
    peaks = (predicted_peak(dims, fixed, *c, choices.mlp_chunk) for c in candidates(dims, choices))
    return min(peaks) / GIB / (1 - ALLOCATOR_SLACK)
