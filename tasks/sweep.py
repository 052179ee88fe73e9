"""Sweeps: a base RunConfig and a grid (or a list) of overrides -> candidates; their ranking; the comparison.

flows/qlora_sweep.py trains and evaluates every candidate as mapped stage tasks and calls these helpers; nothing
here imports a stage package. A candidate differs from the base config only in train_adapter's sections (lora,
train, speed): data, model, eval and export are shared, so prepare_data and prepare_model run once and every
candidate is scored on the same eval split. Candidates are ranked by the promotion gate's own comparison
(tasks/registry/gate.py `gate`, margin 0), so a sweep's winner is the one the gate would prefer.

    runs_dir/sweeps/<key>/        the sweep's record (key = hash of the base config and the candidates)
        sweep.json                every candidate: overrides, status, stage folders, metrics, rank; the winner
        comparison.png            tuned eval loss per candidate and the training loss curves overlaid
        winner.yaml               the winner's RunConfig (`qlora-pipeline run --config winner.yaml` retrains it)
"""

from __future__ import annotations

import copy
import difflib
import functools
import itertools
import json
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from prefect.task_runners import ThreadPoolTaskRunner
from pydantic import BaseModel, ValidationError, WithJsonSchema

from tasks.config import MAX_CONFIG_BYTES, RunConfig, TrackArgs
from tasks.errors import UserError
from tasks.hashing.keys import hash_json
from tasks.log import candidate_run_name, current_run_attempt, logger
from tasks.on_disk import disk
from tasks.on_disk.manifest import read_manifest
from tasks.pool.gpus import pool_gpus
from tasks.registry.gate import gate
from tasks.reporting import artifacts, tracking
from tasks.reporting.artifacts import figure, inline_png, png_bytes

SWEPT_SECTIONS = ("lora", "train", "speed")  # train_adapter's inputs; the other sections are shared
# The qlora-sweep flow's `candidates`: in the run form a list of mappings, empty by default (no candidates, as None
# is); `list | None` showed a type toggle whose preselected None side reads 'Property is type "None"'.
CandidateList = Annotated[Sequence[dict[str, Any]] | None,
                          WithJsonSchema({"type": "array", "items": {"type": "object"}})]
MAX_CANDIDATES = 256  # a typo in a grid (a long list, one key too many) should not queue a month of training
# no candidate can lose to this: a candidate that does not beat it has no usable metric (a NaN loss)
_WORST = {"tuned_eval_loss": math.inf, "tuned_reward_accuracy": -math.inf}


@dataclass(frozen=True)
class Candidate:
    """One point of the sweep: its name (c1, c2, ...), its overrides of the base config, the config they make."""

    name: str
    overrides: dict[str, Any]
    config: RunConfig

    @property
    def label(self) -> str:
        return _label(self.overrides)

    def sections(self) -> dict[str, Any]:
        """Its train_adapter sections (lora, train, speed): the only ones in which candidates differ."""
        return {name: getattr(self.config, name) for name in SWEPT_SECTIONS}


@dataclass(frozen=True)
class Plan:
    """The validated sweep: the base config, its candidates and the sweep's key."""

    base: RunConfig
    candidates: list[Candidate]
    key: str

    @property
    def dir(self) -> Path:
        return Path(self.base.runs_dir).expanduser().resolve() / "sweeps" / self.key


@dataclass
class Outcome:
    """What became of one candidate."""

    candidate: Candidate
    status: Literal["finished", "unranked", "failed"]  # unranked: evaluated, but its metric is not a number
    adapter_dir: str | None = None
    eval_dir: str | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    user_error: bool = True
    rank: int | None = None


@dataclass
class Ranking:
    """The candidates best first (finished ones by the gate's rule, then unranked, then failed)."""

    plan: Plan
    outcomes: list[Outcome]
    eval_data: str  # prepare_data's key: the one eval split every candidate was scored on

    @property
    def winner(self) -> Outcome | None:
        return self.outcomes[0] if self.outcomes and self.outcomes[0].status == "finished" else None

    @property
    def failed(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status == "failed"]


def load_grid(path: Path) -> tuple[dict[str, list[Any]] | None, list[dict[str, Any]] | None]:
    """(grid, None) for a YAML mapping of keys to lists of values, (None, candidates) for a list of overrides."""
    loaded = _read_grid(Path(path))
    if isinstance(loaded, dict):
        return loaded, None
    if isinstance(loaded, list):
        return None, loaded
    raise UserError(f"{path}: a sweep grid is a mapping of SECTION.FIELD keys to lists of values (lora.r: [4, 8]) "
                    f"or a list of overrides (- {{lora.r: 4}}), not {type(loaded).__name__}. Fix the file.")


_GRID_SHAPE = ("a sweep grid is a YAML mapping of SECTION.FIELD keys to lists of values (lora.r: [4, 8]) or a list "
               "of overrides (- {lora.r: 4})")


def _read_grid(path: Path) -> Any:
    """The grid file's YAML; a UserError naming the file for whatever keeps it from being read as one."""
    if not path.is_file():
        raise UserError(f"grid file {path} {'is a folder' if path.is_dir() else 'does not exist'}; {_GRID_SHAPE}.")
    if (size := path.stat().st_size) > MAX_CONFIG_BYTES:  # it becomes the sweep's flow-run parameters
        raise UserError(f"grid file {path} is {size:,} bytes, more than the {MAX_CONFIG_BYTES:,} bytes Prefect "
                        f"accepts as a flow run's parameters; {_GRID_SHAPE}, a few lines.")
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise UserError(f"grid file {path} is not text (byte {exc.start} is not UTF-8): is it the file you meant? "
                        f"{_GRID_SHAPE[0].upper()}{_GRID_SHAPE[1:]}.") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise UserError(f"grid file {path} is not valid YAML ({getattr(exc, 'problem', None) or exc}{where}); "
                        f"{_GRID_SHAPE}. Fix the file.") from None
    except RecursionError:
        raise UserError(f"grid file {path} is nested too deeply to read; {_GRID_SHAPE}, a few levels deep. Look "
                        "for runaway brackets or indentation.") from None
    except OSError as exc:
        raise UserError(f"cannot read the grid file {path} ({exc.strerror or exc}).") from None


def expand(base: RunConfig, grid: dict[str, Any] | None = None, candidates: list[Any] | None = None) -> Plan:
    """The candidates of a grid (cartesian product) or a list of overrides, each validated as a RunConfig.

    Every problem (a key that is no RunConfig field or not a training field, a value that does not validate,
    two candidates that are the same) is listed in one UserError, before any stage runs.
    """
    problems: list[str] = []
    overrides = _overrides(grid, candidates, problems)
    bad_keys = {k: p for k in dict.fromkeys(k for o in overrides for k in o) if (p := _key_problem(k)) is not None}
    if problems:  # the grid's shape is wrong: its values cannot be combined into candidates yet
        raise _bad_grid([*problems, *bad_keys.values()])
    problems += bad_keys.values()
    base_raw = base.model_dump(mode="json")
    made: list[Candidate] = []
    bad_values: dict[str, list[str]] = {}
    seen: dict[str, str] = {}
    for number, override in enumerate(overrides, start=1):
        name = f"c{number}"
        try:  # the bad keys are already listed: check the other keys' values
            config = RunConfig.model_validate(_apply(base_raw, {k: v for k, v in override.items()
                                                                if k not in bad_keys}))
        except ValidationError as exc:
            for message in _messages(exc):
                bad_values.setdefault(message, []).append(name)
            continue
        same = seen.setdefault(hash_json(config.model_dump(mode="json")), name)
        if same != name and not bad_keys:
            problems.append(f"{name} ({_label(override)}) is the same config as {same}")
        made.append(Candidate(name, override, config))
    problems += [f"{message} (candidate{'s' if len(names) > 1 else ''} {', '.join(names)})"
                 for message, names in bad_values.items()]
    if problems:
        raise _bad_grid(problems)
    key = hash_json({"base": base_raw, "candidates": overrides})[:16]
    return Plan(base=base, candidates=made, key=key)


def _overrides(grid: Any, candidates: Any, problems: list[str]) -> list[dict[str, Any]]:
    """The list of override mappings the grid or candidate list stands for; shape problems go to `problems`."""
    grid, candidates = grid or None, candidates or None  # an empty one (a UI form's default) is none
    if (grid is None) == (candidates is None):
        problems.append("give either a grid (a mapping of SECTION.FIELD keys to lists of values) or a list of "
                        "candidates (each a mapping of SECTION.FIELD keys to values), not both and not neither")
        return []
    if grid is not None:
        if not isinstance(grid, dict):
            problems.append(f"the grid is a {type(grid).__name__}, not a mapping of keys to lists of values")
            return []
        for key, values in grid.items():
            if not isinstance(values, list) or not values:
                problems.append(f"{key}: the grid takes a non-empty list of values to try, e.g. {key}: [a, b] "
                                f"(got {_show(values)})")
        count = math.prod(len(v) for v in grid.values() if isinstance(v, list))
        if count > MAX_CANDIDATES:
            problems.append(f"the grid makes {count:,} candidates, more than the {MAX_CANDIDATES} a sweep takes")
        if problems:  # each key once, so its name is still checked
            return [dict.fromkeys(grid)]
        return [dict(zip(grid, combo, strict=True)) for combo in itertools.product(*grid.values())]
    if not isinstance(candidates, list):
        problems.append(f"the candidates are a {type(candidates).__name__}, not a list of mappings")
        return []
    if len(candidates) > MAX_CANDIDATES:
        problems.append(f"{len(candidates):,} candidates, more than the {MAX_CANDIDATES} a sweep takes")
    for number, override in enumerate(candidates, start=1):
        if not isinstance(override, dict) or not override:
            problems.append(f"candidate c{number} is {_show(override)}, not a mapping of SECTION.FIELD keys to "
                            "values (e.g. {lora.r: 8})")
    return [o for o in candidates if isinstance(o, dict) and o]


def _key_problem(key: Any) -> str | None:
    """Why `key` cannot be swept, or None: it must name a field of RunConfig's lora, train or speed section."""
    if not isinstance(key, str):
        return f"{_show(key)} is not a SECTION.FIELD key"
    section, _, name = key.partition(".")
    model = _section_model(section)
    if model is None or name not in model.model_fields:
        known = [f"{s}.{f}" for s in RunConfig.model_fields if (m := _section_model(s)) for f in m.model_fields]
        near = difflib.get_close_matches(key, known, n=1)
        return f"{key} is not a RunConfig field" + (f" (did you mean {near[0]}?)" if near else "")
    if section not in SWEPT_SECTIONS:
        return (f"{key} is shared by every candidate (data and model are prepared once and every candidate is "
                "evaluated on the same eval split): set it in the base config, and sweep lora, train or speed fields")
    return None


def _section_model(section: str) -> type[BaseModel] | None:
    info = RunConfig.model_fields.get(section)
    kind = info.annotation if info is not None else None
    return kind if isinstance(kind, type) and issubclass(kind, BaseModel) else None


def _apply(raw: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(raw)
    for key, value in override.items():
        section, _, name = key.partition(".")
        out[section][name] = value
    return out


def _messages(exc: ValidationError) -> list[str]:
    return [f"{'.'.join(map(str, e['loc'])) or 'config'}: {e['msg']}"
            + (f" (got {_show(e['input'])})" if e["type"] != "missing" else "") for e in exc.errors()]


def _bad_grid(problems: list[str]) -> UserError:
    return UserError(f"The sweep's grid has {len(problems)} problem(s); no stage ran: " + "; ".join(problems)
                     + ". Keys are SECTION.FIELD names of the lora, train or speed section (as with --set, e.g. "
                     "lora.r or train.learning_rate); docs/configuration.md lists them and their allowed values.")


def _label(override: dict[str, Any]) -> str:
    return ", ".join(f"{k}={_show(v)}" for k, v in override.items())


def _show(value: Any) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else value
    return text if len(text) <= 80 else text[:77] + "..."


@contextmanager
def training_runner() -> Iterator[Any]:
    """The task runner the candidates' train_adapter runs go to: as many at once as the GPU pool has GPUs, or the
    flow's own runner (one stage task at a time) where there is no pool of devices.

    Why not more in one process: two trainings in the flow-run process share its global state. torch's default
    RNG is one per process: each training seeds it (set_seed in train_adapter/fit.py) and then draws its LoRA A
    matrices' initial values from it, and later, with lora_dropout > 0, its dropout masks. A second training's
    seeding and draws interleave with the first's, so the same cache key got another adapter (tuned eval loss
    5.976 against 5.951). transformers also sets torch's default dtype process-wide while it loads a model,
    which a training or evaluation in another thread sees.
    Where the pool has devices, gpu_slot gives each training its own GPUs and train_adapter trains in a child
    process that sees only those (its own RNG, dtype and threads): candidates then train at once, each as it would
    alone, and the pool's slots bound how many (a candidate that finds none free shows "Waiting for GPU").
    Evaluations stay on the flow's own runner, one at a time, in this process. On a CPU-only worker, training runs
    in this process, so the candidates go one at a time; at once they would only split the same cores (each
    training's threads are already sized to its share of them, tasks/pool/cpus.py cpu_share).
    """
    from prefect.context import FlowRunContext

    gpus = pool_gpus()
    if gpus:
        logger().info("sweep: up to %d candidate(s) train at once, one per free GPU of the pool", gpus)
    with SignalLeavesThreads(max_workers=gpus) if gpus else nullcontext(FlowRunContext.get().task_runner) as runner:
        yield runner


class SignalLeavesThreads(ThreadPoolTaskRunner):
    """Prefect's ThreadPoolTaskRunner, except that a flow leaving on a signal (SIGTERM, Ctrl-C) does not wait for
    the tasks still running in its threads: Prefect's runner joins them on exit, before its flow engine records the
    crash, so a SIGTERM during a candidate's training waited for that training to end (minutes). Their task runs
    are ended by the flow's crash hook (tasks/reporting/artifacts.py failure_summary) and the threads by the
    process's exit; a training resumes from its latest complete checkpoint on the next run."""

    def duplicate(self) -> SignalLeavesThreads:  # the copy the flow engine enters
        return SignalLeavesThreads(max_workers=self._max_workers)

    def __exit__(self, exc_type: Any, exc_value: Any, traceback: Any) -> None:
        if exc_type is not None and not issubclass(exc_type, Exception) and self._executor is not None:
            for event in self._cancel_events.values():
                event.set()
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
        super().__exit__(exc_type, exc_value, traceback)


def named(task: Any, candidate: Candidate) -> Any:
    """`task` (a stage) for this candidate: its task runs named for the candidate in the UI, "train_adapter-c2
    (lora.r=8)", and its artifacts keyed by it (log.for_candidate)."""
    name = candidate_run_name(task.name, candidate.name, _show(candidate.label))
    return task.with_options(task_run_name=lambda: name)  # a callable: a string would be formatted with the inputs


def then(futures: list[Any], submits: list[Callable[[Any], Any]]) -> list[Any]:
    """Submit the next stage for each future as soon as it completes, with `submits` in the futures' order (its
    result passed as the future, so the UI shows the dependency); None in place of a future that did not
    complete: that candidate failed alone."""
    from prefect.futures import as_completed

    futures = list(futures)
    nexts: list[Any] = [None] * len(futures)
    position = {id(f): i for i, f in enumerate(futures)}
    for future in as_completed(futures):
        future.wait()  # sets the future's own final state; .state would otherwise ask the server, which may lag
        if future.state.is_completed():
            nexts[position[id(future)]] = submits[position[id(future)]](future)
    return nexts


def rank(plan: Plan, trained: list[Any], evaluated: list[Any], data_dir: str, track: TrackArgs) -> Ranking:
    """Wait for every candidate, rank them, write the comparison (artifact and files) and log it to the sweep's
    tracked run (`track`: the candidates' track section, tracking.open_sweep's); fail if none finished."""
    outcomes = [_outcome(c, t, e) for c, t, e in zip(plan.candidates, trained, evaluated, strict=True)]
    eval_data = read_manifest(Path(data_dir)).key
    ranking = Ranking(plan, order(outcomes, eval_data), eval_data)
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


def order(outcomes: list[Outcome], eval_data: str) -> list[Outcome]:
    """Best first by the gate's rule (ties keep candidate order), numbered; then the unranked, then the failed.

    A finished candidate that does not beat even the worst possible one (a NaN loss) becomes unranked.
    """
    for outcome in outcomes:
        if outcome.status == "finished" and not _beats(outcome.metrics, _WORST, eval_data):
            outcome.status, outcome.error = "unranked", "its eval metric is not a number (training diverged?)"
    done = sorted((o for o in outcomes if o.status == "finished"),
                  key=functools.cmp_to_key(lambda a, b: _compare(a.metrics, b.metrics, eval_data)))
    for number, outcome in enumerate(done, start=1):
        outcome.rank = number
    rest = {"unranked": 1, "failed": 2}
    return done + sorted((o for o in outcomes if o.status != "finished"), key=lambda o: rest[o.status])


def _outcome(candidate: Candidate, trained: Any, evaluated: Any) -> Outcome:
    trained.wait()
    if not trained.state.is_completed():
        return _failed(candidate, "train_adapter", trained.state)
    evaluated.wait()
    if not evaluated.state.is_completed():
        return _failed(candidate, "evaluate_adapter", evaluated.state, adapter_dir=trained.result())
    eval_dir = evaluated.result()
    metrics = read_manifest(Path(eval_dir)).metrics.model_dump()
    return Outcome(candidate, "finished", adapter_dir=trained.result(), eval_dir=eval_dir, metrics=metrics)


def _failed(candidate: Candidate, stage: str, state: Any, **dirs: Any) -> Outcome:
    exc = state.result(raise_on_failure=False)
    text = str(exc) if isinstance(exc, BaseException) else (state.message or state.name)
    return Outcome(candidate, "failed", error=f"{stage}: {text}", user_error=isinstance(exc, UserError), **dirs)


def _compare(a: dict[str, Any], b: dict[str, Any], eval_data: str) -> int:
    """-1 when the gate prefers a to b, 1 the other way round, 0 for a tie (the earlier candidate stays first)."""
    return -1 if _beats(a, b, eval_data) else 1 if _beats(b, a, eval_data) else 0


def _beats(challenger: dict[str, Any], incumbent: dict[str, Any], eval_data: str) -> bool:
    """The promotion gate's verdict, margin 0, with `incumbent` in the champion's place."""
    record = {"version": "the other candidate", "metrics": _own(incumbent), "eval_data": eval_data}
    return gate(_own(challenger), record, 0.0, eval_data)[0] == "promoted"


def _own(metrics: dict[str, Any]) -> dict[str, Any]:
    """A candidate's own metrics, without the registry champion's (champion_*): scored on the same data, they
    would make the gate compare each candidate with the champion instead of with the other candidate."""
    return {k: v for k, v in metrics.items() if not k.startswith("champion_")}


def report(ranking: Ranking, run_summary: dict[str, Any]) -> Any:
    """Write winner.yaml and sweep.json (with the published version), the winner artifact; the sweep summary, as
    the flow run's Completed state whose message is the verdict (artifacts.verdict).

    Raises after everything is written and published when a candidate failed (the flow's docstring says why).
    """
    winner = ranking.winner
    text = yaml.safe_dump(winner.candidate.config.model_dump(mode="json", exclude={"runs_dir"}), sort_keys=False)
    _write(ranking.plan.dir / "winner.yaml", text)
    summary = {**record(ranking), "export": {k: run_summary["metrics"].get(k) for k in (
        "export_name", "export_version", "export_path", "promotion", "promotion_reason", "champion_version")},
        "export_dir": run_summary["export_dir"], "run_dir": run_summary["run_dir"]}
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
            ("tuned reward accuracy", "tuned_reward_accuracy"), ("tuned ROUGE-L", "tuned_rouge_l")]


def comparison(ranking: Ranking) -> str:
    """The comparison as markdown (one table row per candidate, best first, and the plot inline); also an
    artifact `sweep-comparison` in a flow run, and comparison.png in the sweep folder."""
    keys = list(dict.fromkeys(k for c in ranking.plan.candidates for k in c.overrides))
    columns = [(label, name) for label, name in _COLUMNS
               if any(o.metrics.get(name) is not None for o in ranking.outcomes)]
    head = ["rank", "candidate", *keys, "status", *(label for label, _ in columns)]
    rows = [[str(o.rank or "-"), o.candidate.name, *(_cell(_show(o.candidate.overrides.get(k, "(base)")))
                                                     for k in keys),
             o.status if o.error is None else f"{o.status}: {_cell(o.error)}",
             *(_number(o.metrics.get(name)) for _, name in columns)] for o in ranking.outcomes]
    table = "\n".join("| " + " | ".join(r) + " |" for r in [head, ["---"] * len(head), *rows])
    image = _plot(ranking)
    _write(ranking.plan.dir / "comparison.png", image)
    winner = ranking.winner
    markdown = (f"## Sweep `{ranking.plan.key}`: {len(ranking.outcomes)} candidates, winner "
                f"{winner.candidate.name if winner else 'none'}\n\nRanked by the promotion gate's rule (margin 0) on "
                f"the same eval data (prepare_data `{ranking.eval_data[:12]}`): the lowest tuned eval loss wins; for "
                f"preference runs the highest tuned reward accuracy.\n\n{table}\n\n"
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
