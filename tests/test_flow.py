"""The whole flow on the embedded default, under a Prefect test server."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import run_flow, settled_task_states, statuses

pytestmark = pytest.mark.slow  # whole flow runs

STAGES = ["prepare_data", "prepare_model", "train_adapter", "evaluate_adapter", "export_adapter"]


@pytest.fixture(scope="module")
def default_run(prefect_env: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One run of the unchanged default config (only runs_dir moved to a temp folder)."""
    runs_dir = tmp_path_factory.mktemp("runs")
    return {"summary": run_flow([f"runs_dir={runs_dir}"]), "runs_dir": runs_dir}


def test_default_run_computes_every_stage_and_learns(default_run: dict[str, Any]) -> None:
    summary = default_run["summary"]
    assert list(summary["stages"]) == STAGES
    assert set(statuses(summary).values()) == {"computed"}
    metrics = summary["metrics"]
    assert metrics["tuned_eval_loss"] <= 0.9 * metrics["base_eval_loss"]
    assert metrics["tuned_rouge_l"] > metrics["base_rouge_l"] and metrics["generation_samples"] == 32
    assert (Path(summary["run_dir"]) / "run.json").is_file()


def test_default_run_publishes_the_first_champion_and_eval_tables(default_run: dict[str, Any]) -> None:
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    metrics = default_run["summary"]["metrics"]
    assert (metrics["export_version"], metrics["promotion"], metrics["champion_version"]) == ("v0001", "promoted",
                                                                                            "v0001")
    assert Path(metrics["export_path"]) == default_run["runs_dir"].resolve() / "exports" / "adapter" / "v0001"
    flow_run_id = Path(default_run["summary"]["run_dir"]).name.split("-")[-1]
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(
            any_=["eval-samples", "eval-metrics"])))
    tables = {a.key: a for a in found if str(a.flow_run_id).startswith(flow_run_id)}
    assert set(tables) == {"eval-samples", "eval-metrics"} and tables["eval-metrics"].type == "table"
    data = tables["eval-metrics"].data
    rows = json.loads(data) if isinstance(data, str) else data
    assert rows[0]["model"] == "base" and "reward accuracy" not in rows[0]  # an SFT run: no column of n/a


def test_stage_folders_hold_exactly_their_outputs(default_run: dict[str, Any]) -> None:
    dirs = {stage: Path(info["dir"]) for stage, info in default_run["summary"]["stages"].items()}
    files = {stage: sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file() and p.name != ".hashes.json")
             for stage, d in dirs.items()}
    assert all((d / ".hashes.json").is_file() for d in dirs.values())  # the hash memo (README: Integrity)
    assert files["prepare_data"] == ["eval.parquet", "manifest.json", "train.parquet"]
    assert files["prepare_model"] == ["config.json", "generation_config.json", "manifest.json", "model.safetensors",
                                      "modules.json", "tokenizer.json", "tokenizer_config.json"]
    assert files["train_adapter"] == ["adapter/adapter_config.json", "adapter/adapter_model.safetensors",
                                      "loss.jsonl", "manifest.json"]
    assert files["evaluate_adapter"] == ["manifest.json", "metrics.json", "samples.jsonl"]
    assert files["export_adapter"] == ["README.md", "adapter_config.json", "adapter_model.safetensors",
                                       "manifest.json", "published/README.md", "published/version.json",
                                       "run_config.yaml", "tokenizer.json", "tokenizer_config.json"]


def test_exported_adapter_loads_with_peft_and_changes_outputs(default_run: dict[str, Any]) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoTokenizer

    from tasks.models.loading import load_quantized

    summary = default_run["summary"]
    export = Path(summary["export_dir"])
    tokenizer = AutoTokenizer.from_pretrained(export)
    ids = tokenizer("### Instruction:\nWhat is the plural of cat?\n\n### Response:\n", return_tensors="pt")
    base = load_quantized(Path(summary["stages"]["prepare_model"]["dir"]))
    with torch.no_grad():
        before = base(**ids).logits.clone()
        tuned = PeftModel.from_pretrained(base, export)
        after = tuned(**ids).logits
    assert (after - before).abs().max() > 0.1
    card = (export / "README.md").read_text()
    assert "base_model:" in card and summary["stages"]["prepare_data"]["key"] not in card  # keys are internal
    assert f"{summary['metrics']['tuned_eval_loss']:.4f}" in card


def _file_stamps(dirs: list[Path]) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_mtime_ns, p.stat().st_size) for d in dirs for p in d.rglob("*") if p.is_file()}


def test_rerun_of_unchanged_config_is_cached_and_writes_nothing(default_run: dict[str, Any]) -> None:
    from prefect import get_client

    stage_dirs = [Path(info["dir"]) for info in default_run["summary"]["stages"].values()]
    before = _file_stamps(stage_dirs)
    summary = run_flow([f"runs_dir={default_run['runs_dir']}"])
    assert set(statuses(summary).values()) == {"cached"}
    assert [Path(info["dir"]) for info in summary["stages"].values()] == stage_dirs
    assert _file_stamps(stage_dirs) == before  # no stage wrote, or even rewrote, a file
    # Prefect itself reports the reused stages as Cached (what the UI shows)
    flow_run_id = Path(summary["run_dir"]).name.split("-")[-1]
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(sort="START_TIME_DESC", limit=1)
    names = sorted(s for v in settled_task_states(runs[0].id).values() for s in v)
    assert str(runs[0].id).startswith(flow_run_id)
    assert names == ["Cached"] * 6  # the five stages and score_champion (the champion is this adapter)
    # what this run did, in the runs list and on its page: nothing new published (not "promoted" every night)
    assert "unchanged" in runs[0].tags and "promoted" not in runs[0].tags, runs[0].tags
    assert runs[0].state.message.startswith("adapter: nothing new published; this run's adapter is v0001, published "
                                            "by an earlier run (promoted then: first version"), runs[0].state.message
    assert runs[0].state.message.endswith("champion now v0001"), runs[0].state.message
    exports = default_run["runs_dir"] / "exports" / "adapter"
    assert sorted(p.name for p in exports.glob("v*")) == ["v0001"]  # a cached export publishes nothing


def test_eval_only_change_recomputes_exactly_two_stages(default_run: dict[str, Any]) -> None:
    summary = run_flow([f"runs_dir={default_run['runs_dir']}", "eval.max_samples=40"])
    assert statuses(summary) == {"prepare_data": "cached", "prepare_model": "cached", "train_adapter": "cached",
                                 "evaluate_adapter": "computed", "export_adapter": "computed"}
    assert summary["metrics"]["eval_examples"] == 40
    # a new export stage key, but the champion's own adapter with nothing to add: no second copy of it
    assert (summary["metrics"]["export_version"], summary["metrics"]["gate_rule"]) == ("v0001", "same-adapter")
    assert summary["metrics"]["promotion_reason"].endswith("with the same formats: nothing to add: not published again")
    assert summary["metrics"]["export_published"] == "by an earlier run"  # so its tag is unchanged, not promoted
