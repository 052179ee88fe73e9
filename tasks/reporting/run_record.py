"""The run folder: which stage folders a run used, whether each was computed, resumed or reused."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from tasks import methods
from tasks.config import RunConfig
from tasks.log import current_run_attempt
from tasks.on_disk import disk
from tasks.on_disk.manifest import Manifest, read_manifest
from tasks.registry import store as registry
from tasks.reporting import artifacts, tracking
from tasks.reporting.artifacts import loss_curve


def stage_status(manifest: Manifest) -> str:
    """computed or resumed when this flow-run attempt wrote the manifest, else cached."""
    attempt = current_run_attempt()
    if attempt is None or manifest.run_attempt != attempt:
        return "cached"
    return "resumed" if manifest.resumed_from_step is not None else "computed"


def record_run(config: RunConfig, stage_dirs: list[str], serving: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write runs_dir/runs/<time>-<attempt>/run.json and return the run summary (with `serving`, what
    tasks/export_adapter/serving.py did to serve.url's server, when one is set)."""
    manifests = [read_manifest(Path(d)) for d in stage_dirs]
    stages = {m.stage: {"status": stage_status(m), "dir": d, "key": m.key,
                        **({"resumed_from_step": m.resumed_from_step} if m.resumed_from_step is not None else {})}
              for m, d in zip(manifests, stage_dirs, strict=True)}
    attempt = (current_run_attempt() or f"local-{os.getpid()}").replace(":", "-")
    run_dir = Path(config.runs_dir).resolve() / "runs" / f"{time.strftime('%Y%m%d-%H%M%S')}-{attempt[:8]}"
    by_stage = {m.stage: m.metrics.model_dump() for m in manifests}
    # eval metrics plus the export's registry verdict (export_version, promotion, promotion_reason) and the champion
    # it was judged against (champion_*); only the fields the export set, so an older export's cannot blank them
    verdict = [m.metrics.model_dump(exclude_unset=True) for m in manifests if m.stage == "export_adapter"]
    metrics = {**by_stage["evaluate_adapter"], **(verdict[0] if verdict else {})}
    if "export_adapter" in by_stage:  # the champion as champion.json says now, not when the export was computed
        # by this run only when its export stage computed and published a version (the champion's own adapter
        # again, with nothing to add, publishes nothing)
        now = stages["export_adapter"]["status"] != "cached" and metrics.get("published_now") is not False
        metrics.update(registry_now(config, Path(stage_dirs[-1])),
                       export_published="by this run" if now else "by an earlier run")
    summary = {"run_dir": str(run_dir), "method": config.train.method, "stages": stages, "metrics": metrics,
               "export_dir": stage_dirs[-1],
               **({"serving": serving} if serving is not None else {})}
    train_dir = Path(stages["train_adapter"]["dir"])
    files = {"loss.png": loss_curve(train_dir / "loss.jsonl", run_dir / "loss.png", write=False)}
    artifacts.run_completed(stages["train_adapter"]["status"], by_stage["train_adapter"].get("optimizer_steps"))
    if "promotion" in metrics:  # every run, cached or not: the nightly report is right when nothing changed
        root = registry.registry_dir(config.runs_dir, config.export.name)
        champion = registry.champion(root)
        artifacts.table("eval-metrics", eval_table(metrics, champion, methods.method(config.train.method)),
                        f"{metrics['export_name']} "
                        f"{metrics['export_version']} {metrics['promotion']}: {metrics['promotion_reason']} "
                        f"Champion now: {metrics['champion_version'] or 'none'}.")
        files["registry-history.png"] = artifacts.registry_history(
            config.export.name, registry.history(root), run_dir / "registry-history.png", write=False)
    if config.track.backend:  # one MLflow/TensorBoard run per result: this run's, or the earlier one it reused
        summary["tracking"] = tracking.finish(config, stage_dirs, {k: v["status"] for k, v in stages.items()}, metrics)
        artifacts.tracking_report(summary["tracking"])
    files["run.json"] = json.dumps({**summary, "config": config.model_dump(mode="json")}, indent=2).encode()
    write_run_folder(run_dir, Path(config.runs_dir), {name: data for name, data in files.items() if data is not None})
    if config.track.backend:  # what a backend did not take waits for a later run, named by this run folder
        tracking.remember_unsent(Path(config.runs_dir), summary, tracking.flow_run_tags())
    return summary


def write_run_folder(run_dir: Path, runs_dir: Path, files: dict[str, bytes]) -> None:
    """Write the run folder's files (run.json last, each whole); on a full disk remove the folder, so that no run
    folder without its run.json, or with half of one, is left: the one-paragraph error says how much it needs."""
    left = f"the run folder {run_dir} was removed: a run folder holds a whole run.json or does not exist"
    new = not run_dir.exists()  # never remove another run's folder (same second, same attempt)
    with disk.writing("the run record (run.json)", runs_dir, run_dir.parent, left, "run.json and its plots",
                      disk.blocks(*map(len, files.values())),
                      undo=lambda: new and shutil.rmtree(run_dir, ignore_errors=True)):
        run_dir.mkdir(parents=True, exist_ok=True)
        for name, data in files.items():  # run.json is the dict's last entry
            disk.write_whole(run_dir / name, data)


def registry_now(config: RunConfig, export_dir: Path) -> dict[str, Any]:
    """Repair the registry from the export folder if needed (repair logs what it did); its champion as it is now,
    and this run's version under this runs_dir (the manifest holds it relative: a copied runs_dir names its copy)."""
    root = registry.registry_dir(config.runs_dir, config.export.name)
    registry.repair(root, export_dir)
    now = registry.current(root)
    version = read_manifest(export_dir).metrics.export_version
    return {"champion_version": now["champion_version"], "champion_tuned_eval_loss": now["champion_tuned_eval_loss"],
            "export_path": str(root / version)}


_METRIC_ROWS = [("eval loss", "eval_loss"), ("perplexity", "perplexity"), ("exact match", "exact_match"),
                ("ROUGE-L", "rouge_l")]


def eval_table(metrics: dict[str, Any], champion: dict[str, Any] | None, method: methods.Method
               ) -> list[dict[str, Any]]:
    """Rows for the eval-metrics table artifact: base, the champion scored in this run, tuned (this run's adapter),
    all on this run's eval data; then the champion now, on its own night's data, when it is another version. A
    column per regression suite where the run has them (eval.suites)."""
    judged = metrics.get("judged_against")
    rows = [("base", "base", metrics, "this run's")]
    if judged:
        rows.append((f"champion {judged} (scored beside it)", "champion", metrics, "this run's"))
    rows.append((f"tuned ({metrics['export_version']}, {metrics['promotion']})", "tuned", metrics, "this run's"))
    if champion is not None and champion["version"] != judged:
        rows.append((f"champion now ({champion['version']})", "tuned", champion["metrics"], "its own night's"))
    # the method's own numbers (tasks/methods.py), one number each (a reward per function is the samples' to show)
    names = _METRIC_ROWS + [(label, key) for label, key in method.shown
                            if not isinstance(metrics.get(f"tuned_{key}"), dict)]
    suites = {f"suite {name} ({suite['metric']})": name for name, suite in (metrics.get("suites") or {}).items()}
    return [{"model": label, "eval data": data, **{name: _fmt(m.get(f"{prefix}_{key}")) for name, key in names},
             **{column: _fmt((m.get(f"{prefix}_suites") or {}).get(name)) for column, name in suites.items()}}
            for label, prefix, m, data in rows]


def _fmt(value: Any) -> str:
    return "n/a" if value is None else f"{value:.4f}"
