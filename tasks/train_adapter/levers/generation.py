"""GRPO's answers sampled on the 4-bit base dequantized once per generation (train.method grpo).

TRL samples each step's answers with the policy's training forward: every 4-bit layer dequantizes its weight again
at every decoding step (max_completion_length steps a generation), and every LoRA layer runs peft's dozen small ops
around it; on a GPU the host's launches of those ops, not the GPU, set the pace. Here TRL's own
`_generate_single_turn` still runs (its padding, generation config, sampling and cut at the first eos), but while it
runs:

- each 4-bit layer multiplies by its weight dequantized once for the whole generation, by the function
  evaluate_adapter's dequantized copy uses (tasks/models/dequantize.py): the very matrix the 4-bit layer computes
  with, in its compute dtype. The copy is freed when the generation ends, so it never competes with training for
  memory; it must fit beside what is allocated (fits_budget: speed.gpu_memory_budget_gb on a GPU, the host's free
  memory on a CPU, the KV cache counted);
- each LoRA layer adds its adapter unmerged, as it is at this step, in peft's own ops and casts, without peft's
  call overhead;
- on a GPU the KV cache is static and each decoding step replays one CUDA graph (levers/decode_graphs.py).

The policy, the sampling and the answers' masks are TRL's; only how the same products are computed changes (on a CPU
in float32 the sampled tokens are TRL's own, tests/test_grpo_generation.py). Steps aside, with one log line saying
why: TRL's other generation backends (vLLM, continuous batching, tools, a rollout function, a vision model's inputs),
a model without 4-bit layers, a copy and KV cache that do not fit (logged again whenever that verdict changes).
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from tasks.config import SpeedArgs
from tasks.log import logger
from tasks.train_adapter.levers import decode_graphs

DENSE = "_qlora_dense_weight"  # attribute of a 4-bit layer holding its dequantized weight while answers are sampled
BUDGET_SHARE = 0.95  # of speed.gpu_memory_budget_gb, as the memory plan: the rest for the allocator's rounding


def install(trainer: Any, speed: SpeedArgs) -> str | None:
    """Make `trainer` (TRL's GRPOTrainer) sample its answers on the dequantized base where it can; what was done,
    in words, or None where it steps aside (both logged)."""
    reason = unsupported(trainer)
    if reason is not None:
        logger().info("train_adapter (generation): answers sampled by TRL's own path (%s)", reason)
        return None
    trainer._generate_single_turn = _fast_generation(trainer, trainer._generate_single_turn, speed)
    graphs = decode_graphs.unsupported(trainer.model)
    done = ("answers sampled on the 4-bit base dequantized once per generation, LoRA unmerged; "
            + (f"eager decoding steps ({graphs})" if graphs else "a static KV cache, each decoding step replayed as a "
               "CUDA graph"))
    logger().info("train_adapter (generation): %s", done)
    return done


def unsupported(trainer: Any) -> str | None:
    """Why the trainer's generation cannot take the dense path, or None."""
    if getattr(trainer, "use_vllm", False) or getattr(trainer, "use_transformers_continuous_batching", False):
        return "vLLM or continuous batching generates"
    if getattr(trainer, "tools", None) or getattr(trainer, "rollout_func", None) is not None:
        return "tools or a rollout function take part in generation"
    if not any(True for _ in _four_bit_layers(trainer.model)):
        return "the model has no 4-bit layers"
    return None


def _fast_generation(trainer: Any, original: Callable[..., Any], speed: SpeedArgs) -> Callable[..., Any]:
    """TRL's _generate_single_turn, run on the dense layers whenever its batch fits the budget."""
    said: list[bool] = []  # the last verdict logged: a new line only when it changes
    decoder = decode_graphs.Decoder()

    def generate_single_turn(prompt_ids: list[list[int]], images: Any, multimodal_fields: Any, num_generations: int,
                             has_tool_images: bool = False) -> Any:
        args = (prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        if images is not None or multimodal_fields or has_tool_images:  # a vision model's inputs: TRL's own path
            return original(*args)
        fits, why = fits_budget(trainer.model, speed, len(prompt_ids),
                                max(map(len, prompt_ids)) + trainer.max_completion_length)
        if said[-1:] != [fits]:
            said[:] = [fits]
            logger().info("train_adapter (generation): %s", why)
        if not fits:
            return original(*args)
        with dense_layers(trainer.model), decoder.graphed(trainer.model, trainer.generation_config):
            return original(*args)

    return generate_single_turn


def fits_budget(model: Any, speed: SpeedArgs, rows: int, tokens: int) -> tuple[bool, str]:
    """(whether the dequantized copy and the KV cache of `rows` sequences of `tokens` tokens fit: on a GPU beside
    what is allocated within speed.gpu_memory_budget_gb, on a CPU in the host's free memory with evaluation's
    margin; why)."""
    import torch

    from tasks.models.dequantize import DEQUANTIZE_MARGIN
    from tasks.models.memory import free_memory
    from tasks.train_adapter.plan import gpu_budget_gb

    need = sum(generation_bytes(model, rows, tokens))
    sizes = f"the copy and KV cache of {rows} answers x {tokens} tokens need {need / 2**30:.2f} GiB"
    if next(model.parameters()).device.type == "cuda":
        allocated, budget = torch.cuda.memory_allocated(), gpu_budget_gb(speed) * 2**30
        fits = allocated + need <= BUDGET_SHARE * budget
        where = (f"{allocated / 2**30:.2f} GiB allocated, {BUDGET_SHARE:.0%} of a {budget / 2**30:.1f} GiB budget "
                 "(speed.gpu_memory_budget_gb)")
    else:
        free, total = free_memory("cpu")
        fits = need + DEQUANTIZE_MARGIN * total <= free
        where = f"{free / 2**30:.1f} GiB of {total / 2**30:.1f} GiB host memory free, {DEQUANTIZE_MARGIN:.0%} kept"
    return fits, (f"answers sampled {'on the dequantized base' if fits else 'in 4 bits'}: {sizes} "
                  f"({'fits' if fits else 'does not fit'}: {where})")


def generation_bytes(model: Any, rows: int, tokens: int) -> tuple[int, int, int]:
    """Bytes a generation of `rows` sequences of `tokens` tokens adds on the dense path: the dequantized copy of
    the 4-bit layers, the KV cache, a decoding step's logits (and their float32 copy for sampling)."""
    from tasks.models.dims import model_dims

    dims = model_dims(model.config)
    dtype = next(model.parameters()).dtype  # the activations', so the cache's
    copy = sum(m.in_features * m.out_features * (m.compute_dtype or dtype).itemsize for m in _four_bit_layers(model))
    cache = 2 * dims.layers * rows * tokens * dims.kv * dtype.itemsize
    return copy, cache, rows * dims.vocab * (dtype.itemsize + 4)


@contextmanager
def dense_layers(model: Any) -> Iterator[None]:
    """While inside: every 4-bit layer of `model` multiplies by its dequantized weight, and every LoRA layer over
    one adds its adapter in peft's ops without peft's call overhead; both as they were afterwards."""
    from tasks.models.dequantize import dequantized_weight

    with ExitStack() as undo:
        for layer in _four_bit_layers(model):
            setattr(layer, DENSE, dequantized_weight(layer))
            undo.callback(delattr, layer, DENSE)
            undo.enter_context(_forward_replaced(layer, _dense_linear))
        for lora in _lora_layers(model):
            undo.enter_context(_forward_replaced(lora, _dense_lora))
        yield


@contextmanager
def _forward_replaced(module: Any, forward: Callable[..., Any]) -> Iterator[None]:
    """module.forward replaced by `forward` (bound to it) while inside; the forward it had put back, be it the
    class's or an instance's own (the fused LoRA lever sets one)."""
    own = module.__dict__.get("forward")
    module.forward = types.MethodType(forward, module)
    try:
        yield
    finally:
        if own is None:
            del module.forward
        else:
            module.forward = own


def _dense_linear(self: Any, x: Any) -> Any:
    """bnb's Linear4bit.forward with the dequantized weight: x in the compute dtype, the product back in x's."""
    import torch

    weight = getattr(self, DENSE)
    bias = None if self.bias is None else self.bias.to(weight.dtype)
    return torch.nn.functional.linear(x.to(weight.dtype), weight, bias).to(x.dtype)


def _dense_lora(self: Any, x: Any, *args: Any, **kwargs: Any) -> Any:
    """peft's LoRA forward over the dense base: result + lora_B(lora_A(dropout(x))) * scaling, the same ops and
    casts, for the plain case (one vanilla adapter, no autocast); peft's own forward otherwise."""
    import torch

    peft_forward = type(self).forward  # calls self.base_layer, which is dense while inside dense_layers
    active = self.active_adapters
    if (args or kwargs or self.disable_adapters or self.merged or len(active) != 1 or active[0] not in self.lora_A
            or active[0] in self.lora_variant or torch.is_autocast_enabled()):
        return peft_forward(self, x, *args, **kwargs)
    name = active[0]
    result = self.base_layer(x)
    a, b = self.lora_A[name].weight, self.lora_B[name].weight
    dropout = self.lora_dropout[name]
    x = self._cast_input_dtype(x, a.dtype)
    if not isinstance(dropout, torch.nn.Identity):
        x = dropout(x)  # TRL samples in training mode: peft's dropout, where lora_dropout > 0, applies as there
    output = torch.nn.functional.linear(torch.nn.functional.linear(x, a), b) * self.scaling[name]
    return result + output.to(result.dtype)


def _four_bit_layers(model: Any) -> Iterator[Any]:
    """bitsandbytes' 4-bit layers of `model` whose weight dequantizes as it is stored (not repacked for bnb's CPU
    inference kernel, whose layout dequantize_4bit cannot read)."""
    import bitsandbytes as bnb

    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit) and getattr(module.weight, "quant_state", None) is not None and \
                not getattr(module.weight.quant_state, "packing_format_for_cpu", False):
            yield module


def _lora_layers(model: Any) -> Iterator[Any]:
    """peft's LoRA layers whose base layer is one of _four_bit_layers."""
    from tasks.train_adapter.levers.fused_lora import lora_types

    dense = {id(m) for m in _four_bit_layers(model)}
    for module in model.modules():
        if isinstance(module, lora_types()) and id(module.get_base_layer()) in dense:
            yield module
