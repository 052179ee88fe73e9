"""speed.fused_lora: each LoRA layer as one autograd Function gives peft's outputs and gradients, and a training
run with it gives the same losses and a normal PEFT adapter."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tasks.config import EMBEDDED_MODEL, LoraArgs, SpeedArgs, TrainArgs

torch = pytest.importorskip("torch")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _lora_model(base: str, dropout: float = 0.0) -> Any:
    """The real tiny Llama (4-bit NF4 with double quantization, or plain fp32) with LoRA on all projections and
    non-zero B matrices, so every gradient carries a value."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    extra: dict[str, Any] = {}
    if base == "4bit":
        extra["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL, dtype=torch.float32, device_map="cpu", **extra)
    model.config.use_cache = False
    torch.manual_seed(0)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=16, lora_dropout=dropout, target_modules=ALL))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model.train()


def _loss_and_grads(model: Any, autocast: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ids = torch.randint(3, 1000, (2, 37), generator=torch.Generator().manual_seed(2))
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(inputs_embeds=embeds, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), {**grads, "inputs_embeds": embeds.grad}


def _q_proj(model: Any) -> Any:
    return model.get_base_model().model.layers[0].self_attn.q_proj


def _runs_fused(layer: Any) -> bool:
    x = torch.randn(3, layer.in_features, requires_grad=True)
    node = layer(x).grad_fn  # the fused output, shaped like x outside the Function (a view)
    node = node.next_functions[0][0] if type(node).__name__ == "ViewBackward0" else node
    return type(node).__name__ == "_FusedLoraLinearBackward"


@pytest.mark.parametrize("base", ["4bit", "linear"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_fused_layers_give_peft_outputs_and_gradients(base: str, autocast: bool) -> None:
    from tasks.train_adapter.levers.fused_lora import fuse_lora_layers

    reference = _loss_and_grads(_lora_model(base), autocast)
    model = _lora_model(base)
    names = set(model.state_dict())
    assert fuse_lora_layers(model) == 4 * len(ALL)
    assert _runs_fused(_q_proj(model))
    loss, grads = _loss_and_grads(model, autocast)
    assert set(model.state_dict()) == names  # forward and backward change, the parameters do not
    assert grads.keys() == reference[1].keys() and len(grads) == 2 * 4 * len(ALL) + 1
    if not autocast:  # the same maths in another order
        torch.testing.assert_close(loss, reference[0], rtol=1e-5, atol=0)
        for name, grad in reference[1].items():
            assert grad.abs().max() > 0, name
            torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6 * float(grad.abs().max()), msg=name)
        return
    # bf16: both paths round every matmul, in different places; the fused one must be as close to the exact
    # (fp32) result as peft's own bf16 path is
    exact = _loss_and_grads(_lora_model(base), False)
    torch.testing.assert_close(loss, reference[0], rtol=1e-2, atol=0)
    for name, grad in exact[1].items():
        peft_error = float((reference[1][name] - grad).norm() / grad.norm())
        fused_error = float((grads[name] - grad).norm() / grad.norm())
        assert fused_error < 1.5 * peft_error + 2e-3 and fused_error < 0.05, (name, fused_error, peft_error)


def test_single_layer_matches_peft_in_fp32_and_bf16() -> None:
    """One 4-bit LoRA layer alone: output and the gradients of x, A and B, at tight tolerances."""
    from tasks.train_adapter.levers.fused_lora import fuse_lora_layers, unfuse_lora_layers

    model = _lora_model("4bit")
    layer = _q_proj(model)
    for autocast, tol in ((False, 1e-5), (True, 1e-2)):
        results = []
        for fused in (False, True):
            (fuse_lora_layers if fused else unfuse_lora_layers)(model)
            assert _runs_fused(layer) == fused
            x = torch.randn(2, 5, layer.in_features, generator=torch.Generator().manual_seed(3), requires_grad=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                y = layer(x)
            (y.float() * torch.linspace(-1, 1, y.numel()).view(y.shape)).sum().backward()
            a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
            results.append((y.detach(), x.grad, a.grad, b.grad))
            a.grad = b.grad = None
        for got, want in zip(results[1], results[0], strict=True):
            assert got.dtype == want.dtype
            assert float((got - want).norm() / want.norm()) < tol


@pytest.mark.parametrize("optimizer", ["bnb_8bit", "torch"])
def test_weights_cast_once_per_step_follow_every_update(optimizer: str) -> None:
    """Under bf16 autocast the fused layer keeps each LoRA weight's bf16 cast for an optimizer step. Training
    steps must still see every update: bitsandbytes' 8-bit AdamW writes the weights without moving their
    version counter, a checkpoint load moves only that. A stale cast would repeat the first step's outputs."""
    import bitsandbytes as bnb

    from tasks.train_adapter.levers.fused_lora import CAST, fuse_lora_layers, unfuse_lora_layers

    runs = {}
    for fused in (False, True):
        model = _lora_model("4bit")
        layer = _q_proj(model)
        (fuse_lora_layers if fused else unfuse_lora_layers)(model)
        params = [layer.lora_A["default"].weight, layer.lora_B["default"].weight]
        opt = (bnb.optim.AdamW8bit if optimizer == "bnb_8bit" else torch.optim.AdamW)(params, lr=2e-3)
        x = torch.randn(6, layer.in_features, generator=torch.Generator().manual_seed(5))
        outputs = []
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = layer(x)
            outputs.append(y.detach().float())
            y.float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        # a forward that caches the casts, then one after an in-place copy of a weight (as a checkpoint load
        # makes: no optimizer step), then one after new storage is put in (`.data =`, no version change)
        for change in ("copy", "data", None):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                outputs.append(layer(x).detach().float())
            with torch.no_grad():
                if change == "copy":
                    params[1].copy_(params[1] * 0.5)
                elif change == "data":
                    params[1].data = params[1].data * 0.5
        runs[fused] = outputs
        assert fused == hasattr(params[0], CAST)
    assert float((runs[False][1] - runs[False][0]).norm() / runs[False][0].norm()) > 0.1  # a step changes y
    for i in (4, 5):  # so do the copy and the new storage
        assert float((runs[False][i] - runs[False][i - 1]).norm() / runs[False][i - 1].norm()) > 0.1
    for got, want in zip(runs[True], runs[False], strict=True):
        assert float((got - want).norm() / want.norm()) < 1e-2


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_fused_layers_compile_without_graph_breaks_once_for_all_layers(autocast: bool) -> None:
    """torch.compile (Dynamo) traces decoder layers with the fused 4-bit LoRA layers and the chunked MLP whole:
    no graph break (a class built inside the traced code gave one per LoRA layer; under autocast, the LoRA
    weight cast cache gave one per layer on the GPU), one compiled graph for all four layers (per-layer objects in
    the traced code, such as methods bound to each layer, made it compile every layer anew, and stop compiling
    after 8), the loss and gradients of the same layers run eagerly. The ground for compiling layers."""
    import torch._dynamo

    from tasks.train_adapter.levers.fused_lora import fuse_lora_layers
    from tasks.train_adapter.levers.mlp import tile_mlp

    models = [_lora_model("4bit"), _lora_model("4bit")]
    for model in models:
        tile_mlp(model.get_base_model(), 16)  # 37 tokens: three chunks, each checkpointed
        fuse_lora_layers(model)
    reference = _loss_and_grads(models[0], autocast=autocast)
    model = models[1]
    for layer in model.get_base_model().model.layers:
        layer.compile(backend="aot_eager")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    try:
        loss, grads = _loss_and_grads(model, autocast=autocast)
        assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(loss, reference[0], rtol=1e-6, atol=0)
    for name, grad in reference[1].items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6 * float(grad.abs().max()), msg=name)


def test_layer_forward_compiled_inside_the_offloaded_checkpoint() -> None:
    """bench/compile_layers.py's "inside" way, the one the defaults' offloaded checkpoint needs: the decoder
    layer's forward compiled inside the checkpoint, for all layers at once, recomputed in the backward pass; loss
    and gradients as the same layers run eagerly, under bf16 autocast (the LoRA weight cast in the graph)."""
    import torch._dynamo

    from bench.compile_layers import compile_layers, dynamo_counts
    from tasks.train_adapter.levers.fused_lora import fuse_lora_layers
    from tasks.train_adapter.levers.recompute import enable_checkpointing

    models = [_lora_model("4bit"), _lora_model("4bit")]
    for model in models:
        fuse_lora_layers(model)
        enable_checkpointing(model.get_base_model(), offload=True)
    reference = _loss_and_grads(models[0], autocast=True)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    try:
        assert compile_layers(models[1], "inside", backend="aot_eager") == 4
        loss, grads = _loss_and_grads(models[1], autocast=True)
        # two graphs for all four layers: the forward (no autograd inside the checkpoint's Function) and the
        # recomputation in the backward pass (with autograd)
        assert dynamo_counts() == {"graph_breaks": 0, "compiled_graphs": 2}
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(loss, reference[0], rtol=0, atol=0)
    for name, grad in reference[1].items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=0, msg=name)


def test_dropout_merged_and_disabled_adapters_keep_peft_forward() -> None:
    from tasks.train_adapter.levers.fused_lora import fuse_lora_layers

    model = _lora_model("4bit", dropout=0.1)
    fuse_lora_layers(model)
    layer = _q_proj(model)
    assert not _runs_fused(layer)  # dropout is active in training: peft's own path, with its dropout
    model.eval()
    assert _runs_fused(layer)  # dropout is off in eval
    x = torch.randn(4, layer.in_features)
    with model.disable_adapter():
        assert not _runs_fused(layer)
        torch.testing.assert_close(layer(x), layer.get_base_layer()(x))
    plain = _lora_model("linear")
    fuse_lora_layers(plain)
    layer = _q_proj(plain)
    fused_out = layer(x)
    layer.merge()
    assert not _runs_fused(layer)
    torch.testing.assert_close(layer(x), fused_out, rtol=1e-5, atol=1e-5)


def test_training_with_fused_lora_gives_the_same_losses_and_a_peft_adapter(stages: dict[str, str]) -> None:
    from peft import PeftModel

    from tasks.models.loading import load_quantized
    from tasks.train_adapter.stage import train_adapter

    folders, losses = {}, {}
    for fused in (False, True):
        train = TrainArgs(max_steps=4, save_steps=10, logging_steps=1, per_device_train_batch_size=4)
        folder = Path(train_adapter.fn(LoraArgs(r=8, lora_alpha=16), train, SpeedArgs(fused_lora=fused),
                                       stages["runs"], stages["data"],
                                       stages["model"]))
        folders[fused] = folder
        losses[fused] = [json.loads(line)["loss"] for line in (folder / "loss.jsonl").read_text().splitlines()]
    assert folders[True] != folders[False] and len(losses[True]) == 4
    assert losses[True][0] != losses[True][-1]  # it trained
    torch.testing.assert_close(torch.tensor(losses[True]), torch.tensor(losses[False]), rtol=2e-3, atol=0)
    ids = torch.randint(3, 1000, (1, 24), generator=torch.Generator().manual_seed(4))
    logits = {}
    for fused, folder in folders.items():
        model = PeftModel.from_pretrained(load_quantized(Path(stages["model"])), folder / "adapter").eval()
        with torch.no_grad():
            logits[fused] = model(input_ids=ids).logits
    base = load_quantized(Path(stages["model"])).eval()
    with torch.no_grad():
        plain = base(input_ids=ids).logits
    assert float((logits[True] - plain).abs().max()) > 1e-3  # the adapter changes the outputs
    torch.testing.assert_close(logits[True], logits[False], rtol=2e-2, atol=2e-2)


def test_prepare_peft_fuses_by_default_and_not_when_off() -> None:
    from tasks.train_adapter.levers.fused_lora import PATCHED
    from tasks.train_adapter.plan import prepare_peft

    for setting, expected in ((None, 4 * len(ALL)), (True, 4 * len(ALL)), (False, 0)):
        model = prepare_peft(_lora_model("linear"), SpeedArgs(fused_lora=setting))
        assert sum(hasattr(m, PATCHED) for m in model.modules()) == expected
