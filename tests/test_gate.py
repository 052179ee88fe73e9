"""The nightly loop's judgement (issue 25) and its registry's reliability (issue 28): the champion scored beside
the challenger on the same data, the cross-night fallback, the history, runs_dir moved or copied, and damaged
starting adapters. Stages through .fn() on the tiny model; one whole flow for the summary and artifacts."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tasks.config import (
    EMBEDDED_DATA,
    PROJECT_ROOT,
    DataArgs,
    EvalArgs,
    ExportArgs,
    LoraArgs,
    ModelArgs,
    SpeedArgs,
    TrainArgs,
)
from tasks.errors import UserError
from tasks.evaluate_adapter.champion import score_champion
from tasks.evaluate_adapter.stage import evaluate_adapter
from tasks.export_adapter.stage import export_adapter
from tasks.methods import REWARD_ACCURACY
from tasks.on_disk.manifest import MANIFEST, read_manifest
from tasks.registry import store as registry
from tasks.registry.gate import gate, identity, rule
from tasks.registry.init_adapter import resolve_adapter

EVAL = EvalArgs(max_samples=16, generation_samples=2, max_new_tokens=4, per_device_eval_batch_size=8)
# a few steps on the tiny model move its eval loss by about 1%: the gate's margin must be below that
MARGIN = 0.001


def _metrics(folder: str | Path) -> dict[str, Any]:
    return read_manifest(Path(folder)).metrics.model_dump(exclude_unset=True)


@pytest.fixture(scope="module")
def nights(stages: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two eval sets (the sample data, and the same with 8 unpredictable words after every answer: harder for both
    adapters, still easier than for the base model) and two adapters trained on the sample data: strong (12 steps at
    a high rate) and weak (2 steps)."""
    from tasks.prepare_data.stage import prepare_data
    from tasks.train_adapter.stage import train_adapter

    runs, rng = stages["runs"], random.Random(0)
    rows = [json.loads(line) for line in EMBEDDED_DATA.read_text().splitlines()[:200]]
    noise = [f"zq{i}" for i in range(50)]
    out = {**stages, "easy": stages["data"]}
    for name, k in (("hard", 8),):  # unpredictable words after every answer: a harder eval split
        noisy = tmp_path_factory.mktemp(name) / f"{name}.jsonl"
        noisy.write_text("".join(json.dumps({**r, "response": f"{r['response']} {' '.join(rng.choices(noise, k=k))}"})
                                 + "\n" for r in rows))
        out[name] = prepare_data.fn(DataArgs(source=str(noisy)), ModelArgs(), runs)
    lora = LoraArgs(r=4, lora_alpha=8)
    out["strong"] = train_adapter.fn(lora, TrainArgs(max_steps=12, learning_rate=0.02, logging_steps=1),
                                     SpeedArgs(), runs, out["easy"], out["model"])
    out["weak"] = train_adapter.fn(lora, TrainArgs(max_steps=2, logging_steps=1), SpeedArgs(), runs, out["easy"],
                                   out["model"])
    return out


def _night(n: dict[str, Any], name: str, data: str, adapter: str, runs: Path | None = None,
           export: ExportArgs | None = None) -> tuple[str, dict[str, Any]]:
    """One night's evaluation, champion scoring and export of `adapter` on `data` into registry `name` (under
    `runs`, default the shared runs_dir, where the evaluation always goes), as the flow runs them: (eval dir,
    export metrics)."""
    export = export or ExportArgs(name=name, promotion_margin=MARGIN)
    evaluated = evaluate_adapter.fn(EVAL, n["runs"], n[data], n["model"], n[adapter])
    judged = score_champion.fn(EVAL, runs or n["runs"], n[data], n["model"], n[adapter], evaluated, export)
    exported = export_adapter.fn(export, runs or n["runs"], n[data], n["model"], n[adapter], evaluated, judged)
    return evaluated, _metrics(exported)


def test_same_data_gate_promotes_a_better_adapter_the_old_rule_would_reject(nights: dict[str, Any]) -> None:
    first_eval, first = _night(nights, "better", "easy", "weak")
    assert (first["export_version"], first["promotion"], first["gate_rule"]) == ("v0001", "promoted", "first")
    assert "beats the base model's" in first["promotion_reason"] and first.get("judged_against") is None
    second_eval, second = _night(nights, "better", "hard", "strong")  # a harder eval split tonight
    night1, night2 = _metrics(first_eval), _metrics(second_eval)
    assert second["judged_against"] == "v0001" and "judged_against" not in night2  # scored apart, not in the eval
    # the old rule: tonight's loss on harder data against the champion's loss on its own (easier) night
    assert night2["tuned_eval_loss"] > night1["tuned_eval_loss"] * (1 - MARGIN)
    # the same-data rule: the champion scored on tonight's data is worse than the challenger
    assert second["champion_eval_loss"] > night2["tuned_eval_loss"] / (1 - MARGIN)
    assert (second["promotion"], second["gate_rule"]) == ("promoted", "same-data")
    assert "on this run's eval data (same-data rule)" in second["promotion_reason"]
    assert f"champion v0001's {second['champion_eval_loss']:.4f}" in second["promotion_reason"]
    # the champion's same-data numbers are its own, on these batches: exactly as if evaluated alone on tonight's
    # data (a wrong adapter is 1e-2 off)
    alone = _metrics(evaluate_adapter.fn(EVAL, nights["runs"], nights["hard"], nights["model"], nights["weak"]))
    assert second["champion_eval_loss"] == alone["tuned_eval_loss"]
    assert second["champion_rouge_l"] == alone["tuned_rouge_l"]
    root = registry.registry_dir(nights["runs"], "better")
    record = json.loads((root / "v0002" / "version.json").read_text())
    assert record["rule"] == "same-data" and record["champion_before"]["version"] == "v0001"
    assert record["metrics"]["champion_eval_loss"] == second["champion_eval_loss"]
    assert record["path"] == "exports/better/v0002" and not Path(record["source"]).is_absolute()
    card = (root / "v0002" / "README.md").read_text()
    assert "| metric | base | champion v0001 | tuned (this adapter) |" in card
    assert f"| eval loss | {night2['base_eval_loss']:.4f} | {second['champion_eval_loss']:.4f} | " in card
    assert registry.champion(root)["version"] == "v0002"


def test_an_unchanged_rerun_after_its_promotion_stays_cached(nights: dict[str, Any]) -> None:
    """Re-running night 2 after v0002 (its own adapter) became the champion: the same keys, nothing recomputed,
    nothing scored."""
    _night(nights, "again", "easy", "weak")
    evaluated, exported = _night(nights, "again", "hard", "strong")
    assert exported["promotion"] == "promoted"
    root = registry.registry_dir(nights["runs"], "again")
    stage = root.parent.parent / registry.version_record(root, "v0002")["source"]
    stamps = [(Path(d) / MANIFEST).stat().st_mtime_ns for d in (evaluated, stage)]
    again, metrics = _night(nights, "again", "hard", "strong")
    assert again == evaluated and [(Path(d) / MANIFEST).stat().st_mtime_ns for d in (again, stage)] == stamps
    assert metrics["export_version"] == "v0002" and len(registry.versions(root)) == 2
    export = ExportArgs(name="again", promotion_margin=MARGIN)
    assert score_champion.fn(EVAL, nights["runs"], nights["hard"], nights["model"], nights["strong"], evaluated,
                             export) is None  # the champion is this adapter: nothing to score, nothing loaded


def test_same_data_gate_rejects_a_worse_adapter_the_old_rule_would_promote(nights: dict[str, Any]) -> None:
    first_eval, _ = _night(nights, "worse", "hard", "strong")  # the champion's night had the harder eval split
    second_eval, second = _night(nights, "worse", "easy", "weak")
    night1, night2 = _metrics(first_eval), _metrics(second_eval)
    assert night2["tuned_eval_loss"] < night1["tuned_eval_loss"] * (1 - MARGIN)  # the old rule would promote it
    assert second["champion_eval_loss"] < night2["tuned_eval_loss"]  # on the same data the champion is better
    assert (second["promotion"], second["gate_rule"]) == ("rejected", "same-data")
    assert registry.champion(registry.registry_dir(nights["runs"], "worse"))["version"] == "v0001"


def test_a_champion_that_cannot_be_scored_falls_back_to_the_cross_night_rule(nights: dict[str, Any]) -> None:
    _night(nights, "fallback", "easy", "weak")
    root = registry.registry_dir(nights["runs"], "fallback")
    published = registry.source_dir(root, registry.version_record(root, "v0001")) / registry.PUBLISHED
    # as if on another base model (the stage folder's copy too: a record unlike it is damage, and restored from it)
    for file in (root / "v0001" / registry.VERSION_FILE, root / registry.CHAMPION, published / registry.VERSION_FILE):
        file.write_text(json.dumps({**json.loads(file.read_text()), "base_model": "another"}))
    evaluated, exported = _night(nights, "fallback", "hard", "strong")
    assert exported.get("judged_against") is None and "judged_against" not in _metrics(evaluated)
    assert exported["gate_rule"] == "cross-night"
    assert "cross-night rule: champion v0001 was trained on another base model" in exported["promotion_reason"]


def test_preference_gate_same_data_and_fallback() -> None:
    champion = {"version": "v0001", "files": {"adapter_model.safetensors": "x"}, "eval_data": "old",
                "metrics": {"tuned_eval_loss": 1.0, "tuned_reward_accuracy": 0.9}}
    tonight = {"tuned_eval_loss": 1.0, "tuned_reward_accuracy": 0.7, "champion_reward_accuracy": 0.6,
               "champion_eval_loss": 1.0, "judged_against": "v0001", "champion_adapter": identity(champion)}
    verdict, reason = gate(tonight, champion, 0.01, "new", REWARD_ACCURACY)
    assert verdict == "promoted" and "champion v0001's 0.600 on this run's eval data (same-data rule)" in reason
    assert rule(tonight, champion) == "same-data"
    verdict, reason = gate({**tonight, "champion_adapter": None}, champion, 0.01, "new", REWARD_ACCURACY, "why not")
    assert verdict == "rejected" and "0.900 on its own night's eval data (cross-night rule: why not" in reason


@pytest.mark.slow
def test_dpo_champion_is_scored_with_the_same_rewards(stages: dict[str, Any], tmp_path: Path) -> None:
    from tasks.config import EMBEDDED_PREFERENCES, load_config
    from tasks.prepare_data.stage import prepare_data
    from tasks.train_adapter.stage import train_adapter

    runs = stages["runs"]
    pairs = prepare_data.fn(DataArgs(source=str(EMBEDDED_PREFERENCES)), ModelArgs(), runs)
    adapters = []
    for steps in (20, 1):  # the champion first: strong (20 steps, as test_preference.py's DPO run), far from ties
        c = load_config(None, ["train.method=dpo", f"train.max_steps={steps}", "train.learning_rate=0.003",
                               "train.beta=0.5", "train.per_device_train_batch_size=8", "lora.r=4"])
        adapters.append(train_adapter.fn(c.lora, c.train, c.speed, runs, pairs, stages["model"]))
    ev = EvalArgs(max_samples=32, generation_samples=2, max_new_tokens=4, per_device_eval_batch_size=8)
    export = ExportArgs(name="pref-gate")
    first = evaluate_adapter.fn(ev, runs, pairs, stages["model"], adapters[0])
    judged = score_champion.fn(ev, runs, pairs, stages["model"], adapters[0], first, export)
    first_export = _metrics(export_adapter.fn(export, runs, pairs, stages["model"], adapters[0], first, judged))
    assert (first_export["promotion"], first_export["gate_rule"]) == ("promoted", "first")
    assert "beats the base model's 0.500" in first_export["promotion_reason"]
    second = evaluate_adapter.fn(ev, runs, pairs, stages["model"], adapters[1])
    judged = score_champion.fn(ev, runs, pairs, stages["model"], adapters[1], second, export)
    exported = _metrics(export_adapter.fn(export, runs, pairs, stages["model"], adapters[1], second, judged))
    alone, night2 = _metrics(first), _metrics(second)
    # the champion scored apart is scored as the adapter of its own evaluation was: the same numbers
    assert exported["champion_reward_accuracy"] == alone["tuned_reward_accuracy"]
    assert exported["champion_reward_margin"] == pytest.approx(alone["tuned_reward_margin"], abs=1e-6)
    assert night2["tuned_reward_accuracy"] < exported["champion_reward_accuracy"]  # one DPO step vs twenty
    assert (exported["promotion"], exported["gate_rule"]) == ("rejected", "same-data")
    assert "tuned reward accuracy" in exported["promotion_reason"]


# --- the same data whenever a champion exists, like with like, formats (issue 41) --------------------------------

def test_an_evaluation_cached_from_before_the_champion_is_judged_on_the_same_data(nights: dict[str, Any]) -> None:
    """weak's evaluation was computed before v0002 became champion; exported again (other settings, as a
    formats-only re-export is), the champion is still scored on its eval data instead of the cross-night fallback."""
    first_eval, first = _night(nights, "cached", "easy", "weak")
    _, second = _night(nights, "cached", "easy", "strong")
    assert (first["promotion"], second["promotion"], second["gate_rule"]) == ("promoted", "promoted", "same-data")
    export = ExportArgs(name="cached", promotion_margin=MARGIN, max_shard_size="1GB")
    again_eval, again = _night(nights, "cached", "easy", "weak", export=export)
    assert again_eval == first_eval  # the evaluation was reused
    assert (again["export_version"], again["judged_against"], again["gate_rule"], again["promotion"]) == (
        "v0003", "v0002", "same-data", "rejected")
    assert "champion v0002's" in again["promotion_reason"] and "(same-data rule)" in again["promotion_reason"]
    # an unchanged re-run: the export is cached, so nothing is scored and nothing loaded
    assert score_champion.fn(EVAL, nights["runs"], nights["easy"], nights["model"], nights["weak"], again_eval,
                             export) is None


@pytest.mark.slow  # three merged exports, two with GGUF files (~25 s)
def test_a_formats_only_reexport_gives_the_champion_its_formats(nights: dict[str, Any]) -> None:
    """The serving example: the champion's adapter exported again with merge and GGUF becomes the champion with
    those formats, not a rejected copy; fewer formats are not promoted; the same formats are the champion already."""
    _night(nights, "serve", "easy", "strong")
    root = registry.registry_dir(nights["runs"], "serve")
    gguf = ExportArgs(name="serve", promotion_margin=MARGIN, merge=True, gguf=["q8_0"])
    _, second = _night(nights, "serve", "easy", "strong", export=gguf)
    assert (second["export_version"], second["promotion"], second["gate_rule"], second["champion_version"]) == (
        "v0002", "promoted", "same-adapter", "v0002")
    assert second["promotion_reason"].startswith("same adapter as champion v0001 (identical weights, same base "
                                                 "model), with formats added (")
    assert "gguf model-q8_0" in second["promotion_reason"] and "merged bfloat16" in second["promotion_reason"]
    assert second.get("judged_against") is None  # identical weights: nothing to score
    champion = root / registry.champion(root)["version"]
    assert (champion / "gguf" / "model-q8_0.gguf").is_file() and (champion / "merged" / "config.json").is_file()
    _, fewer = _night(nights, "serve", "easy", "strong", export=gguf.model_copy(update={"gguf": []}))
    assert (fewer["export_version"], fewer["promotion"], fewer["champion_version"]) == ("v0003", "rejected", "v0002")
    assert "not promoted: it lacks the champion's gguf " in fewer["promotion_reason"]
    _, same = _night(nights, "serve", "easy", "strong", export=gguf.model_copy(update={"max_shard_size": "1GB"}))
    assert (same["export_version"], same["champion_version"], same["gate_rule"]) == ("v0002", "v0002",
                                                                                      "same-adapter")
    assert same["promotion_reason"].endswith("with the same formats: nothing to add: not published again")
    assert [r["version"] for r in registry.versions(root)] == ["v0001", "v0002", "v0003"]


def test_the_gate_compares_like_with_like(nights: dict[str, Any]) -> None:
    """A challenger evaluated on whole texts against a champion chosen on answers only (the Prefect form's run of
    the issue) is not promoted on that comparison; export.accept_new_measure adopts the new measure deliberately."""
    from tasks.prepare_data.stage import prepare_data
    from tasks.train_adapter.stage import train_adapter

    runs = nights["runs"]
    source = read_manifest(Path(nights["easy"])).params["data"]["source"]
    full = prepare_data.fn(DataArgs(source=source, completion_only_loss=False), ModelArgs(), runs)
    n = {**nights, "full": full, "full-text": train_adapter.fn(
        LoraArgs(r=4, lora_alpha=8), TrainArgs(max_steps=12, learning_rate=0.02, logging_steps=1), SpeedArgs(), runs,
        full, nights["model"])}
    _night(n, "measure", "easy", "strong")
    _, unlike = _night(n, "measure", "full", "full-text")
    assert (unlike["export_version"], unlike["promotion"], unlike["gate_rule"], unlike["champion_version"]) == (
        "v0002", "rejected", "unlike", "v0001")
    reason = unlike["promotion_reason"]
    assert reason.startswith("not compared with champion v0001: this run's evaluation measures the loss on whole "
                             "texts (dolly data), champion v0001's measured the loss on answers only (dolly data)")
    assert "run again with export.accept_new_measure=true" in reason and "a new export.name" in reason
    accept = ExportArgs(name="measure", promotion_margin=MARGIN, accept_new_measure=True)
    _, accepted = _night(n, "measure", "full", "full-text", export=accept)
    assert (accepted["export_version"], accepted["gate_rule"], accepted["judged_against"]) == ("v0003", "same-data",
                                                                                               "v0001")
    assert accepted["promotion_reason"].startswith("new measure accepted (export.accept_new_measure): this run's "
                                                   "evaluation measures the loss on whole texts")


# --- history -------------------------------------------------------------------------------------------------

def _weights(folder: Path, value: float = 1.0) -> None:
    """A small adapter_model.safetensors (publishing reads its weights)."""
    from safetensors.torch import save_file
    from torch import full

    save_file({"base_model.model.lm_head.lora_A.weight": full((2, 2), value)}, folder / "adapter_model.safetensors")


def _registry_of_three(tmp_path: Path) -> Path:
    root = tmp_path / "runs" / "exports" / "h"
    for i, (loss, champion_loss) in enumerate([(2.0, None), (1.9, 2.1), (1.95, 1.9)]):
        source = tmp_path / "runs" / "export_adapter" / f"k{i}"
        source.mkdir(parents=True)
        _weights(source, float(i))
        metrics = {"tuned_eval_loss": loss, "base_eval_loss": 2.2}
        if champion_loss is not None:
            current = registry.champion(root)
            metrics.update(champion_eval_loss=champion_loss, judged_against=current["version"],
                           champion_adapter=identity(current))
        registry.publish(root, source, f"k{i}", metrics, 0.01, "d", lambda folder, record: "card")
    return root


def test_history_table_plot_and_command_on_three_versions(tmp_path: Path) -> None:
    from tasks.reporting.artifacts import history_markdown, registry_history

    root = _registry_of_three(tmp_path)
    rows = registry.history(root)
    assert [(r["version"], r["tuned eval loss"], r["champion same-night loss"], r["verdict"], r["rule"])
            for r in rows] == [("v0001", 2.0, None, "promoted", "first"), ("v0002", 1.9, 2.1, "promoted", "same-data"),
                               ("v0003", 1.95, 1.9, "rejected", "same-data")]
    table = history_markdown(rows)
    assert table.splitlines()[0].startswith("| version | published | tuned eval loss | judged against |")
    assert "| v0003 |" in table and "| 1.9500 | v0002 | 1.9000 | rejected | same-data |" in table
    assert registry_history("h", rows, tmp_path / "h.png").startswith(b"\x89PNG")
    out = subprocess.run([sys.executable, "-m", "deployments.cli", "history", "--export-name", "h", "--runs-dir",
                          str(tmp_path / "runs")], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(PROJECT_ROOT)})
    assert out.returncode == 0, out.stderr
    assert table in out.stdout
    missing = subprocess.run([sys.executable, "-m", "deployments.cli", "history", "--export-name", "nope",
                              "--runs-dir", str(tmp_path / "runs")], cwd=PROJECT_ROOT, capture_output=True, text=True,
                             timeout=300, env={**os.environ, "PYTHONPATH": str(PROJECT_ROOT)})
    assert missing.returncode == 2 and "no exports registry 'nope'" in missing.stderr


# --- registry paths (issue 28) ---------------------------------------------------------------------------------

def test_moved_and_copied_runs_dirs_use_their_own_versions(nights: dict[str, Any], tmp_path: Path) -> None:
    original = tmp_path / "a"
    _night(nights, "mv", "easy", "weak", runs=original)
    champion = json.loads((original / "exports" / "mv" / registry.CHAMPION).read_text())
    assert champion["path"] == "exports/mv/v0001"
    copy = tmp_path / "copy"
    shutil.copytree(original, copy)
    assert resolve_adapter("champion:mv", copy) == (copy / "exports" / "mv" / "v0001").resolve()
    moved = tmp_path / "moved"
    original.rename(moved)
    assert resolve_adapter("champion:mv", moved) == (moved / "exports" / "mv" / "v0001").resolve()
    # a record written before paths were relative: its absolute path is not used
    old = moved / "exports" / "mv" / registry.CHAMPION
    old.write_text(json.dumps({**champion, "path": str(original / "exports" / "mv" / "v0001")}))
    assert resolve_adapter("champion:mv", copy) == (copy / "exports" / "mv" / "v0001").resolve()
    assert resolve_adapter("champion:mv", moved) == (moved / "exports" / "mv" / "v0001").resolve()
    # a damaged version in the moved runs_dir is restored from its own export stage folder
    weights = moved / "exports" / "mv" / "v0001" / "adapter_model.safetensors"
    good = weights.read_bytes()
    weights.unlink()  # a replaced file, so the stage folder's hard-linked copy stays intact
    weights.write_bytes(b"\0" * len(good))
    assert resolve_adapter("champion:mv", moved) == weights.parent.resolve() and weights.read_bytes() == good


# --- damaged starting adapters (issue 28) -------------------------------------------------------------------------

def _damage(path: Path, how: str) -> None:
    """Damage a file in place (so its hard-linked twin in the stage folder is damaged too)."""
    size = path.stat().st_size
    with path.open("r+b") as f:
        if how == "garbage header":
            f.write(b"\xff" * 16)
        elif how == "truncated":
            f.truncate(size // 2)
        else:  # same size: 4 KB flipped in the middle of the weights
            f.seek(size // 2)
            block = f.read(4096)
            f.seek(size // 2)
            f.write(bytes(b ^ 0xFF for b in block))


@pytest.mark.parametrize("how", ["garbage header", "truncated", "same-size"])
def test_a_damaged_champion_fails_with_the_file_named(nights: dict[str, Any], tmp_path: Path, how: str) -> None:
    runs = tmp_path / "runs"
    _night(nights, "dmg", "easy", "weak", runs=runs)
    weights = runs / "exports" / "dmg" / "v0001" / "adapter_model.safetensors"
    _damage(weights, how)
    with pytest.raises(UserError) as caught:
        resolve_adapter("champion:dmg", runs)
    text = str(caught.value)
    assert f"{weights.resolve()} is damaged" in text and "cannot restore it" in text and "Publish it again" in text


@pytest.mark.parametrize("how", ["garbage header", "truncated"])
def test_a_damaged_plain_folder_fails_on_its_header(nights: dict[str, Any], tmp_path: Path, how: str) -> None:
    folder = tmp_path / "plain"
    shutil.copytree(Path(nights["weak"]) / "adapter", folder)
    _damage(folder / "adapter_model.safetensors", how)
    with pytest.raises(UserError, match="does not load as safetensors .* only its header could be checked"):
        resolve_adapter(str(folder), tmp_path)


@pytest.mark.slow
def test_a_run_from_a_damaged_champion_exits_2_before_any_stage(nights: dict[str, Any], tmp_path: Path) -> None:
    from tests.conftest import cli, cli_env, finish

    runs = tmp_path / "runs"
    _night(nights, "adapter", "easy", "weak", runs=runs)
    weights = runs / "exports" / "adapter" / "v0001" / "adapter_model.safetensors"
    _damage(weights, "same-size")
    made = sorted(p.name for p in runs.iterdir())
    proc = cli(["run", "--set", f"runs_dir={runs}", "--set", "train.init_adapter=champion"],
               cli_env(tmp_path / "prefect"), tmp_path / "log")
    out, err = finish(proc, tmp_path / "log", timeout=600)
    assert proc.returncode == 2, out[-2000:] + err[-3000:]
    assert "v0001/adapter_model.safetensors is damaged" in err.replace("\n", " ") and "Traceback" not in err
    assert sorted(p.name for p in runs.iterdir() if p.name != "runs") == made  # no stage began


# --- the whole flow: summary and artifacts ----------------------------------------------------------------------

@pytest.mark.slow
def test_two_nights_show_base_champion_and_challenger_side_by_side(prefect_env: Path, small_data: Path,
                                                                  tmp_path: Path, capsys: pytest.CaptureFixture
                                                                  ) -> None:
    from deployments.cli import _print_summary
    from tests.conftest import run_flow, small_overrides, statuses
    from tests.test_run_reports import _artifacts, _run_prefix

    extra = {"export.name": "nightly", "eval.generation_samples": 2, "eval.max_new_tokens": 4}
    first = run_flow(small_overrides(small_data, tmp_path / "runs", **extra))
    assert first["metrics"]["gate_rule"] == "first" and first["metrics"]["judged_against"] is None
    with small_data.open("a") as f:  # the data grew overnight
        f.write("".join(EMBEDDED_DATA.read_text().splitlines(keepends=True)[240:300]))
    tonight = small_overrides(small_data, tmp_path / "runs", **extra)
    second = run_flow(tonight)
    m = second["metrics"]
    assert m["judged_against"] == "v0001" and m["gate_rule"] == "same-data" and m["export_version"] == "v0002"
    rows = {row["model"]: row for row in json.loads(_artifacts(_run_prefix(second), "eval-metrics")[0].data)}
    assert list(rows)[:3] == ["base", "champion v0001 (scored beside it)", f"tuned (v0002, {m['promotion']})"]
    assert rows["champion v0001 (scored beside it)"]["eval loss"] == f"{m['champion_eval_loss']:.4f}"
    history = _artifacts(_run_prefix(second), "registry-history")
    assert len(history) == 1 and "](data:image/png;base64,iVBORw0KGgo" in history[0].data
    assert "| v0002 |" in history[0].data and "same-data" in history[0].data
    _print_summary(second)
    out = capsys.readouterr().out
    assert f"champion v0001 on the same eval data: eval loss {m['champion_eval_loss']:.4f}" in out
    assert f"{m['promotion']} by the same-data rule: " in out
    assert set(statuses(run_flow(tonight)).values()) == {"cached"}  # unchanged, whatever the verdict was
