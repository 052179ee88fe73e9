"""Regression suites of the promotion gate (issue 51): a local lm-evaluation-harness task (a YAML task file and its
JSONL, written here) on the embedded tiny model. An adapter trained on data that contradicts the task is refused
although its loss wins; one that keeps the task is promoted; a suite is keyed by its content, not its place; a suite
that cannot run, or lm-eval missing, stops the run before any stage; eval.lm_eval_tasks runs local task files too."""

from __future__ import annotations

import json
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
    JudgeArgs,
    LoraArgs,
    ModelArgs,
    SpeedArgs,
    SuiteArgs,
    TrainArgs,
)
from tasks.errors import UserError
from tasks.evaluate_adapter.champion import score_champion
from tasks.evaluate_adapter.checks import check_evaluation
from tasks.evaluate_adapter.stage import evaluate_adapter
from tasks.evaluate_adapter.stage import spec as eval_spec
from tasks.export_adapter.stage import export_adapter
from tasks.on_disk.manifest import read_manifest
from tasks.registry import store as registry
from tests.conftest import cli_env, free_port

DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
TOLERANCE = 0.15  # one question of the suite's seven may go


def write_suite(folder: Path) -> Path:
    """The next_day task: after "The day after X is", the day that follows X against " green." (the answer the
    contradicting data teaches), as a multiple-choice lm-eval task file and its data; the task file's path."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "next_day.jsonl").write_text("".join(json.dumps({
        "query": f"### Instruction:\nName the day after {day}.\n\n### Response:\nThe day after {day} is",
        "choices": [f" {DAYS[(i + 1) % 7]}.", " green."], "gold": 0}) + "\n" for i, day in enumerate(DAYS)))
    (folder / "next_day.yaml").write_text(
        "task: next_day\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: next_day.jsonl\n"
        "test_split: test\noutput_type: multiple_choice\ntarget_delimiter: \"\"\ndoc_to_text: \"{{query}}\"\n"
        "doc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{gold}}\"\nmetric_list:\n  - metric: acc\n")
    return folder / "next_day.yaml"


@pytest.fixture(scope="module")
def days(stages: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The sample data's next_day records as they are (right) and answered "green" (wrong: they contradict the
    suite), each prepared and trained on (30 steps); the suite's task file."""
    from tasks.prepare_data.stage import prepare_data
    from tasks.train_adapter.stage import train_adapter

    tmp, runs = tmp_path_factory.mktemp("days"), stages["runs"]
    rows = [json.loads(line) for line in EMBEDDED_DATA.read_text().splitlines() if '"next_day"' in line]
    wrong = [{**r, "response": " ".join(r["response"].split()[:4]) + " is green."} for r in rows]
    out = {**stages, "suite": write_suite(tmp / "suite")}
    for name, records in (("right", rows), ("wrong", wrong)):
        (tmp / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        # 14 distinct records: a larger share held out, so that each split has some
        out[f"{name}_data"] = prepare_data.fn(DataArgs(source=str(tmp / f"{name}.jsonl"), eval_fraction=0.3),
                                              ModelArgs(), runs)
        out[name] = train_adapter.fn(LoraArgs(), TrainArgs(max_steps=30, learning_rate=0.01, logging_steps=10),
                                     SpeedArgs(), runs, out[f"{name}_data"], stages["model"])
    return out


def _eval(suite: Path, **fields: Any) -> EvalArgs:
    return EvalArgs(max_samples=16, generation_samples=2, max_new_tokens=4,
                    suites=[SuiteArgs(task=str(suite), tolerance=TOLERANCE)], **fields)


def _night(d: dict[str, Any], adapter: str, runs: Path, args: EvalArgs) -> tuple[str, dict[str, Any]]:
    """One night of `adapter` on its own data into registry suites under `runs`: (eval dir, export metrics)."""
    export, data = ExportArgs(name="suites", promotion_margin=0.001), d[f"{adapter}_data"]
    evaluated = evaluate_adapter.fn(args, d["runs"], data, d["model"], d[adapter])
    judged = score_champion.fn(args, runs, data, d["model"], d[adapter], evaluated, export)
    exported = export_adapter.fn(export, runs, data, d["model"], d[adapter], evaluated, judged)
    return evaluated, read_manifest(Path(exported)).metrics.model_dump(exclude_unset=True)


@pytest.mark.slow
def test_a_version_that_regresses_a_suite_is_refused_and_one_that_keeps_it_is_promoted(days: dict[str, Any],
                                                                                         tmp_path: Path) -> None:
    runs, args = tmp_path / "runs", _eval(days["suite"])
    evaluated, first = _night(days, "right", runs, args)
    scored = read_manifest(Path(evaluated)).metrics.model_dump(exclude_unset=True)
    assert scored["suites"]["next_day"]["metric"] == "acc" and scored["suites"]["next_day"]["samples"] == 7
    suites = json.loads((Path(evaluated) / "suites.json").read_text())
    assert suites["tuned"]["next_day"]["score"] == scored["tuned_suites"]["next_day"]
    assert (first["promotion"], first["gate_rule"]) == ("promoted", "first"), first["promotion_reason"]
    assert "regression suites within tolerance: next_day acc" in first["promotion_reason"]
    assert scored["tuned_suites"]["next_day"] >= scored["base_suites"]["next_day"] - TOLERANCE

    # trained to answer "green": its loss on its own data beats the champion's, its suite falls to nothing
    evaluated, second = _night(days, "wrong", runs, args)
    scored = read_manifest(Path(evaluated)).metrics.model_dump(exclude_unset=True)
    champion = second["champion_suites"]["next_day"]
    assert scored["tuned_suites"]["next_day"] < champion - TOLERANCE
    assert (second["export_version"], second["promotion"], second["gate_rule"]) == ("v0002", "rejected", "suites")
    reason = second["promotion_reason"]
    assert reason.startswith("not promoted: a regression suite fell by more than its tolerance: next_day acc "
                             f"{scored['tuned_suites']['next_day']:.4f} against champion v0001's {champion:.4f} "
                             f"(tolerance {TOLERANCE:g})"), reason
    assert "(the same-data rule alone would promote: tuned eval loss" in reason
    root = registry.registry_dir(runs, "suites")
    assert registry.champion(root)["version"] == "v0001"
    rows = {row["version"]: row for row in registry.history(root)}
    assert rows["v0002"]["suites: tuned (against)"] == (f"next_day {scored['tuned_suites']['next_day']:.3f} "
                                                        f"(champion {champion:.3f})")
    card = (root / "v0002" / "README.md").read_text()
    assert "| suite | metric | base | champion v0001 | tuned | tolerance |" in card and "| next_day | acc |" in card
    done = subprocess.run([sys.executable, "-m", "deployments.cli", "history", "--export-name", "suites",
                           "--runs-dir", str(runs)], cwd=PROJECT_ROOT, env=cli_env(tmp_path / "home"),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "| suites: tuned (against) |" in done.stdout, done.stderr[-2000:]
    assert f"| rejected | suites | {rows['v0002']['suites: tuned (against)']} |" in done.stdout, done.stdout


def test_a_suite_is_keyed_by_its_content_not_its_place(stages: dict[str, Any], tmp_path: Path) -> None:
    """evaluate_adapter's key: the same suite copied elsewhere keeps it, one byte of its data changes it, and an
    evaluation without suites or a judge has the key it had before they existed (README's quick start checks that
    one)."""
    folder = Path(stages["data"])
    here, there = write_suite(tmp_path / "here"), write_suite(tmp_path / "there" / "deeper")
    key = eval_spec(_eval(here), stages["runs"], folder, stages["model"], folder).key  # any finished folder upstream
    assert eval_spec(_eval(there), stages["runs"], folder, stages["model"], folder).key == key
    data = there.parent / "next_day.jsonl"
    data.write_text(data.read_text().replace("Sunday.", "Sunday!", 1))
    assert eval_spec(_eval(there), stages["runs"], folder, stages["model"], folder).key != key
    plain = eval_spec(EvalArgs(), stages["runs"], folder, stages["model"], folder)
    assert "suites" not in plain.params["eval"] and "judge" not in plain.params["eval"] and plain.fingerprint == {}


@pytest.mark.slow  # the command with its temporary Prefect server: ~20 s on 2 cores
def test_a_suite_that_cannot_run_stops_the_run_before_any_stage(tmp_path: Path) -> None:
    """Every problem in one paragraph: a task file that is not there, one whose data file is missing, a metric the
    task lacks; from the CLI, exit 2 before any stage, also for a judge nobody answers."""
    good = write_suite(tmp_path / "good")
    lost = write_suite(tmp_path / "lost")
    (lost.parent / "next_day.jsonl").unlink()
    args = EvalArgs(suites=[SuiteArgs(task=str(tmp_path / "nowhere.yaml")), SuiteArgs(task=str(lost))])
    with pytest.raises(UserError) as error:
        check_evaluation(args, TrainArgs())
    said = str(error.value)
    assert f"suite {tmp_path / 'nowhere.yaml'}: {tmp_path / 'nowhere.yaml'} does not exist" in said
    assert f"suite {lost}: {lost.parent / 'next_day.jsonl'} does not exist" in said
    with pytest.raises(UserError, match=r"suite .*good/next_day.yaml has no metric 'f1' \(its metrics: acc\)"):
        check_evaluation(EvalArgs(suites=[SuiteArgs(task=str(good), metric="f1")]), TrainArgs())
    check_evaluation(EvalArgs(suites=[SuiteArgs(task=str(good))]), TrainArgs())  # this one loads

    runs = tmp_path / "runs"
    done = subprocess.run([sys.executable, "-m", "deployments.cli", "run", "--set", f"runs_dir={runs}", "--set",
                           f"eval.suites=[{{task: {tmp_path / 'nowhere.yaml'}}}]", "--set",
                           f"eval.judge.url=http://127.0.0.1:{free_port()}/v1", "--set", "eval.judge.model=judge",
                           "--set", "eval.judge.retries=0"],
                          cwd=PROJECT_ROOT, env=cli_env(tmp_path / "home"), capture_output=True, text=True,
                          timeout=300)
    said = " ".join(done.stderr.split())
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "nowhere.yaml does not exist" in said and "cannot be reached" in said, said
    assert not (runs / "prepare_data").exists()


def test_lm_eval_missing_is_an_error_not_a_skip(stages: dict[str, Any], tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if not installed
    for args in (EvalArgs(lm_eval_tasks=["hellaswag"]), EvalArgs(suites=[SuiteArgs(task="hellaswag")])):
        with pytest.raises(UserError, match=r"lm-evaluation-harness is not installed: install the eval extra"):
            check_evaluation(args, TrainArgs())


@pytest.mark.slow
def test_lm_eval_tasks_report_a_local_task_on_base_and_tuned(days: dict[str, Any], tmp_path: Path) -> None:
    """eval.lm_eval_tasks (reported, not gated) takes local task files as eval.suites does."""
    suite = shutil.copytree(days["suite"].parent, tmp_path / "task") / "next_day.yaml"
    args = EvalArgs(max_samples=4, generation_samples=0, lm_eval_tasks=[str(suite)], limit=3)
    folder = Path(evaluate_adapter.fn(args, tmp_path, days["right_data"], days["model"], days["right"]))
    results = json.loads((folder / "lm_eval.json").read_text())
    assert set(results) == {"base", "tuned"} and {r["next_day"]["sample_len"] for r in results.values()} == {3}
    assert read_manifest(folder).metrics.model_dump(exclude_unset=True)["lm_eval"] == "lm_eval.json"


def test_suites_and_the_judge_are_refused_for_a_method_without_answers() -> None:
    from tasks import methods

    scorer = next(m for m in methods.METHODS if m.head != "causal_lm")
    args = EvalArgs(suites=[SuiteArgs(task="arc_easy")], judge=JudgeArgs(url="http://h:1/v1", model="m"))
    with pytest.raises(UserError, match=f"train.method={scorer.name} trains a score head"):
        check_evaluation(args, TrainArgs.model_construct(**{**TrainArgs().model_dump(), "method": scorer.name}))
