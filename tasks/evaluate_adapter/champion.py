"""score_champion: the registry's champion scored on this run's eval data, for the promotion gate.

Reads the registry of export.name, eval.parquet (prepare_data), the 4-bit checkpoint (prepare_model), this run's
adapter (train_adapter: only its weights' sha256) and evaluation (evaluate_adapter: where its base results are
remembered). Returns the champion's metrics (champion_eval_loss, ... or, for preference data, champion_reward_
accuracy, ...) with its version and identity, which export_adapter hands to the gate; writes only the champion's
results into runs_dir/evaluate_adapter/.memo/, beside the base model's.

Why a task of its own: the champion changes as runs publish, while an adapter's evaluation does not. With the
champion in evaluate_adapter's key, an evaluation cached from before the current champion existed (a formats-only
re-export, a sweep's candidates, another export.name) left the gate without same-data numbers. Here the champion
is the one of the moment, scored on the same batches and prompts as the adapter (evaluation is deterministic: the
numbers equal those of the same pass) and remembered per (champion, eval data, model, settings, device), so it is
computed once; Prefect caches the task by (this evaluation, the champion it scores), so an unchanged re-run shows
it Cached. Nothing is scored, and nothing loaded, when no verdict needs it: no champion yet, the champion is this
very adapter (the gate judges its formats), this evaluation is already published with these export settings
(export_adapter is then cached), or the champion cannot be scored here (another base model, no recorded hashes,
damaged beyond repair: the gate falls back to its own night's numbers and says why).

With eval.suites, the champion's suite scores are scored here too (suites.py, remembered by its identity); with
eval.judge, the judge's verdict on this adapter's answers against the champion's (or, with no champion yet, the base
model's) is asked here (judging.py): it depends on both. The task has no cache key while verdicts are missing, so a
run whose judge failed asks it again, only what it lacks.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import CachePolicy
from prefect.context import TaskRunContext

from tasks.config import EvalArgs, ExportArgs
from tasks.evaluate_adapter import judging, sequences, suites
from tasks.evaluate_adapter.outputs import without_cudnn_attention
from tasks.evaluate_adapter.scorers import scorer_of, trained
from tasks.hashing.files import file_sha256
from tasks.hashing.keys import cache_key
from tasks.log import logger
from tasks.on_disk.manifest import EvalMetrics
from tasks.pool.cpus import cpu_share
from tasks.registry import store as registry
from tasks.registry.gate import WEIGHTS, identity, same_adapter


@dataclass
class _ChampionCache(CachePolicy):
    """Prefect's cache key of score_champion: this evaluation (its stage key) and the champion it would score (its
    identity; none when nothing is to be scored, whatever the reason: the result is None then). An unchanged re-run,
    also the first one after this adapter's own promotion, shows Cached; a new champion to score is scored. With
    eval.judge, the pair it judges too, and no key while its verdicts are not all in (the task runs, and asks the
    missing ones): the run that judged stores no result, so its first re-run computes once what it then caches."""

    def compute_key(self, task_ctx: TaskRunContext, inputs: dict[str, Any], flow_parameters: dict[str, Any],
                    **kwargs: Any) -> str | None:
        try:
            args, runs_dir, eval_dir = inputs["args"], inputs["runs_dir"], Path(inputs["eval_dir"])
            root = registry.registry_dir(runs_dir, inputs["export"].name)
            current = registry.champion(root)
            why, case = _nothing_to_score(root, current, Path(inputs["model_dir"]), Path(inputs["adapter_dir"]),
                                          eval_dir, inputs["export"], fix=False)
            pair = _pair(args, runs_dir, eval_dir, current) if _judges(args, case) and case != UNUSABLE else None
        except Exception:  # noqa: BLE001 - no key: the task runs, and raises what it meets there, once
            return None
        if _judges(args, case) and case != UNUSABLE and (pair is None or not judging.done(args, runs_dir, pair)):
            return None  # verdicts to ask, or the champion's answers to compute first
        scored, evaluation = None if why else identity(current), eval_dir.name
        judged = [judging.folder(args, runs_dir, pair).name] if pair is not None else []
        return "score_champion-" + cache_key([evaluation, scored, str(runs_dir), *judged], digits=24)


# why no verdict needs the champion scored (_nothing_to_score's second value): the judge is asked in FIRST (against
# the base model) and when the champion is scored (""); it cannot be in UNUSABLE; the others need no verdict
FIRST, SAME, PUBLISHED, OTHER_HEAD, UNUSABLE = "first", "same adapter", "published", "other head", "unusable"


# not a stage: no folder of its own; its results are remembered in the evaluation memo and by Prefect (_ChampionCache)
@task(name="score_champion", cache_policy=_ChampionCache(), persist_result=True)
def score_champion(args: EvalArgs, runs_dir: Path, data_dir: str, model_dir: str, adapter_dir: str, eval_dir: str,
                   export: ExportArgs) -> dict[str, Any] | None:
    """The champion of export.name scored on this run's eval data (champion_* metrics, judged_against,
    champion_adapter) and, with eval.judge, the judge's verdict on this adapter against it (judge), or None when no
    verdict needs either."""
    root = registry.registry_dir(runs_dir, export.name)
    current = registry.champion(root)
    why, case = _nothing_to_score(root, current, Path(model_dir), Path(adapter_dir), Path(eval_dir), export)
    if why:
        logger().info("score_champion: nothing to score: %s", why)
    scores = None if why else _scores(args, runs_dir, data_dir, model_dir, adapter_dir, eval_dir, root, current)
    if not _judges(args, case):
        return scores
    return {**(scores or {}), "judge": _judge(args, runs_dir, Path(eval_dir), current, case, why)}


def _scores(args: EvalArgs, runs_dir: Path, data_dir: str, model_dir: str, adapter_dir: str, eval_dir: str,
            root: Path, current: dict[str, Any]) -> dict[str, Any]:
    """The champion's numbers on this run's eval data, as this run's adapter was scored (and its suite scores)."""
    score = scorer_of(Path(adapter_dir)).champion  # this run's way of scoring, on this run's data
    folder = root / current["version"]
    with cpu_share("evaluate_adapter"), without_cudnn_attention():
        metrics = score(args, runs_dir, Path(data_dir), Path(model_dir), Path(adapter_dir), Path(eval_dir),
                        folder, identity(current))
        if args.suites:
            metrics.update(suites.champion(args, runs_dir, Path(model_dir), folder, identity(current)))
    metrics = {k: v for k, v in metrics.items() if k in EvalMetrics.model_fields}
    logger().info("score_champion: champion %s on this run's eval data: %s", current["version"],
                  ", ".join(f"{k.removeprefix('champion_')} {v:.4f}" for k, v in metrics.items()
                            if isinstance(v, float)))
    return {"judged_against": current["version"], "champion_adapter": identity(current), **metrics}


def _judges(args: EvalArgs, case: str) -> bool:
    """Whether the judge has a say on this verdict: configured, and the gate is to compare this adapter with the
    champion or, for a first version, with the base model."""
    return args.judge.url is not None and case in ("", FIRST, UNUSABLE)


def _pair(args: EvalArgs, runs_dir: Path, eval_dir: Path, current: dict[str, Any] | None) -> judging.Pair | None:
    """What the judge compares: this adapter's answers with the champion's (None until score_champion has computed
    them) or, with no champion yet, the base model's."""
    if current is None:
        return judging.pair_of(args, eval_dir, "base", None)
    answers = sequences.champion_answers(runs_dir, eval_dir, identity(current))
    return None if answers is None else judging.pair_of(args, eval_dir, current["version"], answers)


def _judge(args: EvalArgs, runs_dir: Path, eval_dir: Path, current: dict[str, Any] | None, case: str, why: str
           ) -> dict[str, Any]:
    """The judge's result for the gate (status judged, or why it could not judge)."""
    against = current["version"] if current else "base"
    pair = None if case == UNUSABLE else _pair(args, runs_dir, eval_dir, current)
    if pair is not None:
        return judging.judged(args, runs_dir, pair)
    reason = (f"the champion could not be scored on this run's data ({why}), so there are no answers of it to judge"
              if case == UNUSABLE else "the evaluation kept no greedy answers of both to judge (eval.generation_"
              "samples is 0, or the data trains on whole texts)")
    logger().warning("score_champion: the judge did not judge: %s", reason)
    return {"status": "not judged", "reason": reason, "against": against, "min_win_rate": args.judge.min_win_rate,
            "model": args.judge.model, "url": args.judge.url}


def _nothing_to_score(root: Path, current: dict[str, Any] | None, model_dir: Path, adapter_dir: Path,
                      eval_dir: Path, export: ExportArgs, fix: bool = True) -> tuple[str, str]:
    """(why no verdict needs the champion scored now, which case that is: FIRST, SAME, ...); ('', '') when one does.
    `fix`: a champion with damaged files is restored from its export stage folder first (and the fallback is
    logged)."""
    if current is None:
        return "no champion yet", FIRST
    ours, theirs = trained(adapter_dir), registry.record_method(root, current)
    if ours.head != theirs.head:  # a scorer and a language model cannot be scored the same way
        return (f"champion {current['version']} was trained by {theirs.name} (a {theirs.head} adapter), this adapter "
                f"by {ours.name} (a {ours.head} adapter): one cannot be scored as the other"), OTHER_HEAD
    base_model = registry.base_identity(model_dir)
    if same_adapter(file_sha256(adapter_dir / "adapter" / WEIGHTS), base_model, current):
        return f"champion {current['version']} is this adapter", SAME
    published = registry.published_as(root, eval_dir.name, export.model_dump(mode="json"))
    if published is not None:
        return f"this evaluation was published as {published['version']} with these export settings", PUBLISHED
    why = registry.unusable(root, current, base_model, fix=fix)
    if why and fix:
        logger().warning("score_champion: the champion is not scored on this run's data: %s; the promotion gate "
                         "falls back to its own night's numbers", why)
    return why, UNUSABLE if why else ""
