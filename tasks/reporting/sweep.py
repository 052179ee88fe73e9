"""A sweep's report: the ranking written as the comparison (artifact and plot), the sweep's record and the winner's
config, logged to the sweep's tracked run; the verdict as the sweep run's final state.

    runs_dir/sweeps/<key>/        the sweep's record (key = hash of the base config and the candidates)
        sweep.json                every candidate: overrides, status, stage folders, metrics, rank; the winner
        comparison.png            tuned eval loss per candidate and the training loss curves overlaid
        winner.yaml               the winner's RunConfig (`qlora-pipeline run --config winner.yaml` retrains it)
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import yaml

from tasks import methods
from tasks.config import TrackArgs
from tasks.errors import UserError
from tasks.log import current_run_attempt, logger
from tasks.on_disk import disk
from tasks.on_disk.manifest import read_manifest
from tasks.reporting import artifacts, tracking
from tasks.reporting.artifacts import figure, inline_png, png_bytes
from tasks.sweep.grid import Plan, show
from tasks.sweep.ranking import Outcome, Ranking, order


def rank(plan: Plan, outcomes: list[Outcome], data_dir: str, track: TrackArgs) -> Ranking:
    """Rank the candidates' outcomes, write the comparison (artifact and files) and log it to the sweep's tracked
    run (`track`: the candidates' track section, tracking.open_sweep's); fail if none finished."""
    eval_data = read_manifest(Path(data_dir)).key
    ranking = Ranking(plan, order(outcomes, eval_data, plan.measure), eval_data)
    comparison(ranking)
    _write(plan.dir / "sweep.json", json.dumps(record(ranking), indent=2))
    if track.backend:
        tracking.finish_sweep(track, tracking.SweepRun(plan.key, plan.dir, record(ranking)))
    if ranking.winner is None:
        raise _failure(ranking, [o for o in ranking.outcomes if o.status != "finished"],
                       "no candidate finished, so nothing was published")
    logger().info("sweep %s: winner %s (%s) of %d candidate(s)", plan.key, ranking.winner.candidate.name,
                  ranking.winner.candidate.label, len(outcomes))
    return ranking


def report(ranking: Ranking, run_summary: dict[str, Any]) -> Any:
    """Write winner.yaml and sweep.json (with the published version and what serving did), the winner artifact; the
    sweep summary, as the flow run's final state whose message is the verdict (artifacts.verdict).

    Raises after everything is written and published when a candidate failed (the flow's docstring says why).
    """
    winner = ranking.winner
    text = yaml.safe_dump(winner.candidate.config.model_dump(mode="json", exclude={"runs_dir"}), sort_keys=False)
    _write(ranking.plan.dir / "winner.yaml", text)
    summary = {**record(ranking), "export": {k: run_summary["metrics"].get(k) for k in (
        "export_name", "export_version", "export_path", "promotion", "promotion_reason", "champion_version")},
        "export_dir": run_summary["export_dir"], "run_dir": run_summary["run_dir"],
        **({"serving": run_summary["serving"]} if run_summary.get("serving") else {})}
    _write(ranking.plan.dir / "sweep.json", json.dumps(summary, indent=2))
    export = summary["export"]
    _markdown("sweep-winner", f"## Sweep winner {winner.candidate.name}: {winner.candidate.label}\n\n"
              f"Published as `{export['export_name']}` {export['export_version']} ({export['promotion']}: "
              f"{_cell(export['promotion_reason'])}). Its config, also in `{ranking.plan.dir / 'winner.yaml'}`:"
              f"\n\n```yaml\n{text}```\n", f"sweep {ranking.plan.key}: the winner's config")
    if ranking.failed:
        raise _failure(ranking, ranking.failed, f"the winner {winner.candidate.name} was published as "
                       f"{export['export_name']} {export['export_version']} ({export['promotion']})")
    return artifacts.verdict(summary, run_summary["metrics"], f"winner {winner.candidate.name} "
                             f"({winner.candidate.label}) of {len(ranking.outcomes)}: ")


def _failure(ranking: Ranking, failed: list[Outcome], done: str) -> Exception:
    listed = "; ".join(f"{o.candidate.name} ({o.candidate.label}) {o.error}" for o in failed)
    message = (f"Sweep {ranking.plan.key}: {len(failed)} of {len(ranking.outcomes)} candidate(s) did not finish: "
               f"{listed}. {done[0].upper() + done[1:]}. Fix or drop those candidates and run the sweep again: "
               f"finished candidates are reused. Record: {ranking.plan.dir / 'sweep.json'}")
    return UserError(message) if all(o.user_error for o in failed) else RuntimeError(message)


def record(ranking: Ranking) -> dict[str, Any]:
    """The sweep as sweep.json holds it."""
    return {"key": ranking.plan.key, "sweep_dir": str(ranking.plan.dir), "flow_run": current_run_attempt(),
            "eval_data": ranking.eval_data, "winner": ranking.winner and ranking.winner.candidate.name,
            "candidates": [{"name": o.candidate.name, "overrides": o.candidate.overrides, "status": o.status,
                            "rank": o.rank, "error": o.error, "adapter_dir": o.adapter_dir, "eval_dir": o.eval_dir,
                            "metrics": o.metrics} for o in ranking.outcomes]}


_COLUMNS = [("tuned eval loss", "tuned_eval_loss"), ("base eval loss", "base_eval_loss"),
            ("tuned ROUGE-L", "tuned_rouge_l")]


def comparison(ranking: Ranking) -> str:
    """The comparison as markdown (one table row per candidate, best first, and the plot inline); also an
    artifact `sweep-comparison` in a flow run, and comparison.png in the sweep folder."""
    keys = list(dict.fromkeys(k for c in ranking.plan.candidates for k in c.overrides))
    measure = ranking.plan.measure
    ranked_on = [] if measure == methods.LOSS else [(f"tuned {measure.label}", f"tuned_{measure.key}")]
    columns = [(label, name) for label, name in [*_COLUMNS[:2], *ranked_on, *_COLUMNS[2:]]
               if any(o.metrics.get(name) is not None for o in ranking.outcomes)]
    head = ["rank", "candidate", *keys, "status", *(label for label, _ in columns)]
    rows = [[str(o.rank or "-"), o.candidate.name, *(_cell(show(o.candidate.overrides.get(k, "(base)")))
                                                     for k in keys),
             o.status if o.error is None else f"{o.status}: {_cell(o.error)}",
             *(_number(o.metrics.get(name)) for _, name in columns)] for o in ranking.outcomes]
    table = "\n".join("| " + " | ".join(r) + " |" for r in [head, ["---"] * len(head), *rows])
    image = _plot(ranking)
    _write(ranking.plan.dir / "comparison.png", image)
    winner = ranking.winner
    markdown = (f"## Sweep `{ranking.plan.key}`: {len(ranking.outcomes)} candidates, winner "
                f"{winner.candidate.name if winner else 'none'}\n\nRanked by the promotion gate's rule (margin 0) on "
                f"the same eval data (prepare_data `{ranking.eval_data[:12]}`): the "
                f"{'highest' if measure.higher_wins else 'lowest'} tuned {measure.label} wins.\n\n{table}\n\n"
                f"{inline_png(image, 'eval loss per candidate')}\n\n"
                f"Sweep folder on the worker: `{ranking.plan.dir}`\n")
    _markdown("sweep-comparison", markdown, f"sweep {ranking.plan.key}: {len(ranking.outcomes)} candidates ranked")
    return markdown


def _plot(ranking: Ranking) -> bytes:
    """Tuned eval loss per candidate (bars, base model dashed) beside the candidates' training loss curves."""
    fig, (bars, curves) = figure(columns=2, size=(10, 3.8))
    scored = [o for o in ranking.outcomes if o.metrics.get("tuned_eval_loss") is not None]
    losses = [o.metrics["tuned_eval_loss"] for o in scored]
    drawn = bars.bar([o.candidate.name for o in scored], losses,
                     color=["tab:green" if o is ranking.winner else "tab:blue" for o in scored])
    bars.bar_label(drawn, fmt="%.4f", fontsize="small")
    finite = [x for x in losses if math.isfinite(x)]
    if finite:  # candidates differ by a few per cent: bars from 0 would all look the same
        base = scored[0].metrics["base_eval_loss"]
        bars.axhline(base, color="gray", linestyle="--", label=f"base model {base:.4f}")
        spread = max(max(finite), base) - min(finite)
        bars.set_ylim(min(finite) - 0.5 * spread, max(max(finite), base) + 0.15 * spread)
        bars.legend(fontsize="small")
    bars.set_ylabel("tuned eval loss")
    bars.set_title("eval loss per candidate (same eval split)")
    for outcome in ranking.outcomes:
        log = Path(outcome.adapter_dir or "/nonexistent") / "loss.jsonl"
        entries = [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log.is_file() else []
        if entries:
            curves.plot([e["step"] for e in entries], [e["loss"] for e in entries], label=outcome.candidate.name)
    curves.set_xlabel("optimizer step")
    curves.set_ylabel("training loss")
    curves.set_title("training loss")
    if curves.get_legend_handles_labels()[0]:
        curves.legend(fontsize="small")
    return png_bytes(fig)


def _markdown(key: str, markdown: str, description: str) -> None:
    if current_run_attempt() is None:  # outside a flow run there is no server to show it
        return
    from prefect.artifacts import create_markdown_artifact

    create_markdown_artifact(markdown=markdown, key=key, description=description)


def _cell(text: str) -> str:
    """Text safe inside a markdown table cell: one line, no column separators, no raw HTML."""
    return " ".join(str(text).split()).replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def _number(value: Any) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def _write(path: Path, data: str | bytes) -> None:
    """Write a file of the sweep folder (runs_dir/sweeps/<key>/) whole: a reader never sees half of it, and a
    full disk is the one-paragraph error, with the file as it was before (the candidates' stages are kept)."""
    left = f"{path.name} is written to a temporary file and renamed over the old one only when whole"
    with disk.writing(f"the sweep record ({path.name})", path.parents[2], path.parent, left, path.name,
                      disk.blocks(len(data))):
        path.parent.mkdir(parents=True, exist_ok=True)
        disk.write_whole(path, data)
