"""The pairwise judge of the promotion gate (issue 51): verdicts read strictly, counted with ties as half and bounded
from below; and against the session's real vLLM server (docs/serving.md's command, the embedded tiny Llama as the
judge, its verdicts held to A, B or tie by vLLM's structured outputs): both orders of every prompt, the bound against
judge.min_win_rate, verdicts kept by what they depend on, a judge that goes down mid-run (the champion stays, the
next run resumes), a kill -9 while judging, and a judge that rambles (no win counted)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from tasks.config import PROJECT_ROOT, EvalArgs, ExportArgs, JudgeArgs, LoraArgs, SpeedArgs, TrainArgs
from tasks.errors import UserError
from tasks.evaluate_adapter import judge as judges
from tasks.evaluate_adapter.champion import score_champion
from tasks.evaluate_adapter.checks import check_evaluation
from tasks.evaluate_adapter.stage import evaluate_adapter
from tasks.export_adapter.stage import export_adapter
from tasks.on_disk.manifest import read_manifest
from tasks.registry import answers
from tasks.registry import store as registry
from tests.conftest import VLLM_API_KEY, free_port
from tests.relay import Relay

JUDGE_MODEL = "data/tiny-llama"  # the documented server's --model: the tiny Llama judges
PROMPTS = 3
MARGIN = 0.001  # as tests/test_gate.py: a few steps move the tiny model's loss by about 1%


def _judge(url: str, **fields: Any) -> JudgeArgs:
    """The tiny Llama behind `url` (the server's root) as judge: completions (it has no chat template), its verdict
    held to A, B or tie by vLLM's structured outputs."""
    return JudgeArgs(**{"url": f"{url}/v1", "model": JUDGE_MODEL, "api": "completions", "constrain": "choice",
                        "prompts": PROMPTS, "retries": 1, "api_key_env": "VLLM_API_KEY", **fields})


def _eval(judge: JudgeArgs | None = None) -> EvalArgs:
    return EvalArgs(max_samples=16, generation_samples=PROMPTS, max_new_tokens=8, per_device_eval_batch_size=8,
                    **({"judge": judge} if judge is not None else {}))


# --- reading and counting verdicts -------------------------------------------------------------------------------

def test_a_verdict_is_read_strictly_and_an_unreadable_one_is_never_a_win() -> None:
    for text, label in [("A", "A"), (" b.\n", "B"), ("Tie", "tie"), ('{"verdict": "tie"}', "tie"),
                        ('{\n  "verdict": "A"\n}', "A")]:
        assert judges.read(text) == label, text
    for text in ["", "A because it is correct", "B!", "AB", '{"verdict": "C"}', '{"verdict": "A", "why": "x"}',
                 '{"verdict": "A"', "The answer is A.", '["A"]', "\n\n\n\n"]:
        assert judges.read(text) is None, text
    assert [judges.outcome(label, "ab") for label in ("A", "B", "tie", None)] == ["win", "loss", "tie", "unparseable"]
    assert [judges.outcome(label, "ba") for label in ("A", "B", "tie", None)] == ["loss", "win", "tie", "unparseable"]
    # both orders: a judge that picks the same position twice (a position bias) ties; one unreadable verdict of the
    # two makes the prompt unparseable, never a win
    assert judges.prompt_outcome("win", "win") == "win" and judges.prompt_outcome("win", "tie") == "win"
    assert judges.prompt_outcome("win", "loss") == "tie" and judges.prompt_outcome("tie", "tie") == "tie"
    assert judges.prompt_outcome("loss", "tie") == "loss"
    assert judges.prompt_outcome("win", "unparseable") == "unparseable"


def test_the_win_rate_counts_ties_half_and_its_bound_is_wilsons() -> None:
    got = judges.summary(["win"] * 6 + ["tie"] * 2 + ["loss", "unparseable"], 0.95)
    assert (got["wins"], got["ties"], got["losses"], got["unparseable"], got["prompts"]) == (6, 2, 1, 1, 10)
    assert got["win_rate"] == 0.7  # (6 + 2/2) / 10: the unparseable prompt counts as no win
    z = 1.6448536269514722  # one-sided 95%
    centre, spread = 0.7 + z * z / 20, z * math.sqrt(0.7 * 0.3 / 10 + z * z / 400)
    assert got["lower_bound"] == pytest.approx((centre - spread) / (1 + z * z / 10), abs=1e-12)
    assert 0.44 < got["lower_bound"] < 0.7  # 10 prompts: far below the rate
    assert judges.wilson_lower(0, 0, 0.95) == 0.0 and judges.wilson_lower(3, 3, 0.95) == pytest.approx(3 / (3 + z * z))
    assert judges.summary(["unparseable"] * 4, 0.95)["win_rate"] == 0.0


def _gated(judge: dict[str, Any] | None, current: dict[str, Any] | None = None, **metrics: Any) -> tuple[str, str, str]:
    return answers.judged({**metrics, **({"judge": judge} if judge is not None else {})}, current, "promoted",
                          "tuned eval loss beats", "first" if current is None else "same-data")


def test_the_gate_needs_the_judges_bound_and_never_promotes_without_its_say() -> None:
    judged = {"status": "judged", "against": "base", "model": "m", "prompts": 10, "wins": 9, "ties": 0, "losses": 1,
              "unparseable": 0, "win_rate": 0.9, "lower_bound": 0.64, "confidence": 0.95, "min_win_rate": 0.5}
    promotion, reason, rule = _gated(judged)
    assert (promotion, rule) == ("promoted", "first")
    assert "lower bound 0.640 reaches eval.judge.min_win_rate 0.5" in reason
    promotion, reason, rule = _gated({**judged, "min_win_rate": 0.7})
    assert (promotion, rule) == ("rejected", "judge") and reason.startswith("not promoted: judge m: win rate 0.900")
    assert "(the first rule alone would promote: tuned eval loss beats)" in reason
    promotion, reason, rule = _gated({"status": "unreachable", "reason": "no answer within 60 s"})
    assert (promotion, rule) == ("rejected", "judge")
    assert reason.startswith("not promoted: the judge could not be reached (no answer within 60 s)")
    assert _gated(None, judged_by="m at http://h/v1")[:2] == ("rejected", "not promoted: the judge's verdict (m at "
                                                                          "http://h/v1) is missing, so the champion "
                                                                          "stays (the first rule alone would promote: "
                                                                          "tuned eval loss beats)")
    champion = {"version": "v0002", "metrics": {}}
    assert _gated(judged, champion)[0] == "rejected"  # judged against base, but v0002 is champion now
    assert _gated({**judged, "against": "v0002"}, champion)[0] == "promoted"
    unread = {**judged, "wins": 0, "losses": 0, "unparseable": 10, "win_rate": 0.0, "lower_bound": 0.0,
              "min_win_rate": 0.0}
    promotion, reason, rule = _gated(unread)
    assert (promotion, rule) == ("rejected", "judge") and "gave no readable verdict" in reason
    assert _gated(None) == ("promoted", "tuned eval loss beats", "first")  # no judge configured: the rule as before


def test_a_judge_url_with_credentials_or_a_key_for_a_name_is_refused() -> None:
    from pydantic import ValidationError

    assert JudgeArgs(url="http://127.0.0.1:8000").url == "http://127.0.0.1:8000/v1"
    assert JudgeArgs(url="https://api.example.com/v1/").url == "https://api.example.com/v1"
    for bad, said in [("http://user:pw@host:8000/v1", "holds credentials (a user:password@ part before the host)"),
                      ("http://host/v1?api_key=abc", "holds credentials (the query parameter api_key)"),
                      ("ftp://host/v1", "is not the root of an OpenAI-compatible API")]:
        with pytest.raises(ValidationError) as error:
            JudgeArgs(url=bad)
        message = error.value.errors()[0]["msg"]
        assert said in message and "pw" not in message and "abc" not in message, message
    with pytest.raises(ValidationError, match="must be the NAME of an environment variable"):
        JudgeArgs(api_key_env="sk-proj-abc123")
    with pytest.raises(ValidationError, match="is more than eval.generation_samples=2"):
        EvalArgs(generation_samples=2, judge=JudgeArgs(url="http://h:1/v1", model="m", prompts=3))
    with pytest.raises(ValidationError, match="eval.judge.model is empty"):
        EvalArgs(judge=JudgeArgs(url="http://h:1/v1"))


# --- against the real server ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def adapters(stages: dict[str, Any]) -> dict[str, Any]:
    """Two adapters on the shared prepared data (as tests/test_gate.py's): weak (2 steps) and strong (12)."""
    from tasks.train_adapter.stage import train_adapter

    lora, runs = LoraArgs(r=4, lora_alpha=8), stages["runs"]
    return {**stages, "weak": train_adapter.fn(lora, TrainArgs(max_steps=2, logging_steps=1), SpeedArgs(), runs,
                                               stages["data"], stages["model"]),
            "strong": train_adapter.fn(lora, TrainArgs(max_steps=12, learning_rate=0.02, logging_steps=1),
                                       SpeedArgs(), runs, stages["data"], stages["model"])}


@pytest.fixture
def judge_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_API_KEY", VLLM_API_KEY)  # the session server's key, named by judge.api_key_env


def _night(n: dict[str, Any], adapter: str, runs: Path, name: str, args: EvalArgs
           ) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """One night of `adapter` into registry `name` under `runs`, as the flow runs it: (score_champion's result, the
    export's metrics)."""
    export = ExportArgs(name=name, promotion_margin=MARGIN)
    evaluated = evaluate_adapter.fn(args, n["runs"], n["data"], n["model"], n[adapter])
    judged = score_champion.fn(args, runs, n["data"], n["model"], n[adapter], evaluated, export)
    exported = export_adapter.fn(export, runs, n["data"], n["model"], n[adapter], evaluated, judged)
    return judged, read_manifest(Path(exported)).metrics.model_dump(exclude_unset=True)


def _verdicts(runs: Path, judged: dict[str, Any]) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (runs.resolve() / judged["verdicts"]).read_text().splitlines()]


@pytest.mark.slow
def test_the_judge_swaps_positions_and_its_bound_decides(adapters: dict[str, Any], vllm_server: str, judge_key: None,
                                                         tmp_path: Path) -> None:
    """A first version judged against the base model, then a challenger against champion v0001's answers: each
    prompt asked twice, the answers swapped; the counts are the verdicts' as the file holds them; the lower bound
    decides against min_win_rate; verdicts are kept by what they depend on, so a changed threshold asks none again."""
    runs = tmp_path / "runs"
    check_evaluation(_eval(_judge(vllm_server)), TrainArgs())  # the check before any stage: it answers, it serves
    judged, first = _night(adapters, "weak", runs, "judged", _eval(_judge(vllm_server, min_win_rate=0.0)))
    assert (first["promotion"], first["gate_rule"]) == ("promoted", "first"), first["promotion_reason"]
    verdict = judged["judge"]
    assert verdict["status"] == "judged" and verdict["against"] == "base" and verdict["prompts"] == PROMPTS
    rows = _verdicts(runs, verdict)
    assert sorted((r["prompt"], r["order"]) for r in rows) == [(i, o) for i in range(PROMPTS) for o in ("ab", "ba")]
    for i in range(PROMPTS):
        ab, ba = (next(r for r in rows if (r["prompt"], r["order"]) == (i, o)) for o in ("ab", "ba"))
        assert (ab["answer_a"], ab["answer_b"]) == (ba["answer_b"], ba["answer_a"])  # the position swap
        assert ab["verdict"] in ("A", "B", "tie") and ab["judge_text"] == ab["verdict"]  # held to the choice
        assert ab["outcome"] == judges.outcome(ab["verdict"], "ab")
        assert ba["outcome"] == judges.outcome(ba["verdict"], "ba")
    outcomes = [judges.prompt_outcome(*(next(r["outcome"] for r in rows if (r["prompt"], r["order"]) == (i, o))
                                        for o in ("ab", "ba"))) for i in range(PROMPTS)]
    assert {k: verdict[k] for k in ("wins", "ties", "losses", "unparseable", "win_rate", "lower_bound")} == {
        k: v for k, v in judges.summary(outcomes, 0.95).items() if k not in ("prompts", "confidence")}
    root = registry.registry_dir(runs, "judged")
    assert (root / "v0001" / "judge-verdicts.jsonl").read_text() == (runs / verdict["verdicts"]).read_text()
    card = (root / "v0001" / "README.md").read_text()
    assert f"win rate {verdict['win_rate']:.3f} against base over {PROMPTS}" in card

    # against champion v0001: a bound no win rate below 1 reaches keeps it champion, whatever the loss says
    judged, second = _night(adapters, "strong", runs, "judged", _eval(_judge(vllm_server, min_win_rate=1.0)))
    verdict = judged["judge"]
    assert verdict["against"] == "v0001" and second["judged_against"] == "v0001"
    assert second["promotion"] == "rejected" and second["gate_rule"] == ("judge" if "rule alone would promote" in
                                                                         second["promotion_reason"] else "same-data")
    assert f"lower bound {verdict['lower_bound']:.3f} is below eval.judge.min_win_rate 1" in second["promotion_reason"]
    kept = (runs / verdict["verdicts"]).stat()
    judged, third = _night(adapters, "strong", runs, "judged", _eval(_judge(vllm_server, min_win_rate=0.0)))
    assert judged["judge"]["verdicts"] == verdict["verdicts"]  # the same pair: nothing asked again
    assert (runs / verdict["verdicts"]).stat().st_mtime_ns == kept.st_mtime_ns
    assert third["export_version"] == "v0003" and third["promotion"] == ("promoted" if second["gate_rule"] == "judge"
                                                                           else "rejected")
    history = {row["version"]: row for row in registry.history(root)}
    assert history["v0002"]["judged win rate"].startswith(f"{verdict['win_rate']:.3f} (lower bound")
    assert history["v0002"]["rule"] == second["gate_rule"]


@pytest.mark.slow
def test_a_judge_down_mid_run_keeps_the_champion_and_the_next_run_asks_only_the_rest(
        adapters: dict[str, Any], vllm_server: str, judge_key: None, tmp_path: Path) -> None:
    runs, target = tmp_path / "runs", urlsplit(vllm_server)
    _, first = _night(adapters, "weak", runs, "down", _eval())  # no judge yet: v0001 the champion
    relay = Relay((target.hostname, target.port), down_after=2)
    try:
        args = _eval(_judge(relay.url, min_win_rate=0.0, timeout_s=30))
        judged, night = _night(adapters, "strong", runs, "down", args)
        assert judged["judge"]["status"] == "unreachable" and judged["judge"]["kept"] == 2
        assert "gave no answer after 2 tries: it cannot be reached" in judged["judge"]["reason"]
        assert (night["export_version"], night["promotion"], night["gate_rule"]) == ("v0002", "rejected", "judge")
        assert night["promotion_reason"].startswith("not promoted: the judge could not be reached (")
        assert registry.champion(registry.registry_dir(runs, "down"))["version"] == "v0001"
        relay.down_after, relay.requests = None, 0
        relay.up()
        judged, again = _night(adapters, "strong", runs, "down", args)
        assert relay.requests == 2 * PROMPTS - 2  # the two it gave were kept
        assert judged["judge"]["status"] == "judged" and len(_verdicts(runs, judged["judge"])) == 2 * PROMPTS
        assert again["export_version"] == "v0003" and again["gate_rule"] != "judge", again["promotion_reason"]
    finally:
        relay.down()


@pytest.mark.slow
@pytest.mark.kill
def test_kill_9_while_judging_then_the_run_resumes_without_asking_again(
        adapters: dict[str, Any], vllm_server: str, judge_key: None, tmp_path: Path) -> None:
    runs, target = tmp_path / "runs", urlsplit(vllm_server)
    relay = Relay((target.hostname, target.port), delay_s=1.0)  # a slow judge: the kill lands between verdicts
    try:
        args = _eval(_judge(relay.url))
        evaluated = evaluate_adapter.fn(args, adapters["runs"], adapters["data"], adapters["model"], adapters["weak"])
        call = [runs, adapters["data"], adapters["model"], adapters["weak"], evaluated]
        script = ("import json, sys; from pathlib import Path; from tasks.config import EvalArgs, ExportArgs; "
                  "from tasks.evaluate_adapter.champion import score_champion; a = json.loads(sys.argv[1]); "
                  "score_champion.fn(EvalArgs.model_validate(a[0]), Path(a[1]), *a[2:], ExportArgs(name='killed'))")
        proc = subprocess.Popen([sys.executable, "-c", script, json.dumps([args.model_dump(), *map(str, call)])],
                                cwd=PROJECT_ROOT, start_new_session=True, stdout=subprocess.DEVNULL,
                                stderr=(tmp_path / "judging.err").open("w"))
        found: list[Path] = []
        deadline = time.time() + 300
        while not (found and len(found[0].read_text().splitlines()) >= 2):
            assert proc.poll() is None, (tmp_path / "judging.err").read_text()[-3000:]
            assert time.time() < deadline, "no verdict kept in time"
            time.sleep(0.1)
            found = list((runs / "evaluate_adapter" / ".judge").glob("*/verdicts.jsonl"))
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        kept = [json.loads(line) for line in found[0].read_text().splitlines()]
        assert 2 <= len(kept) < 2 * PROMPTS and not (found[0].parent / "result.json").exists()
        relay.delay_s, relay.requests = 0.0, 0
        judged = score_champion.fn(args, runs, *call[1:], ExportArgs(name="killed"))["judge"]
        assert relay.requests == 2 * PROMPTS - len(kept)
        rows = _verdicts(runs, judged)
        assert rows[:len(kept)] == kept and len({(r["prompt"], r["order"]) for r in rows}) == 2 * PROMPTS == len(rows)
        assert judged["status"] == "judged" and judged["prompts"] == PROMPTS
    finally:
        relay.down()


@pytest.mark.slow
def test_a_judge_that_rambles_counts_no_win(adapters: dict[str, Any], vllm_server: str, judge_key: None,
                                            tmp_path: Path) -> None:
    """The same server without structured output, asked by a rubric that invites an essay: every verdict is
    unparseable, none counts as a win, and the gate keeps the champion."""
    rubric = tmp_path / "essay.txt"
    rubric.write_text("Write a long essay about these two answers.\n{prompt}\nFirst: {answer_a}\nSecond: {answer_b}\n")
    args = _eval(_judge(vllm_server, constrain="none", rubric=str(rubric), retries=0, max_tokens=24))
    judged, night = _night(adapters, "weak", tmp_path / "runs", "rambling", args)
    verdict = judged["judge"]
    assert (verdict["unparseable"], verdict["wins"], verdict["win_rate"]) == (PROMPTS, 0, 0.0)
    assert all(r["verdict"] is None and r["outcome"] == "unparseable" and r["judge_text"].strip()
               for r in _verdicts(tmp_path / "runs", verdict))
    assert (night["promotion"], night["gate_rule"]) == ("rejected", "judge")
    assert f"{PROMPTS} unparseable" in night["promotion_reason"]


def test_a_judge_that_cannot_judge_stops_the_run_before_any_stage(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing listens at the URL, the key's variable is unset, the rubric lacks an answer: one paragraph names all."""
    rubric = tmp_path / "rubric.txt"
    rubric.write_text("{prompt} {answer_a}")
    monkeypatch.delenv("NO_SUCH_JUDGE_KEY", raising=False)
    judge = JudgeArgs(url=f"http://127.0.0.1:{free_port()}/v1", model="m", api_key_env="NO_SUCH_JUDGE_KEY",
                      rubric=str(rubric), retries=0, prompts=3)
    with pytest.raises(UserError) as error:
        check_evaluation(_eval(judge), TrainArgs())
    said = str(error.value)
    assert said.startswith("The promotion gate's evaluation cannot run as configured, so nothing was run: ")
    assert "eval.judge.api_key_env names NO_SUCH_JUDGE_KEY, which is not set" in said
    assert "eval.judge.rubric lacks {answer_b}" in said
    assert f"eval.judge.url: the judge at {judge.url} gave no answer after 1 try: it cannot be reached" in said


@pytest.mark.slow
def test_a_run_with_a_suite_and_a_judge_shows_both_and_a_rerun_is_cached(
        prefect_env: Path, vllm_server: str, judge_key: None, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The whole flow: the verdict names the rule and what the suite and the judge said, the UI has the
    judge-verdicts table, the CLI's summary a line for each; run again, every stage and score_champion are Cached."""
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from deployments.cli import _print_summary
    from tasks.config import EMBEDDED_DATA
    from tests.conftest import run_flow, settled_task_states, small_overrides, statuses
    from tests.test_suites import write_suite

    data = tmp_path / "small.jsonl"
    data.write_text("".join(EMBEDDED_DATA.read_text().splitlines(keepends=True)[:240]))
    suite = write_suite(tmp_path / "suite")
    judge = {"url": f"{vllm_server}/v1", "model": JUDGE_MODEL, "api": "completions", "constrain": "choice",
             "prompts": PROMPTS, "retries": 1, "api_key_env": "VLLM_API_KEY", "min_win_rate": 0.0}
    overrides = small_overrides(data, tmp_path / "runs", **{
        "export.name": "answers", "eval.generation_samples": PROMPTS, "eval.max_new_tokens": 8,
        "eval.suites": json.dumps([{"task": str(suite), "tolerance": 1.0}]), "eval.judge": json.dumps(judge)})
    summary = run_flow(overrides)
    m = summary["metrics"]
    assert (m["promotion"], m["gate_rule"]) == ("promoted", "first"), m["promotion_reason"]
    assert "; regression suites within tolerance: next_day acc" in m["promotion_reason"]
    assert f"; judge {JUDGE_MODEL}: win rate {m['judge']['win_rate']:.3f} against the base model" in \
        m["promotion_reason"]
    prefix = Path(summary["run_dir"]).name.split("-")[-1]
    with get_client(sync_client=True) as client:
        tables = [a for a in client.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=["judge-verdicts"]))) if str(a.flow_run_id).startswith(prefix)]
        metrics_table = [a for a in client.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=["eval-metrics"]))) if str(a.flow_run_id).startswith(prefix)]
    shown = {row["model"]: row for row in json.loads(metrics_table[0].data)}
    assert shown["base"]["suite next_day (acc)"] == f"{m['base_suites']['next_day']:.4f}"
    rows = json.loads(tables[0].data)
    assert len(rows) == PROMPTS and {"verdict, challenger as A", "verdict, challenger as B", "base's answer",
                                     "challenger's answer", "judge's text (challenger as A)"} <= set(rows[0])
    _print_summary(summary)
    out = capsys.readouterr().out
    assert "suite next_day (acc, tolerance 1): base " in out and f"judge {JUDGE_MODEL} against base: win rate" in out
    assert "promoted by the first rule: first version" in out

    verdicts = tmp_path / "runs" / m["judge"]["verdicts"]
    kept = verdicts.stat().st_mtime_ns
    again = run_flow(overrides)
    assert set(statuses(again).values()) == {"cached"} and verdicts.stat().st_mtime_ns == kept
    with get_client(sync_client=True) as client:
        run = client.read_flow_runs(sort="START_TIME_DESC", limit=1)[0]
    assert str(run.id).startswith(Path(again["run_dir"]).name.split("-")[-1])
    states = settled_task_states(run.id)
    # score_champion had no key while its verdicts were missing (a judge that fails is asked again next run), so
    # this first re-run computes its key's result once: nothing to score, nothing loaded or asked
    assert states.pop("score_champion") in (["Completed"], ["Cached"])
    assert sorted(s for v in states.values() for s in v) == ["Cached"] * 5
