"""The memory plan of train_adapter: the fastest training that fits a GPU memory budget.

A plan is: tokens per packed micro-batch; which decoder layers recompute their activations in the backward pass,
in three modes (the first `recompute_layers` recompute the whole layer, the next `recompute_mlp_layers` only their
MLP, the rest keep everything); whether the whole-recomputed layers run their MLP in chunks
(speed.mlp_chunk_tokens) when the pack is longer; whether the recomputed layers' saved inputs live in host memory;
and whether the frozen embedding table and output layer do. choose_plan predicts each candidate's peak memory
from the model's dimensions and what is already allocated, and its time per token from a cost model; it takes
the fastest candidate that fits. The settings a user pins (speed.max_tokens_per_batch, speed.recompute_layers,
speed.recompute_mlp_layers, the offloads, train.gradient_checkpointing) narrow the candidates instead of being
overridden.

The memory and time models, why the layers go in this order, why an enumeration, and the measurements the
constants were fitted to: docs/performance.md, "How the memory plan chooses".
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

from tasks.models.dims import Dims

GIB = 2**30
# fitted to measured 8B runs: docs/performance.md, "The time model"
HOST_TOKENS = 1500
RECOMPUTE_COST = 0.333
OFFLOAD_ACTIVATIONS_COST = 0.02  # the side-stream copies of recomputed layers' inputs, per recomputed share
OFFLOAD_EMBEDDINGS_TOKENS = 480  # per micro-step: the output layer's copy to the GPU (~20 ms) and a host wait
TRAINABLE_BYTES = 16  # per trainable parameter: fp32 gradient, AdamW's two fp32 moments, the bf16 cast of the weight
LOSS_ROWS = 512  # the fused loss's largest chunk of rows: its fp32 logits (rows x vocabulary) exist at once
ALLOCATOR_SLACK = 0.05  # share of the budget kept free for fragmentation: the plan fits 95% of it
SCORES_SAVED = 4  # bytes per head per token pair: a layer keeping its attention's activations (dense mask)
SCORES_WORK = 12  # bytes per head per token pair: a layer's attention backward, on top (dense mask)
PACK_SIZES = (1024, 2048, 3072, 4096, 6144, 8192, 12288, 16384, 24576, 32768)  # candidate tokens per micro-batch


class Layout(NamedTuple):
    """One candidate: what a plan sets, before its peak and time are predicted."""

    tokens: int  # per packed micro-batch (an example longer than this trains alone)
    recompute_layers: int  # the first this many decoder layers recompute their whole activations
    offload_activations: bool  # whole-recomputed layers' saved inputs in pinned host memory
    offload_embeddings: bool  # the frozen embedding table (and output layer, where the fused loss runs) on the host
    recompute_mlp_layers: int = 0  # the next this many recompute only their MLP's; the rest keep everything
    chunk_recomputed: bool = False  # whole-recomputed layers run their MLP in chunks (packs past the chunk only)


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
    recompute_mlp_layers: int = 0  # the next this many recompute only their MLP (attention keeps its activations)
    chunk_recomputed: bool = False  # the whole-recomputed layers' MLP runs in speed.mlp_chunk_tokens chunks
    mlp_chunk: int = 0  # speed.mlp_chunk_tokens when the plan was made (MLP-only layers always chunk past it)
    dense_attention: bool = False  # packed rows attend through a T x T mask (the varlen kernel stepped aside)

    def describe(self) -> str:
        """One line for the log: what was chosen and the predicted peak."""
        kept = self.layers - self.recompute_layers - self.recompute_mlp_layers
        where = "host" if self.offload_activations else "GPU"
        parts = []
        if self.recompute_layers:
            chunks = f", MLP in chunks of {self.mlp_chunk:,}" if self.chunk_recomputed else ""
            parts.append(f"{self.recompute_layers} of {self.layers} layers recompute whole (inputs on the {where}"
                         f"{chunks})")
        if self.recompute_mlp_layers:
            parts.append(f"{self.recompute_mlp_layers} recompute only their MLP")
        parts.append(f"{kept} keep their activations" if kept < self.layers else
                     f"all {self.layers} layers keep their activations (no recomputation)")
        if self.dense_attention:
            parts.append("attention through a dense mask")
        return (f"memory plan: packs of {self.tokens:,} tokens, {', '.join(parts)}, embeddings and output layer on "
                f"the {'host' if self.offload_embeddings else 'GPU'}; predicted peak {self.predicted_peak_gib:.2f} "
                f"GiB of the {self.budget_gib:.2f} GiB budget")

    def mlp_chunks(self) -> list[int]:
        """Each decoder layer's MLP chunk (0: never): the plan chunks only recomputed MLPs, kept layers run whole."""
        whole = self.mlp_chunk if self.chunk_recomputed else 0
        mlp_only = self.recompute_layers + self.recompute_mlp_layers
        return [whole if i < self.recompute_layers else self.mlp_chunk if i < mlp_only else 0
                for i in range(self.layers)]

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
    mlp_chunk: int = 0  # speed.mlp_chunk_tokens (0: never)
    recompute_mlp_layers: int | None = None
    recompute_skip: bool = False  # recomputations skip the MLP's output projection (speed.recompute_skip)
    dense_attention: bool = False  # packed rows attend through a T x T mask (attention.dense_attention)


def mlp_share(dims: Dims) -> float:
    """The MLP's share of a decoder layer's matmul FLOPs per token: 3 i against the attention projections' 2 h + 2
    kv (q and o: h x h each; k and v: h x kv each)."""
    kv = dims.kv or dims.hidden
    return 3 * dims.intermediate / (3 * dims.intermediate + 2 * dims.hidden + 2 * kv)


def output_projection_share(dims: Dims) -> float:
    """The MLP's output projection's share of a decoder layer's matmul FLOPs per token: i of 3 i + 2 h + 2 kv."""
    return mlp_share(dims) / 3


def predicted_peak(dims: Dims, fixed: Fixed, layout: Layout, mlp_chunk: int = 0, dense: bool = False) -> int:
    """Peak GPU bytes allocated while training with this plan: the largest of the end of the forward pass (every
    saved activation, and the output layer back on the GPU for the loss when it lives on the host) and the backward
    of the top layer of each mode (what the layers below it hold, plus its own working memory). Past `mlp_chunk`
    tokens (speed.mlp_chunk_tokens) the MLP-only layers, and the whole-recomputed ones where the layout says so,
    run their MLP in checkpointed chunks: its activations then exist a chunk at a time. `dense`: attention runs
    through a T x T mask, whose scores add per layer (the module docstring)."""
    h, i, kv = dims.hidden, dims.intermediate, dims.kv or dims.hidden
    tokens, whole, mlp_only = layout.tokens, layout.recompute_layers, layout.recompute_mlp_layers
    chunk = mlp_chunk if mlp_chunk and tokens > mlp_chunk else tokens
    kept = dims.layers - whole - mlp_only
    pairs = (dims.heads or 1) * tokens * tokens if dense else 0  # attention scores of one layer
    scores, work = SCORES_SAVED * pairs, SCORES_WORK * pairs
    kept_layer = tokens * 2 * (8 * h + 2 * kv + 3 * i)
    mlp_layer = tokens * 2 * (8 * h + 2 * kv)  # attention's activations, the MLP's input and output
    held = kept * (kept_layer + scores) + mlp_only * (mlp_layer + scores)
    ends = [held + (fixed.output_layer_bytes if layout.offload_embeddings else 0)]  # the loss's copy of the head
    if kept:  # the top kept layer's backward holds about half a layer's activations more while it runs
        ends.append(held + kept_layer / 2 + work)
    if mlp_only:  # the top MLP-only layer's: half a layer and its MLP's rebuilt activations (or its attention's)
        ends.append(mlp_only * (mlp_layer + scores) + mlp_layer / 2 + max(2 * 3 * i * chunk, work))
    if whole:  # a whole-recomputed layer's backward rebuilds it
        ends.append(2 * (14 * h * tokens + 3 * i * (chunk if layout.chunk_recomputed else tokens)) + scores + work)
    saved = 0 if layout.offload_activations else whole * tokens * 2 * h
    offloaded = fixed.embedding_bytes + fixed.output_layer_bytes if layout.offload_embeddings else 0
    state = TRAINABLE_BYTES * fixed.trainable_parameters + 4 * LOSS_ROWS * dims.vocab + (tokens * tokens if dense
                                                                                         else 0)  # the bool mask
    return int(fixed.allocated - offloaded + state + saved + max(ends))


def relative_time(dims: Dims, layout: Layout, mlp_chunk: int = 0, skip: bool = False, dense: bool = False) -> float:
    """Predicted time per token of a plan, relative to no recomputation, no offload and endless packs; `skip`:
    recomputations skip the MLP's output projection; `dense`: attention computes every token pair of the pack."""
    share, skipped = mlp_share(dims), output_projection_share(dims) if skip else 0.0
    chunked = layout.chunk_recomputed and bool(mlp_chunk) and layout.tokens > mlp_chunk
    whole = 1 - skipped + (share - skipped if chunked else 0)
    recomputed = layout.recompute_layers * whole + layout.recompute_mlp_layers * (share - skipped)
    time = (1 + HOST_TOKENS / layout.tokens) * (1 + RECOMPUTE_COST * recomputed / dims.layers)
    if dense:  # 4 T h attention FLOPs per token and layer against the projections' 2 h (2 h + 2 kv + 3 i)
        time *= 1 + 2 * layout.tokens / (2 * dims.hidden + 2 * (dims.kv or dims.hidden) + 3 * dims.intermediate)
    if layout.offload_activations and layout.recompute_layers:
        time += OFFLOAD_ACTIVATIONS_COST * layout.recompute_layers / dims.layers
    if layout.offload_embeddings:
        time += OFFLOAD_EMBEDDINGS_TOKENS / layout.tokens
    return time


def candidates(dims: Dims, choices: Choices) -> Iterator[tuple[Layout, Sequence[int]]]:
    """The layouts the settings allow, in groups that differ only in their MLP-only layers: each group's layout
    and the numbers of MLP-only layers it allows, fewest (the fastest: each one more trades a kept layer for a
    recomputed MLP) first."""
    sizes = [choices.tokens] if choices.tokens else sorted({max(s, choices.longest_example) for s in PACK_SIZES})
    wholes = [choices.recompute_layers] if choices.recompute_layers is not None else range(dims.layers + 1)
    acts = [choices.offload_activations] if choices.offload_activations is not None else [False, True]
    embs = [choices.offload_embeddings] if choices.offload_embeddings is not None else [False, True]
    for tokens in sizes:
        for whole in wholes:
            whole = min(whole, dims.layers)
            mlps = ([min(choices.recompute_mlp_layers, dims.layers - whole)]
                    if choices.recompute_mlp_layers is not None else range(dims.layers - whole + 1))
            chunkings = [False, True] if whole and choices.mlp_chunk and tokens > choices.mlp_chunk else [False]
            for act in acts:
                if act and not whole:
                    continue  # nothing is saved to offload
                for emb in embs:
                    for chunked in chunkings:
                        yield Layout(tokens, whole, act, emb, 0, chunked), mlps


def choose_plan(dims: Dims, fixed: Fixed, budget_gib: float, choices: Choices) -> MemoryPlan | None:
    """The fastest predicted plan whose peak fits (1 - ALLOCATOR_SLACK) of the budget; None if none does."""
    room = budget_gib * GIB * (1 - ALLOCATOR_SLACK)
    best: tuple[float, int, Layout] | None = None
    for group, mlps in candidates(dims, choices):
        # within a group the peak never grows with the MLP-only layers (each replaces a kept layer, whose backward
        # needs more than the MLP's rebuilt activations) and the time grows: the first that fits is the fastest,
        # found by bisection (every layout, one by one, takes seconds for 80 layers)
        fits = bisect.bisect_left(mlps, True, key=lambda m, g=group: predicted_peak(
            dims, fixed, g._replace(recompute_mlp_layers=m), choices.mlp_chunk, choices.dense_attention) <= room)
        if fits == len(mlps):
            continue
        layout = group._replace(recompute_mlp_layers=mlps[fits])
        key = (relative_time(dims, layout, choices.mlp_chunk, choices.recompute_skip, choices.dense_attention),
               predicted_peak(dims, fixed, layout, choices.mlp_chunk, choices.dense_attention), layout)
        if best is None or key[:2] < best[:2]:
            best = key
    if best is None:
        return None
    time, peak, layout = best
    return MemoryPlan(layout.tokens, layout.recompute_layers, dims.layers, layout.offload_activations,
                      layout.offload_embeddings, round(peak / GIB, 2), round(budget_gib, 2), round(time, 4),
                      layout.recompute_mlp_layers, layout.chunk_recomputed, choices.mlp_chunk,
                      choices.dense_attention)


def smallest_peak_gib(dims: Dims, fixed: Fixed, choices: Choices) -> float:
    """The least memory any plan the settings allow needs (for the message when none fits): each group's last."""
    peaks = (predicted_peak(dims, fixed, group._replace(recompute_mlp_layers=mlps[-1]), choices.mlp_chunk,
                            choices.dense_attention) for group, mlps in candidates(dims, choices))
    return min(peaks) / GIB / (1 - ALLOCATOR_SLACK)
