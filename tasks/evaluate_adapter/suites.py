"""Regression suites (eval.suites): lm-evaluation-harness tasks scored on the base model, base + adapter and the
registry's champion, so that the promotion gate sees what a new adapter forgot (tasks/registry/gate.py: no suite may
fall by more than its tolerance).

A suite is a built-in task by name, or a local task file (YAML) whose data files (JSONL, Parquet) it names relative
to itself: nothing is fetched for a local one, and its datasets library cache is a temporary folder (nothing is left
in ~/.cache). evaluate_adapter scores base and tuned (`stage`: suites.json, and each suite's score, metric, direction
and tolerance in its metrics), score_champion the champion (`champion`). Results are remembered per (the suites'
content, the 4-bit model, how it is evaluated, the device) in runs_dir/evaluate_adapter/.memo/suites-<key>/, the base
model's and each champion's, so a nightly run computes only its new adapter's. `problems` is the flow's check before
any stage: a suite that cannot run stops the run there, never a silent skip.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import tempfile
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

from tasks.config import EvalArgs, SuiteArgs
from tasks.errors import UserError
from tasks.evaluate_adapter import VERSION
from tasks.evaluate_adapter.outputs import attached
from tasks.hashing.files import files_sha256
from tasks.hashing.keys import cache_key
from tasks.log import logger
from tasks.on_disk import disk
from tasks.on_disk.manifest import upstream_key

LOCAL_SUFFIXES = (".yaml", ".yml")
NOT_INSTALLED = ("lm-evaluation-harness is not installed: install the eval extra (pip install -c constraints.txt "
                 "-e \".[eval]\", README: set-up)")


def is_local(task: str) -> bool:
    """Whether a suite's task is a local task file (else a built-in task's name)."""
    return task.lower().endswith(LOCAL_SUFFIXES)


def installed() -> str | None:
    """The installed lm-evaluation-harness version, None without one (found, not imported: that takes seconds)."""
    try:
        return metadata.version("lm_eval") if importlib.util.find_spec("lm_eval") is not None else None
    except (metadata.PackageNotFoundError, ValueError):
        return None


# --- what a suite holds: its files, and their content as a key --------------------------------------------------

class _Tolerant(yaml.SafeLoader):
    """Reads a task file's plain fields; lm-eval's own tags (!function) are read as nothing."""


_Tolerant.add_multi_constructor("!", lambda loader, suffix, node: None)


def _data_files(task_file: Path) -> list[Path]:
    """The files its dataset_kwargs.data_files name (a path, a glob, a list, or a split -> path mapping), relative
    to the task file."""
    try:
        config = yaml.load(task_file.read_text(encoding="utf-8"), Loader=_Tolerant)  # noqa: S506 - a safe subclass
    except (OSError, ValueError, yaml.YAMLError) as exc:
        raise UserError(f"eval.suites: the task file {task_file} cannot be read: {exc}") from None
    named = ((config or {}).get("dataset_kwargs") or {}).get("data_files") if isinstance(config, dict) else None
    values = named.values() if isinstance(named, dict) else [named] if named is not None else []
    paths = [p for v in values for p in (v if isinstance(v, list) else [v]) if isinstance(p, str)]
    return [Path(f) for p in paths for f in sorted(glob.glob(str(task_file.parent / p))) or [task_file.parent / p]]


def suite_files(task_file: Path) -> list[Path]:
    """What a local suite's score depends on: its task file, the files beside it (an included task file, the
    Python of its !function hooks) and the data files it names."""
    beside = [p for p in task_file.parent.iterdir() if p.is_file() and not p.name.startswith(".")]
    return sorted(set(beside) | set(_data_files(task_file)))


def fingerprint(suites: list[SuiteArgs], runs_dir: Path | None = None) -> str:
    """The suites' content: each one's settings (a local task by its files' bytes, not their place) and the
    lm-evaluation-harness version; a UserError naming every file that is missing."""
    version = installed()
    if version is None:
        raise UserError(f"eval.suites is set, but {NOT_INSTALLED}.")
    missing = [str(p) for s in suites if is_local(s.task) for p in _named(Path(s.task)) if not p.is_file()]
    if missing:
        raise UserError(f"eval.suites: these files of local suites do not exist: {', '.join(missing)}. Give each "
                        "suite's task file, with its data files named relative to it.")
    parts = []
    for suite in suites:
        content: Any = suite.task
        if is_local(suite.task):
            task_file = Path(suite.task).expanduser()
            hashes = files_sha256(suite_files(task_file), runs_dir)
            content = {os.path.relpath(p, task_file.parent): h for p, h in sorted(hashes.items())}
            content["task file"] = task_file.name
        parts.append({**suite.model_dump(), "task": content})
    return cache_key(["lm_eval", version, parts])


def _named(task_file: Path) -> list[Path]:
    """The task file and, when it can be read, the data files it names."""
    task_file = task_file.expanduser()
    return [task_file, *(_data_files(task_file) if task_file.is_file() else [])]


# --- scoring ----------------------------------------------------------------------------------------------------

def _spec(task: str, cache: Path) -> str | dict[str, Any]:
    """What lm-eval loads for a task: a built-in task's name, or a local task file's config with its data files
    made absolute (the datasets library reads relative ones from the working directory) and a temporary cache."""
    if not is_local(task):
        return task
    # lm-eval's own reader of task files: it resolves include: and !function relative to the file
    from lm_eval.tasks._yaml_loader import load_yaml

    task_file = Path(task).expanduser().resolve()
    config = load_yaml(task_file, resolve_func=True, recursive=True)
    kwargs = dict(config.get("dataset_kwargs") or {})
    if "data_files" in kwargs:
        kwargs["data_files"] = _absolute(kwargs["data_files"], task_file.parent)
    config["dataset_kwargs"] = {**kwargs, "cache_dir": str(cache)}
    return config


def _absolute(named: Any, folder: Path) -> Any:
    if isinstance(named, dict):
        return {k: _absolute(v, folder) for k, v in named.items()}
    if isinstance(named, list):
        return [_absolute(v, folder) for v in named]
    return str(folder / named) if isinstance(named, str) else named


def _manager(tasks: list[str]) -> Any:
    """lm-eval's TaskManager: its index of built-in tasks only when a task is one (building it reads every built-in
    task file: seconds)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_defaults=any(not is_local(t) for t in tasks))


def results(model: Any, tokenizer: Any, tasks: list[str], batch_size: int, limit: int | None) -> dict[str, Any]:
    """lm-evaluation-harness's results per task on `model` (eval.lm_eval_tasks: reported, not gated)."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    with tempfile.TemporaryDirectory(prefix="qlora-suites-") as cache:
        return lm_eval.simple_evaluate(model=lm, tasks=[_spec(t, Path(cache)) for t in tasks],
                                       task_manager=_manager(tasks), limit=limit, bootstrap_iters=0,
                                       log_samples=False)["results"]


def scores(model: Any, tokenizer: Any, suites: list[SuiteArgs], batch_size: int) -> dict[str, dict[str, Any]]:
    """Each suite's result on `model` (a transformers model in memory), by its task's name: the score of its metric,
    the metric, whether higher is better, and on how many examples."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    manager, out = _manager([s.task for s in suites]), {}
    with tempfile.TemporaryDirectory(prefix="qlora-suites-") as cache:
        for suite in suites:  # one call each: each suite has its own limit
            results = lm_eval.simple_evaluate(model=lm, tasks=[_spec(suite.task, Path(cache))], task_manager=manager,
                                              limit=suite.limit, bootstrap_iters=0, log_samples=False)
            name, result = _result(results, suite)
            out[name] = result
    return out


def _result(results: dict[str, Any], suite: SuiteArgs) -> tuple[str, dict[str, Any]]:
    """(task name, its score) from simple_evaluate's results: the suite's metric (default the task's first)."""
    name = next(iter(results["results"]))  # the task (or group) the suite named comes first
    found = results["results"][name]
    directions = results.get("higher_is_better", {}).get(name) or {}
    metric = suite.metric or next(iter(directions), None) or next(
        (k.split(",")[0] for k in found if "," in k and "_stderr" not in k), None)
    key = next((k for k in found if k.split(",")[0] == metric and "_stderr" not in k), None)
    if key is None or not isinstance(found[key], (int, float)):
        shown = sorted({k.split(",")[0] for k in found if "," in k and "_stderr" not in k})
        raise UserError(f"eval.suites: the task {name} ({suite.task}) has no score for metric {metric!r}; its "
                        f"metrics: {', '.join(shown) or 'none'}. Set the suite's metric to one of them.")
    samples = (results.get("n-samples", {}).get(name) or {}).get("effective")
    return name, {"score": float(found[key]), "metric": metric, "higher_is_better": bool(directions.get(metric, True)),
                  "samples": samples}


def _memo(runs_dir: Path, model_dir: Path, args: EvalArgs) -> Path:
    """Where base and champion suite results are remembered: per (the suites' content, the 4-bit model, how it is
    evaluated, this code's VERSION, the device)."""
    import torch

    where = torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu, {torch.get_num_threads()} threads"
    inputs = {"version": VERSION, "suites": fingerprint(args.suites, runs_dir), "model": upstream_key(model_dir),
              "dequantize": args.dequantize, "batch": args.per_device_eval_batch_size, "device": where,
              "torch": torch.__version__}
    return runs_dir / "evaluate_adapter" / ".memo" / f"suites-{cache_key(inputs)}"


def _remembered(path: Path | None, who: str, compute: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    if path is not None and path.is_file():
        logger().info("evaluate_adapter: %s's suite scores as an earlier run computed them (%s)", who, path)
        return json.loads(path.read_text())
    results = compute()
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        disk.write_whole(path, json.dumps(results))
    return results


def _scored(args: EvalArgs, runs_dir: Path, model_dir: Path, adapter: Path, who: str, memo_name: str | None,
            with_base: bool = False) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(the adapter's suite results, with `with_base` the base model's too, from the same load); `who` names the
    adapter in the log, memo_name its memo file (None: not remembered). The model is loaded only for what the memo
    lacks."""
    from tasks.models.loading import load_for_evaluation, load_tokenizer
    from tasks.models.memory import release_device_memory

    memo, batch, loaded = _memo(runs_dir, model_dir, args), args.per_device_eval_batch_size, []

    def run(with_adapter: bool) -> dict[str, Any]:
        if not loaded:
            loaded.extend([load_for_evaluation(model_dir, args.dequantize), load_tokenizer(model_dir)])
        model = attached(loaded[0], adapter) if with_adapter else loaded[0]
        return scores(model, loaded[1], args.suites, batch)

    # the base first: the adapter is merged into the same weights
    base = _remembered(memo / "base.json", "the base model", lambda: run(False)) if with_base else None
    mine = _remembered(memo / f"{memo_name}.json" if memo_name else None, who, lambda: run(True))
    loaded.clear()
    release_device_memory()
    return mine, base


def stage(args: EvalArgs, runs_dir: Path, out: Path, model_dir: Path, adapter_dir: Path
          ) -> tuple[list[str], dict[str, Any]]:
    """The suites on base and tuned, written into out/suites.json; the files written and the metrics (suites: each
    one's metric, direction and tolerance; base_suites, tuned_suites: the scores)."""
    tuned, base = _scored(args, runs_dir, model_dir, adapter_dir / "adapter", "base + adapter", None, with_base=True)
    (out / "suites.json").write_text(json.dumps({"base": base, "tuned": tuned}, indent=2))
    tolerance = {s.task: s.tolerance for s in args.suites}
    names = dict(zip(tuned, args.suites, strict=True))  # task name -> its suite (in the config's order)
    # content: what a later night's gate compares by, when it falls back to this version's own numbers
    metrics = {"suites": {name: {"task": s.task, "metric": tuned[name]["metric"], "tolerance": tolerance[s.task],
                                 "higher_is_better": tuned[name]["higher_is_better"],
                                 "samples": tuned[name]["samples"],
                                 "content": fingerprint([s.model_copy(update={"tolerance": 0.0})], runs_dir)}
                          for name, s in names.items()},
               "base_suites": {name: base[name]["score"] for name in names},
               "tuned_suites": {name: tuned[name]["score"] for name in names}}
    logger().info("evaluate_adapter: suites, base -> tuned: %s", "; ".join(
        f"{n} {tuned[n]['metric']} {base[n]['score']:.4f} -> {tuned[n]['score']:.4f}" for n in names))
    return ["suites.json"], metrics


def champion(args: EvalArgs, runs_dir: Path, model_dir: Path, folder: Path, identity: str | None) -> dict[str, Any]:
    """score_champion's suite scores of the champion in `folder` (champion_suites), remembered by its identity."""
    scored, _ = _scored(args, runs_dir, model_dir, folder, "the champion", f"champion-{identity}" if identity else None)
    return {"champion_suites": {name: r["score"] for name, r in scored.items()}}


# --- the check before any stage ---------------------------------------------------------------------------------

def problems(suites: list[SuiteArgs]) -> list[str]:
    """Why each suite cannot run (not installed, a missing file, a task that does not load, a metric it lacks);
    [] when all can. Loads each task and its data, as evaluation will."""
    if not suites:
        return []
    if installed() is None:
        return [f"eval.suites is set, but {NOT_INSTALLED}"]
    found = [f"suite {s.task}: {p} does not exist" for s in suites if is_local(s.task) for p in _named(Path(s.task))
             if not p.is_file()]
    if found:
        return found
    manager = _manager([s.task for s in suites])
    with tempfile.TemporaryDirectory(prefix="qlora-suites-") as cache:
        for suite in suites:
            found += _load_problems(suite, manager, Path(cache))
    return found


def _load_problems(suite: SuiteArgs, manager: Any, cache: Path) -> list[str]:
    try:
        tasks = manager.load([_spec(suite.task, cache)])["tasks"]
    except Exception as exc:  # noqa: BLE001 - lm-eval and the datasets library raise many kinds; each is said
        return [f"suite {suite.task} does not load: {type(exc).__name__}: {str(exc)[:300]}"]
    metrics = {m for task in tasks.values() for m in (task.higher_is_better() or {})}
    if suite.metric is not None and metrics and suite.metric not in metrics:
        return [f"suite {suite.task} has no metric {suite.metric!r} (its metrics: {', '.join(sorted(metrics))})"]
    return []
