"""A training whose loss stops being a finite number is stopped, and a damaged init adapter is refused, before
anything of theirs is saved.

Why a loss goes non-finite: a learning rate too high for the model and data, float16 overflow, or a starting adapter
(train.init_adapter) whose weights are damaged. The Trainer itself trains on (its NaN filter is off, and would only
hide the NaN in the logged average: fit.host_sync_free) and saves NaN weights that evaluate to a uniform guess.

- `guarded(Trainer class)` + `FiniteLoss`: each micro-step's loss is tested on its own device, without waiting for
  it (a wait per step lets the GPU idle while the host prepares the next one); the first optimizer step whose loss
  was not finite is kept there, and read where the Trainer waits for the device anyway (before a loss log line, a
  checkpoint, the end of training) and at every step on a CPU, where reading costs nothing. All processes of a
  data-parallel training read the same step (an all-reduce), so they stop together. The stop raises TrainingDiverged
  naming that step, before the log line or checkpoint: no loss line, checkpoint, adapter or manifest holds it.
- `check_init_adapter`: before the first optimizer step, the base model with the init adapter and without it on the
  first training examples. Damaged means: a logit is not finite; or every logit is the same at every scored position
  (a uniform guess: weights of 1e28 do that, the hidden states overflow to inf in the norms, which then output 0)
  where the base model's are not; or its loss is more than WORSE_THAN_GUESSING nat above both the base model's and
  a uniform guess's (ln V). An adapter that is merely worse than the base passes (it may come from other data): a
  training from it that diverges is stopped as above, and the registry's gate judges what it becomes.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from transformers import TrainerCallback

from tasks.config import TrainArgs
from tasks.errors import TrainingDiverged, UserError
from tasks.log import logger

if TYPE_CHECKING:
    import torch

_NONE = 2**62  # "no non-finite step yet": above any step number, so the smallest over processes is the first
CHECK_ROWS, CHECK_TOKENS = 4, 256  # examples the init adapter is tried on, and tokens of each (logits: T x V floats)
WORSE_THAN_GUESSING = 1.0  # nats above both the base model's loss and a uniform guess's (ln V): damaged
_FLAT = 1e-4  # logits that differ by no more than this across the vocabulary are one uniform prediction


@functools.cache
def guarded(base: type) -> type:
    """`base` (the transformers Trainer, or TRL's DPO/KTO trainer) whose training step hands each micro-step's loss
    to the FiniteLoss callback among its callbacks."""

    class FiniteLossTrainer(base):
        def training_step(self, *args: Any, **kwargs: Any) -> Any:
            loss = super().training_step(*args, **kwargs)
            watch = next(c for c in self.callback_handler.callbacks if isinstance(c, FiniteLoss))
            watch.see(loss, self.state.global_step + 1)  # the optimizer step this micro-step belongs to
            return loss

    FiniteLossTrainer.__name__ = FiniteLossTrainer.__qualname__ = f"FiniteLoss{base.__name__}"
    return FiniteLossTrainer


class FiniteLoss(TrainerCallback):
    """Stops training with TrainingDiverged once a micro-step's loss was not finite (see the module docstring)."""

    def __init__(self, train: TrainArgs, compute_dtype: str) -> None:
        self.train, self.compute_dtype = train, compute_dtype
        self.first: torch.Tensor | None = None  # on the loss's device: the first such optimizer step, or _NONE
        self.value: torch.Tensor | None = None  # the loss of that step

    def see(self, loss: torch.Tensor, step: int) -> None:
        """Record `loss` (a micro-step of optimizer step `step`) on its device; nothing here waits for it."""
        import torch

        loss = loss.detach().float().reshape(-1)[:1].reshape(())
        if self.first is None:
            self.first = torch.full((), _NONE, dtype=torch.int64, device=loss.device)
            self.value = torch.zeros((), dtype=torch.float32, device=loss.device)
        new = ~torch.isfinite(loss) & (self.first == _NONE)
        self.first = torch.where(new, step, self.first)
        self.value = torch.where(new, loss, self.value)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # the default flow callback ran first: should_log / should_save say what the Trainer does after this
        waits_anyway = control.should_log or control.should_save or state.global_step >= state.max_steps
        if waits_anyway or self.first is None or self.first.device.type == "cpu":
            self.check(state.max_steps)

    def check(self, max_steps: int) -> None:
        """Raise TrainingDiverged when some process saw a non-finite loss (every process must call it)."""
        import torch
        import torch.distributed as dist

        first = self.first if self.first is not None else torch.full((), _NONE, dtype=torch.int64)
        mine = int(first.item())
        if dist.is_available() and dist.is_initialized():
            device = "cuda" if dist.get_backend() == "nccl" else "cpu"
            shared = first.to(device).clone()
            dist.all_reduce(shared, op=dist.ReduceOp.MIN)
            first = shared
        step = int(first.item())
        if step == _NONE:
            return
        value = float(self.value.item()) if mine == step and self.value is not None else float("nan")
        raise TrainingDiverged(diverged_message(step, max_steps, value, self.train, self.compute_dtype))


def diverged_message(step: int, max_steps: int, value: float, train: TrainArgs, compute_dtype: str) -> str:
    """The paragraph for a training stopped at `step`: what happened, what was kept, what to change."""
    causes = [f"a learning rate too high for this model and data (train.learning_rate={train.learning_rate:g}: try "
              f"{train.learning_rate / 10:g}, or more train.warmup_steps)"]
    if compute_dtype == "float16":
        causes.append("float16 overflow on a GPU without bfloat16 (a smaller learning rate helps there too)")
    if train.init_adapter:
        causes.append(f"a damaged starting adapter (train.init_adapter={train.init_adapter}: start from another "
                      "version, or unset it)")
    return (f"train_adapter stopped at optimizer step {step} of {max_steps}: the training loss there was {value}, "
            "not a finite number, so the weights trained from then on cannot be trusted; nothing of that step or "
            "later was written (no loss line, checkpoint, adapter or manifest). The usual causes: "
            f"{'; '.join(causes)}. Change that and run again: the same settings diverge the same way.")


def check_init_adapter(model: Any, rows: list[tuple[list[int], list[int]]], name: str) -> None:
    """Refuse train.init_adapter `name` when, on `rows` (the first training examples: token ids and labels, -100
    where not scored), the base model with it is damaged by the module docstring's rules, compared with the base
    model alone on the same rows."""
    import torch

    rows = [_window(ids, labels) for ids, labels in rows[:CHECK_ROWS]]
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            tuned = _lm_loss(model, rows)
            with model.disable_adapter():
                base = _lm_loss(model, rows)
    finally:
        model.train(training)
    if tuned.loss is None or base.loss is None:  # no scored token in these rows: nothing to compare
        return
    uniform = math.log(tuned.vocab)
    logger().info("train_adapter: the init adapter on the first %d training examples: loss %.4f, the base model's "
                  "%.4f (a uniform guess: %.4f)", len(rows), tuned.loss, base.loss, uniform)
    if not math.isfinite(tuned.loss):
        what = "computes logits that are not finite numbers"
    elif tuned.flat and not base.flat:
        what = "predicts the same for every token at every position (a uniform guess), which the base model does not"
    elif tuned.loss > max(base.loss, uniform) + WORSE_THAN_GUESSING:
        what = f"scores more than {WORSE_THAN_GUESSING:g} nat worse than both the base model and a uniform guess"
    else:
        return
    raise UserError(
        f"train.init_adapter={name!r} is damaged: on the first {len(rows)} training examples the base model with it "
        f"{what} (loss {tuned.loss:.4f}; the base model alone {base.loss:.4f}, a uniform guess over its "
        f"{tuned.vocab} tokens {uniform:.4f}); its largest weight is {_largest_weight(model):.3g}. Nothing was "
        "trained from it. Start from another adapter (an earlier registry version: runs_dir/exports/NAME/vNNNN), or "
        "unset train.init_adapter to train a fresh one.")


@dataclass
class _Scored:
    loss: float | None  # mean next-token cross-entropy over the scored tokens; None: none scored; inf: a bad logit
    vocab: int
    flat: bool  # every scored position's logits are equal (within _FLAT): a uniform prediction


def _window(ids: list[int], labels: list[int]) -> tuple[list[int], list[int]]:
    """At most CHECK_TOKENS tokens of an example, from a little before its first scored token (a long prompt would
    leave nothing scored in its first tokens)."""
    first = next((i for i, label in enumerate(labels) if label != -100), 0)
    start = max(0, min(first - CHECK_TOKENS // 4, len(ids) - CHECK_TOKENS))
    return ids[start:start + CHECK_TOKENS], labels[start:start + CHECK_TOKENS]


def _lm_loss(model: Any, rows: list[tuple[list[int], list[int]]]) -> _Scored:
    """The model's scores on `rows`, one row per forward (no padding, so the packed-attention path runs as plain
    causal attention)."""
    import torch

    device = model.get_input_embeddings().weight.device
    total, count, vocab, flat = 0.0, 0, 1, True
    for ids, labels in rows:
        logits = model(input_ids=torch.tensor([ids], device=device)).logits[0, :-1].float()
        vocab = logits.shape[-1]
        if not torch.isfinite(logits).all():
            return _Scored(math.inf, vocab, False)
        targets = torch.tensor(labels[1:], device=logits.device)
        scored = targets != -100
        total += float(torch.nn.functional.cross_entropy(logits[scored], targets[scored], reduction="sum"))
        count += int(scored.sum())
        spread = logits[scored].max(dim=-1).values - logits[scored].min(dim=-1).values
        flat = flat and bool((spread <= _FLAT).all())
    return _Scored(total / count if count else None, vocab, flat and count > 0)


def _largest_weight(model: Any) -> float:
    """The largest absolute value among the adapter's trained weights (a hint at the damage)."""
    values = [p.detach().abs().max().item() for n, p in model.named_parameters() if "lora_" in n and p.numel()]
    return max(values, default=0.0)
