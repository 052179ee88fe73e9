"""The QLoRA pipeline flow: orchestration only, one line per stage; all logic lives in tasks/."""

from __future__ import annotations

from typing import Any

from prefect import flow

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
from tasks.registry.init_adapter import check_init_adapter
from tasks.registry.store import check_registry
from tasks.reporting import tracking
from tasks.reporting.artifacts import failure_summary, verdict
from tasks.reporting.run_record import record_run
from tasks.tested_versions import warn_untested_versions
from tasks.train_adapter.stage import train_adapter


# hooks: user errors logged without a traceback, the objects alive at the start out of the garbage collector's scans
# (memory.freeze_startup_objects); on a failure or a crash, a summary artifact and no task run left
# Running (the worker runs on_crashed hooks when the flow-run process was killed)
@flow(name="qlora-pipeline", on_running=[quiet_user_errors, freeze_startup_objects, watch_for_cancel],
      on_completion=[stop_watching], on_failure=[stop_watching, failure_summary],
      on_crashed=[stop_watching, failure_summary], on_cancellation=[stop_watching])
def qlora_pipeline(config: RunConfig = RunConfig()) -> dict[str, Any]:  # noqa: B008 - a pydantic default
    """Fine-tune a causal language model with QLoRA in five cached stages.

    Each stage's output is a folder under runs_dir keyed by its inputs' content, so unchanged stages
    are reused (shown as Cached) and a failed run resumes from the last completed stage.

    Args:
        config: The whole run: runs_dir, one section per stage (data, model, lora, train, eval,
            export) and speed (how training runs: levers, GPUs). Every field has a default; the defaults
            run the embedded tiny model and sample data on a CPU in a few minutes.
    """
    warn_untested_versions(config.track)  # a worker whose libraries are not the tested ones says so
    runs = config.runs_dir
    check_access(config.data)  # a source outside what the worker's operator allows is refused before any stage
    check_registry(config.export.name, runs)  # damaged registry records are repaired, or refused, before any stage
    check_init_adapter(config.train.init_adapter, runs)  # a damaged starting adapter fails before any stage runs
    rewards.check(config.train, runs)  # so does a reward the deployment does not allow, or one that does not load
    tracking.check(config)  # so does a tracking server that does not answer, or a URI with a secret in it
    check_evaluation(config.eval, config.train)  # so do suites that cannot run and a judge that does not answer
    prefetch_fingerprint(config.model, runs)  # prepare_model's key hashed while prepare_data runs
    data_dir = prepare_data(config.data, config.model, runs)  # first: bad data fails before any GPU work
    model_dir = prepare_model(config.model, runs)
    adapter_dir = train_adapter(config.lora, config.train, config.speed, runs, data_dir, model_dir, config.track)
    eval_dir = evaluate_adapter(config.eval, runs, data_dir, model_dir, adapter_dir)
    judged = score_champion(config.eval, runs, data_dir, model_dir, adapter_dir, eval_dir, config.export)
    export_dir = export_adapter(config.export, runs, data_dir, model_dir, adapter_dir, eval_dir, judged)
    serving = serve_champion(config.serve, config.export.name, runs)  # serve.url's vLLM: the champion, checked
    summary = record_run(config, [data_dir, model_dir, adapter_dir, eval_dir, export_dir], serving)
    return verdict(summary, summary["metrics"])  # the final state: the verdict (and serving, if it failed), its tags
