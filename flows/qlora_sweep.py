"""The QLoRA sweep flow: orchestration only; the sweep machinery lives in tasks/sweep.py, the stages in tasks/."""

from __future__ import annotations

from functools import partial
from typing import Any

from prefect import flow, unmapped
from prefect.task_runners import ThreadPoolTaskRunner

from tasks import sweep
from tasks.artifacts import failure_summary
from tasks.config import RunConfig
from tasks.evaluate_adapter.stage import evaluate_adapter
from tasks.export_adapter.stage import export_adapter
from tasks.log import quiet_user_errors
from tasks.prepare_data.stage import prepare_data
from tasks.prepare_model.stage import prepare_model
from tasks.run_record import record_run
from tasks.train_adapter.stage import train_adapter


# One stage task at a time in this process: training and evaluation run in the flow-run process, and two at once
# share its global state (torch's RNG; the default dtype, which transformers sets process-wide while it loads one).
# Measured: a candidate trained beside three others got another adapter than the same cache key trained alone
# (tuned eval loss 5.976 against 5.951). Candidates on several GPUs at once need training in child processes.
@flow(name="qlora-sweep", task_runner=ThreadPoolTaskRunner(max_workers=1), on_running=[quiet_user_errors],
      on_failure=[failure_summary], on_crashed=[failure_summary])
def qlora_sweep(config: RunConfig = RunConfig(),  # noqa: B008 - a pydantic default
                grid: dict[str, list[Any]] | None = None, candidates: list[dict[str, Any]] | None = None
                ) -> dict[str, Any]:
    """Train and evaluate every candidate of a grid, rank them on the same eval data, publish only the winner.

    Data and model are prepared once; each candidate's train_adapter and evaluate_adapter are mapped task runs
    (one at a time, through the GPU slot), cached by content like any run's, so a re-run reuses every finished
    candidate. The ranking is the promotion gate's rule; the winner goes through export_adapter and the
    registry's gate as any run does. Artifacts: sweep-comparison (table and plot), sweep-winner (its config).

    A failed candidate fails alone: its task run is Failed, the others go on, and the best of those that finished
    is ranked and published. The sweep itself then ends Failed, after publishing, with the failed candidates in
    its message: a Failed run is what alerts (the failure automation) and what the UI's Retry re-runs, and a
    Retry then recomputes only the failed candidates (the finished ones are Cached). A sweep in which no
    candidate finished fails without publishing.

    Args:
        config: The base run (RunConfig); every candidate starts from it.
        grid: SECTION.FIELD keys of the lora, train or speed section to lists of values, e.g.
            {"lora.r": [4, 8], "train.learning_rate": [0.001, 0.003]}: every combination is a candidate.
        candidates: Instead of a grid, a list of overrides, each a mapping such as {"lora.r": 8}.
    """
    plan = sweep.expand(config, grid, candidates)  # every bad key or value, before any stage runs
    runs = config.runs_dir
    data_dir = prepare_data(config.data, config.model, runs)
    model_dir = prepare_model(config.model, runs)
    # unmapped: a pydantic section is iterable, and would be mapped over its fields
    trained = train_adapter.map(plan.sections("lora"), plan.sections("train"), plan.sections("speed"),
                                unmapped(runs), unmapped(data_dir), unmapped(model_dir))
    evaluated = sweep.then(trained, partial(evaluate_adapter.submit, config.eval, runs, data_dir, model_dir))
    ranking = sweep.rank(plan, trained, evaluated, data_dir)
    best = ranking.winner
    export_dir = export_adapter(config.export, runs, data_dir, model_dir, best.adapter_dir, best.eval_dir)
    run = record_run(best.candidate.config, [data_dir, model_dir, best.adapter_dir, best.eval_dir, export_dir])
    return sweep.report(ranking, run)
