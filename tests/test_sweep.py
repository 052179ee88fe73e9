"""Sweeps (README: Sweeps): a 2 x 2 grid on the embedded model under the Prefect test server, its re-run, a
candidate that fails alone, and the bad-grid message."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tasks.config import EMBEDDED_DATA, load_config
from tasks.errors import UserError
from tasks.sweep.grid import expand
from tests.conftest import (
    SMALL_ROWS,
    cli,
    cli_env,
    session_processes,
    settled_task_states,
    small_overrides,
    wait_for_checkpoint,
)

GRID = {"lora.r": [4, 8], "train.learning_rate": [1e-3, 3e-3]}


def _base(runs_dir: Path, data: Path) -> Any:
    # a few optimizer steps and a tiny eval per candidate
    return load_config(None, small_overrides(data, runs_dir, **{"train.max_steps": 4, "eval.generation_samples": 2}))


def _artifacts(flow_run_id: Any, key: str) -> list[Any]:
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        return client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]), key=ArtifactFilterKey(any_=[key])))


def _table_rows(markdown: str) -> list[list[str]]:
    lines = [line for line in markdown.splitlines() if line.startswith("| ")]
    return [[c.strip() for c in line.strip("|").split(" | ")] for line in lines[2:]]  # without the header and rule


def _stage_dirs(runs_dir: Path) -> set[Path]:
    return {p for stage in ("prepare_data", "prepare_model", "train_adapter", "evaluate_adapter", "export_adapter")
            for p in (runs_dir / stage).glob("*") if p.is_dir()}


@pytest.fixture(scope="module")
def first(prefect_env: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One 2 x 2 sweep on the embedded model."""
    from flows.qlora_sweep import qlora_sweep

    runs_dir = tmp_path_factory.mktemp("runs")
    data = runs_dir.parent / "sweep-data.jsonl"
    data.write_text("".join(EMBEDDED_DATA.read_text().splitlines(keepends=True)[:SMALL_ROWS]))
    state = qlora_sweep(config=_base(runs_dir, data), grid=GRID, return_state=True)
    return {"state": state, "runs_dir": runs_dir, "data": data, "summary": state.result(raise_on_failure=False)}


@pytest.mark.slow  # whole sweeps under the test server
def test_sweep_trains_four_candidates_and_publishes_only_the_best(first: dict[str, Any]) -> None:
    state, summary = first["state"], first["summary"]
    assert state.is_completed(), state.message
    flow_run_id = state.state_details.flow_run_id
    states = settled_task_states(flow_run_id)
    assert states["train_adapter"] == ["Completed"] * 4 and states["evaluate_adapter"] == ["Completed"] * 4
    assert states["export_adapter"] == ["Completed"] and states["prepare_data"] == ["Completed"]
    candidates = summary["candidates"]
    assert [c["status"] for c in candidates] == ["finished"] * 4 and [c["rank"] for c in candidates] == [1, 2, 3, 4]
    losses = [c["metrics"]["tuned_eval_loss"] for c in candidates]
    assert losses == sorted(losses) and len({c["adapter_dir"] for c in candidates}) == 4
    assert len({c["metrics"]["base_eval_loss"] for c in candidates}) == 1  # the same eval data for all
    winner = candidates[0]
    assert summary["winner"] == winner["name"]
    registry = first["runs_dir"].resolve() / "exports" / "adapter"
    assert sorted(p.name for p in registry.glob("v*")) == ["v0001"]  # only the winner was published
    version = json.loads((registry / "v0001" / "version.json").read_text())
    assert version["metrics"]["tuned_eval_loss"] == winner["metrics"]["tuned_eval_loss"]
    assert summary["export"]["export_version"] == "v0001" and summary["export"]["promotion"] == "promoted"
    winner_yaml = yaml.safe_load((Path(summary["sweep_dir"]) / "winner.yaml").read_text())
    assert {"lora.r": winner_yaml["lora"]["r"], "train.learning_rate": winner_yaml["train"]["learning_rate"]} \
        == winner["overrides"]
    assert load_config(Path(summary["sweep_dir"]) / "winner.yaml").lora.r == winner["overrides"]["lora.r"]


@pytest.mark.slow  # whole sweeps under the test server
def test_sweep_artifacts_compare_every_candidate(first: dict[str, Any]) -> None:
    flow_run_id = first["state"].state_details.flow_run_id
    (comparison,) = _artifacts(flow_run_id, "sweep-comparison")
    rows = _table_rows(comparison.data)
    assert len(rows) == 4 and [r[0] for r in rows] == ["1", "2", "3", "4"]
    names = [c["name"] for c in first["summary"]["candidates"]]
    assert [r[1] for r in rows] == names
    assert "data:image/png;base64," in comparison.data
    png = Path(first["summary"]["sweep_dir"]) / "comparison.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (winner,) = _artifacts(flow_run_id, "sweep-winner")
    assert "```yaml" in winner.data and first["summary"]["winner"] in winner.data


@pytest.mark.slow  # whole sweeps under the test server
def test_sweep_names_each_candidate_and_says_the_verdict(first: dict[str, Any]) -> None:
    """Each candidate's task runs and artifacts carry its name and overrides (they share one flow run); the verdict
    is the flow run's final state message and a tag; eval-samples shows the answers first."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    flow_run_id = first["state"].state_details.flow_run_id
    with get_client(sync_client=True) as client:
        names = {r.name for r in client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(
            any_=[flow_run_id])))}
        tags = client.read_flow_run(flow_run_id).tags
    labels = {c["name"]: ", ".join(f"{k}={v}" for k, v in c["overrides"].items())
              for c in first["summary"]["candidates"]}
    for name, label in labels.items():
        assert {f"train_adapter-{name} ({label})", f"evaluate_adapter-{name} ({label})"} <= names, names
        for key in ("train-progress", "loss-curve", "train-adapter", "evaluate-adapter", "eval-samples"):
            (artifact,) = _artifacts(flow_run_id, f"{key}-{name}")
            assert artifact.description.startswith(f"{name} ({label}): "), artifact.description
    (samples,) = _artifacts(flow_run_id, f"eval-samples-{first['summary']['winner']}")
    rows = json.loads(samples.data) if isinstance(samples.data, str) else samples.data
    assert list(rows[0])[:3] == ["tuned answer", "base answer", "reference answer"] and list(rows[0])[-1] == "prompt"
    winner = first["summary"]["winner"]
    assert first["state"].message.startswith(f"winner {winner} ({labels[winner]}) of 4: adapter v0001 promoted: "
                                             "first version"), first["state"].message
    assert "promoted" in tags


@pytest.mark.slow  # whole sweeps under the test server
def test_sweep_rerun_reuses_every_candidate(first: dict[str, Any]) -> None:
    from flows.qlora_sweep import qlora_sweep

    before = _stage_dirs(first["runs_dir"])
    state = qlora_sweep(config=_base(first["runs_dir"], first["data"]), grid=GRID, return_state=True)
    assert state.is_completed(), state.message
    states = settled_task_states(state.state_details.flow_run_id)
    assert {k: set(v) for k, v in states.items()} == {k: {"Cached"} for k in (
        "prepare_data", "prepare_model", "train_adapter", "evaluate_adapter", "score_champion", "export_adapter")}
    assert len(states["train_adapter"]) == 4 and len(states["evaluate_adapter"]) == 4
    assert _stage_dirs(first["runs_dir"]) == before  # no stage folder added
    assert state.result()["winner"] == first["summary"]["winner"]
    assert sorted(p.name for p in (first["runs_dir"] / "exports" / "adapter").glob("v*")) == ["v0001"]


@pytest.mark.slow  # whole sweeps under the test server
def test_cli_sweep_prints_the_ranking(first: dict[str, Any], tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    """`qlora-pipeline sweep --config --grid` (in this process, under the test server): the cached re-run's ranking,
    as text and as JSON; a bad grid exits 2 with the message before any flow run."""
    from deployments.cli import USER_ERROR_EXIT, main

    base, grid = tmp_path / "base.yaml", tmp_path / "grid.yaml"
    base.write_text(yaml.safe_dump(_base(first["runs_dir"], first["data"]).model_dump(mode="json")))
    grid.write_text(yaml.safe_dump(GRID))
    assert main(["sweep", "--config", str(base), "--grid", str(grid)]) == 0
    out = capsys.readouterr().out
    winner = first["summary"]["winner"]
    assert f"4 candidate(s), winner {winner}" in out and "winner published as adapter v0001" in out
    ranked = [line.split()[:3] for line in out.splitlines() if line[:1].isdigit()]
    # a re-run: every candidate's training and evaluation were reused, and the table says so
    assert ranked == [[str(c["rank"]), c["name"], "reused"] for c in first["summary"]["candidates"]]
    assert main(["sweep", "--config", str(base), "--grid", str(grid), "--set", "lora.r=8", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [c["overrides"] for c in printed["candidates"]] == [c["overrides"] for c in first["summary"]["candidates"]]
    assert printed["key"] != first["summary"]["key"]  # --set changed the base config: another sweep, same stages
    grid.write_text("lora.rank: [4, 8]\n")
    assert main(["sweep", "--config", str(base), "--grid", str(grid)]) == USER_ERROR_EXIT
    assert "lora.rank is not a RunConfig field (did you mean lora.r?)" in " ".join(capsys.readouterr().err.split())


@pytest.mark.slow  # whole sweeps under the test server
def test_a_failed_candidate_fails_alone(first: dict[str, Any]) -> None:
    """A module name the model lacks passes validation and fails in train_adapter; the other candidate (one of
    the grid's, reused) is ranked and published, and the sweep ends Failed naming the failed candidate."""
    from flows.qlora_sweep import qlora_sweep

    finished = first["summary"]["candidates"][-1]["overrides"]  # the grid's last-ranked candidate
    candidates = [{"lora.target_modules": ["q_proj", "no_such_proj"]}, finished]
    state = qlora_sweep(config=_base(first["runs_dir"], first["data"]), candidates=candidates, return_state=True)
    assert state.is_failed()
    assert "c1 (lora.target_modules=" in state.message and "no_such_proj" in state.message, state.message
    assert "1 of 2 candidate(s) did not finish" in state.message
    flow_run_id = state.state_details.flow_run_id
    states = settled_task_states(flow_run_id)
    assert sorted(states["train_adapter"]) == ["Cached", "Failed"]
    assert states["evaluate_adapter"] == ["Cached"]  # none for the failed candidate
    assert states["export_adapter"] == ["Completed"]  # a new winner: published, the gate decides its fate
    record = json.loads((first["runs_dir"].resolve() / "sweeps" / expand(
        _base(first["runs_dir"], first["data"]), None, candidates).key / "sweep.json").read_text())
    assert [(c["name"], c["status"]) for c in record["candidates"]] == [("c2", "finished"), ("c1", "failed")]
    assert record["winner"] == "c2" and record["export"]["export_version"] == "v0002"
    assert record["export"]["promotion"] == "rejected"  # the grid's worst does not beat the grid's best
    # its evaluation is reused from before v0001 existed, and v0001 is still scored beside it on the same data
    assert "champion v0001's" in record["export"]["promotion_reason"]
    assert "(same-data rule)" in record["export"]["promotion_reason"]
    (comparison,) = _artifacts(flow_run_id, "sweep-comparison")
    rows = _table_rows(comparison.data)
    assert [r[:2] for r in rows] == [["1", "c2"], ["-", "c1"]]
    assert any("failed: train_adapter:" in cell for cell in rows[1])


BAD_GRID = {"lora.rank": [4, 8], "data.max_seq_length": [64], "train.learning_rate": [-1.0, 1e-3],
            "lora.target_modules": ["all-linear", 3]}


def test_bad_grid_lists_every_bad_key_and_value() -> None:
    with pytest.raises(UserError) as caught:
        expand(load_config(), BAD_GRID)
    message = str(caught.value)
    assert "5 problem(s); no stage ran" in message  # target_modules: two, one per type it may be
    assert "lora.rank is not a RunConfig field (did you mean lora.r?)" in message
    assert "data.max_seq_length is shared by every candidate" in message
    assert "train.learning_rate: Input should be greater than 0 (got -1.0) (candidates c1, c2, c5, c6)" in message
    assert "lora.target_modules" in message and "(got 3) (candidates c2, c4, c6, c8)" in message


@pytest.mark.slow
def test_bad_grid_fails_the_flow_before_any_stage(prefect_env: Path, tmp_path: Path) -> None:
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from flows.qlora_sweep import qlora_sweep

    base = load_config(None, [f"runs_dir={tmp_path / 'runs'}"])
    with pytest.raises(UserError) as caught:
        expand(base, BAD_GRID)
    state = qlora_sweep(config=base, grid=BAD_GRID, return_state=True)
    assert state.is_failed() and state.message.endswith(str(caught.value))
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(
            id=FlowRunFilterId(any_=[state.state_details.flow_run_id])))
    assert runs == [] and not (tmp_path / "runs").exists()  # no stage ran


def test_ranking_follows_the_promotion_gate() -> None:
    """Lowest tuned eval loss first; a NaN loss is unranked, never the winner; preference runs by reward accuracy;
    the registry champion's numbers in a candidate's metrics do not enter the comparison."""
    from tasks.methods import LOSS, REWARD_ACCURACY
    from tasks.sweep.ranking import Outcome, order

    plan = expand(load_config(), {"lora.r": [1, 2, 3, 4]})
    losses = [2.0, float("nan"), 1.5, 2.0]
    outcomes = [Outcome(c, "finished", metrics={"tuned_eval_loss": x, "champion_eval_loss": 0.1})
                for c, x in zip(plan.candidates, losses, strict=True)]
    outcomes.append(Outcome(plan.candidates[0], "failed", error="train_adapter: boom"))
    ranked = order(outcomes, "data-key", LOSS)
    assert [(o.candidate.name, o.status, o.rank) for o in ranked] == [
        ("c3", "finished", 1), ("c1", "finished", 2), ("c4", "finished", 3), ("c2", "unranked", None),
        ("c1", "failed", None)]
    preference = [Outcome(c, "finished", metrics={"tuned_eval_loss": loss, "tuned_reward_accuracy": accuracy})
                  for c, loss, accuracy in zip(plan.candidates, [1.0, 3.0, 2.0, 1.5], [0.6, 0.9, 0.7, float("nan")],
                                                strict=True)]
    assert [(o.candidate.name, o.status) for o in order(preference, "data-key", REWARD_ACCURACY)] == [
        ("c2", "finished"), ("c3", "finished"), ("c1", "finished"), ("c4", "unranked")]


def test_grid_file_and_candidate_list_shapes(tmp_path: Path) -> None:
    from tasks.sweep.grid import load_grid

    grid_file, list_file, bad_file = tmp_path / "g.yaml", tmp_path / "l.yaml", tmp_path / "b.yaml"
    grid_file.write_text("lora.r: [4, 8]\nlora.target_modules: [[q_proj, v_proj], all-linear]\n")
    list_file.write_text("- {lora.r: 4}\n- {train.learning_rate: 0.003, train.num_train_epochs: 2}\n")
    bad_file.write_text("just text\n")
    plan = expand(load_config(), *load_grid(grid_file))
    assert [c.label for c in plan.candidates] == [
        'lora.r=4, lora.target_modules=["q_proj", "v_proj"]', "lora.r=4, lora.target_modules=all-linear",
        'lora.r=8, lora.target_modules=["q_proj", "v_proj"]', "lora.r=8, lora.target_modules=all-linear"]
    assert plan.candidates[0].config.lora.target_modules == ["q_proj", "v_proj"]
    listed = expand(load_config(), *load_grid(list_file))
    assert listed.candidates[1].config.train.num_train_epochs == 2 and listed.candidates[1].config.lora.r == 16
    assert listed.key != plan.key and listed.dir.parent.name == "sweeps"
    with pytest.raises(UserError, match="not str"):
        load_grid(bad_file)
    assert expand(load_config(), {}, [{"lora.r": 4}]).candidates[0].config.lora.r == 4  # an empty grid is none
    with pytest.raises(UserError, match="not both and not neither"):
        expand(load_config(), None, [])
    with pytest.raises(UserError, match="the same config as c1"):
        expand(load_config(), None, [{"lora.r": 4}, {"lora.r": 4}])


@pytest.mark.parametrize(("content", "problem"), [
    (b"lora.r: [4, 8\ntrain: {\n", "is not valid YAML (expected ',' or ']', but got ':' at line 2, column 6)"),
    (b"\x00\x01\xff\xfe", "is not text (byte 2 is not UTF-8)"),
    (("lora.r: " + "[" * 5000 + "4" + "]" * 5000 + "\n").encode(), "is nested too deeply to read"),
    (None, "is a folder"),
], ids=["invalid-yaml", "binary", "nested-5000", "folder"])
def test_unreadable_grid_file_is_one_paragraph_before_anything_runs(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes | None, problem: str) -> None:
    from deployments.cli import USER_ERROR_EXIT, main

    grid = tmp_path / "grid.yaml"
    grid.mkdir() if content is None else grid.write_bytes(content)
    runs = tmp_path / "runs"
    assert main(["sweep", "--grid", str(grid), "--set", f"runs_dir={runs}"]) == USER_ERROR_EXIT
    err = " ".join(capsys.readouterr().err.split())
    assert f"error: grid file {grid} {problem}" in err, err[:2000]
    assert "Traceback" not in err and len(err) < 1000 and not runs.exists()


@pytest.mark.slow
@pytest.mark.kill
def test_sigterm_during_a_sweep_ends_it_within_seconds_as_crashed(small_data: Path, tmp_path: Path) -> None:
    """SIGTERM to a sweep's process group while a candidate trains (in a thread of the process, on a CPU): the
    sweep is recorded Crashed with its hook, the process exits 143 within seconds, no traceback from a server that
    went first, nothing of it left running."""
    grid = tmp_path / "grid.yaml"
    grid.write_text("lora.r: [4, 8]\n")
    overrides = small_overrides(small_data, tmp_path / "runs", **{"train.max_steps": 400})
    proc = cli(["sweep", "--grid", str(grid), *sum((["--set", o] for o in overrides), [])],
               cli_env(tmp_path / "prefect"), tmp_path / "sweep")
    try:
        wait_for_checkpoint(proc, tmp_path / "runs", tmp_path / "sweep")
        stopping = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=300)
        took = time.monotonic() - stopping
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    err = (tmp_path / "sweep.err").read_text()
    assert proc.returncode == 143 and took < 15, (took, err[-3000:])
    assert "its run-failure artifact says what to do next" in err, err[-3000:]
    assert "stopped: the run got SIGTERM and ended as Crashed" in " ".join(err.split())
    for noise in ("Traceback", "ConnectError", "Error logging to API"):
        assert noise not in err, err[-3000:]
    time.sleep(1)
    assert not session_processes(proc.pid)
