"""evaluate_adapter and export_adapter alone (through .fn()), their metrics, and the exports registry."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest

from tasks.config import EvalArgs, ExportArgs, LoraArgs, ModelArgs, SpeedArgs, TrainArgs
from tasks.evaluate_adapter.generation import exact_match, lcs_length, rouge_l, rouge_tokens, score, split_prompt
from tasks.evaluate_adapter.stage import evaluate_adapter
from tasks.export_adapter.stage import export_adapter
from tasks.on_disk.manifest import MANIFEST, read_manifest
from tasks.registry import store as registry
from tasks.train_adapter.stage import train_adapter

SMALL_EVAL = {"max_samples": 12, "generation_samples": 6, "max_new_tokens": 8, "per_device_eval_batch_size": 4}


@pytest.fixture(scope="module")
def trained(stages: dict[str, Any]) -> dict[str, Any]:
    """The shared first two stages, a few training steps, then one evaluation."""
    out = dict(stages)
    runs = out["runs"]
    out["adapter"] = train_adapter.fn(LoraArgs(r=4, lora_alpha=8), TrainArgs(max_steps=4, logging_steps=1),
                                      SpeedArgs(), runs, out["data"], out["model"])
    out["eval"] = evaluate_adapter.fn(EvalArgs(**SMALL_EVAL), runs, out["data"], out["model"], out["adapter"])
    return out


def _upstream(trained: dict[str, Any]) -> tuple[str, str, str, str]:
    return trained["data"], trained["model"], trained["adapter"], trained["eval"]


# --- metrics, checked by hand ---------------------------------------------------------------------------------

def test_exact_match_ignores_whitespace_only() -> None:
    assert exact_match("  A cat\n says meow. ", "A cat says meow.") == 1.0
    assert exact_match("a cat says meow.", "A cat says meow.") == 0.0  # case counts
    assert exact_match("A cat says meow", "A cat says meow.") == 0.0  # punctuation counts


def test_rouge_l_by_hand() -> None:
    # tokens: [the cat sat on the mat] vs [the cat is on the mat]; LCS = the cat on the mat = 5 of 6 and 6
    assert rouge_l("The cat sat on the mat.", "the cat is on the mat") == pytest.approx(5 / 6)
    # LCS 1 ("cat"): precision 1/1, recall 1/3 -> F1 = 2 * 1 * (1/3) / (1 + 1/3) = 0.5
    assert rouge_l("cat", "the cat sat") == pytest.approx(0.5)
    # [a lion says moo] vs [a cat says meow]: LCS "a says" = 2 of 4 and 4 -> 0.5
    assert rouge_l("A lion says moo.", "A cat says meow.") == pytest.approx(0.5)
    # order matters: LCS of [b a] and [a b] is 1 -> P = R = 1/2
    assert rouge_l("b a", "a b") == pytest.approx(0.5)
    assert rouge_l("Meow!", "meow") == 1.0 and rouge_l("", "meow") == 0.0 and rouge_l("dog", "cat") == 0.0
    assert rouge_tokens("3 is larger-than 2.") == ["3", "is", "larger", "than", "2"]
    assert lcs_length(list("ABCBDAB"), list("BDCABA")) == 4  # the textbook case (BCBA)


def test_score_averages_over_answers() -> None:
    got = score(["A cat says meow.", "cat"], ["A cat says meow.", "the cat sat"])
    assert got == {"exact_match": 0.5, "rouge_l": pytest.approx((1.0 + 0.5) / 2)}
    assert score([], []) == {"exact_match": None, "rouge_l": None}


def test_prompt_is_the_masked_prefix_and_reference_the_first_answer() -> None:
    ids, labels = [1, 10, 11, 20, 21, 2, 30, 40], [-100, -100, -100, 20, 21, 2, -100, 40]
    assert split_prompt(ids, labels) == ([1, 10, 11], [20, 21, 2])
    assert split_prompt([1, 5, 6], [1, 5, 6]) is None  # plain text: nothing masked, no prompt


# --- evaluate_adapter ---------------------------------------------------------------------------------------------

def test_evaluate_writes_metrics_and_samples(trained: dict[str, Any]) -> None:
    folder = Path(trained["eval"])
    assert sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")) == [
        "manifest.json", "metrics.json", "samples.jsonl"]
    metrics = read_manifest(folder).metrics.model_dump(exclude_unset=True)
    assert metrics == json.loads((folder / "metrics.json").read_text())
    assert metrics["eval_examples"] == 12 and metrics["generation_samples"] == 6
    from tasks.on_disk.parquet_dataset import ParquetExamples

    examples = ParquetExamples(Path(trained["data"]) / "eval.parquet")
    labels = [examples[i]["labels"][1:] for i in range(12)]  # next-token targets: the first label is never scored
    assert metrics["eval_tokens"] == sum(t != -100 for row in labels for t in row)
    samples = [json.loads(line) for line in (folder / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 6 and all(s["prompt"].endswith("### Response:\n") for s in samples)
    for who in ("base", "tuned"):
        scores = [rouge_l(s[f"{who}_output"], s["reference"]) for s in samples]
        assert metrics[f"{who}_rouge_l"] == pytest.approx(sum(scores) / 6)
        assert metrics[f"{who}_exact_match"] == sum(exact_match(s[f"{who}_output"], s["reference"])
                                                    for s in samples) / 6
    assert samples[0]["base_output"] != samples[0]["tuned_output"]  # the adapter changes the answers
    assert "lm_eval" not in metrics


def test_evaluate_is_deterministic(trained: dict[str, Any], tmp_path: Path) -> None:
    again = Path(evaluate_adapter.fn(EvalArgs(**SMALL_EVAL), tmp_path, trained["data"], trained["model"],
                                     trained["adapter"]))
    assert again != Path(trained["eval"])  # computed afresh in another runs_dir, not reused
    for name in ("metrics.json", "samples.jsonl"):
        assert (again / name).read_bytes() == (Path(trained["eval"]) / name).read_bytes()


# eval.lm_eval_tasks without lm-eval, and with a real local task: tests/test_suites.py


# --- export_adapter -----------------------------------------------------------------------------------------------

def test_merged_model_matches_base_plus_adapter(trained: dict[str, Any], tmp_path: Path) -> None:
    import bitsandbytes as bnb
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tasks.models.loading import load_quantized

    args = ExportArgs(merge=True, merged_dtype="float32")
    folder = Path(export_adapter.fn(args, tmp_path, *_upstream(trained)))
    files = sorted(str(p.relative_to(folder / "merged")) for p in (folder / "merged").rglob("*") if p.is_file())
    assert files == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                     "tokenizer_config.json"]
    assert set(read_manifest(folder).outputs) >= {f"merged/{f}" for f in files}
    ids = torch.tensor([[1, 37, 215, 96, 512, 7, 300, 44, 901, 12, 2]])
    tuned = PeftModel.from_pretrained(load_quantized(Path(trained["model"])), Path(trained["adapter"]) / "adapter")
    for module in tuned.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            # bnb's CPU inference kernel (AVX512-BF16 CPUs) rounds to bf16; the reference must be the fp32 math
            module.support_avx512bf16_for_cpu = False
    merged = AutoModelForCausalLM.from_pretrained(folder / "merged", dtype=torch.float32)
    assert not any(isinstance(m, bnb.nn.Linear4bit) for m in merged.modules()) and not hasattr(
        merged.config, "quantization_config")
    with torch.no_grad():
        want = tuned.eval()(input_ids=ids).logits
        got = merged.eval()(input_ids=ids).logits
    # Tolerance 1e-4 absolute on logits of magnitude ~1: both sides compute in fp32 from the same dequantized NF4
    # weights, x @ (W + s*B@A)^T merged vs x @ W^T + s*(x @ A^T) @ B^T, so only the rounding order differs
    # (measured 1.5e-6). A merging mistake is far above it: merging into the original (not dequantized) weights
    # moved these logits by 0.2, and bnb's bf16 CPU kernel alone by 9e-3.
    assert (got - want).abs().max().item() < 1e-4
    # the default bf16 export rounds every weight to 8 significant bits (~0.4%): measured 1.2e-2, allowed 5e-2
    bf16 = Path(export_adapter.fn(ExportArgs(merge=True), tmp_path, *_upstream(trained))) / "merged"
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(bf16, dtype=torch.float32).eval()(input_ids=ids).logits
    assert (got - want).abs().max().item() < 5e-2


def test_model_card_has_metrics_settings_and_load_command(trained: dict[str, Any], tmp_path: Path) -> None:
    folder = Path(export_adapter.fn(ExportArgs(name="cardtest"), tmp_path, *_upstream(trained)))
    metrics = read_manifest(Path(trained["eval"])).metrics.model_dump(exclude_unset=True)
    version = tmp_path.resolve() / "exports" / "cardtest" / "v0001"
    for card in ((folder / "README.md").read_text(), (version / "README.md").read_text()):
        for label, key in [("eval loss", "eval_loss"), ("perplexity", "perplexity"),
                           ("exact match", "exact_match"), ("ROUGE-L", "rouge_l")]:
            assert f"| {label} | {metrics['base_' + key]:.4f} | {metrics['tuned_' + key]:.4f} |" in card
        data_manifest = read_manifest(Path(trained["data"]))
        assert data_manifest.fingerprint["data"] in card
        # as the run config records it: the embedded model relative to the checkout
        assert "base_model: " + ModelArgs().model_dump()["base_model"] in card and "revision `local folder`" in card
        assert '"r": 4, "lora_alpha": 8' in card and '"max_steps": 4' in card
        assert 'bnb_4bit_quant_type="nf4"' in card and "revision=None" in card
    card = (version / "README.md").read_text()
    assert f'model = PeftModel.from_pretrained(base, "{version}")' in card
    assert "Registry: `cardtest` **v0001**, promoted: first version" in card


def test_registry_gate_promotes_first_rejects_worse_promotes_better(trained: dict[str, Any], tmp_path: Path) -> None:
    from safetensors.torch import save_file
    from torch import ones

    source = tmp_path / "stage"
    source.mkdir()
    save_file({"lora_A": ones(2, 2)}, source / "adapter_model.safetensors")
    (source / "README.md").write_text("stage card")
    (source / MANIFEST).write_text("{}")
    root = tmp_path / "exports" / "a"

    def publish(key: str, loss: float) -> dict[str, Any]:
        stage = tmp_path / f"stage-{key}"  # an export stage folder per key, as the stage makes them
        if not stage.exists():
            shutil.copytree(source, stage)
        return registry.publish(root, stage, key, {"tuned_eval_loss": loss, "base_eval_loss": 2.5}, 0.05,
                                "evalsplit", lambda folder, record: f"card of {folder.name}: {record['promotion']}")

    first = publish("k1", 2.0)
    assert (first["version"], first["promotion"]) == ("v0001", "promoted")
    worse = publish("k2", 1.95)  # 2.5% lower: not more than the 5% margin
    assert (worse["version"], worse["promotion"]) == ("v0002", "rejected")
    assert worse["reason"] == ("tuned eval loss 1.9500 does not beat champion v0001's 2.0000 on its own night's eval "
                               "data (cross-night rule: this run scored no champion beside it) by more than the "
                               "5.0% margin (needed < 1.9000)")
    assert worse["rule"] == "cross-night" and worse["path"] == "exports/a/v0002"
    better = publish("k3", 1.8)
    assert (better["version"], better["promotion"]) == ("v0003", "promoted")
    champion = registry.champion(root)
    assert champion["version"] == "v0003" and champion["metrics"]["tuned_eval_loss"] == 1.8
    # each version is a complete, separate folder with its verdict; none was overwritten
    rejected = json.loads((root / "v0002" / "version.json").read_text())
    assert rejected["promotion"] == "rejected" and rejected["reason"] == worse["reason"]
    assert rejected["champion_before"]["version"] == "v0001"
    assert (root / "v0001" / "README.md").read_text() == "card of v0001: promoted"
    assert (root / "v0002" / "README.md").read_text() == "card of v0002: rejected"
    assert (tmp_path / "stage-k1" / "README.md").read_text() == "stage card"  # the hard-linked source: not written
    assert not (root / "v0001" / MANIFEST).exists()
    assert sorted(p.name for p in root.iterdir()) == ["champion.json", "v0001", "v0002", "v0003"]
    # the same stage key again (its manifest lost after publishing) gets its version back, not a new one
    assert publish("k2", 1.0)["version"] == "v0002" and len(registry.versions(root)) == 3


def test_export_publishes_once_per_stage_key_and_records_the_verdict(trained: dict[str, Any], tmp_path: Path) -> None:
    first = Path(export_adapter.fn(ExportArgs(name="gate"), tmp_path, *_upstream(trained)))
    root = tmp_path.resolve() / "exports" / "gate"
    metrics = read_manifest(first).metrics.model_dump(exclude_unset=True)
    assert metrics["export_version"] == "v0001" and metrics["promotion"] == "promoted"
    assert metrics["champion_version"] == "v0001" and metrics["export_path"] == "exports/gate/v0001"
    # a cached re-run (the stage folder is done) publishes nothing
    assert export_adapter.fn(ExportArgs(name="gate"), tmp_path, *_upstream(trained)) == str(first)
    assert [r["version"] for r in registry.versions(root)] == ["v0001"]
    # a lost manifest recomputes the stage under the same key: still v0001
    (first / MANIFEST).unlink()
    export_adapter.fn(ExportArgs(name="gate"), tmp_path, *_upstream(trained))
    assert [r["version"] for r in registry.versions(root)] == ["v0001"]
    # new export settings that add no format (another shard size): the champion's own adapter, not a second version
    second = Path(export_adapter.fn(ExportArgs(name="gate", max_shard_size="1GB"), tmp_path, *_upstream(trained)))
    metrics = read_manifest(second).metrics.model_dump(exclude_unset=True)
    assert (metrics["export_version"], metrics["promotion"], metrics["gate_rule"]) == ("v0001", "promoted",
                                                                                        "same-adapter")
    assert metrics["promotion_reason"] == ("same adapter as champion v0001 (identical weights, same base model), with "
                                           "the same formats: nothing to add: not published again")
    assert [r["version"] for r in registry.versions(root)] == ["v0001"] and metrics["champion_version"] == "v0001"


# --- evaluation at GPU speed: dequantized base, length-sorted batches --------------------------------------------
def _eval_inputs(trained: dict[str, Any], size: int) -> tuple[list[dict[str, Any]], list[list[int]], list[int]]:
    """The first 40 eval examples in length-sorted batches, their prompts, and the eos ids."""
    from tasks.evaluate_adapter.sequences import _batches
    from tasks.models.loading import load_tokenizer
    from tasks.on_disk.parquet_dataset import ParquetExamples

    examples = ParquetExamples(Path(trained["data"]) / "eval.parquet")
    count = min(40, len(examples))
    prompts = [p for p, _ in filter(None, (split_prompt(**examples[i]) for i in range(count)))]
    tokenizer = load_tokenizer(Path(trained["model"]))
    return _batches(examples, count, size, tokenizer.pad_token_id), prompts, [tokenizer.eos_token_id]


def _fp32_4bit(model: Any) -> Any:
    """bnb's CPU inference kernel (AVX512-BF16 CPUs) rounds to bf16: turned off, the 4-bit layers run the fp32 math."""
    import bitsandbytes as bnb

    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False
    return model


def test_dequantized_evaluation_equals_the_4bit_path(trained: dict[str, Any]) -> None:
    from peft import PeftModel

    from tasks.evaluate_adapter.generation import greedy_generate
    from tasks.evaluate_adapter.sequences import mean_loss
    from tasks.models.dequantize import dequantize_decision, dequantize_in_place
    from tasks.models.loading import load_quantized

    batches, prompts, eos = _eval_inputs(trained, 4)
    adapter = Path(trained["adapter"]) / "adapter"
    four_bit = _fp32_4bit(load_quantized(Path(trained["model"])))
    plain = load_quantized(Path(trained["model"]))
    assert dequantize_decision(plain, "auto")[0]  # 1 MB of weights fit any host
    assert dequantize_decision(plain, False) == (False, "eval.dequantize=false")
    dequantize_in_place(plain)
    assert dequantize_decision(plain, True)[0] is False  # nothing left to dequantize
    results = []
    for model in (four_bit, plain):
        base = [mean_loss(model, batches), greedy_generate(model, prompts, 4, 12, 0, eos)]
        tuned = PeftModel.from_pretrained(model, adapter, adapter_name="tuned")
        results.append((base, [mean_loss(tuned, batches), greedy_generate(tuned, prompts, 4, 12, 0, eos)]))
    (four_base, four_tuned), (plain_base, plain_tuned) = results
    for four, same in ((four_base, plain_base), (four_tuned, plain_tuned)):
        assert four[1] == same[1] and four[0][1] == same[0][1]  # identical greedy answers, same token count
        # both compute in fp32 from the same dequantized NF4 weights: the 4-bit layer dequantizes on every forward
        # and runs the same matmul. Measured 0.0 (bit-identical losses, same answers) on the 2-core dev host,
        # 2026-12-02; 1e-5 leaves room for another BLAS's summation order. Dequantizing to another dtype than the
        # layer's compute dtype would move it by ~1e-3 (bf16 rounding)
        assert abs(four[0][0] - same[0][0]) < 1e-5
    assert four_tuned[0][0] != four_base[0][0]  # the adapter is attached on both paths


def test_merged_adapter_scores_as_peft_layers_do(trained: dict[str, Any]) -> None:
    """evaluate_adapter merges the adapter into a dequantized base (outputs.attached): the same loss as peft's own LoRA
    layers beside the weights, up to float rounding, and the same greedy answers; on a 4-bit base it keeps them."""
    from peft import PeftModel

    from tasks.evaluate_adapter.generation import greedy_generate
    from tasks.evaluate_adapter.outputs import attached
    from tasks.evaluate_adapter.sequences import mean_loss
    from tasks.models.dequantize import dequantize_in_place
    from tasks.models.loading import load_quantized

    batches, prompts, eos = _eval_inputs(trained, 4)
    adapter = Path(trained["adapter"]) / "adapter"
    layers = PeftModel.from_pretrained(dequantize_in_place(load_quantized(Path(trained["model"]))), adapter)
    merged = attached(dequantize_in_place(load_quantized(Path(trained["model"]))), adapter)
    assert merged.base_model.model.model.layers[0].mlp.down_proj.merged
    assert not layers.base_model.model.model.layers[0].mlp.down_proj.merged
    (loss, tokens), (same, same_tokens) = mean_loss(merged, batches), mean_loss(layers, batches)
    assert tokens == same_tokens and abs(loss - same) < 1e-5 * same  # fp32 on CPU: rounding only
    assert greedy_generate(merged, prompts, 4, 12, 0, eos) == greedy_generate(layers, prompts, 4, 12, 0, eos)
    four_bit = attached(load_quantized(Path(trained["model"])), adapter)
    assert not four_bit.base_model.model.model.layers[0].mlp.down_proj.merged


def test_length_sorted_batches_keep_the_loss_and_the_answers(trained: dict[str, Any]) -> None:
    from tasks.evaluate_adapter.generation import by_length, generation_tokens, greedy_generate
    from tasks.evaluate_adapter.sequences import mean_loss
    from tasks.models.dequantize import dequantize_in_place
    from tasks.models.loading import load_quantized

    model = dequantize_in_place(load_quantized(Path(trained["model"])))
    sorted_batches, prompts, eos = _eval_inputs(trained, 8)
    one_by_one, _, _ = _eval_inputs(trained, 1)
    assert len(sorted_batches) < len(one_by_one) / 4  # far fewer batches than examples
    loss, tokens = mean_loss(model, sorted_batches)
    alone = mean_loss(model, one_by_one)
    assert tokens == alone[1] and abs(loss - alone[0]) < 1e-6 * alone[0]
    batched = greedy_generate(model, prompts, 8, 12, 0, eos)
    assert batched == [greedy_generate(model, [p], 1, 12, 0, eos)[0] for p in prompts]
    # the stage's token budget: no more memory than the largest loss batch holds in logits, one batch here
    budget = generation_tokens(model, max(b["input_ids"].numel() for b in sorted_batches))
    assert len(by_length([len(p) + 12 for p in prompts], 8, budget)) == 1 < len(by_length(
        [len(p) + 12 for p in prompts], 1))
    assert greedy_generate(model, prompts, 8, 12, 0, eos, budget) == batched


def test_base_results_are_remembered_for_the_next_adapter(trained: dict[str, Any], tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """An evaluation leaves the base model's results in runs_dir/evaluate_adapter/.memo; the next adapter's, on the
    same eval data, model and settings, takes them from there (one log line) instead of computing them again, and
    writes the metrics and samples that a fresh evaluation in another runs_dir computes, byte for byte."""
    monkeypatch.setenv("QLORA_CPU_THREADS", "1")  # the same threads every time: a CPU's digits can depend on them
    runs, data, model = tmp_path / "runs", trained["data"], trained["model"]
    other = train_adapter.fn(LoraArgs(r=4, lora_alpha=8), TrainArgs(max_steps=2, logging_steps=1), SpeedArgs(),
                             runs, data, model)
    evaluate_adapter.fn(EvalArgs(**SMALL_EVAL), runs, data, model, trained["adapter"])
    assert len(list((runs / "evaluate_adapter" / ".memo").glob("*/base.json"))) == 1
    with caplog.at_level(logging.INFO):
        remembered = Path(evaluate_adapter.fn(EvalArgs(**SMALL_EVAL), runs, data, model, other))
    assert "base model: eval loss" in caplog.text and "as an earlier run computed them" in caplog.text
    fresh = Path(evaluate_adapter.fn(EvalArgs(**SMALL_EVAL), tmp_path / "fresh", data, model, other))
    for name in ("metrics.json", "samples.jsonl"):
        assert (remembered / name).read_bytes() == (fresh / name).read_bytes()
    caplog.clear()
    with caplog.at_level(logging.INFO):  # other settings: other batches and answers, computed
        evaluate_adapter.fn(EvalArgs(**{**SMALL_EVAL, "max_new_tokens": 4}), runs, data, model, other)
    assert "as an earlier run computed them" not in caplog.text
    assert len(list((runs / "evaluate_adapter" / ".memo").glob("*/base.json"))) == 2
