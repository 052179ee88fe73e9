"""Padding-free preference batches: TRL's DPO and KTO trainers hand the model right-padded rows (each answer
after its prompt, padded to the longest row of the micro-batch); this runs the same sequences as one packed row
without the padding and gives TRL its per-token outputs back in the padded layout it reads them in.

Why here and not TRL's own: TRL 1.16 accepts DPOConfig.padding_free but turns it off with a warning
("temporarily unavailable after a refactor"), and KTOConfig has no such option. With lognormal lengths the
padding is a large share of a padded micro-batch (the longest of its rows sets everyone's length), and TRL runs
every row three times per step (policy forward, its backward, the reference forward).

How: TRL's add_fused_lm_head replaced the model's forward with one that, called with fused_lm_head=True and
labels, returns per-token log-probabilities (and entropy, mean logit, top-1) computed a tile at a time, never
the (tokens x vocabulary) logits. unpad_forward wraps that forward: the real tokens of the padded rows become
one row with position ids restarting at each sequence and cu_seq_lens marking the boundaries (the pipeline's
varlen attention on a GPU, attention.py; elsewhere transformers masks the row block-diagonally from the position
ids), the labels are shifted within each sequence (no sequence predicts the next one's first token), the fused
forward runs on that row with those shift_labels, and each per-token output is scattered back to (rows,
length - 1). The policy pass, the reference pass (adapter disabled), KTO's KL pass and TRL's reference precompute
all call this forward, so all run padding-free; the loss code, the reward metrics and the log are TRL's own.
"""

from __future__ import annotations

import functools
from typing import Any

PER_TOKEN = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask")


def unpad_forward(causal_lm: Any) -> bool:
    """Make `causal_lm`'s fused forward (TRL's add_fused_lm_head, already applied) run padding-free. False, with
    one log line, where TRL installed no fused forward (an older TRL): its padded batches then stay."""
    if "forward" not in vars(causal_lm):  # add_fused_lm_head sets an instance attribute
        from tasks.log import logger

        logger().info("train_adapter: padding-free batches step aside: this TRL computes no fused log-probabilities "
                      "(add_fused_lm_head, TRL 1.16) to wrap; TRL pads each micro-batch")
        return False
    fused = causal_lm.forward

    @functools.wraps(fused)
    def forward(*args: Any, fused_lm_head: bool = False, labels: Any = None, input_ids: Any = None,
                attention_mask: Any = None, **kwargs: Any) -> Any:
        if _padded_fused_call(args, fused_lm_head, labels, input_ids, attention_mask, kwargs):
            return _unpadded(fused, input_ids, attention_mask, labels, kwargs)
        return fused(*args, fused_lm_head=fused_lm_head, labels=labels, input_ids=input_ids,
                     attention_mask=attention_mask, **kwargs)

    forward.padding_free = True  # type: ignore[attr-defined] - for the log and the tests
    causal_lm.forward = forward
    return True


def _padded_fused_call(args: tuple, fused_lm_head: bool, labels: Any, input_ids: Any, attention_mask: Any,
                       kwargs: dict[str, Any]) -> bool:
    """True for the calls TRL's loss makes (token ids, a padding mask, labels, the fused head); anything else
    (generation, embeddings given, position ids or shifted labels already made) keeps the plain forward."""
    return (fused_lm_head and not args and labels is not None and input_ids is not None
            and attention_mask is not None and attention_mask.dim() == 2
            and all(kwargs.get(k) is None for k in ("inputs_embeds", "position_ids", "shift_labels")))


def _unpadded(fused: Any, input_ids: Any, attention_mask: Any, labels: Any, kwargs: dict[str, Any]) -> Any:
    import torch

    real = attention_mask.bool()
    rows, width = input_ids.shape
    # the label of position t is the token at t + 1 of the same row, none where that is padding or past the end
    shifted = torch.full_like(labels, -100)
    shifted[:, :-1] = labels[:, 1:].masked_fill(~real[:, 1:], -100)
    positions = (real.cumsum(1) - 1)[real].unsqueeze(0)
    bounds = torch.zeros(rows + 1, dtype=torch.int32, device=input_ids.device)
    bounds[1:] = real.sum(1).cumsum(0)
    # the padded width bounds every sequence's length: varlen attention takes it as its maximum, no host sync
    packed = fused(input_ids=input_ids[real].unsqueeze(0), attention_mask=None, position_ids=positions,
                   shift_labels=shifted[real].unsqueeze(0), fused_lm_head=True, cu_seq_lens_q=bounds,
                   cu_seq_lens_k=bounds, max_length_q=width, max_length_k=width, **kwargs)

    def padded(x: Any) -> Any:  # (1, real tokens) -> (rows, width - 1), zero where TRL's padded call gives zero
        flags = x.dtype == torch.bool  # is_top1, label_mask: scattered as bytes, the kernels' common ground
        source = x[0].to(torch.uint8) if flags else x[0]
        out = source.new_zeros(rows, width).masked_scatter(real, source)[:, :-1]
        return out.bool() if flags else out

    return type(packed)(**{k: padded(v) if k in PER_TOKEN else v for k, v in packed.items()})
