"""export.gguf: the merged model as GGUF (checked by transformers' own GGUF reader and by llama.cpp itself), the
GGUF LoRA adapter (llama.cpp on the base GGUF vs peft), the Ollama Modelfile, and the adapter folder checked against
vLLM's LoRA loader rules."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from tasks.config import PROJECT_ROOT, EvalArgs, ExportArgs, LoraArgs, ModelArgs, SpeedArgs, TrainArgs

PROMPTS = ["the answer to the question is", "what is two plus three", "hello"]
# max |logit difference| vs the merged model, logits of magnitude ~1. f16 keeps 11 significant bits of each weight
# (measured 5.6e-4 on the tiny Llama); q8_0 keeps 8 bits per 32-wide block (measured 1.6e-2). A wrong tensor
# layout (e.g. q/k rows left unpermuted) moves them by far more than this. f32 keeps the weights: only llama.cpp's
# order of summation differs (a bound, not measured).
TOLERANCE = {"f32": 1e-3, "f16": 5e-3, "q8_0": 6e-2}
NEW_TOKENS = 8
# llama.cpp's own reader: node-llama-cpp's prebuilt llama.cpp, installed as README: Development says
NODE_DIR = PROJECT_ROOT / "tests" / ".node"
NODE_INSTALL = ("npm i -E --ignore-scripts --omit=optional --no-audit --no-fund --prefix tests/.node "
                "node-llama-cpp@3.21.1 @node-llama-cpp/linux-x64@3.21.1")


@pytest.fixture(scope="module")
def exported(stages: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A few training steps on the shared first stages, then export with merge and two GGUF types."""
    from tasks.evaluate_adapter.stage import evaluate_adapter
    from tasks.export_adapter.stage import export_adapter
    from tasks.train_adapter.stage import train_adapter

    runs = stages["runs"]
    adapter = train_adapter.fn(LoraArgs(r=4, lora_alpha=8), TrainArgs(max_steps=2, logging_steps=1), SpeedArgs(),
                               runs, stages["data"], stages["model"])
    evals = evaluate_adapter.fn(EvalArgs(max_samples=4, generation_samples=0), runs, stages["data"],
                                stages["model"], adapter)
    args = ExportArgs(name="gguftest", merge=True, merged_dtype="float32", gguf=["f16", "q8_0"])
    out = tmp_path_factory.mktemp("export")
    folder = Path(export_adapter.fn(args, out, stages["data"], stages["model"], adapter, evals))
    return {"folder": folder, "version": out.resolve() / "exports" / "gguftest" / "v0001", "model": stages["model"]}


def llama_cpp(requests: list[dict[str, Any]]) -> list[list[dict[str, list[int]]]]:
    """Each {"model": GGUF, "lora": GGUF or None} read by llama.cpp (tests/llamacpp_check.mjs): per request, per
    PROMPTS entry, {"tokens": prompt tokens, "greedy": NEW_TOKENS greedy tokens}. CI must have the reader (fail);
    elsewhere a missing one skips with the command that installs it."""
    node = shutil.which("node")
    if node is None or not (NODE_DIR / "node_modules" / "node-llama-cpp").is_dir():
        missing = f"llama.cpp's reader is not installed (node: {node}; {NODE_DIR}): run {NODE_INSTALL}"
        if os.environ.get("CI"):
            pytest.fail(missing)
        pytest.skip(missing)
    request = NODE_DIR / f"request-{os.getpid()}.json"
    request.write_text(json.dumps([{"prompts": PROMPTS, "new_tokens": NEW_TOKENS, "lora": None, **r}
                                   for r in requests]))
    try:
        done = subprocess.run([node, str(PROJECT_ROOT / "tests" / "llamacpp_check.mjs"), str(NODE_DIR), str(request)],
                              capture_output=True, text=True, timeout=600)
    finally:
        request.unlink()
    assert done.returncode == 0, done.stderr[-3000:]
    return [result["prompts"] for result in json.loads(done.stdout)]


def hf_greedy(model: Any, tokenizer: Any) -> list[dict[str, list[Any]]]:
    """Per PROMPTS entry as llama_cpp gives it: the tokenizer's ids, the next token's log-probabilities and
    transformers' NEW_TOKENS greedy tokens; and at each greedy step the margin between the top two logits."""
    import torch

    out = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            greedy = model.eval().generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                           max_new_tokens=NEW_TOKENS, pad_token_id=tokenizer.pad_token_id,
                                           output_logits=True, return_dict_in_generate=True)
        margins = [float(top[0, 0] - top[0, 1]) for top in (step.topk(2).values for step in greedy.logits)]
        out.append({"tokens": ids[0].tolist(), "greedy": greedy.sequences[0, ids.shape[1]:].tolist(),
                    "logprobs": greedy.logits[0][0].float().log_softmax(-1).tolist(), "margins": margins})
    return out


def assert_same_greedy(got: list[dict[str, list[Any]]], want: list[dict[str, list[Any]]], kind: str) -> None:
    """llama.cpp read the prompts as the tokenizer does; its next-token log-probabilities are transformers' within
    twice the GGUF type's logit tolerance (log-softmax moves by at most twice the largest logit change), over the
    whole vocabulary; and it picked transformers' greedy tokens up to where transformers stopped (end-of-sequence)
    or its top two logits came closer than that (there the weights' rounding may pick the other one, and the two
    continuations part)."""
    import numpy as np

    for prompt, llama, hf in zip(PROMPTS, got, want, strict=True):
        assert llama["tokens"] == hf["tokens"], prompt
        assert len(llama["logprobs"]) == len(hf["logprobs"]) and None not in llama["logprobs"], prompt
        diff = float(np.abs(np.array(llama["logprobs"]) - np.array(hf["logprobs"])).max())
        assert diff < 2 * TOLERANCE[kind], (prompt, kind, diff)
        sure = next((i for i, m in enumerate(hf["margins"]) if m < 2 * TOLERANCE[kind]), len(hf["greedy"]))
        assert llama["greedy"][:sure] == hf["greedy"][:sure], (prompt, hf["margins"])


def _logits(model: Any, tokenizer: Any) -> Any:
    import torch

    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        return model.eval()(**batch).logits


def _check_gguf_logits(merged: Path, folder: Path, name: str, tolerance: float) -> float:
    """The GGUF file read back by transformers gives the merged model's logits; returns the max difference."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(merged)
    want = _logits(AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32), tokenizer)
    got = _logits(AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32), tokenizer)
    diff = (got - want).abs().max().item()
    assert diff < tolerance, (name, diff)
    # the tokenizer inside the GGUF (what llama.cpp and Ollama use) encodes as the original one
    from_gguf = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    for prompt in PROMPTS:
        assert from_gguf(prompt).input_ids == tokenizer(prompt).input_ids
    assert (from_gguf.bos_token_id, from_gguf.eos_token_id) == (tokenizer.bos_token_id, tokenizer.eos_token_id)
    return diff


def test_gguf_types_are_validated_and_need_merge() -> None:
    with pytest.raises(ValidationError) as bad:
        ExportArgs(merge=True, gguf=["q4_k_m", "q8_0"])
    assert "Input should be 'f32', 'f16', 'bf16', 'q8_0'" in str(bad.value)
    with pytest.raises(ValidationError, match="export.gguf needs the merged model: set export.merge=true"):
        ExportArgs(gguf=["q8_0"])
    assert ExportArgs().gguf == [] and ExportArgs(merge=True, gguf=["f16", "q4_0"]).gguf == ["f16", "q4_0"]


def test_llama_gguf_files_match_the_merged_model(exported: dict[str, Any]) -> None:
    import gguf

    from tasks.on_disk.manifest import read_manifest

    folder = exported["folder"]
    ggufs = folder / "gguf"
    files = ["Modelfile", "Modelfile.adapter", "base-f16.gguf", "lora-f32.gguf", "model-f16.gguf", "model-q8_0.gguf"]
    assert sorted(p.name for p in ggufs.iterdir()) == files
    assert {f"gguf/{name}" for name in files} <= set(read_manifest(folder).outputs)
    diffs = {kind: _check_gguf_logits(folder / "merged", ggufs, f"model-{kind}.gguf", TOLERANCE[kind])
             for kind in ("f16", "q8_0")}
    assert diffs["q8_0"] > diffs["f16"]  # it really is quantized, not f16 under another name
    tensors = {t.name: t.tensor_type.name for t in gguf.GGUFReader(ggufs / "model-q8_0.gguf").tensors}
    assert tensors["blk.0.attn_q.weight"] == "Q8_0" and tensors["blk.0.attn_norm.weight"] == "F32"
    assert (ggufs / "Modelfile").read_text() == 'FROM ./model-f16.gguf\nPARAMETER stop "</s>"\n'
    # Ollama's adapter form: its instructions, without the comment lines
    adapter_form = [line for line in (ggufs / "Modelfile.adapter").read_text().splitlines() if not line.startswith("#")]
    assert adapter_form == ["FROM ./base-f16.gguf", "ADAPTER ./lora-f32.gguf", 'PARAMETER stop "</s>"']
    # the published version carries the files, and both cards list them
    version = exported["version"]
    assert sorted(p.name for p in (version / "gguf").iterdir()) == files
    for card in (folder / "README.md", version / "README.md"):
        assert "GGUF files for llama.cpp and Ollama in `gguf/`: `model-f16.gguf`, `model-q8_0.gguf`" in card.read_text()
        assert "The adapter as a GGUF LoRA in `gguf/`: `lora-f32.gguf`, on `base-f16.gguf`, the base as the " \
               "adapter was trained against it (`llama-server -m gguf/base-f16.gguf --lora gguf/lora-f32.gguf`; " \
               "Ollama: `ollama create NAME -f gguf/Modelfile.adapter`)" in " ".join(card.read_text().split())


def _dequantized_base(model_dir: Path, out: Path) -> Any:
    """prepare_model's 4-bit checkpoint dequantized (the weights the adapter was trained against), saved in out
    with the tokenizer; returns the model."""
    import torch

    from tasks.models.loading import load_quantized
    from tasks.models.sources import TOKENIZER_FILES

    base = load_quantized(model_dir).dequantize().to(torch.float32)
    base.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (model_dir / name).is_file():
            shutil.copy2(model_dir / name, out / name)
    return base


def test_llama_cpp_reads_the_merged_ggufs_and_the_adapter_form_as_exported(exported: dict[str, Any],
                                                                           tmp_path: Path) -> None:
    """llama.cpp itself: the merged f16 and q8_0 GGUFs give transformers' greedy tokens from the merged model; the
    files Modelfile.adapter names (FROM the exported base GGUF, ADAPTER the LoRA), as they are in the published
    version, give peft's base + adapter greedy tokens: Ollama's adapter form is usable straight from the export."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    version, merged = exported["version"], exported["folder"] / "merged"
    tokenizer = AutoTokenizer.from_pretrained(merged)
    want_merged = hf_greedy(AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32), tokenizer)
    base = _dequantized_base(Path(exported["model"]), tmp_path / "base")
    want_lora = hf_greedy(PeftModel.from_pretrained(base, version), tokenizer)
    lines = (version / "gguf" / "Modelfile.adapter").read_text().splitlines()
    named = {word: version / "gguf" / line.split()[1] for line in lines for word in ("FROM", "ADAPTER")
             if line.startswith(f"{word} ")}
    assert named["FROM"].is_file() and named["ADAPTER"].is_file(), named
    f16, q8_0, adapter_form = llama_cpp([{"model": str(version / "gguf" / "model-f16.gguf")},
                                         {"model": str(version / "gguf" / "model-q8_0.gguf")},
                                         {"model": str(named["FROM"]), "lora": str(named["ADAPTER"])}])
    for got, want, kind in ((f16, want_merged, "f16"), (q8_0, want_merged, "q8_0"), (adapter_form, want_lora, "f16")):
        assert_same_greedy(got, want, kind)


def test_qwen2_gguf_matches_and_carries_the_chat_template(tmp_path: Path) -> None:
    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tasks.export_adapter.gguf import write_gguf
    from tests.families import build_family_model

    merged = build_family_model("qwen2", tmp_path / "qwen2")
    config = json.loads((merged / "tokenizer_config.json").read_text())
    template = "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"
    (merged / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    assert write_gguf(merged, tmp_path / "gguf", ["q8_0"]) == ["gguf/model-q8_0.gguf", "gguf/Modelfile"]
    _check_gguf_logits(merged, tmp_path / "gguf", "model-q8_0.gguf", TOLERANCE["q8_0"])
    field = gguf.GGUFReader(tmp_path / "gguf" / "model-q8_0.gguf").get_field("tokenizer.chat_template")
    assert field is not None and field.contents() == template
    [got] = llama_cpp([{"model": str(tmp_path / "gguf" / "model-q8_0.gguf")}])
    tokenizer = AutoTokenizer.from_pretrained(merged)
    assert_same_greedy(got, hf_greedy(AutoModelForCausalLM.from_pretrained(merged), tokenizer), "q8_0")


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_lora_gguf_on_the_base_gguf_gives_peft_greedy_tokens(family: str, tmp_path: Path) -> None:
    """A random (not zero-initialized) adapter on every Linear layer, so that a wrong layout (q/k rows, A/B
    order, alpha) changes the answers: llama.cpp's base GGUF + --lora vs peft's base + adapter."""
    import gguf
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tasks.export_adapter.gguf import write_gguf, write_lora_gguf
    from tests.families import build_family_model

    base = build_family_model(family, tmp_path / family)
    torch.manual_seed(1)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    tuned = get_peft_model(AutoModelForCausalLM.from_pretrained(base), lora)
    tuned.save_pretrained(tmp_path / "adapter")
    write_gguf(base, tmp_path / "gguf", ["f32"])
    assert write_lora_gguf(tmp_path / "adapter", base / "config.json", tmp_path / "gguf", ["f32"]) == \
        ["gguf/lora-f32.gguf"]
    reader = gguf.GGUFReader(tmp_path / "gguf" / "lora-f32.gguf")
    fields = {key: reader.get_field(key).contents() for key in ("general.type", "general.architecture",
                                                                 "adapter.type", "adapter.lora.alpha")}
    assert fields == {"general.type": "adapter", "general.architecture": family, "adapter.type": "lora",
                      "adapter.lora.alpha": 8.0}
    # ggml's shapes (numpy's reversed): lora_a (in, r), lora_b (r, out), as llama.cpp's loader checks them
    shapes = {t.name: [int(n) for n in t.shape] for t in reader.tensors}
    assert shapes["blk.0.attn_q.weight.lora_a"] == [64, 4] and shapes["blk.0.attn_q.weight.lora_b"] == [4, 64]
    assert shapes["blk.0.attn_k.weight.lora_b"] == [4, 32] and shapes["blk.1.ffn_down.weight.lora_a"] == [128, 4]
    assert len(shapes) == 2 * 7 * 2  # 7 Linear layers per block, 2 blocks, A and B
    tokenizer = AutoTokenizer.from_pretrained(base)
    plain, adapted = llama_cpp([{"model": str(tmp_path / "gguf" / "model-f32.gguf")},
                                {"model": str(tmp_path / "gguf" / "model-f32.gguf"),
                                 "lora": str(tmp_path / "gguf" / "lora-f32.gguf")}])
    with tuned.disable_adapter():
        assert_same_greedy(plain, hf_greedy(tuned, tokenizer), "f32")
    assert_same_greedy(adapted, hf_greedy(tuned, tokenizer), "f32")
    assert [p["greedy"] for p in plain] != [p["greedy"] for p in adapted]  # the adapter was applied


def test_adapters_llama_cpp_cannot_take_get_a_log_line_and_no_lora_gguf(tmp_path: Path,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    from tasks.export_adapter.gguf import write_lora_gguf
    from tests.families import build_family_model

    base = build_family_model("llama", tmp_path / "llama")
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    for extra, why in (({"use_dora": True}, "DoRA"), ({"alpha_pattern": {"q_proj": 32}}, "per-module ranks or alphas")):
        (adapter / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8, **extra}))
        with caplog.at_level(logging.INFO):
            assert write_lora_gguf(adapter, base / "config.json", tmp_path / "gguf", ["f16"]) == []
        assert f"no GGUF LoRA: llama.cpp's LoRA loader does not take {why}" in caplog.text
    assert not (tmp_path / "gguf").exists()


def test_family_the_writer_does_not_know_gets_a_log_line_and_no_gguf(tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    from tasks.export_adapter.gguf import write_gguf, write_lora_gguf
    from tests.families import build_family_model

    merged = build_family_model("gpt2", tmp_path / "gpt2")
    with caplog.at_level(logging.INFO):
        assert write_gguf(merged, tmp_path / "gguf", ["q8_0"]) == []
    assert "no GGUF: family 'gpt2' is not one the GGUF export knows (llama, mistral, qwen2)" in caplog.text
    (merged / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8}))  # the family decides first
    assert write_lora_gguf(merged, merged / "config.json", tmp_path / "gguf", ["q8_0"]) == []
    assert not (tmp_path / "gguf").exists()
    # a known family with a tokenizer the writer cannot express (byte-fallback BPE, sentencepiece style)
    llama = build_family_model("llama", tmp_path / "llama")
    tokenizer = json.loads((llama / "tokenizer.json").read_text())
    tokenizer["model"]["byte_fallback"] = True
    (llama / "tokenizer.json").write_text(json.dumps(tokenizer))
    with caplog.at_level(logging.INFO):
        assert write_gguf(llama, tmp_path / "gguf", ["f16"]) == []
    assert "no GGUF: the tokenizer is not byte-level BPE" in caplog.text and not (tmp_path / "gguf").exists()


# vLLM's LoRA loader, as of vllm-project/vllm main (2026):
# https://github.com/vllm-project/vllm/blob/main/vllm/lora/lora_model.py (LoRAModel.from_local_checkpoint) reads
#   adapter_model.safetensors (or .bin/.pt) from the folder; every tensor name must parse with
#   parse_fine_tuned_lora_name (https://github.com/vllm-project/vllm/blob/main/vllm/lora/utils.py):
#   "base_model.model.<module path>.lora_A.weight" / ".lora_B.weight" (or .lora_embedding_A/B), and the module's
#   last name must be one of the model's supported LoRA modules, else "expected target modules in ...".
# https://github.com/vllm-project/vllm/blob/main/vllm/lora/peft_helper.py (PEFTHelper) needs r, lora_alpha and
#   target_modules in adapter_config.json, refuses modules_to_save ("vLLM only supports modules_to_save being
#   None") and use_dora ("vLLM does not yet support DoRA").
VLLM_LLAMA_LORA_MODULES = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                           "embed_tokens", "lm_head"}  # its packed qkv_proj / gate_up_proj accept these names


def test_adapter_folder_is_what_vllms_lora_loader_accepts(exported: dict[str, Any]) -> None:
    from safetensors import safe_open

    version = exported["version"]
    config = json.loads((version / "adapter_config.json").read_text())
    assert {"r", "lora_alpha", "target_modules"} <= set(config) and config["r"] == 4
    assert not config.get("modules_to_save") and not config.get("use_dora")
    # the user's base model (here the embedded one, as the run config names it), not the run's 4-bit checkpoint
    assert config["base_model_name_or_path"] == ModelArgs().model_dump()["base_model"]
    with safe_open(version / "adapter_model.safetensors", framework="pt") as f:
        names = list(f.keys())
    assert names
    for name in names:
        parts = name.split(".")
        assert parts[:2] == ["base_model", "model"], name
        assert parts[-1] == "weight" and parts[-2] in ("lora_A", "lora_B"), name
        assert parts[-3] in VLLM_LLAMA_LORA_MODULES, name


@pytest.mark.slow
def test_cli_run_publishes_a_gguf_that_transformers_and_llama_cpp_read(tmp_path: Path) -> None:
    """The issue's "done when": one CLI run with export.merge and export.gguf=[q8_0], its published GGUF read back by
    transformers and by llama.cpp."""
    from tests.conftest import SMALL_ROWS, cli_env, last_json, small_overrides

    data = tmp_path / "small.jsonl"
    from tasks.config import EMBEDDED_DATA

    data.write_text("".join(EMBEDDED_DATA.read_text().splitlines(keepends=True)[:SMALL_ROWS]))
    sets = small_overrides(data, tmp_path / "runs", **{"train.max_steps": 2, "eval.max_samples": 4,
                                                       "eval.generation_samples": 0})
    args = ["run", "--json", *[a for s in [*sets, "export.merge=true", "export.gguf=[q8_0]"] for a in ("--set", s)]]
    done = subprocess.run([sys.executable, "-m", "deployments.cli", *args], cwd=PROJECT_ROOT, capture_output=True,
                          text=True, env=cli_env(tmp_path / "prefect-home"), timeout=1100)
    assert done.returncode == 0, done.stderr[-3000:]
    version = Path(last_json(done.stdout)["metrics"]["export_path"])
    assert (version / "gguf" / "Modelfile").read_text().startswith("FROM ./model-q8_0.gguf\n")
    _check_gguf_logits(version / "merged", version / "gguf", "model-q8_0.gguf", TOLERANCE["q8_0"])
    from transformers import AutoModelForCausalLM, AutoTokenizer

    [got] = llama_cpp([{"model": str(version / "gguf" / "model-q8_0.gguf")}])  # llama.cpp, the third-party reader
    merged = version / "merged"
    tokenizer = AutoTokenizer.from_pretrained(merged)
    assert_same_greedy(got, hf_greedy(AutoModelForCausalLM.from_pretrained(merged), tokenizer), "q8_0")


def test_a_dpo_champion_exports_the_same_gguf_files(stages: dict[str, Any], tmp_path: Path) -> None:
    """The issue's "the same for DPO/KTO champions": a DPO adapter's export writes the merged GGUF, the GGUF LoRA and
    the Modelfile, and llama.cpp reads the merged GGUF with transformers' greedy tokens."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tasks.config import EMBEDDED_PREFERENCES, DataArgs, load_config
    from tasks.evaluate_adapter.stage import evaluate_adapter
    from tasks.export_adapter.stage import export_adapter
    from tasks.prepare_data.stage import prepare_data
    from tasks.train_adapter.stage import train_adapter

    runs, model = stages["runs"], stages["model"]
    config = load_config(None, ["train.method=dpo", "train.max_steps=2", "train.per_device_train_batch_size=4",
                                "lora.r=4", "eval.max_samples=8", "eval.generation_samples=0", "export.name=dpo",
                                "export.merge=true", "export.merged_dtype=float32", "export.gguf=[q8_0]"])
    data = prepare_data.fn(DataArgs(source=str(EMBEDDED_PREFERENCES)), config.model, runs)
    adapter = train_adapter.fn(config.lora, config.train, config.speed, runs, data, model)
    evals = evaluate_adapter.fn(config.eval, runs, data, model, adapter)
    export_adapter.fn(config.export, tmp_path, data, model, adapter, evals)
    version = tmp_path.resolve() / "exports" / "dpo" / "v0001"
    assert json.loads((version.parent / "champion.json").read_text())["version"] == "v0001"
    assert sorted(p.name for p in (version / "gguf").iterdir()) == ["Modelfile", "Modelfile.adapter", "base-q8_0.gguf",
                                                                    "lora-f32.gguf", "model-q8_0.gguf"]
    assert "`lora-f32.gguf`" in (version / "README.md").read_text()
    _check_gguf_logits(version / "merged", version / "gguf", "model-q8_0.gguf", TOLERANCE["q8_0"])
    tokenizer = AutoTokenizer.from_pretrained(version / "merged")
    [got] = llama_cpp([{"model": str(version / "gguf" / "model-q8_0.gguf")}])
    merged = AutoModelForCausalLM.from_pretrained(version / "merged", dtype=torch.float32)
    assert_same_greedy(got, hf_greedy(merged, tokenizer), "q8_0")


def test_rows_that_are_not_whole_q8_0_blocks_stay_f16(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import gguf

    from tasks.export_adapter.gguf import write_gguf
    from tests.families import build_family_model

    merged = build_family_model("llama", tmp_path / "llama", hidden=48, intermediate=64)  # 48: not 32-wide blocks
    with caplog.at_level(logging.INFO):
        write_gguf(merged, tmp_path / "gguf", ["q8_0"])
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(tmp_path / "gguf" / "model-q8_0.gguf").tensors}
    # rows of 48 (q/k/v/gate/up, embeddings) stay f16; down_proj's rows of 64 are quantized
    assert types["blk.0.attn_q.weight"] == "F16" and types["blk.0.ffn_down.weight"] == "Q8_0"
    assert "blk.0.attn_q.weight [48, 48] stays f16 (rows not whole q8_0 blocks)" in caplog.text
    _check_gguf_logits(merged, tmp_path / "gguf", "model-q8_0.gguf", TOLERANCE["q8_0"])
