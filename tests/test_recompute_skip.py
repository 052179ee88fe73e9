"""speed.recompute_skip: a recomputation skips exactly the fused LoRA layers whose output it never reads, found in
the autograd graph per family, and the gradients stay bit for bit those of computing them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.families import build_family_model

torch = pytest.importorskip("torch")

# checkpoint mode -> (whole layers recomputed, MLP-only layers) of the tiny 2-layer models
MODES = {"offloaded": (2, 0), "checkpoint": (2, 0), "mlp": (0, 2), "mlp-chunks": (0, 2)}
# family, mode -> the projections a recomputation skips (their last name), in every recomputed layer
SKIPPED = {
    ("llama", "offloaded"): {"down_proj"},
    ("llama", "checkpoint"): {"down_proj"},
    ("llama", "mlp"): {"down_proj"},
    ("llama", "mlp-chunks"): {"down_proj"},
    # post_feedforward_layernorm normalises the MLP's output: a whole layer's recomputation reads it, the MLP's
    # own checkpoint (whose output it is) does not
    ("gemma2", "offloaded"): set(),
    ("gemma2", "mlp"): {"down_proj"},
    # parallel attention and MLP, each added into the residual: both output projections go unread
    ("gpt_neox", "checkpoint"): {"dense", "dense_4h_to_h"},
}


def _model(family: str, folder: Path, mode: str, skip: bool) -> Any:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from tasks.config import SpeedArgs
    from tasks.train_adapter import plan
    from tasks.train_adapter.levers.mlp import recompute_mlps
    from tasks.train_adapter.levers.recompute import enable_checkpointing

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.config.use_cache = False
    torch.manual_seed(1)
    model = get_peft_model(model, LoraConfig(target_modules="all-linear", r=4, lora_dropout=0.0,
                                             init_lora_weights="gaussian"))
    plan.prepare_peft(model, SpeedArgs(recompute_skip=skip))
    whole, mlp_only = MODES[mode]
    base = model.get_base_model()
    enable_checkpointing(base, offload=mode == "offloaded", recompute_layers=whole)
    recompute_mlps(base, whole, mlp_only, [5] * 2 if mode == "mlp-chunks" else None)
    return model.train()


def _step(model: Any, base_calls: list[str]) -> dict[str, torch.Tensor]:
    """One forward and backward; the fused layers' base matmuls run in the backward pass land in base_calls."""
    ids = torch.randint(3, 1000, (2, 13), generator=torch.Generator().manual_seed(2))
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    base_calls.clear()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family, mode", list(SKIPPED))
def test_recomputation_skips_the_unread_outputs_with_the_same_gradients(family: str, mode: str, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from tasks.train_adapter.levers import fused_lora

    folder = build_family_model(family, tmp_path / family)
    names: dict[int, str] = {}
    calls: list[str] = []
    original = fused_lora._base_matmul

    def spy(base: Any, kind: str, x: torch.Tensor) -> torch.Tensor:
        calls.append(names[id(base)])
        return original(base, kind, x)

    monkeypatch.setattr(fused_lora, "_base_matmul", spy)
    grads, recomputed = [], []
    for skip in (False, True):
        model = _model(family, folder, mode, skip)
        names.update({id(m): n.split(".")[-2] for n, m in model.named_modules() if n.endswith("base_layer")})
        steps = [_step(model, calls) for _ in range(2)]  # an offloaded layer learns in its first backward pass
        grads.append(steps[1])
        recomputed.append(list(calls))
    unskipped, skipping = recomputed
    assert unskipped, "the mode recomputes something"
    expected = [name for name in unskipped if name not in SKIPPED[family, mode]]
    assert sorted(skipping) == sorted(expected)
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name, grad in grads[0].items():
        assert torch.equal(grads[1][name], grad), name


def test_a_value_read_by_a_saving_node_is_never_skipped() -> None:
    """The graph rule on its own: an output that reaches the checkpoint's output through a multiply (which saves
    its inputs) is used; one that reaches it only through adds and casts is not."""
    from tasks.train_adapter.levers import recompute_skip

    x = torch.randn(4, 3, requires_grad=True)
    weights = [torch.randn(3, 3, requires_grad=True) for _ in range(3)]

    class Tagged(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, tag: str) -> torch.Tensor:
            ctx.save_for_backward(x, w)
            setattr(ctx, recompute_skip.SKIPPABLE, tags[tag])
            return x @ w

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
            x, w = ctx.saved_tensors
            return grad @ w.t(), x.t() @ grad, None

    tags = {name: torch.nn.Identity() for name in ("read", "added", "cast")}
    h = x + Tagged.apply(x, weights[0], "read")
    out = (h * h).sum(-1, keepdim=True) + Tagged.apply(h, weights[1], "added").double().float()
    out = out + Tagged.apply(x, weights[2], "cast").to(torch.float64).to(torch.float32)
    recompute_skip.learn("layer", out, [x], list(tags.values()))
    assert {name: getattr(tag, recompute_skip.VERDICTS) for name, tag in tags.items()} == {
        "read": {"layer": False}, "added": {"layer": True}, "cast": {"layer": True}}


@pytest.mark.parametrize("mode", ["offloaded", "mlp"])
def test_learning_the_verdicts_leaves_no_cycle_holding_the_graph(mode: str, tmp_path: Path) -> None:
    """The walk keeps nothing of the graph: a reference cycle holding autograd nodes kept every recomputed layer's
    saved activations alive until the cyclic collector ran, and ran a 16 GiB plan out of memory on the GPU."""
    import gc

    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    model = _model("llama", build_family_model("llama", tmp_path / "llama"), mode, skip=True)
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        _step(model, [])
        gc.collect()
        # torch.compile's tracing tensors (fake and functional: they hold no memory) sit in cycles of their own,
        # left by an earlier test's compile or by this step's, where it is the first compile of this worker process
        held = [type(o).__name__ for o in gc.garbage if isinstance(o, (torch.Tensor, torch.autograd.graph.Node))
                and not isinstance(o, (FakeTensor, FunctionalTensor))]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert not held
