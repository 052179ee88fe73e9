"""A fused, chunked linear + cross-entropy: the loss and its gradient are computed from the hidden states a few
hundred rows at a time, so the (tokens x vocabulary) float32 logits never exist at once."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from tasks.config import SpeedArgs
from tasks.log import logger

if TYPE_CHECKING:
    import torch


def _chunk_rows(rows: int, hidden: int, vocab: int) -> int:
    """Rows per chunk: logits about the size of all the hidden states, within 256..512 rows (a 512 x 128,256
    chunk holds 0.4 GB of logits at once)."""
    return max(256, min(512, -(-rows * hidden // vocab)))


def _linear_ce_forward(hidden: torch.Tensor, head: torch.nn.Linear, labels: torch.Tensor, want_grad: bool,
                       softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Summed cross-entropy of head(hidden) against labels (all valid), and its gradient w.r.t. hidden. With
    softcap (Gemma 2), the logits are softcap * tanh(logits / softcap), as in the model's own forward.

    The logits come from calling the head module, not from its weight alone: under FSDP2 the head's parameters
    are gathered by the hooks of that call (reading head.weight without one finds a shard)."""
    import torch

    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    grad = torch.empty_like(hidden) if want_grad else None
    chunk = _chunk_rows(hidden.shape[0], hidden.shape[1], head.out_features)
    # a head kept in host memory comes to the device once for all chunks, and goes when the loss is done
    weight = head.on(hidden.device) if isinstance(head, _host_linear_type()) else None
    for start in range(0, hidden.shape[0], chunk):
        h, y = hidden[start:start + chunk], labels[start:start + chunk]
        logits = (head(h) if weight is None else torch.nn.functional.linear(h, weight)).float()
        capped = torch.tanh(logits / softcap) if softcap else None
        if capped is not None:
            logits = capped * softcap
        lse = torch.logsumexp(logits, dim=-1)
        total += (lse - logits.gather(1, y[:, None]).squeeze(1)).sum()
        if grad is not None:
            probs = logits.sub_(lse[:, None]).exp_()  # softmax, in place
            probs.scatter_add_(1, y[:, None], torch.full_like(lse, -1.0)[:, None])
            if capped is not None:  # d(softcap * tanh(z / softcap)) / dz = 1 - tanh^2
                probs.mul_(1 - capped.square_())
            grad[start:start + chunk] = probs.to(head.weight.dtype) @ (head.weight if weight is None else weight)
    return total, grad


class LinearCrossEntropy:
    """loss = sum over labelled rows of CE(head(hidden), label) / divisor; head is a frozen bias-free Linear."""

    @staticmethod
    def apply(hidden: torch.Tensor, head: torch.nn.Linear, labels: torch.Tensor, divisor: Any,
              softcap: float | None = None) -> torch.Tensor:
        return _function().apply(hidden, head, labels, divisor, softcap)


@functools.cache
def _function() -> Any:
    import torch

    class _LinearCrossEntropy(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, hidden: torch.Tensor, head: torch.nn.Linear, labels: torch.Tensor, divisor: Any,
                    softcap: float | None) -> torch.Tensor:
            rows = (labels != -100).nonzero().squeeze(1)
            picked = hidden if rows.numel() == hidden.shape[0] else hidden.index_select(0, rows)
            if picked.dtype != head.weight.dtype:  # autocast does not reach inside a custom Function's matmuls
                picked = picked.to(head.weight.dtype)
            total, grad = _linear_ce_forward(picked, head, labels.index_select(0, rows), hidden.requires_grad,
                                             softcap)
            ctx.shape, ctx.dtype, ctx.divisor = hidden.shape, hidden.dtype, divisor
            ctx.save_for_backward(rows, grad if grad is not None else rows.new_empty(0))
            return total / divisor

        @staticmethod
        def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
            rows, grad = ctx.saved_tensors
            grad = (grad * (grad_out / ctx.divisor)).to(ctx.dtype)
            if rows.numel() == ctx.shape[0]:
                return grad, None, None, None, None
            full = torch.zeros(ctx.shape, dtype=ctx.dtype, device=grad.device)
            return full.index_copy_(0, rows, grad), None, None, None, None

    return _LinearCrossEntropy


# config fields that change the logits after the head (Cohere, Granite, ...): the fused loss would skip them
LOGIT_SCALES = ("logit_scale", "logits_scaling", "output_multiplier_scale", "lm_head_multiplier")


def apply(model: Any, speed: SpeedArgs) -> str | None:
    """speed.fused_cross_entropy, before LoRA wraps the model: what it applied, for the log line; where the model's
    own loss cannot be reproduced (fused_loss_unsupported), one log line says why and transformers computes it."""
    if not speed.fused_cross_entropy:
        return None
    reason = fused_loss_unsupported(model)
    if reason is None and use_fused_loss(model):
        return "fused cross-entropy"
    logger().info("train_adapter: fused cross-entropy steps aside: %s; transformers computes the loss", reason)
    return None


def fused_loss_unsupported(causal_lm: Any) -> str | None:
    """Why the fused loss cannot reproduce this model's own loss, or None."""
    import torch

    head, inner = causal_lm.get_output_embeddings(), _inner_model(causal_lm)
    if type(head) is not torch.nn.Linear or getattr(head, "bias", None) is not None:
        return f"its output layer is a {type(head).__name__}{' with a bias' if head is not None else ''}, " \
               "not a bias-free Linear"
    if inner is None:
        return f"{type(causal_lm).__name__} has no inner model at .{causal_lm.base_model_prefix}"
    scaled = [name for name in LOGIT_SCALES if getattr(causal_lm.config, name, None) not in (None, 1, 1.0)]
    return f"its logits are rescaled ({', '.join(scaled)})" if scaled else None


def _inner_model(causal_lm: Any) -> Any:
    """The decoder under the LM head: .model (Llama, Qwen, Gemma...), .transformer (GPT-2), .gpt_neox (Pythia)."""
    return getattr(causal_lm, causal_lm.base_model_prefix, None)


def use_fused_loss(causal_lm: Any) -> bool:
    """Replace a causal LM's forward (with labels) by hidden states + LinearCrossEntropy; False where
    fused_loss_unsupported gives a reason."""
    import torch

    if fused_loss_unsupported(causal_lm):
        return False
    inner = _inner_model(causal_lm)
    softcap = getattr(causal_lm.config, "final_logit_softcapping", None)
    original = causal_lm.forward

    def forward(input_ids: Any = None, attention_mask: Any = None, position_ids: Any = None, labels: Any = None,
                num_items_in_batch: Any = None, **kwargs: Any) -> Any:
        from transformers.modeling_outputs import CausalLMOutputWithPast

        if labels is None:
            return original(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
        kwargs.pop("use_cache", None)
        out = inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                    use_cache=False, **kwargs)
        hidden = out.last_hidden_state[:, :-1].reshape(-1, out.last_hidden_state.shape[-1])
        targets = labels[:, 1:].reshape(-1).to(hidden.device)
        divisor = num_items_in_batch if num_items_in_batch is not None else (targets != -100).sum().clamp(min=1)
        if isinstance(divisor, torch.Tensor):
            divisor = divisor.to(hidden.device)
        # the head is looked up at each call: offload_output_layer may have replaced it since
        loss = LinearCrossEntropy.apply(hidden, causal_lm.get_output_embeddings(), targets, divisor, softcap)
        return CausalLMOutputWithPast(loss=loss, logits=None)

    causal_lm.forward = forward
    causal_lm._qlora_fused_loss = True
    return True


def offload_output_layer(causal_lm: Any) -> bool:
    """Keep the frozen output layer's weight in CPU memory (HostLinear), where the fused loss computes the loss:
    that loss needs the weight on the GPU only while it runs, in the forward pass (it computes its gradient
    there too), so the weight (vocabulary x hidden: 1 GiB for Llama 3's 128k tokens in bf16) no longer takes GPU
    memory through the backward pass, where the peak is. The price is one copy of the weight to the GPU per
    micro-batch (about 20 ms for 1 GiB). False where not possible: no fused loss, a trained, tied or
    biased head, or several processes (DDP broadcasts every parameter over NCCL, which takes GPU tensors only).
    True if already done (an earlier Trainer on the same model)."""
    head = causal_lm.get_output_embeddings()
    if isinstance(head, _host_linear_type()):
        return True
    reason = output_layer_offload_unsupported(causal_lm)
    if reason:
        logger().info("train_adapter: output layer offload steps aside: %s", reason)
        return False
    causal_lm.set_output_embeddings(_host_linear_type()(head))
    return True


def output_layer_offload_unsupported(causal_lm: Any) -> str | None:
    """Why the output layer cannot move to CPU memory, or None."""
    import torch

    from tasks.train_adapter.levers.parallel import several_processes

    head, emb = causal_lm.get_output_embeddings(), causal_lm.get_input_embeddings()
    if not getattr(causal_lm, "_qlora_fused_loss", False):
        return "the fused loss is not in use (transformers computes the loss from the output layer module)"
    bias = getattr(head, "bias", None) is not None
    if type(head) is not torch.nn.Linear or bias:
        return f"the output layer is a {type(head).__name__}{' with a bias' if bias else ''}"
    if head.weight is getattr(emb, "weight", None):
        return "the output layer is tied to the input embedding"
    if head.weight.requires_grad:
        return "the output layer is trained"
    if several_processes():
        return "several processes (DDP broadcasts parameters over NCCL, GPU tensors only)"
    return None


@functools.cache
def _host_linear_type() -> type:
    import torch

    class HostLinear(torch.nn.Module):
        """A frozen bias-free Linear whose weight stays in CPU memory (pinned where a GPU is present): a plain
        attribute, not a parameter or buffer, so that moving the model leaves it where it is. on(device) copies
        it over without making the host wait; the copy is freed when its user lets it go."""

        def __init__(self, linear: torch.nn.Linear) -> None:
            super().__init__()
            table = linear.weight.detach().to("cpu")
            self.table = table.pin_memory() if torch.cuda.is_available() else table
            self.out_features, self.in_features = self.table.shape

        @property
        def weight(self) -> torch.Tensor:  # for code that reads the head's dtype or shape
            return self.table

        def on(self, device: torch.device) -> torch.Tensor:
            return self.table.to(device, non_blocking=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # outside the fused loss (generation, say)
            return torch.nn.functional.linear(x, self.on(x.device))

    return HostLinear
