"""Hostile input and faults (issue 28): huge and deep configs, the resumed run's summary, a full disk, SIGTERM,
and what a person sees of a failed run (its card, --watch, the form).

Each case builds its input itself and goes through the CLI's `main` in this process: the exit code and stderr
paragraph are the behaviour, and nothing may be started or written.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from deployments.cli import USER_ERROR_EXIT, _print_summary, main
from tasks.config import EMBEDDED_DATA, LoraArgs, ModelArgs, SpeedArgs, TrainArgs, load_config
from tasks.errors import UserError
from tasks.hashing.files import HASH_MEMO, INPUT_HASH_MEMO
from tasks.on_disk.manifest import MANIFEST
from tasks.prepare_model.stage import prepare_model
from tasks.train_adapter.stage import train_adapter
from tests.conftest import cli, cli_env, finish, last_json, small_overrides, wait_for_checkpoint


def _fails(capsys: pytest.CaptureFixture[str], argv: list[str], *fragments: str) -> str:
    started = time.monotonic()
    assert main(argv) == USER_ERROR_EXIT
    assert time.monotonic() - started < 30  # at once, not after minutes of wrapping or a server's refusal
    err = " ".join(capsys.readouterr().err.split())
    for fragment in fragments:
        assert fragment in err, err[:2000]
    assert len(err) < 3000  # one paragraph, never the value itself
    return err


def test_huge_config_file_fails_at_once_with_the_limit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "huge.yaml"
    path.write_text("train:\n  colour: " + "x" * 3_000_000 + "\n")
    runs = tmp_path / "runs"
    _fails(capsys, ["run", "--config", str(path), "--set", f"runs_dir={runs}"], "3,000,", "limit of 524,288 bytes",
           str(path))
    assert not runs.exists()


def test_long_value_is_quoted_by_a_prefix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = _fails(capsys, ["validate", "--set", "train.colour=" + "y" * 200_000],
                 "train.colour: Extra inputs are not permitted", "yyy...yyy")
    assert "y" * 100 not in err


def test_many_bad_entries_show_a_few(capsys: pytest.CaptureFixture[str]) -> None:
    entries = ",".join(f"c{i}: {i}" for i in range(5000))
    _fails(capsys, ["validate", "--set", f"data.column_mapping={{{entries}}}"],
           "5000 problem(s)", "data.column_mapping.c0: Input should be a valid string (got 0)", "and 4,990 more")


def test_parameters_over_prefects_limit_fail_before_a_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # under the file limit as YAML, over Prefect's 524,288 bytes as JSON parameters (the quotes add up)
    path = tmp_path / "mapping.yaml"
    path.write_text("data:\n  column_mapping: {" + ",".join(f"c{i}: d{i}" for i in range(36_000)) + "}\n")
    assert path.stat().st_size < 524_288
    runs = tmp_path / "runs"
    _fails(capsys, ["run", "--config", str(path), "--set", f"runs_dir={runs}"],
           "as flow-run parameters, more than the 524,288 bytes", "nothing was started")
    assert not runs.exists()


@pytest.mark.parametrize("text", ["train: " + "[" * 5000 + "]" * 5000,
                                  "data: {column_mapping: " + "{a: " * 3000 + "b" + "}" * 3001])
def test_deep_nesting_names_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str) -> None:
    path = tmp_path / "deep.yaml"
    path.write_text(text + "\n")
    err = _fails(capsys, ["validate", "--config", str(path)], f"{path} is nested too deeply")
    assert "recursion" not in err


def test_summary_names_the_resumed_step_and_the_reward_accuracy(capsys: pytest.CaptureFixture[str]) -> None:
    stages = {"prepare_data": {"status": "cached", "dir": "runs/prepare_data/a"},
              "train_adapter": {"status": "resumed", "dir": "runs/train_adapter/b", "resumed_from_step": 4},
              "evaluate_adapter": {"status": "computed", "dir": "runs/evaluate_adapter/c"}}
    metrics = {"base_eval_loss": 2.0, "tuned_eval_loss": 1.0, "relative_improvement": 0.5, "base_perplexity": 7.4,
               "tuned_perplexity": 2.7, "eval_pairs": 20, "base_reward_accuracy": 0.5, "tuned_reward_accuracy": 0.85,
               "base_reward_margin": 0.0, "tuned_reward_margin": 1.25}  # a dpo run's: its gate compares the accuracy
    _print_summary({"stages": stages, "metrics": metrics, "export_dir": "x", "run_dir": "r"})
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.strip()}
    assert "resumed from step 4" in lines["train_adapter"]
    assert "base 0.500 -> tuned 0.850" in lines["reward"] and "20 held-out pairs" in lines["reward"]
    assert "cached" in lines["prepare_data"] and "step" not in lines["prepare_data"]


# ---- a full disk ------------------------------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 8 MB filesystem (tmpfs) for runs_dir; mounting needs root."""
    mount = tmp_path / "disk"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)], capture_output=True,
                          text=True, check=False)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {made.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def _fill(disk: Path, leave: int) -> Path:
    """Fill disk with one file, leaving about `leave` bytes free."""
    filler = disk / "filler"
    filler.write_bytes(b"\0" * (shutil.disk_usage(disk).free - leave))
    return filler


def _full_disk_paragraph(info: pytest.ExceptionInfo[UserError], stage: str, runs: Path) -> None:
    message = str(info.value)
    for fragment in (f"{stage}: not enough disk space under runs_dir {runs}", "B free of 8.0 MB",
                     "Free space there or set runs_dir to a larger disk"):
        assert fragment in message, message
    assert "\n" not in message


def test_prepare_model_checks_the_space_it_needs(small_disk: Path) -> None:
    runs = small_disk / "runs"
    filler = _fill(small_disk, 200_000)
    with pytest.raises(UserError) as info:
        prepare_model.fn(ModelArgs(), runs)
    _full_disk_paragraph(info, "prepare_model", runs)
    assert "it needs about" in str(info.value) and "the 4-bit checkpoint" in str(info.value)
    assert not list(runs.glob("prepare_model/*/*.safetensors")) and not list(runs.rglob(MANIFEST))
    filler.unlink()
    assert (Path(prepare_model.fn(ModelArgs(), runs)) / MANIFEST).is_file()


@pytest.mark.slow  # two short trainings
def test_checkpoint_on_a_full_disk_is_one_paragraph_and_resumes(small_disk: Path, stages: dict[str, Any]) -> None:
    runs, train = small_disk / "runs", TrainArgs(max_steps=3, save_steps=1, logging_steps=1)
    lora = LoraArgs(r=32, lora_alpha=32)  # checkpoints of about 2 MB: the second does not fit
    filler = _fill(small_disk, 3_000_000)
    with pytest.raises(UserError) as info:
        train_adapter.fn(lora, train, SpeedArgs(), runs, stages["data"], stages["model"])
    _full_disk_paragraph(info, "train_adapter", runs)
    assert not list(runs.rglob(MANIFEST)) and not list(runs.glob("train_adapter/*/adapter"))
    complete = [c.name for c in runs.glob("train_adapter/*/checkpoints/checkpoint-*") if (c / "complete").is_file()]
    assert complete == ["checkpoint-1"]  # kept for the resume; a half-written one has no marker and is skipped
    filler.unlink()
    folder = Path(train_adapter.fn(lora, train, SpeedArgs(), runs, stages["data"], stages["model"]))
    made = json.loads((folder / MANIFEST).read_text())
    assert made["resumed_from_step"] == 1 and made["metrics"]["optimizer_steps"] == 3


@pytest.fixture
def exported(small_disk: Path, stages: dict[str, Any]) -> dict[str, Any]:
    """A finished train, eval and export (registry v0001, the champion) with runs_dir on the small disk."""
    from tasks.config import EvalArgs, ExportArgs
    from tasks.evaluate_adapter.stage import evaluate_adapter
    from tasks.export_adapter.stage import export_adapter

    runs = small_disk / "runs"
    dirs = [stages["data"], stages["model"]]
    dirs.append(train_adapter.fn(LoraArgs(r=4, lora_alpha=8), TrainArgs(max_steps=2, logging_steps=1), SpeedArgs(),
                                 runs, *dirs))
    dirs.append(evaluate_adapter.fn(EvalArgs(max_samples=8, generation_samples=2, max_new_tokens=4), runs, *dirs))
    upstream = list(dirs)
    # two steps beat the base model, by less than the default 1%: the version must be the champion
    export = lambda: export_adapter.fn(ExportArgs(promotion_margin=0.001), runs, *upstream)  # noqa: E731 - again later
    dirs.append(export())
    return {"runs": runs, "dirs": dirs, "export": export, "root": runs / "exports" / ExportArgs().name}


def _tree(folder: Path) -> dict[str, bytes]:
    """Every file under folder with its bytes (hidden ones too: a leftover temp file is a difference)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.slow  # a training, an evaluation and an export on the small disk (25-50 s)
def test_registry_repair_on_a_full_disk_leaves_the_registry_as_it_was(small_disk: Path, exported: dict[str, Any]
                                                                       ) -> None:
    root = exported["root"]
    whole = _tree(root)
    shutil.rmtree(root / "v0001")  # what the cached export's self-repair restores: a version and champion.json
    (root / "champion.json").unlink()
    before = _tree(root)
    filler = _fill(small_disk, 0)
    with pytest.raises(UserError) as info:
        exported["export"]()
    _full_disk_paragraph(info, "the repair of exports registry adapter", exported["runs"])
    assert "nothing half-made is in the registry" in str(info.value) and "it needs about" in str(info.value)
    assert _tree(root) == before  # no half version, no .tmp-* folder, no half champion.json
    filler.unlink()
    assert exported["export"]() == exported["dirs"][-1]  # the cached export repairs the registry now
    assert _tree(root) == whole


@pytest.mark.slow  # a training, an evaluation and an export on the small disk (25-50 s)
@pytest.mark.parametrize("backend", [[], ["tensorboard"]])
def test_run_record_on_a_full_disk_leaves_no_run_folder(small_disk: Path, exported: dict[str, Any],
                                                        backend: list[str]) -> None:
    from tasks.reporting.run_record import record_run

    config = load_config(None, [f"runs_dir={exported['runs']}", f"track.backend={json.dumps(backend)}"])
    events = exported["runs"] / "tensorboard"
    filler = _fill(small_disk, 0)
    with pytest.raises(UserError) as info:
        record_run(config, exported["dirs"])
    step = "tracking (TensorBoard)" if backend else "the run record (run.json)"
    _full_disk_paragraph(info, step, exported["runs"])
    assert not list((exported["runs"] / "runs").glob("*"))  # no run folder without its whole run.json
    assert not [p for p in events.rglob("*") if p.is_file()]  # no half event file that says "logged"
    filler.unlink()
    summary = record_run(config, exported["dirs"])
    record = json.loads((Path(summary["run_dir"]) / "run.json").read_text())
    assert record["stages"]["export_adapter"]["key"] == Path(exported["dirs"][-1]).name
    assert sorted(p.name for p in Path(summary["run_dir"]).iterdir()) == ["loss.png", "registry-history.png",
                                                                          "run.json"]
    if backend:
        assert summary["tracking"]["tensorboard"]["logged"] == "now"
        assert not [p for p in events.rglob(".*")]  # the temporary folder is gone


@pytest.mark.slow  # three CLI runs
def test_cli_full_disk_in_the_registry_repair_is_exit_2_and_recovers(small_disk: Path, small_data: Path,
                                                                    tmp_path: Path) -> None:
    """The command a person types: every stage cached, the registry's self-repair finds the disk full."""
    runs = small_disk / "runs"
    args = ["run", "--json", *sum((["--set", o] for o in small_overrides(small_data, runs)), [])]
    env = cli_env(tmp_path / "prefect")
    out, err = finish(cli(args, env, tmp_path / "first"), tmp_path / "first", timeout=900)
    first = last_json(out)
    root = runs / "exports" / "adapter"
    whole = _tree(root)
    shutil.rmtree(root / "v0001")
    (root / "champion.json").unlink()
    before = _tree(root)
    filler = _fill(small_disk, 0)
    full = cli(args, env, tmp_path / "full")
    out, err = finish(full, tmp_path / "full", timeout=900)
    assert full.returncode == USER_ERROR_EXIT, err[-3000:]
    message = " ".join(err.split())
    assert f"error: the repair of exports registry adapter: not enough disk space under runs_dir {runs}" in message
    assert "Traceback" not in err and "it needs about" in message, err[-3000:]
    assert _tree(root) == before and [p.name for p in (runs / "runs").iterdir()] == [Path(first["run_dir"]).name]
    filler.unlink()
    out, err = finish(cli(args, env, tmp_path / "again"), tmp_path / "again", timeout=900)
    again = last_json(out)
    assert {k: v["status"] for k, v in again["stages"].items()} == dict.fromkeys(first["stages"], "cached")
    assert _tree(root) == whole and again["metrics"]["champion_version"] == "v0001"


# 0: the tokenizer's memo does not fit; 9 pages: it does (8), the first part's rows (7.7 KB) do not
@pytest.mark.parametrize("leave", [0, 9 * 4096])
def test_prepare_data_parts_on_a_full_disk_leave_no_temporary_part(small_disk: Path, tmp_path: Path, leave: int
                                                                    ) -> None:
    from tasks.config import DataArgs
    from tasks.prepare_data.parts import read_part
    from tasks.prepare_data.stage import prepare_data

    shards = tmp_path / "shards"  # a folder source: tokenized file by file into parts
    shards.mkdir()
    lines = EMBEDDED_DATA.read_text().splitlines(keepends=True)
    for n in range(3):
        (shards / f"{n}.jsonl").write_text("".join(lines[n * 100:(n + 1) * 100]))
    runs, roomy = small_disk / "runs", tmp_path / "roomy"
    filler = _fill(small_disk, leave)
    with pytest.raises(UserError) as info:
        prepare_data.fn(DataArgs(source=str(shards)), ModelArgs(), runs)
    _full_disk_paragraph(info, "prepare_data", runs)
    memos = (HASH_MEMO, INPUT_HASH_MEMO)  # the hash memos are whole files (written by os.replace), not leftovers
    assert not [p for p in runs.rglob(".*") if p.name not in memos]  # no temporary part or file
    assert not list(runs.rglob(MANIFEST))
    assert all(read_part(p) is not None for p in runs.glob("prepare_data/parts/*") if p.is_dir())  # whole parts
    filler.unlink()
    folder = Path(prepare_data.fn(DataArgs(source=str(shards)), ModelArgs(), runs))
    alone = Path(prepare_data.fn(DataArgs(source=str(shards)), ModelArgs(), roomy))
    assert folder.name == alone.name  # the same key, and byte-identical data to a run that had space:
    assert [(folder / f).read_bytes() for f in ("train.parquet", "eval.parquet")] == \
        [(alone / f).read_bytes() for f in ("train.parquet", "eval.parquet")]


def test_sweep_record_on_a_full_disk_keeps_the_old_file(small_disk: Path) -> None:
    from tasks.reporting.sweep import _write

    record = small_disk / "runs" / "sweeps" / "k" / "sweep.json"
    _write(record, '{"before": true}')
    filler = _fill(small_disk, 0)
    with pytest.raises(UserError) as info:
        _write(record, json.dumps({"after": "x" * 100_000}))
    _full_disk_paragraph(info, "the sweep record (sweep.json)", small_disk / "runs")
    assert _tree(record.parent) == {"sweep.json": b'{"before": true}'}  # whole, no temporary file beside it
    filler.unlink()


# ---- what a person sees -----------------------------------------------------------------------------------------


def _flow_run(state: Any) -> Any:
    from prefect import get_client

    from flows.qlora_pipeline import qlora_pipeline

    with get_client(sync_client=True) as client:
        run = client.create_flow_run(qlora_pipeline, parameters={})
        client.set_flow_run_state(run.id, state, force=True)
        return client.read_flow_run(run.id)


def _artifact(flow_run_id: Any, key: str) -> Any:
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        (found,) = client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]), key=ArtifactFilterKey(any_=[key])))
        return found


def test_failure_card_keeps_placeholders_and_says_what_to_change(prefect_env: Path) -> None:
    from prefect.states import Failed

    from tasks.reporting.artifacts import failure_summary

    state = Failed(message="Flow run encountered an exception: UserError: lora.target_modules names q_projj, which "
                   "data/tiny-llama does not have.")
    run = _flow_run(state)
    failure_summary(None, run, state)
    card = _artifact(run.id, "run-failure").data
    assert "`runs_dir/<stage>/<key>/`" in card  # a code span: rendered as written, not as an HTML tag
    assert "lora.target\\_modules names q\\_projj" in card  # the message as text, not markdown
    assert "If it names a config field, start a new run with the field changed" in card
    assert "Retry would run the same parameters" in card
    # the command names the field the message names (a run of `qlora-pipeline run`: that command)
    assert "`qlora-pipeline run --set lora.target_modules=<new value>`" in card and "SECTION.FIELD" not in card


@pytest.mark.parametrize(("message", "retry_helps"), [
    ("Validation of flow parameters failed with error: ParameterTypeError: Flow run received invalid parameters:\n"
     " - config.train.max_steps: Value error, 0 steps would train nothing", False),
    ("Flow run encountered an exception: UserError: data.source='/data/x.jsonl': no such file.", True),
    ("Crashed: the flow-run process exited with -9 (SIGKILL)", True),
    (None, True),
])
def test_failure_alert_gives_the_cards_advice(message: str | None, retry_helps: bool) -> None:
    """The alert's body, rendered as Prefect's server renders it (a sandboxed Jinja template), advises Retry exactly
    where the run-failure card does; for refused parameters neither does."""
    import yaml
    from jinja2 import ChainableUndefined
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from deployments.setup import HERE
    from tasks.reporting.artifacts import _next_step

    (automation,) = yaml.safe_load((HERE / "automations.yaml").read_text())["automations"]
    environment = ImmutableSandboxedEnvironment(undefined=ChainableUndefined)
    environment.filters["ui_url"] = lambda run: f"http://127.0.0.1:4200/runs/flow-run/{run['id']}"
    run = {"name": "calm-otter", "id": "0b6f", "state": {"name": "Failed", "message": message}}
    body = environment.from_string(automation["actions"][0]["body"]).render(flow_run=run)
    card = _next_step(message or "no message", "0b6f", "`qlora-pipeline start embedded-default --set x=<new value>`")
    assert ("press Retry" in body) == retry_helps == ("press **Retry**" in card), body
    assert "prefect flow-run retry 0b6f" in body if retry_helps else "Retry would run the same parameters" in body


@pytest.mark.slow  # waits on purpose
def test_watch_waits_for_the_failure_card_and_skips_result_records(prefect_env: Path) -> None:
    import threading

    from prefect import get_client
    from prefect.client.schemas.actions import ArtifactCreate
    from prefect.states import Crashed

    from deployments.watch import watch

    run = _flow_run(Crashed(message="Execution was aborted by a termination signal."))
    with get_client(sync_client=True) as client:  # what Prefect records for a persisted result: no key
        client.create_artifact(ArtifactCreate(type="result", data={"storage_key": "/x/abc"}, flow_run_id=run.id))

    def hook_later() -> None:  # the worker's on_crashed hook writes the card seconds after the state
        time.sleep(4)
        with get_client(sync_client=True) as client:
            client.create_artifact(ArtifactCreate(key="run-failure", type="markdown", flow_run_id=run.id,
                                                  data="## run crashed during train\\_adapter", description="Why"))

    threading.Thread(target=hook_later, daemon=True).start()
    printed: list[str] = []
    assert watch(run.id, out=printed.append, poll_seconds=0.5) == "CRASHED"
    text = "\n".join(printed)
    assert "run crashed during train_adapter" in text and "storage_key" not in text, text


def test_form_schema_has_no_const_and_no_null_toggle() -> None:
    from prefect.utilities.callables import parameter_schema
    from prefect.utilities.schema_tools.validation import validate

    from flows.qlora_pipeline import qlora_pipeline
    from tasks.config import RunConfig

    schema = parameter_schema(qlora_pipeline).model_dump_for_openapi()
    text = json.dumps(schema)
    assert '"const"' not in text and '{"type": "null"}' not in text
    lora = schema["definitions"]["LoraArgs"]["properties"]["target_modules"]
    branches = [{k: b[k] for k in ("enum", "type") if k in b} for b in lora["anyOf"]]  # titled for the form
    assert {"enum": ["all-linear"], "type": "string"} in branches
    assert schema["definitions"]["TrainArgs"]["properties"]["optim"]["type"] == "string"
    # a full config (its nulls included) still validates as Prefect's server validates deployment parameters
    full = load_config(None, ["train.optim=adamw_torch", "data.name=x"])
    for config in (RunConfig(), full):
        assert not validate({"config": config.model_dump(mode="json")}, schema, raise_on_error=False,
                            preprocess=True, ignore_required=True)
    assert validate({"config": {"train": {"optim": "sgd"}}}, schema, raise_on_error=False, preprocess=True,
                    ignore_required=True)


# ---- SIGTERM ----------------------------------------------------------------------------------------------------


def _session_processes(sid: int) -> list[int]:
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if os.getsid(int(proc.name)) == sid:
                found.append(int(proc.name))
        except OSError:  # ended meanwhile
            pass
    return found


@pytest.mark.slow
@pytest.mark.kill
@pytest.mark.parametrize("target", ["process", "group"])
def test_sigterm_during_training_crashes_with_hooks_and_resumes(small_data: Path, tmp_path: Path,
                                                                 target: str) -> None:
    """What systemd, Kubernetes or a pre-empted node sends, to the CLI alone or to its whole process group: the run
    ends within seconds as Crashed with its failure hook, nothing of it stays running, and a rerun resumes."""
    steps = 16  # the kill lands after the first checkpoint (step 2), long before the last
    args = ["run", "--json", *sum((["--set", o] for o in small_overrides(
        small_data, tmp_path / "runs", **{"train.max_steps": steps, "train.save_steps": 2})), [])]
    env = cli_env(tmp_path / "prefect")
    proc = cli(args, env, tmp_path / "first")
    try:
        wait_for_checkpoint(proc, tmp_path / "runs", tmp_path / "first")
        (os.killpg if target == "group" else os.kill)(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
        stopped = time.time()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    err = (tmp_path / "first.err").read_text()
    assert proc.returncode == 143, err[-3000:]
    assert "Crashed" in err and "Hook 'failure_summary' finished running successfully" in err, err[-3000:]
    assert "stopped: the run got SIGTERM and ended as Crashed" in " ".join(err.split())
    assert "ConnectError" not in err and "Error logging to API" not in err, err[-3000:]
    while _session_processes(proc.pid) and time.time() < stopped + 10:
        time.sleep(0.2)
    assert not _session_processes(proc.pid), "a process of the run (its Prefect server?) outlived it"
    if target == "process":
        return

    rerun = cli(args, env, tmp_path / "rerun")
    out, err = finish(rerun, tmp_path / "rerun", timeout=900)
    assert rerun.returncode == 0, err[-3000:]
    train = last_json(out)["stages"]["train_adapter"]
    assert train["status"] == "resumed" and train["resumed_from_step"] >= 2
    assert json.loads((Path(train["dir"]) / MANIFEST).read_text())["metrics"]["optimizer_steps"] == steps


def test_libraries_full_disk_errors_are_recognised(small_disk: Path) -> None:
    """safetensors and torch.save report a full disk in their own words (torch's zip writer: "unexpected pos"),
    not as OSError(ENOSPC)."""
    import torch
    from safetensors.torch import save_file

    from tasks.on_disk.disk import is_out_of_space

    _fill(small_disk, 100_000)
    tensors = {"w": torch.zeros(1_000_000)}  # 4 MB
    for write in (lambda: save_file(tensors, small_disk / "w.safetensors"),
                  lambda: torch.save(tensors, small_disk / "w.pt"),
                  lambda: (small_disk / "w.bin").write_bytes(b"\0" * 4_000_000)):
        with pytest.raises(Exception) as info:  # noqa: PT011 - each library's own type
            write()
        assert is_out_of_space(info.value, small_disk), repr(info.value)
    assert not is_out_of_space(RuntimeError("CUDA out of memory"), Path.home())
    assert not is_out_of_space(FileNotFoundError(2, "x"))
