"""evaluate_adapter: base vs base + adapter on the held-out split -> metrics.json, samples.jsonl.

Reads eval.parquet (prepare_data), the 4-bit checkpoint and tokenizer (prepare_model) and the adapter
(train_adapter), and scores base and tuned on the very same held-out examples the way the method that trained the
adapter is judged (tasks/methods.py): scorers.py's entry for it (sequences.py: loss, perplexity, greedy answers and
lm-evaluation-harness tasks; preference.py: reward accuracy; prompts.py: the run's rewards; scores.py: a reward
model's pairwise accuracy).

Everything is deterministic (eval mode, greedy decoding, fixed batches): the same adapter and data give
the same numbers. The registry's champion is not part of this stage: it changes as runs publish, while an
adapter's evaluation does not, so score_champion (champion.py) scores it apart, on the same examples, for the
promotion gate. Writes metrics.json, samples.jsonl (prompt, reference, base and tuned answers, their scores),
lm_eval.json when tasks ran, suites.json with eval.suites (the gate's regression suites, suites.py), and manifest.json
into runs_dir/evaluate_adapter/<key>/; the samples also go to a Prefect table artifact. The pairwise judge
(eval.judge) compares this adapter's answers with the champion's, so it is score_champion's (judging.py).
"""

from __future__ import annotations

from pathlib import Path

from prefect import task

from tasks.config import EvalArgs
from tasks.evaluate_adapter import VERSION, judge, keys, suites
from tasks.evaluate_adapter.scorers import scorer_of
from tasks.on_disk.caching import stage_task_options
from tasks.on_disk.folders import StageSpec, open_stage
from tasks.pool.cpus import cpu_share


def spec(args: EvalArgs, runs_dir: Path, data_dir: str, model_dir: str, adapter_dir: str) -> StageSpec:
    """Cache-key inputs: eval settings and the three upstream stages (not the registry's champion: it changes as
    runs publish, while this adapter's evaluation does not). Suites and the judge only when set (keys.settings),
    local suites and a rubric file by their content, not their place."""
    fingerprint = {"suites": suites.fingerprint(args.suites, runs_dir)} if args.suites else {}
    if args.judge.url is not None and args.judge.rubric is not None:
        fingerprint["rubric"] = judge.rubric_fingerprint(args.judge)
    return StageSpec(stage="evaluate_adapter", version=VERSION, runs_dir=runs_dir,
                     params={"eval": keys.settings(args)}, fingerprint=fingerprint,
                     located=("eval.suites", "eval.judge.rubric") if fingerprint else (),
                     upstream={"prepare_data": Path(data_dir), "prepare_model": Path(model_dir),
                               "train_adapter": Path(adapter_dir)})


@task(name="evaluate_adapter", **stage_task_options(spec))
def evaluate_adapter(args: EvalArgs, runs_dir: Path, data_dir: str, model_dir: str, adapter_dir: str) -> str:
    """Base model and base + adapter scored on the held-out split, as the adapter's training method is judged."""
    # this run's share of the host's cores for torch (tasks/pool/cpus.py)
    with open_stage(spec(args, runs_dir, data_dir, model_dir, adapter_dir)) as stage, cpu_share("evaluate_adapter"):
        if stage.done:
            return str(stage.dir)
        score = scorer_of(Path(adapter_dir)).stage
        outputs, metrics = score(args, runs_dir, stage.dir, Path(data_dir), Path(model_dir), Path(adapter_dir))
        if args.suites:  # the gate's regression suites, on base and tuned
            more, scores = suites.stage(args, runs_dir, stage.dir, Path(model_dir), Path(adapter_dir))
            outputs, metrics = [*outputs, *more], {**metrics, **scores}
        if args.judge.url is not None:  # the judge's verdict is score_champion's; the gate must not go without it
            metrics["judged_by"] = judge.identity(args.judge)
        stage.finish(outputs, metrics)
        return str(stage.dir)
