"""The speed levers of train_adapter keep the maths: packing, fused cross-entropy, offloaded checkpointing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tasks.config import EMBEDDED_MODEL, SpeedArgs, TrainArgs
from tasks.train_adapter.levers.attention import set_packed_attention
from tasks.train_adapter.levers.loss import use_fused_loss
from tasks.train_adapter.levers.mlp import tile_mlp
from tasks.train_adapter.levers.packs import PackedExamples, pack_collator, plan_packs
from tasks.train_adapter.levers.recompute import enable_checkpointing, offload_embeddings
from tasks.train_adapter.plan import training_batches

torch = pytest.importorskip("torch")


class _Examples:
    def __init__(self, input_ids: list[list[int]]) -> None:
        self.input_ids, self.labels = input_ids, [list(x) for x in input_ids]

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return {"input_ids": self.input_ids[i], "labels": self.labels[i]}


def _examples(lengths: list[int], vocab: int = 1024, seed: int = 0) -> _Examples:
    g = torch.Generator().manual_seed(seed)
    return _Examples([torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths])


def _tiny(attn: str = "sdpa") -> Any:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL, dtype=torch.float32, attn_implementation=attn)
    model.config.use_cache = False  # as in training: with a cache, transformers does not mask packed rows
    return model.eval()


def _per_example_loss_unpacked(model: Any, examples: _Examples) -> torch.Tensor:
    sums = []
    with torch.no_grad():
        for ids in examples.input_ids:
            x = torch.tensor([ids])
            sums.append(model(input_ids=x, labels=x).loss * (len(ids) - 1))
    return torch.stack(sums)


def _per_example_loss_packed(model: Any, examples: _Examples) -> torch.Tensor:
    batch = pack_collator()([{"input_ids": examples.input_ids, "labels": examples.labels}])
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                       cu_seq_lens_q=batch["cu_seq_lens_q"], cu_seq_lens_k=batch["cu_seq_lens_k"],
                       max_length_q=batch["max_length_q"], max_length_k=batch["max_length_k"]).logits[0]
    labels = batch["labels"][0]
    token_loss = torch.nn.functional.cross_entropy(logits[:-1].float(), labels[1:], ignore_index=-100,
                                                   reduction="none")
    owner = torch.repeat_interleave(torch.arange(len(examples)), torch.tensor([len(x) for x in examples.input_ids]))
    return torch.zeros(len(examples)).index_add_(0, owner[1:], token_loss)


def test_plan_packs_respects_limits_and_keeps_every_example_once() -> None:
    lengths = [5, 300, 40, 40, 700, 12, 90, 1, 250]
    packs = plan_packs(lengths, max_tokens=400, max_examples=None, seed=3)
    assert sorted(i for p in packs for i in p) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in p) <= 400 or len(p) == 1 for p in packs)
    by_count = plan_packs(lengths, max_tokens=None, max_examples=4, seed=3)
    assert [len(p) for p in by_count] == [4, 4, 1]
    assert plan_packs(lengths, 400, None, seed=3) == packs  # deterministic for a seed


def test_pack_collator_masks_boundaries_and_restarts_positions() -> None:
    batch = pack_collator()([{"input_ids": [[5, 6, 7], [8, 9]], "labels": [[5, 6, 7], [-100, 9]]}])
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    assert batch["labels"].tolist() == [[-100, 6, 7, -100, 9]]  # 8 would be predicted from example 1's last token
    assert batch["cu_seq_lens_q"].tolist() == [0, 3, 5] and batch["max_length_q"] == 3


@pytest.mark.parametrize("attention", ["sdpa", "packed_attention"])
def test_packed_rows_give_each_example_its_unpacked_loss(attention: str) -> None:
    """No example attends to another: per-example losses in one packed row equal those run one by one."""
    model = _tiny()
    examples = _examples([17, 64, 3, 120, 40])
    expected = _per_example_loss_unpacked(model, examples)
    if attention == "packed_attention":  # the GPU path's function, on its CPU fallback
        set_packed_attention(model)
    packed = _per_example_loss_packed(model, examples)
    torch.testing.assert_close(packed, expected, rtol=1e-4, atol=1e-4)
    # and packing really mixes rows: a mask that lets examples see each other changes the losses
    crossed = _tiny()
    batch = pack_collator()([{"input_ids": examples.input_ids, "labels": examples.labels}])
    with torch.no_grad():
        leaky = crossed(input_ids=batch["input_ids"], labels=batch["labels"]).loss  # plain causal over the row
        fair = crossed(input_ids=batch["input_ids"], labels=batch["labels"], position_ids=batch["position_ids"]).loss
    assert abs(leaky - fair) > 1e-3
    torch.testing.assert_close(fair * batch["labels"][0, 1:].ne(-100).sum(), expected.sum(), rtol=1e-4, atol=1e-4)


def test_fused_cross_entropy_matches_transformers_loss_and_gradients() -> None:

    examples = _examples([30, 50, 9])
    batch = pack_collator()([{"input_ids": examples.input_ids, "labels": examples.labels}])
    inputs = {k: batch[k] for k in ("input_ids", "labels", "position_ids")}
    results = []
    for fused in (False, True):
        model = _tiny().train()
        if fused:
            assert use_fused_loss(model)
        loss = model(**inputs).loss
        loss.backward()
        results.append((loss.detach(), model.model.layers[0].mlp.up_proj.weight.grad.clone()))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-4, atol=1e-6)


def test_offloaded_checkpointing_gives_the_same_gradients() -> None:
    from peft import LoraConfig, get_peft_model


    examples = _examples([30, 50, 9])
    batch = pack_collator()([{"input_ids": examples.input_ids, "labels": examples.labels}])
    inputs = {k: batch[k] for k in ("input_ids", "labels", "position_ids")}
    grads = []
    for mode in ("none", "checkpoint", "offload"):
        torch.manual_seed(1)
        base = _tiny()
        if mode != "none":
            enable_checkpointing(base, offload=mode == "offload")
        lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "down_proj"],
                          init_lora_weights="gaussian")
        model = get_peft_model(base, lora).train()
        torch.manual_seed(2)
        model(**inputs).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    for other in grads[1:]:
        assert other.keys() == grads[0].keys()
        for name in grads[0]:
            torch.testing.assert_close(other[name], grads[0][name], rtol=1e-4, atol=1e-6)


def test_offloaded_checkpointing_fetches_each_input_one_layer_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    """In the backward pass each layer's saved input is already on its way back when that layer's turn comes:
    the layer above started the copy (on a GPU, on the side stream, overlapping its own recomputation). Only the
    top layer fetches its own."""
    from tasks.train_adapter.levers import recompute

    ready: list[bool] = []
    original = recompute._fetched

    def spy(ctx: Any) -> Any:
        ready.append(ctx.fetched is not None)
        return original(ctx)

    monkeypatch.setattr(recompute, "_fetched", spy)
    base = _tiny()
    enable_checkpointing(base, offload=True)
    base.train()
    ids = torch.randint(3, 1000, (1, 20), generator=torch.Generator().manual_seed(0))
    base(input_ids=ids, labels=ids).loss.backward()
    assert ready == [False] + [True] * (base.config.num_hidden_layers - 1)


def test_embeddings_kept_in_host_memory_give_the_same_gradients() -> None:
    """offload_embeddings moves the table out of the model's parameters (so no model.to moves it back to a GPU);
    the loss and every LoRA gradient, the first layer's included, stay the same."""
    from peft import LoraConfig, get_peft_model

    examples = _examples([30, 50, 9])
    pack = [{"input_ids": examples.input_ids, "labels": examples.labels}]
    results = []
    for mode in ("on_model", "host"):
        torch.manual_seed(1)
        model = get_peft_model(_tiny(), LoraConfig(r=4, target_modules=["q_proj", "down_proj"],
                                                   init_lora_weights="gaussian"))
        table = model.get_input_embeddings().weight.detach().clone()
        if mode != "on_model":
            assert offload_embeddings(model)
            assert offload_embeddings(model)  # a second Trainer on the same model finds it done
            assert not any("embed_tokens" in name for name, _ in model.named_parameters())
            assert "embed_tokens" not in "".join(model.state_dict())
            model.to(torch.float64)  # what moves or casts the model's tensors leaves the table alone
            assert model.get_input_embeddings().weight.dtype == table.dtype
            torch.testing.assert_close(model.get_input_embeddings().weight, table, rtol=0, atol=0)
            model.to(torch.float32)
        batch = pack_collator()(pack)
        inputs = {k: batch[k] for k in ("input_ids", "labels", "position_ids")}
        # as in training, with the input-gradient hook that the offloading checkpoint needs to build a graph
        enable_checkpointing(model.get_base_model(), offload=True)
        loss = model.train()(**inputs).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}))
    loss0, grads0 = results[0]
    assert any("layers.0." in n for n in grads0)
    for loss1, grads1 in results[1:]:
        torch.testing.assert_close(loss1, loss0, rtol=0, atol=0)
        assert grads1.keys() == grads0.keys()
        for name in grads0:
            torch.testing.assert_close(grads1[name], grads0[name], rtol=0, atol=0)


def test_output_layer_kept_in_host_memory_gives_the_same_loss_and_gradients() -> None:
    """offload_output_layer takes the frozen head out of the model's parameters (no model.to moves it back);
    the fused loss, which alone uses it in training, gives the same loss and gradients to the bit."""
    from peft import LoraConfig, get_peft_model

    from tasks.train_adapter.levers.loss import offload_output_layer

    examples = _examples([30, 50, 9])
    batch = pack_collator()([{"input_ids": examples.input_ids, "labels": examples.labels}])
    inputs = {k: batch[k] for k in ("input_ids", "labels", "position_ids")}
    results = []
    for host in (False, True):
        torch.manual_seed(1)
        base = _tiny().train()
        assert use_fused_loss(base)
        model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "down_proj"],
                                                init_lora_weights="gaussian"))
        head = base.lm_head.weight.detach().clone()
        if host:
            assert offload_output_layer(base) and offload_output_layer(base)  # a second Trainer finds it done
            assert "lm_head" not in "".join(model.state_dict())
            model.to(torch.float64)
            assert base.get_output_embeddings().weight.dtype == head.dtype
            model.to(torch.float32)
            torch.testing.assert_close(base.get_output_embeddings().weight, head, rtol=0, atol=0)
        loss = model(**inputs).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}))
        with torch.no_grad():  # generation and other calls outside the loss still get the logits
            logits = model(input_ids=inputs["input_ids"]).logits
        results[-1][1]["logits"] = logits
    (loss0, grads0), (loss1, grads1) = results
    torch.testing.assert_close(loss1, loss0, rtol=0, atol=0)
    assert grads1.keys() == grads0.keys() and len(grads0) > 1
    for name in grads0:
        torch.testing.assert_close(grads1[name], grads0[name], rtol=0, atol=0)


def test_output_layer_stays_where_the_fused_loss_is_not_used_or_the_head_is_shared_or_trained(
        caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from tasks.train_adapter.levers.loss import offload_output_layer

    caplog.set_level(logging.INFO, logger="qlora_pipeline")
    assert not offload_output_layer(_tiny())  # transformers' own loss calls the head module
    assert "output layer offload steps aside: the fused loss is not in use" in caplog.text
    tied = _tiny()
    tied.lm_head.weight = tied.model.embed_tokens.weight
    trained = _tiny()
    trained.lm_head.weight.requires_grad_(True)
    for model in (tied, trained):
        assert use_fused_loss(model)
        assert not offload_output_layer(model)
        assert type(model.get_output_embeddings()) is torch.nn.Linear
    assert "tied to the input embedding" in caplog.text and "the output layer is trained" in caplog.text


@pytest.mark.parametrize("overrides", [{}, {"offload_activations": True}, {"offload_activations": True,
                                                                        "offload_embeddings": False}])
def test_training_batches_records_what_it_chose(overrides: dict[str, Any]) -> None:
    """Off by default on CPU; explicit offload of the activations brings the embeddings with it unless told not
    to, and the record says what was done to the model."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_tiny(), LoraConfig(r=4, target_modules=["q_proj"]))
    packs, _, chosen = training_batches(model, _examples([30, 50, 9, 12]), TrainArgs(), SpeedArgs(**overrides))
    embeddings_on_host = type(model.get_input_embeddings()).__name__ == "HostEmbedding"
    assert chosen.offload_activations == bool(overrides.get("offload_activations"))
    assert chosen.offload_embeddings == embeddings_on_host == (overrides.get("offload_embeddings", True)
                                                               and chosen.offload_activations)
    assert chosen.max_tokens_per_batch is None and len(packs) == chosen.packs == 1  # on CPU: 8 examples per pack
    assert not chosen.offload_output_layer  # this model computes its own loss: its head stays a module


def test_training_batches_moves_the_output_layer_with_the_embeddings_under_the_fused_loss() -> None:
    from peft import LoraConfig, get_peft_model

    for embeddings in (True, False):
        base = _tiny()
        assert use_fused_loss(base)
        model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj"]))
        speed = SpeedArgs(offload_activations=True, offload_embeddings=embeddings)
        chosen = training_batches(model, _examples([30, 50]), TrainArgs(), speed)[2]
        assert chosen.offload_output_layer == embeddings
        assert (type(base.get_output_embeddings()).__name__ == "HostLinear") == embeddings


def test_packed_examples_by_count_on_cpu() -> None:
    examples = _examples([10, 20, 30, 40, 50])
    packs = PackedExamples(examples, max_tokens=None, max_examples=2, seed=0)
    assert len(packs) == 3 and sum(len(p["input_ids"]) for p in (packs[i] for i in range(3))) == 5


def test_rows_packed_at_data_time_are_split_back_into_examples(tmp_path: Any) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tasks.on_disk.parquet_dataset import ParquetExamples

    pq.write_table(pa.table({"input_ids": [[1, 2, 3, 4, 5], [6, 7]], "labels": [[-100, 2, 3, -100, 5], [-100, 7]],
                             "position_ids": [[0, 1, 2, 0, 1], [0, 1]], "seq_lengths": [[3, 2], [2]]}),
                   tmp_path / "train.parquet")
    examples = ParquetExamples(tmp_path / "train.parquet")
    assert examples.input_ids == [[1, 2, 3], [4, 5], [6, 7]]
    assert examples.labels == [[-100, 2, 3], [-100, 5], [-100, 7]]


def test_tiled_mlp_gives_the_same_loss_and_gradients() -> None:
    from peft import LoraConfig, get_peft_model


    examples = _examples([30, 50, 9])
    batch = pack_collator()([{"input_ids": examples.input_ids, "labels": examples.labels}])
    inputs = {k: batch[k] for k in ("input_ids", "labels", "position_ids")}
    results = []
    for tiled in (False, True):
        base = _tiny()
        if tiled:
            assert tile_mlp(base, 16) == 4  # 89 tokens in 6 chunks
        enable_checkpointing(base, offload=False)
        torch.manual_seed(1)
        model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "up_proj", "down_proj"],
                                                init_lora_weights="gaussian")).train()
        loss = model(**inputs).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-6)
    for name, grad in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], grad, rtol=1e-4, atol=1e-6)


def test_pack_collator_flattens_packs_with_boundaries_and_counts_tokens() -> None:
    collate = pack_collator()
    pack = {"input_ids": [[5, 6, 7], [8, 9]], "labels": [[-100, 6, 7], [8, 9]]}
    batch = collate([pack])
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9]]
    assert batch["labels"].tolist() == [[-100, 6, 7, -100, 9]]  # each example's first label is masked
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    assert batch["cu_seq_lens_q"].tolist() == [0, 3, 5] and batch["cu_seq_lens_q"].dtype == torch.int32
    assert batch["max_length_q"] == 3
    collate([pack])
    assert collate.real_tokens == 10


def test_progress_waits_for_the_device_only_at_its_two_timed_marks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The throughput is timed from the end of the first optimizer step to the end of the last, and only those
    two steps wait for the GPU (a wait at every step would let it idle while the host prepares the next)."""
    from types import SimpleNamespace

    from tasks.train_adapter import callbacks

    waits = []
    monkeypatch.setattr(callbacks.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(callbacks.torch.cuda, "synchronize", lambda: waits.append(state.global_step))
    monkeypatch.setattr(callbacks.torch.cuda, "reset_peak_memory_stats", lambda: None)
    monkeypatch.setattr(callbacks.torch.cuda, "max_memory_allocated", lambda: 3 * 2**30)
    collator = SimpleNamespace(real_tokens=0)
    progress = callbacks.Progress(collator)
    state = SimpleNamespace(global_step=0, max_steps=6, is_world_process_zero=True)
    progress.on_train_begin(None, state, None)
    for step in range(1, 7):
        collator.real_tokens += 1000 * step  # what the collator counted for this step's micro-batches
        state.global_step = step
        progress.on_step_end(None, state, None)
    progress.on_train_end(None, state, None)
    assert waits == [1, 6]
    (t1, k1), (t6, k6) = progress.marks[1], progress.marks[2]
    assert (k1, k6) == (1000, 21000)
    summary = progress.summary()
    assert summary["peak_gpu_allocated_gib"] == 3.0
    assert summary["real_tokens_per_s"] == pytest.approx(20000 / (t6 - t1), rel=1e-3)



def test_the_memory_budget_defaults_to_the_card(monkeypatch: pytest.MonkeyPatch) -> None:
    """speed.gpu_memory_budget_gb None means the GPU's memory less 1 GiB: the memory plan spends the card; a budget
    that is set binds (tests/test_memory_plan.py covers what the plan does with it)."""
    from types import SimpleNamespace

    from tasks.train_adapter import plan

    card = SimpleNamespace(total_memory=48 * 10**9)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _: card)
    assert plan.gpu_budget_gb(SpeedArgs()) == pytest.approx(48e9 / 2**30 - 1)
    assert plan.gpu_budget_gb(SpeedArgs(gpu_memory_budget_gb=12)) == 12


def test_the_optimizer_defaults_to_fused_adamw_on_a_gpu_and_8bit_elsewhere(monkeypatch: pytest.MonkeyPatch
                                                                            ) -> None:
    """train.optim None: torch's fused AdamW on a GPU (bitsandbytes' 8-bit optimizers wait for the GPU after every
    LoRA tensor), its plain AdamW under FSDP, and on CPU bitsandbytes' 8-bit AdamW, which the paged one (the
    default before) fell back to there with a warning, so CPU runs train as they always did; a set optimizer is
    kept everywhere."""
    from transformers import TrainingArguments

    from tasks.train_adapter import plan

    def chosen(fsdp: bool = False, **train: Any) -> str:
        return plan.trainer_settings(TrainArgs(**train), SpeedArgs(fsdp=fsdp))["optim"]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    settings = plan.trainer_settings(TrainArgs(), SpeedArgs())
    assert TrainingArguments(output_dir="unused", use_cpu=True, report_to=[], **settings).optim == "adamw_8bit"
    assert chosen(optim="paged_adamw_8bit") == "paged_adamw_8bit"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert chosen() == "adamw_torch_fused"
    assert chosen(optim="paged_adamw_8bit") == "paged_adamw_8bit"
    assert chosen(fsdp=True) == "adamw_torch_fused"  # FSDP needs several processes; alone it is off
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert chosen() == "adamw_torch_fused"  # DDP
    assert chosen(fsdp=True) == "adamw_torch"
    assert chosen(fsdp=True, optim="paged_adamw_8bit") == "adamw_torch"  # bitsandbytes cannot update shards


def test_module_level_patches_are_undone_after_training() -> None:
    """Liger, given a model instance, still replaces module-level names of its family's modeling module (read from
    liger-kernel 0.8.5: modeling_llama.LlamaRMSNorm, LlamaMLP, apply_rotary_pos_emb), which every Llama loaded later
    in the process would be built from. liger.patches_undone puts back what liger.recorded saw replaced; liger
    itself needs a GPU, so a patch of the same kind stands in for its call."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama import modeling_llama

    from tasks.train_adapter.levers import liger

    original = (modeling_llama.LlamaRMSNorm, modeling_llama.LlamaMLP, modeling_llama.apply_rotary_pos_emb)

    class Replacement(modeling_llama.LlamaRMSNorm):
        pass

    def patch() -> None:
        modeling_llama.LlamaRMSNorm = Replacement
        modeling_llama.apply_rotary_pos_emb = lambda *args, **kwargs: args[:2]

    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2)
    with liger.patches_undone():
        liger.recorded(patch)
        assert isinstance(LlamaForCausalLM(config).model.norm, Replacement)  # the patch reaches new models
    assert (modeling_llama.LlamaRMSNorm, modeling_llama.LlamaMLP, modeling_llama.apply_rotary_pos_emb) == original
    assert type(LlamaForCausalLM(config).model.norm) is original[0]


def test_a_flow_start_freezes_startup_objects_and_later_cycles_are_still_freed() -> None:
    """memory.freeze_startup_objects (the flows' on_running hook) takes what exists out of the collector's scans;
    what is built afterwards, a model in a reference cycle included, is still freed by release_device_memory."""
    code = """
import gc, weakref
import torch
from tasks.models.memory import freeze_startup_objects, release_device_memory
assert gc.get_freeze_count() == 0
freeze_startup_objects()
frozen = gc.get_freeze_count()
assert frozen > 10_000, frozen
model = torch.nn.Linear(64, 64)
model.me = [model]  # a cycle: only a collection frees it
dead = weakref.ref(model)
del model
assert dead() is not None
release_device_memory()
assert dead() is None
freeze_startup_objects()  # once per process
assert gc.get_freeze_count() == frozen
"""
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parent.parent, timeout=120)
