"""The QLoRA sweep flow: orchestration only. How its candidates run (the task runner, their futures, waiting) is
flows/sweep_runner.py; the candidates and their ranking are tasks/sweep/, its report tasks/reporting/sweep.py, the
stages tasks/."""

from __future__ import annotations

from functools import partial
from typing import Any

from prefect import flow

from flows import sweep_runner
from flows.cancellation import stop_watching, watch_for_cancel
from tasks import rewards
from tasks.config import RunConfig
from tasks.evaluate_adapter.champion import score_champion
from tasks.evaluate_adapter.checks import check_evaluation
from tasks.evaluate_adapter.stage import evaluate_adapter
from tasks.export_adapter.serving import serve_champion
from tasks.export_adapter.stage import export_adapter
from tasks.log import quiet_user_errors
from tasks.models.memory import freeze_startup_objects
from tasks.prepare_data.sources import check_access
from tasks.prepare_data.stage import prepare_data
from tasks.prepare_model.stage import prefetch_fingerprint, prepare_model
from tasks.registry.store import check_registry
from tasks.reporting import tracking
from tasks.reporting.artifacts import failure_summary
from tasks.reporting.run_record import record_run
from tasks.reporting.sweep import rank, report
from tasks.sweep.grid import CandidateList, expand
from tasks.tested_versions import warn_untested_versions


# The flow's own runner takes one stage task at a time: they run in the flow-run process, and two at once share its
# global state (sweep_runner.training_runner says which); on SIGTERM it does not wait for them
# (sweep_runner.SignalLeavesThreads). Candidates' trainings go to sweep_runner.training_runner: at once, one per GPU of
# the pool, where each trains in a child process of its own; one at a time without a pool of devices.
@flow(name="qlora-sweep", task_runner=sweep_runner.SignalLeavesThreads(max_workers=1),
      on_running=[quiet_user_errors, freeze_startup_objects, watch_for_cancel], on_completion=[stop_watching],
      on_failure=[stop_watching, failure_summary], on_crashed=[stop_watching, failure_summary],
      on_cancellation=[stop_watching])
def qlora_sweep(config: RunConfig = RunConfig(),  # noqa: B008 - a pydantic default
                grid: dict[str, list[Any]] | None = None, candidates: CandidateList = ()) -> dict[str, Any]:
    """Train and evaluate every candidate of a grid, rank them on the same eval data, publish only the winner.

    Data and model are prepared once; each candidate's train_adapter and evaluate_adapter are task runs named for it
    ("train_adapter-c2 (lora.r=8)"), cached by content like any run's, so a re-run reuses every finished candidate.
    Candidates train at once, one per free GPU, where the GPU pool has several GPUs, and one at a time without one;
    where the work pool has several GPU hosts, each candidate's training is a flow run that the first host with a
    free GPU takes (sweep_runner.train_on_fleet). Evaluations go one at a time. With track.backend set, the sweep
    has a tracked run of its own (MLflow: a parent run, with every candidate's training as a child run) that gets
    the ranking, the winner and the comparison plot. The ranking is the promotion gate's rule; the winner goes
    through export_adapter and the registry's gate as any run does, and its verdict is the sweep run's final state
    message. Artifacts: sweep-comparison (table and plot), sweep-winner (its config), and each candidate's own,
    named for it.

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
    warn_untested_versions(config.track)  # a worker whose libraries are not the tested ones says so
    plan = expand(config, grid, candidates)  # every bad key or value, before any stage runs
    runs = config.runs_dir
    check_access(config.data)  # a source outside what the worker's operator allows is refused before any stage
    tracking.check(config)  # a tracking server that does not answer fails before any stage runs
    check_evaluation(config.eval, config.train)  # so do suites that cannot run and a judge that does not answer
    check_registry(config.export.name, runs)  # damaged registry records are repaired, or refused, before any stage
    for candidate in plan.candidates:  # so is a reward function the deployment does not allow (grpo)
        rewards.check(candidate.config.train, candidate.config.runs_dir)
    track = tracking.open_sweep(config.track, runs, plan.key)  # the candidates' runs are children of the sweep's
    prefetch_fingerprint(config.model, runs)  # prepare_model's key hashed while prepare_data runs
    data_dir = prepare_data(config.data, config.model, runs)
    model_dir = prepare_model(config.model, runs)
    hosts = sweep_runner.fleet_hosts()  # several GPU hosts: each candidate trains on the first with a free GPU
    training = sweep_runner.training_task(hosts)
    with sweep_runner.training_runner(hosts) as runner:  # each candidate's task runs named for it (sweep_runner.named)
        trained = [runner.submit(sweep_runner.named(training, c), {**c.sections(), "runs_dir": runs,
                                                                        "data_dir": data_dir, "model_dir": model_dir,
                                                                        "track": track})
                   for c in plan.candidates]
        evaluated = sweep_runner.then(trained, [partial(sweep_runner.named(evaluate_adapter, c).submit, config.eval,
                                                        runs, data_dir, model_dir) for c in plan.candidates])
        ranking = rank(plan, sweep_runner.outcomes(plan, trained, evaluated), data_dir, track)
    best = ranking.winner
    judged = score_champion(config.eval, runs, data_dir, model_dir, best.adapter_dir, best.eval_dir, config.export)
    export_dir = export_adapter(config.export, runs, data_dir, model_dir, best.adapter_dir, best.eval_dir, judged)
    winner = best.candidate.config.model_copy(update={"track": track})  # its tracked run: a child of the sweep's
    serving = serve_champion(config.serve, config.export.name, runs)  # serve.url's vLLM: the champion, checked
    run = record_run(winner, [data_dir, model_dir, best.adapter_dir, best.eval_dir, export_dir], serving)
    return report(ranking, run)
