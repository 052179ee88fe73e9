"""How a sweep's candidates run (flows/qlora_sweep.py): the task runner their trainings go to, each candidate's task
runs named for it, evaluation chained to training as each finishes, and waiting for what became of each.

tasks/sweep/ makes the candidates and ranks them (pure functions); tasks/reporting/sweep.py writes the comparison.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any
from uuid import UUID

from prefect import task
from prefect.task_runners import ThreadPoolTaskRunner

from tasks.config import LoraArgs, SpeedArgs, TrackArgs, TrainArgs
from tasks.errors import UserError
from tasks.log import candidate_run_name, logger
from tasks.on_disk.manifest import read_manifest
from tasks.pool.gpus import pool_gpus
from tasks.pool.hosts import hosts_of, placement
from tasks.pool.leases import uses_server
from tasks.sweep.grid import Candidate, Plan, show
from tasks.sweep.ranking import Outcome
from tasks.train_adapter.stage import spec, train_adapter

FLEET_DEPLOYMENT = "qlora-train/candidate"  # flows/train_candidate.py, deployed by deployments/prefect.yaml
_FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


def fleet_hosts() -> list[str]:
    """The GPU hosts a sweep's candidates train on, each candidate a flow run that the first host with a free GPU
    takes: the hosts of the candidate-training deployment's work pool (tasks/pool/hosts.py), where there are two or
    more. [] on a single host, without a server or without that deployment: the candidates train here."""
    from prefect import get_client
    from prefect.exceptions import ObjectNotFound

    if not uses_server():
        return []
    with get_client(sync_client=True) as client:
        try:
            deployment = client.read_deployment_by_name(FLEET_DEPLOYMENT)
        except ObjectNotFound:
            return []
        hosts = hosts_of(client, deployment.work_pool_name)
    return hosts if len(hosts) > 1 else []


def training_task(hosts: list[str]) -> Any:
    """The task each candidate's training is: train_adapter here, or train_on_fleet where there are hosts."""
    return train_on_fleet if hosts else train_adapter


@task(name="train_adapter")  # the stage's name: a candidate's training, wherever it runs
def train_on_fleet(lora: LoraArgs, train: TrainArgs, speed: SpeedArgs, runs_dir: Path, data_dir: str,
                   model_dir: str, track: TrackArgs | None = None) -> str:
    """One candidate's train_adapter as a flow run of FLEET_DEPLOYMENT, queued for whichever host has a free GPU
    first (Prefect's work queues and each host's worker --limit: tasks/pool/hosts.py); waits for it and returns the
    stage folder, on the runs_dir every host shares. Its key is the same as here, so a finished training is reused
    wherever it ran."""
    from prefect import get_client
    from prefect.runtime import flow_run, task_run

    parameters = {"lora": lora.model_dump(mode="json"), "train": train.model_dump(mode="json"),
                  "speed": speed.model_dump(mode="json"), "runs_dir": str(runs_dir), "data_dir": data_dir,
                  "model_dir": model_dir, "track": track.model_dump(mode="json") if track else None}
    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name(FLEET_DEPLOYMENT)
        run = client.create_flow_run_from_deployment(
            deployment.id, parameters=parameters, name=f"{flow_run.name}-{task_run.name}"[:120],
            **_tagged(placement(client, deployment.work_pool_name, None), f"sweep:{flow_run.id}"))
    logger().info("%s: trains in flow run %s of %s, on the first GPU host with a free GPU", task_run.name, run.name,
                  FLEET_DEPLOYMENT)
    state = _ended(run.id)
    if state.type.value != "COMPLETED":
        raise RuntimeError(f"the training's flow run {run.name} ({run.id}) ended {state.name}: {state.message}")
    folder = spec(lora, train, speed, runs_dir, data_dir, model_dir).dir
    if read_manifest(folder) is None:
        raise RuntimeError(f"the training's flow run {run.name} completed, but {folder} holds no manifest: is "
                           "runs_dir on storage every host shares (docs/operations.md)?")
    return str(folder)


def _tagged(placed: dict[str, Any], tag: str) -> dict[str, Any]:
    return {**placed, "tags": [*placed.get("tags", []), tag]}


def _ended(run_id: UUID) -> Any:
    """The final state of flow run `run_id`, polled."""
    from prefect import get_client

    with get_client(sync_client=True) as client:
        while (state := client.read_flow_run(run_id).state) is None or state.type.value not in _FINAL:
            time.sleep(2)
    return state


@contextmanager
def training_runner(hosts: list[str] | None = None) -> Iterator[Any]:
    """The task runner the candidates' train_adapter runs go to: as many at once as the GPU pool has GPUs, or the
    flow's own runner (one stage task at a time) where there is no pool of devices. Where there are several GPU
    `hosts` (fleet_hosts), a runner whose threads each wait for a candidate's flow run on the fleet.

    Why not more in one process: two trainings in the flow-run process share its global state. torch's default
    RNG is one per process: each training seeds it (set_seed in train_adapter/builder.py) and then draws its LoRA A
    matrices' initial values from it, and later, with lora_dropout > 0, its dropout masks. A second training's
    seeding and draws interleave with the first's, so the same cache key got another adapter (tuned eval loss
    5.976 against 5.951). transformers also sets torch's default dtype process-wide while it loads a model,
    which a training or evaluation in another thread sees.
    Where the pool has devices, gpu_slot gives each training its own GPUs and train_adapter trains in a child
    process that sees only those (its own RNG, dtype and threads): candidates then train at once, each as it would
    alone, and the pool's slots bound how many (a candidate that finds none free shows "Waiting for GPU").
    Evaluations stay on the flow's own runner, one at a time, in this process. On a CPU-only worker, training runs
    in this process, so the candidates go one at a time; at once they would only split the same cores (each
    training's threads are already sized to its share of them, tasks/pool/cpus.py cpu_share).
    """
    from prefect.context import FlowRunContext

    if hosts:  # each thread only waits for a flow run on some host; the hosts' workers bound how many train
        logger().info("sweep: candidates train on the GPU hosts %s, each where a GPU is free first", ", ".join(hosts))
        with SignalLeavesThreads(max_workers=64) as runner:
            yield runner
        return
    gpus = pool_gpus()
    if gpus:
        logger().info("sweep: up to %d candidate(s) train at once, one per free GPU of the pool", gpus)
    with SignalLeavesThreads(max_workers=gpus) if gpus else nullcontext(FlowRunContext.get().task_runner) as runner:
        yield runner


class SignalLeavesThreads(ThreadPoolTaskRunner):
    """Prefect's ThreadPoolTaskRunner, except that a flow leaving on a signal (SIGTERM, Ctrl-C) does not wait for
    the tasks still running in its threads: Prefect's runner joins them on exit, before its flow engine records the
    crash, so a SIGTERM during a candidate's training waited for that training to end (minutes). Their task runs
    are ended by the flow's crash hook (tasks/reporting/artifacts.py failure_summary) and the threads by the
    process's exit; a training resumes from its latest complete checkpoint on the next run."""

    def duplicate(self) -> SignalLeavesThreads:  # the copy the flow engine enters
        return SignalLeavesThreads(max_workers=self._max_workers)

    def __exit__(self, exc_type: Any, exc_value: Any, traceback: Any) -> None:
        if exc_type is not None and not issubclass(exc_type, Exception) and self._executor is not None:
            for event in self._cancel_events.values():
                event.set()
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
        super().__exit__(exc_type, exc_value, traceback)


def named(task: Any, candidate: Candidate) -> Any:
    """`task` (a stage) for this candidate: its task runs named for the candidate in the UI, "train_adapter-c2
    (lora.r=8)", and its artifacts keyed by it (log.for_candidate)."""
    name = candidate_run_name(task.name, candidate.name, show(candidate.label))
    return task.with_options(task_run_name=lambda: name)  # a callable: a string would be formatted with the inputs


def then(futures: list[Any], submits: list[Callable[[Any], Any]]) -> list[Any]:
    """Submit the next stage for each future as soon as it completes, with `submits` in the futures' order (its
    result passed as the future, so the UI shows the dependency); None in place of a future that did not
    complete: that candidate failed alone."""
    from prefect.futures import as_completed

    futures = list(futures)
    nexts: list[Any] = [None] * len(futures)
    position = {id(f): i for i, f in enumerate(futures)}
    for future in as_completed(futures):
        future.wait()  # sets the future's own final state; .state would otherwise ask the server, which may lag
        if future.state.is_completed():
            nexts[position[id(future)]] = submits[position[id(future)]](future)
    return nexts


def outcomes(plan: Plan, trained: list[Any], evaluated: list[Any]) -> list[Outcome]:
    """Wait for every candidate (its training's and evaluation's futures, `then`'s None where training failed):
    what became of each, in candidate order."""
    return [_outcome(c, t, e) for c, t, e in zip(plan.candidates, trained, evaluated, strict=True)]


def _outcome(candidate: Candidate, trained: Any, evaluated: Any) -> Outcome:
    trained.wait()
    if not trained.state.is_completed():
        return _failed(candidate, "train_adapter", trained.state)
    evaluated.wait()
    if not evaluated.state.is_completed():
        return _failed(candidate, "evaluate_adapter", evaluated.state, adapter_dir=trained.result())
    eval_dir = evaluated.result()
    metrics = read_manifest(Path(eval_dir)).metrics.model_dump()
    return Outcome(candidate, "finished", adapter_dir=trained.result(), eval_dir=eval_dir, metrics=metrics)


def _failed(candidate: Candidate, stage: str, state: Any, **dirs: Any) -> Outcome:
    exc = state.result(raise_on_failure=False)
    text = str(exc) if isinstance(exc, BaseException) else (state.message or state.name)
    return Outcome(candidate, "failed", error=f"{stage}: {text}", user_error=isinstance(exc, UserError), **dirs)
