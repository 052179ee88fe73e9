"""The flow's check of what evaluation and the gate need, before any stage: lm-evaluation-harness installed for
eval.lm_eval_tasks and eval.suites, every suite loadable with its data and metric, and the judge answering with its
model, key and rubric. A problem is one UserError naming them all (exit 2 from the CLI), never a silent skip and never
a run that trains for an hour to fail at evaluation."""

from __future__ import annotations

from tasks import methods
from tasks.config import EvalArgs, TrainArgs
from tasks.errors import UserError
from tasks.evaluate_adapter import judge, suites

_ANSWERS = "sequences"  # the scorer (tasks/methods.py score_with) that keeps the champion's greedy answers


def check_evaluation(args: EvalArgs, train: TrainArgs) -> None:
    """A UserError listing every reason the suites, the judge or eval.lm_eval_tasks cannot run with this method."""
    row, found = methods.method(train.method), []
    if args.lm_eval_tasks and suites.installed() is None:
        found.append(f"eval.lm_eval_tasks={args.lm_eval_tasks} is set, but {suites.NOT_INSTALLED}")
    if (args.suites or args.judge.url) and row.head != "causal_lm":
        found.append(f"train.method={row.name} trains a {row.head} head, which neither answers lm-evaluation-harness "
                     "tasks nor prompts: leave eval.suites and eval.judge.url empty")
    elif args.judge.url and row.score_with != _ANSWERS:
        found.append(f"eval.judge compares greedy answers to held-out instructions, which the evaluation of "
                     f"train.method={row.name} does not keep for the champion: leave eval.judge.url empty")
    if not found:  # what the method cannot use is not loaded or asked
        found += suites.problems(args.suites) + judge.problems(args.judge)
    if found:
        raise UserError("The promotion gate's evaluation cannot run as configured, so nothing was run: "
                        + "; ".join(found) + ".")
