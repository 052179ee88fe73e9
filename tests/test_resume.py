"""Caching, resume and fault tolerance: content keys, broken folders, kill -9, concurrency, OOM back-off."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from tasks.on_disk.manifest import MANIFEST
from tests.conftest import (
    cli,
    cli_env,
    finish,
    last_json,
    run_flow,
    session_processes,
    small_overrides,
    statuses,
    wait_for_checkpoint,
)

ALL_COMPUTED = dict.fromkeys(
    ["prepare_data", "prepare_model", "train_adapter", "evaluate_adapter", "export_adapter"], "computed")


@pytest.mark.slow
def test_one_byte_data_change_recomputes_every_stage_that_reads_it(prefect_env: Path, small_data: Path,
                                                                    tmp_path: Path) -> None:
    """prepare_model never reads the data, so it stays reused; the other four are recomputed."""
    overrides = small_overrides(small_data, tmp_path / "runs")
    assert statuses(run_flow(overrides)) == ALL_COMPUTED
    text = small_data.read_text()
    small_data.write_text(text.replace("The opposite", "the opposite", 1))  # one byte, same path and size
    assert statuses(run_flow(overrides)) == {**ALL_COMPUTED, "prepare_model": "cached"}


@pytest.mark.slow
def test_missing_manifest_or_truncated_parquet_is_recomputed(prefect_env: Path, small_data: Path,
                                                            tmp_path: Path) -> None:
    overrides = small_overrides(small_data, tmp_path / "runs")
    first = run_flow(overrides)
    data_dir = Path(first["stages"]["prepare_data"]["dir"])
    (data_dir / "manifest.json").unlink()
    again = run_flow(overrides)
    assert statuses(again)["prepare_data"] == "computed"
    assert statuses(again)["train_adapter"] == "cached"  # same content, same key downstream
    parquet = data_dir / "eval.parquet"
    parquet.write_bytes(parquet.read_bytes()[:-100])
    third = run_flow(overrides)
    assert statuses(third)["prepare_data"] == "computed"
    assert parquet.stat().st_size == json.loads((data_dir / "manifest.json").read_text())["outputs"]["eval.parquet"]


@pytest.mark.slow
@pytest.mark.kill
@pytest.mark.parametrize("processes", [1, 2])
def test_kill_9_during_training_resumes_from_checkpoint(small_data: Path, tmp_path: Path, processes: int) -> None:
    """With 2 processes the kill also reaches the torchrun ranks (each in a session of its own): none of them
    may train on beside the resumed run, which would show as steps logged twice."""
    steps = 40
    args = ["run", "--json", *sum((["--set", o] for o in small_overrides(
        small_data, tmp_path / "runs", **{"train.max_steps": steps, "train.save_steps": 5,
                                          "speed.num_gpus": processes})), [])]
    env = cli_env(tmp_path / "prefect")
    proc = cli(args, env, tmp_path / "first")
    checkpoints = tmp_path / "runs" / "train_adapter"
    try:
        wait_for_checkpoint(proc, tmp_path / "runs", tmp_path / "first")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the run and its temporary Prefect server
        proc.wait()
    saved = max(int(p.parent.name.split("-")[1]) for p in checkpoints.glob("*/checkpoints/checkpoint-*/complete"))
    assert saved < steps
    deadline = time.time() + 10
    while _processes_mentioning(str(checkpoints)) and time.time() < deadline:
        time.sleep(0.2)
    assert not _processes_mentioning(str(checkpoints)), "a rank outlived the killed run"

    rerun = cli(args, env, tmp_path / "rerun")
    out, err = finish(rerun, tmp_path / "rerun", timeout=900)
    assert rerun.returncode == 0, err[-3000:]
    summary = last_json(out)
    train = summary["stages"]["train_adapter"]
    assert train["status"] == "resumed"
    assert train["resumed_from_step"] >= saved  # the newest complete checkpoint at restart
    manifest = json.loads((Path(train["dir"]) / "manifest.json").read_text())
    assert manifest["metrics"]["optimizer_steps"] == steps
    assert (Path(summary["export_dir"]) / "adapter_model.safetensors").is_file()
    logged = [json.loads(line)["step"] for line in (Path(train["dir"]) / "loss.jsonl").read_text().splitlines()]
    assert logged == list(range(1, steps + 1))  # no step lost or logged twice across the kill


def _processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line contains text (from /proc)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            line = cmdline.read_bytes().decode(errors="replace")
            if text in line and "tasks.train_adapter.launch" in line:
                found.append(int(cmdline.parent.name))
        except OSError:  # ended meanwhile
            pass
    return found


@pytest.mark.slow
def test_two_concurrent_runs_train_once(small_data: Path, tmp_path: Path) -> None:
    args = ["run", "--json", *sum((["--set", o] for o in small_overrides(small_data, tmp_path / "runs")), [])]
    # separate Prefect homes: only the stage folder lock can keep them from training twice
    procs = [cli(args, cli_env(tmp_path / f"prefect{i}"), tmp_path / f"run{i}") for i in range(2)]
    summaries = []
    for i, proc in enumerate(procs):
        out, err = finish(proc, tmp_path / f"run{i}", timeout=900)
        assert proc.returncode == 0, err[-3000:]
        summaries.append(last_json(out))
    train_status = sorted(s["stages"]["train_adapter"]["status"] for s in summaries)
    assert train_status == ["cached", "computed"]
    assert len(list((tmp_path / "runs" / "train_adapter").glob("*/manifest.json"))) == 1


@pytest.mark.slow  # trains through three attempts
def test_simulated_oom_backs_off_micro_batch(small_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                             ) -> None:
    import torch
    from transformers import Trainer

    from tasks.config import DataArgs, LoraArgs, ModelArgs, SpeedArgs, TrainArgs
    from tasks.prepare_data.stage import prepare_data
    from tasks.prepare_model.stage import prepare_model
    from tasks.train_adapter.stage import train_adapter

    real_step = Trainer.training_step
    seen: list[int] = []

    def step_that_ooms_above_2(self, model, inputs, *args, **kwargs):  # a GPU with room for 2 examples
        packed = "cu_seq_lens_q" in inputs  # speed.packing: one row of whole examples
        seen.append(inputs["cu_seq_lens_q"].numel() - 1 if packed else inputs["input_ids"].shape[0])
        if seen[-1] > 2:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real_step(self, model, inputs, *args, **kwargs)

    monkeypatch.setattr(Trainer, "training_step", step_that_ooms_above_2)
    runs = tmp_path / "runs"
    data_dir = prepare_data.fn(DataArgs(source=str(small_data)), ModelArgs(), runs)
    model_dir = prepare_model.fn(ModelArgs(), runs)
    train = TrainArgs(max_steps=3, per_device_train_batch_size=8, gradient_accumulation_steps=1)
    out = Path(train_adapter.fn(LoraArgs(), train, SpeedArgs(), runs, data_dir, model_dir))
    metrics = json.loads((out / "manifest.json").read_text())["metrics"]
    assert (metrics["per_device_train_batch_size"], metrics["gradient_accumulation_steps"]) == (2, 4)
    assert metrics["optimizer_steps"] == 3
    assert seen[:2] == [8, 4] and set(seen[2:]) == {2}


# ---- SIGTERM ------------------------------------------------------------------------------------------------------


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
    assert "Crashed" in err and "its run-failure artifact says what to do next" in err, err[-3000:]
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


@pytest.mark.slow
@pytest.mark.kill
def test_sigterm_to_the_run_alone_reaches_its_training_child_on_the_gpu_pool(
        prefect_env: Path, small_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run whose GPU came from the pool trains in a child process (tasks/train_adapter/launch.py). SIGTERM to the
    run's process alone (as systemd and Kubernetes send it): the child stops within seconds instead of training to
    its end while the run waits, the latest complete checkpoint stays, and the same command resumes from it."""
    from prefect.settings import PREFECT_API_URL

    from deployments.setup import ensure_gpu_limit

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # a 1-GPU worker, simulated as tests/test_gpu_pool.py does
    ensure_gpu_limit(1)
    steps = 40
    runs = tmp_path / "runs"
    args = ["run", "--json", *sum((["--set", o] for o in small_overrides(
        small_data, runs, **{"train.max_steps": steps, "train.save_steps": 2})), [])]
    env = {**cli_env(tmp_path / "prefect"), "PREFECT_API_URL": PREFECT_API_URL.value(), "CUDA_VISIBLE_DEVICES": "0"}
    try:
        proc = cli(args, env, tmp_path / "first")
        try:
            wait_for_checkpoint(proc, runs, tmp_path / "first")
            os.kill(proc.pid, signal.SIGTERM)  # the process alone, not its group
            signalled = time.monotonic()
            proc.wait(timeout=120)
            took = time.monotonic() - signalled
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        err = (tmp_path / "first.err").read_text()
        assert proc.returncode == 143 and "one process on GPU(s) 0" in err, err[-3000:]
        assert took < 45, f"the run took {took:.0f} s to end after SIGTERM"
        deadline = time.monotonic() + 15
        while session_processes(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not session_processes(proc.pid), "the training child outlived the run"
        (folder,) = [f for f in runs.glob("train_adapter/*") if f.is_dir()]
        kept = sorted(int(c.name.split("-")[1]) for c in folder.glob("checkpoints/checkpoint-*")
                      if (c / "complete").is_file())
        assert kept and max(kept) < steps and not (folder / MANIFEST).exists(), kept

        rerun = cli(args, env, tmp_path / "rerun")
        out, err = finish(rerun, tmp_path / "rerun", timeout=900)
        assert rerun.returncode == 0, err[-3000:]
        train = last_json(out)["stages"]["train_adapter"]
        assert train["status"] == "resumed" and train["resumed_from_step"] == max(kept)
        assert json.loads((Path(train["dir"]) / MANIFEST).read_text())["metrics"]["optimizer_steps"] == steps
    finally:
        ensure_gpu_limit(0)
