"""Every common decoder-only family end to end with default settings, on tiny random-weight models built here.

One Prefect test server for all of them (the session's prefect_env); each family runs the whole flow with the
defaults (LoRA on all-linear, the attention transformers picks, every speed lever that applies) on a few sample
rows and steps. Then the levers one by one against the plain model, the bitsandbytes CPU repacking guard, the
error messages, chat templates without a system role, and the 16 GB guide preset's tiny twin.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from tasks.config import EMBEDDED_DATA, PRESETS_DIR, load_config
from tests.conftest import run_flow
from tests.families import FAMILIES, TUPLE_LAYER_FAMILIES, build_family_model

torch = pytest.importorskip("torch")

FAMILY_ROWS = 120
FAMILY_SETTINGS = {"train.max_steps": 8, "eval.max_samples": 16, "eval.generation_samples": 2,
                   "eval.max_new_tokens": 4, "export.merge": True, "export.merged_dtype": "float32"}


@pytest.fixture(scope="module")
def family_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("families")
    (root / "data.jsonl").write_text("".join(EMBEDDED_DATA.read_text().splitlines(keepends=True)[:FAMILY_ROWS]))
    return root


@pytest.fixture(scope="module")
def family_runs(prefect_env: Path, family_root: Path) -> dict[str, Any]:
    """family -> its flow summary, run on first use (one shared Prefect server, one runs_dir)."""
    return {}


def _run_family(family: str, runs: dict[str, Any], root: Path) -> dict[str, Any]:
    if family not in runs:
        model = build_family_model(family, root / "models" / family)
        overrides = {"runs_dir": root / "runs", "data.source": root / "data.jsonl", "model.base_model": model,
                     **FAMILY_SETTINGS}
        runs[family] = run_flow([f"{k}={v}" for k, v in overrides.items()])
    return runs[family]


def _no_cpu_repack(model: Any) -> Any:
    """bitsandbytes' AVX512-BF16 inference kernel computes in bf16; compare in the fp32 matmul path instead."""
    import bitsandbytes as bnb

    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False
    return model


@pytest.mark.slow  # whole flow runs
@pytest.mark.parametrize("family", FAMILIES + TUPLE_LAYER_FAMILIES)
def test_family_trains_with_defaults_and_exports_a_working_adapter(family: str, family_runs: dict[str, Any],
                                                                   family_root: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tasks.models.loading import load_quantized

    summary = _run_family(family, family_runs, family_root)
    metrics = summary["metrics"]
    assert metrics["tuned_eval_loss"] < metrics["base_eval_loss"]
    # every layer LoRA can target is 4-bit (Falcon's FalconLinear stayed bf16 before quirks.plain_linear_layers)
    modules = json.loads((Path(summary["stages"]["prepare_model"]["dir"]) / "modules.json").read_text())
    assert modules["linear_4bit"] and not modules["linear_other"], modules
    export = Path(summary["export_dir"])
    ids = torch.tensor([[1, 37, 250, 511, 4, 900, 77, 12]])
    base = _no_cpu_repack(load_quantized(Path(summary["stages"]["prepare_model"]["dir"])))
    with torch.no_grad():
        before = base(input_ids=ids).logits.clone()
        tuned = PeftModel.from_pretrained(base, export)(input_ids=ids).logits
        merged = AutoModelForCausalLM.from_pretrained(export / "merged", dtype=torch.float32)(input_ids=ids).logits
    assert (tuned - before).abs().max() > 1e-3  # the adapter changes the outputs
    torch.testing.assert_close(merged, tuned, rtol=1e-4, atol=1e-4)  # merged fp32 = base + adapter


# --- the levers, one family at a time, against the plain model ------------------------------------------------

class _Examples:
    def __init__(self, input_ids: list[list[int]]) -> None:
        self.input_ids, self.labels = input_ids, input_ids

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return {"input_ids": self.input_ids[i], "labels": self.labels[i]}


def _examples(n: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 1000, (length,), generator=g).tolist() for length in (9, 14, 6)[:n]]


def _loss_and_grads(model: Any, batch: dict[str, Any]) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", FAMILIES + TUPLE_LAYER_FAMILIES)
def test_every_lever_keeps_the_loss_and_gradients(family: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
                                                  ) -> None:
    """Packing, fused cross-entropy, chunked MLP, offloaded checkpointing, host embeddings and fused LoRA, all on
    at once (the GPU-only parts step aside on CPU) give the loss and LoRA gradients of the plain peft model."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from tasks.config import SpeedArgs, TrainArgs
    from tasks.train_adapter import plan

    folder = build_family_model(family, tmp_path / family)
    examples = _Examples(_examples())
    results = []
    for levers in (False, True, "mlp"):  # "mlp": the same levers, the first layer recomputed whole, the second its MLP
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        for module in model.modules():  # GPT-2's dropout would draw different masks in chunks
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
        if family == "gemma2":
            model.config.final_logit_softcapping = 2.0  # small enough to change the loss: the fused loss must cap
        modes = {"recompute_layers": 1, "recompute_mlp_layers": 1} if levers == "mlp" else {}
        levers = bool(levers)
        speed = SpeedArgs(mlp_chunk_tokens=4 if levers else 0, fused_cross_entropy=levers, fused_lora=levers,
                          offload_activations=levers, offload_embeddings=levers, **modes)
        with caplog.at_level(logging.INFO, logger="qlora_pipeline"):
            applied = plan.prepare_base(model, speed)
            torch.manual_seed(1)  # the same LoRA weights both times
            model = plan.prepare_peft(get_peft_model(model, LoraConfig(target_modules="all-linear", r=4,
                                                                       init_lora_weights=False)), speed)
            packs, collator, choice = plan.training_batches(model, examples, TrainArgs(per_device_train_batch_size=3),
                                                            speed)
        assert choice.recompute_mlp_layers == modes.get("recompute_mlp_layers", 0)
        if levers:  # on a CPU too, when asked for; a tied or scaled embedding steps aside, saying why
            assert choice.offload_activations
            assert choice.offload_embeddings or "embedding offload steps aside" in caplog.text
            assert choice.offload_output_layer or "output layer offload steps aside" in caplog.text
        model.train()
        assert len(packs) == 1
        results.append(_loss_and_grads(model, collator([packs[0]])))
        if levers:  # the second step is the first whose offloaded layers skip what they do not read (recompute_skip)
            results[-1] = _loss_and_grads(model, collator([packs[0]]))
        if levers:
            assert "fused cross-entropy" in applied and any(a.startswith("MLP in chunks") for a in applied), applied
    (loss, grads), *levered = results
    for lever_loss, lever_grads in levered:
        assert lever_loss == pytest.approx(loss, rel=1e-5)
        assert grads.keys() == lever_grads.keys() and grads
        for name, grad in grads.items():
            torch.testing.assert_close(lever_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_model_dims_read_each_familys_config_names() -> None:
    import transformers as tf

    from tasks.models.dims import model_dims
    from tests.families import family_config

    for family in FAMILIES:
        assert model_dims(family_config(family, hidden=96, layers=3, intermediate=160))[:4] == (96, 160, 3, 1024)
    assert model_dims(tf.GPT2Config(n_embd=64, n_layer=2, n_inner=None)).intermediate == 256  # None = 4 x n_embd
    assert model_dims(tf.OPTConfig(hidden_size=64, ffn_dim=100, num_hidden_layers=2))[:4] == (64, 100, 2, 50272)
    assert model_dims(family_config("llama", hidden=96, heads=4, kv_heads=2)).kv == 48  # grouped-query attention


def test_varlen_attention_steps_aside_where_its_kernel_would_change_the_maths() -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from tasks.train_adapter.levers.attention import varlen_unsupported
    from tests.families import family_config

    reasons = {f: varlen_unsupported(config, MODEL_FOR_CAUSAL_LM_MAPPING[type(config)])
               for f, config in ((f, family_config(f)) for f in FAMILIES + TUPLE_LAYER_FAMILIES)}
    assert reasons.pop("gemma2") == "attention logits soft-capped at 50.0 (gemma2)"
    assert reasons.pop("gpt2") == "attention dropout (the varlen kernel has none)"  # GPT-2's attn_pdrop 0.1
    # Falcon's attention is its own code: any implementation but sdpa's name runs it eagerly, T x T scores per head
    assert reasons.pop("falcon") == ("FalconForCausalLM runs its own attention code, not transformers' attention "
                                     "functions")
    assert set(reasons.values()) == {None}


# --- bitsandbytes' CPU inference repacking -------------------------------------------------------------------

def test_layers_that_cpu_repacking_cannot_take_keep_the_plain_4bit_path(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU with AVX512-BF16, bitsandbytes repacks a 4-bit weight on its first eval-mode forward and asserts
    that the output features come in blocks of 32 (stories260K's MLP is 172 wide). The path is forced here on any
    CPU; the guard in load_quantized turns it off for the layers it cannot take, and evaluation runs."""
    import bitsandbytes as bnb
    import bitsandbytes.nn.modules

    from tasks.config import ModelArgs
    from tasks.evaluate_adapter.sequences import mean_loss
    from tasks.models.loading import load_quantized
    from tasks.prepare_model.stage import prepare_model

    source = build_family_model("llama", tmp_path / "odd", hidden=64, intermediate=172)
    model_dir = Path(prepare_model.fn(ModelArgs(base_model=str(source)), tmp_path / "runs"))
    monkeypatch.setattr(bitsandbytes.nn.modules, "has_avx512bf16", lambda: True)  # what Linear4bit asks at init
    model = load_quantized(model_dir)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    odd = {n for n, m in layers.items() if m.out_features % 32}
    assert odd == {f"model.layers.{i}.mlp.{p}" for i in range(2) for p in ("gate_proj", "up_proj")}
    assert not any(layers[n].support_avx512bf16_for_cpu for n in odd)
    # down_proj takes 172 inputs: not whole 64-wide quantization blocks, so it is off too
    assert not any(m.support_avx512bf16_for_cpu for n, m in layers.items() if n.endswith("down_proj"))
    if not bnb.functional.has_avx512bf16():  # the fitting layers' repacked kernel exists only on such CPUs
        for module in layers.values():
            module.support_avx512bf16_for_cpu = False
    ids = torch.tensor([[1, 40, 41, 42, 43, 44, 2]])
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    loss, tokens = mean_loss(model, [batch])
    assert tokens == 6 and 5 < loss < 9  # random weights: about ln(1024) = 6.9


# --- errors and fallbacks ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gpt2_stages(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from tasks.config import DataArgs, ModelArgs
    from tasks.prepare_data.stage import prepare_data
    from tasks.prepare_model.stage import prepare_model

    root = tmp_path_factory.mktemp("gpt2")
    model = ModelArgs(base_model=str(build_family_model("gpt2", root / "gpt2")))
    data = root / "d.jsonl"
    data.write_text("".join(EMBEDDED_DATA.read_text().splitlines(keepends=True)[:40]))
    return {"runs": root / "runs", "data": prepare_data.fn(DataArgs(source=str(data)), model, root / "runs"),
            "model": prepare_model.fn(model, root / "runs")}


def test_llama_names_on_gpt2_fail_before_training_with_the_real_list(gpt2_stages: dict[str, Any]) -> None:
    from tasks.config import LoraArgs, SpeedArgs, TrainArgs
    from tasks.errors import UserError
    from tasks.train_adapter.stage import train_adapter

    with pytest.raises(UserError) as caught:
        train_adapter.fn(LoraArgs(target_modules=["q_proj", "v_proj"]), TrainArgs(max_steps=1), SpeedArgs(),
                         gpt2_stages["runs"], gpt2_stages["data"], gpt2_stages["model"])
    message = str(caught.value)
    assert "lora.target_modules names q_proj, v_proj, which" in message
    assert "can target are: c_attn, c_fc, c_proj" in message
    assert not (gpt2_stages["runs"] / "train_adapter").exists()  # nothing started


def test_unsupported_attention_falls_back_with_one_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from tasks.config import ModelArgs
    from tasks.on_disk.manifest import read_manifest
    from tasks.prepare_model.stage import prepare_model

    source = build_family_model("gemma2", tmp_path / "gemma2")
    with caplog.at_level(logging.WARNING, logger="qlora_pipeline"):
        folder = prepare_model.fn(ModelArgs(base_model=str(source), attn_implementation="sdpa"), tmp_path / "runs")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "prepare_model" in
                r.getMessage()]
    assert warnings == ["prepare_model: model.attn_implementation=sdpa is not supported by Gemma2ForCausalLM (it "
                        "supports eager, flex_attention, flash_attention_2); loading with transformers' own choice "
                        "for it"]
    assert read_manifest(Path(folder)).metrics.attn_implementation == "eager"


# --- chat templates: ChatML (Qwen) and Gemma's, which has no system role ----------------------------------------

# google/gemma-2-2b-it's template (tokenizer_config.json), verbatim
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)
CHATS = [
    [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Capital of France?"},
     {"role": "assistant", "content": "Paris"}],
    [{"role": "user", "content": "Two plus two?"}, {"role": "assistant", "content": "Four"}],
]


def _chat_tokenizer(folder: Path, template: str) -> Path:
    import shutil

    from tasks.config import EMBEDDED_MODEL

    folder.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(EMBEDDED_MODEL / name, folder / name)
    (folder / "chat_template.jinja").write_text(template)
    return folder


def _prepare_chat(tmp_path: Path, template: str, chats: list[Any]) -> tuple[list[str], str]:
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from tasks.config import DataArgs, ModelArgs
    from tasks.prepare_data.stage import prepare_data

    model = _chat_tokenizer(tmp_path / "tok", template)
    data = tmp_path / "chat.jsonl"
    numbered = [[{**m, "content": f"{m['content']} ({i})"} if m["role"] != "system" else m for m in chat]
                for i in range(20) for chat in chats]  # distinct rows: the split is by content
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in numbered))
    folder = Path(prepare_data.fn(DataArgs(source=str(data)), ModelArgs(base_model=str(model)), tmp_path / "runs"))
    tokenizer = AutoTokenizer.from_pretrained(model)
    rows = [r for split in ("train", "eval") for r in pq.read_table(folder / f"{split}.parquet").to_pylist()]
    texts = sorted({tokenizer.decode(r["input_ids"]) for r in rows})
    trained = sorted({tokenizer.decode([t for t in r["labels"] if t != -100]) for r in rows})
    return texts, " | ".join(trained)


def test_gemma_template_gets_the_system_message_in_the_first_user_turn(tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("qlora_pipeline")  # its own handler may not propagate to caplog's
    log.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="qlora_pipeline"):
            texts, trained = _prepare_chat(tmp_path, GEMMA_TEMPLATE, CHATS)
    finally:
        log.removeHandler(caplog.handler)
    assert "the chat template has no system role" in caplog.text
    folded = next(t for t in texts if "France? (0)" in t)
    assert "<start_of_turn>user\nAnswer in one word.\n\nCapital of France? (0)<end_of_turn>" in folded, folded
    assert "Paris" in trained and "France" not in trained  # only the answers are in the loss


def test_gemma_template_rejects_a_system_message_with_no_user_turn_after_it(tmp_path: Path) -> None:
    from tasks.errors import UserError

    bad = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
           {"role": "system", "content": "Be brief."}]
    with pytest.raises(UserError) as caught:
        _prepare_chat(tmp_path, GEMMA_TEMPLATE, [*CHATS, bad])
    assert "a system message is not followed by a user message" in str(caught.value)


def test_chatml_keeps_system_messages_as_their_own_turn(tmp_path: Path) -> None:
    from tasks.prepare_data.formats import CHAT_TEMPLATES

    texts, trained = _prepare_chat(tmp_path, CHAT_TEMPLATES["chatml"], CHATS)
    assert any("<|im_start|>system\nAnswer in one word.<|im_end|>" in t.replace(" <", "<") or
               "system" in t and "Answer" in t for t in texts)
    assert "Paris" in trained and "Answer" not in trained


# --- the 16 GB guide's workflow -----------------------------------------------------------------------------

def test_guide_preset_has_the_guides_settings() -> None:
    config = load_config(PRESETS_DIR / "seed-16gb-guide.yaml")
    assert (config.model.base_model, config.data.name, config.data.split, config.data.format) == \
        ("gpt2", "wikitext-2-raw-v1", "train", "text")
    lora = config.lora
    assert (lora.r, lora.lora_alpha, lora.lora_dropout, lora.bias, lora.target_modules) == (8, 32, 0.1, "none",
                                                                                             ["c_attn"])
    train = config.train
    assert (train.per_device_train_batch_size, train.gradient_accumulation_steps, train.learning_rate,
            train.num_train_epochs, train.optim, train.logging_steps) == (1, 8, 2e-4, 3, "paged_adamw_32bit", 10)
    assert config.model.bnb_4bit_compute_dtype == "auto" and train.bf16 is None  # fp16 where the GPU lacks bf16
    assert config.speed.packing is False  # micro-batch 1 means one example


def _wikitext_shaped(lines: int) -> str:
    """WikiText-2 raw's layout: ' = Title = ' headings, blank lines, paragraphs with spaced punctuation."""
    places = ["glen", "mill", "river", "bridge", "abbey", "harbour"]
    out = [" = Valkyria Glen = ", ""]
    for i in range(lines):
        if i % 7 == 0:
            out += ["", f" = = Part {i // 7 + 1} = = ", ""]
        place = places[i % len(places)]
        out.append(f" The {place} was first recorded in {1500 + 3 * i} , when it served {i % 5 + 2} families . ")
    return "\n".join(out) + "\n"


@pytest.mark.slow  # a whole flow run
def test_guide_settings_run_on_a_tiny_gpt2_and_wikitext_shaped_text(prefect_env: Path, tmp_path: Path) -> None:
    """The preset's settings, unchanged but for the model, the data (local, WikiText-shaped) and the epochs."""
    text = tmp_path / "wiki.train.raw"
    text.write_text(_wikitext_shaped(60))
    model = build_family_model("gpt2", tmp_path / "gpt2")
    config = load_config(PRESETS_DIR / "seed-16gb-guide.yaml", [
        f"runs_dir={tmp_path / 'runs'}", f"model.base_model={model}", f"data.source={text}", "data.name=null",
        "train.num_train_epochs=1", "eval.generation_samples=2", "eval.max_new_tokens=4"])
    from flows.qlora_pipeline import qlora_pipeline

    summary = qlora_pipeline(config=config)
    metrics = summary["metrics"]
    assert metrics["tuned_eval_loss"] < metrics["base_eval_loss"]
    adapter = json.loads((Path(summary["export_dir"]) / "adapter_config.json").read_text())
    assert (adapter["r"], adapter["lora_alpha"], adapter["target_modules"]) == (8, 32, ["c_attn"])
