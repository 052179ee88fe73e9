"""The whole job on a GPU: the five stages of `qlora-pipeline run`, each timed, on real data, one command.

Builds a Llama-3.1-8B-shaped model with random weights once (bench/shapes.py; values change neither time nor
memory) with the project's own tokenizer copied beside it (data/tiny-llama: real text gives realistic token
counts; its ids are a subset of the model's vocabulary), then runs the CLI (`python -m deployments.cli run
--json`) on the 3,739 open_qa records of databricks-dolly-15k (bench/dolly_open_qa.py writes them; one epoch, the
defaults, `export.merge`), once per tree: `--tree DIR` runs another checkout's code (e.g. the commit before a change,
`mkdir .base && git archive COMMIT flows tasks deployments data | tar -x -C .base`) side by side on the same model
and data, each in a runs_dir of its own, so every stage computes. Per tree: each stage's seconds (its manifest's
own timing: from the stage's start to its manifest), the run's wall time, and the stages other than
train_adapter together; and the same from the flow's log lines (log_spans: a stage's span also holds its
cache-key computation, where the base model's files are hashed, and Prefect's task start), the log kept beside
the JSON. `--profile` wraps each run in `py-spy record` (raw collapsed stacks of every process,
written beside the JSON) when py-spy is importable as a command.

usage (GPU host, repository root, after bench/README.md's set-up):
  python3 bench/bench_job.py --dolly /tmp/dolly_open_qa.jsonl --out bench/results/job-h200.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
STAGES = ("prepare_data", "prepare_model", "train_adapter", "evaluate_adapter", "export_adapter")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def build_model(folder: Path) -> float:
    """The bf16 8B-shaped model with the project's tokenizer; seconds spent (0 when already built)."""
    if (folder / "config.json").exists():
        return 0.0
    sys.path.append(str(ROOT))
    from bench.shapes import make_model_dir

    start = time.time()
    make_model_dir(folder)
    for name in TOKENIZER_FILES:
        if (ROOT / "data" / "tiny-llama" / name).exists():
            shutil.copy(ROOT / "data" / "tiny-llama" / name, folder / name)
    return round(time.time() - start, 1)


def run_job(tree: Path, model: Path, dolly: Path, runs_dir: Path, extra: list[str], profile: Path | None,
            log: Path) -> dict[str, Any]:
    """One `run` of the CLI from `tree`: its summary, wall time, each stage's seconds from its manifest and its
    span in the log (written to `log`)."""
    shutil.rmtree(runs_dir, ignore_errors=True)
    # every run starts with the disk at rest: the model just built (16 GB for 8B) and the runs deleted before it, still
    # being written back, slow the next run's saves, which a base model long on disk does not (docs/performance.md,
    # "The whole job")
    os.sync()
    sets = [f"model.base_model={model}", f"data.source={dolly.resolve()}", f"runs_dir={runs_dir}",
            "train.num_train_epochs=1", "export.merge=true", *extra]
    cmd = [sys.executable, "-m", "deployments.cli", "run", "--json", *[a for s in sets for a in ("--set", s)]]
    if profile is not None:
        cmd = ["py-spy", "record", "--subprocesses", "--format", "raw", "--rate", "50", "-o", str(profile), "--", *cmd]
    path = [str(tree), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    start = time.time()
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    wall = round(time.time() - start, 1)
    log.write_text(done.stdout + done.stderr)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:  # py-spy exits 0 whatever its child did: no summary line = failed
        return {"tree": str(tree), "rc": done.returncode or 1, "wall_s": wall,
                "tail": (done.stdout + done.stderr)[-4000:]}
    summary = json.loads(lines[-1])
    seconds = {s: json.loads((Path(info["dir"]) / "manifest.json").read_text())["seconds"]
               for s, info in summary["stages"].items()}
    metrics = summary["metrics"]
    spans = log_spans(done.stdout + done.stderr)
    return {"tree": str(tree), "rc": 0, "wall_s": wall, "stage_s": seconds,
            "other_than_train_s": round(sum(v for s, v in seconds.items() if s != "train_adapter"), 1),
            **spans,
            "eval": {k: metrics.get(k) for k in ("eval_examples", "eval_tokens", "generation_samples",
                                                   "base_eval_loss", "tuned_eval_loss", "base_rouge_l",
                                                   "tuned_rouge_l")}}


_LOG_LINE = re.compile(r"^(\d\d):(\d\d):(\d\d)\.(\d{3}) \| \w+ +\| (Flow|Task) run '([^']+)' - (.*)$")


def log_spans(log: str) -> dict[str, Any]:
    """The job as the flow's log lines time it: `flow_s` from the flow's first line to its last, each stage's
    `span_s` from the line that ended the stage before it (or the flow's start) to its own Finished line, so a span
    holds the stage's cache-key computation (hashing its inputs) and Prefect's task start besides what its
    manifest times; `other_than_train_wall_s` = flow_s less train_adapter's span (the tail after export_adapter,
    the run record, included)."""
    times: list[tuple[float, str, str, str]] = []
    for line in log.splitlines():
        if match := _LOG_LINE.match(line):
            h, m, sec, ms, kind, name, text = match.groups()
            at = int(h) * 3600 + int(m) * 60 + int(sec) + int(ms) / 1000
            times.append((at + 86400 if times and at < times[0][0] else at, kind, name, text))  # past midnight
    flow = [t for t, kind, _, _ in times if kind == "Flow"]
    if not flow:
        return {}
    spans, previous = {}, flow[0]
    for at, kind, name, text in times:
        if kind == "Task" and text.startswith("Finished in state") and name.rsplit("-", 1)[0] in STAGES:
            spans[name.rsplit("-", 1)[0]] = round(at - previous, 2)
            previous = at
    flow_s = round(flow[-1] - flow[0], 2)
    return {"flow_s": flow_s, "span_s": spans,
            "other_than_train_wall_s": round(flow_s - spans.get("train_adapter", 0.0), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dolly", type=Path, required=True, help="Dolly's open_qa records as JSON lines "
                        "(python bench/dolly_open_qa.py FILE writes them)")
    parser.add_argument("--model", type=Path, default=Path("/tmp/qlora-job/llama-8b"))
    parser.add_argument("--work", type=Path, default=Path("/tmp/qlora-job"))
    parser.add_argument("--tree", type=Path, action="append", default=[], help="another checkout to run too")
    parser.add_argument("--set", dest="extra", action="append", default=[], help="more --set overrides")
    parser.add_argument("--skip-root", action="store_true", help="run only the --tree checkouts")
    parser.add_argument("--keep", action="store_true", help="keep the first run's runs_dir (for probe_eval.py)")
    parser.add_argument("--profile", action="store_true", help="py-spy raw stacks of each run, beside --out")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"date": datetime.date.today().isoformat(), "command": " ".join(sys.argv),
                              "build_s": build_model(args.model), "runs": []}
    for i, tree in enumerate(args.tree if args.skip_root else [ROOT, *args.tree]):
        profile = args.out.parent / f"{args.out.stem}-{i}.stacks" if args.profile else None
        run = run_job(tree.resolve(), args.model, args.dolly, args.work / f"runs{i}", args.extra, profile,
                      args.out.parent / f"{args.out.stem}-{i}.log")
        if not (args.keep and i == 0):
            shutil.rmtree(args.work / f"runs{i}", ignore_errors=True)  # 22 GB for 8B; the GPU host has 64
        result["runs"].append(run)
        print(json.dumps(run), flush=True)
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
