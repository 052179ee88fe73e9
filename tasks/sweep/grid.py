"""A sweep's candidates: a base RunConfig and a grid (or a list) of overrides -> candidates, each validated.

A candidate differs from the base config only in train_adapter's sections (lora, train, speed): data, model, eval
and export are shared, so prepare_data and prepare_model run once and every candidate is scored on the same eval
split. Pure functions: flows/sweep_runner.py runs the candidates, ranking.py ranks them, tasks/reporting/sweep.py
writes the record.
"""

from __future__ import annotations

import copy
import difflib
import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import BaseModel, ValidationError, WithJsonSchema

from tasks import methods
from tasks.config import MAX_CONFIG_BYTES, RunConfig
from tasks.errors import UserError
from tasks.hashing.keys import cache_key, hash_json
from tasks.methods import Measure

SWEPT_SECTIONS = ("lora", "train", "speed")  # train_adapter's inputs; the other sections are shared
# The qlora-sweep flow's `candidates`: in the run form a list of mappings, empty by default (no candidates, as None
# is); `list | None` showed a type toggle whose preselected None side reads 'Property is type "None"'.
CandidateList = Annotated[Sequence[dict[str, Any]] | None,
                          WithJsonSchema({"type": "array", "items": {"type": "object"}})]
MAX_CANDIDATES = 256  # a typo in a grid (a long list, one key too many) should not queue a month of training


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
    def measure(self) -> Measure:
        """What ranks the candidates: their methods' one measure (expand checks there is one)."""
        return methods.method(self.candidates[0].config.train.method).measure

    @property
    def dir(self) -> Path:
        return Path(self.base.runs_dir).expanduser().resolve() / "sweeps" / self.key


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
    problems += _measures_problem(made)
    if problems:
        raise _bad_grid(problems)
    key = cache_key({"base": base_raw, "candidates": overrides})
    return Plan(base=base, candidates=made, key=key)


def _measures_problem(made: list[Candidate]) -> list[str]:
    """A sweep ranks its candidates on one measure: their methods (tasks/methods.py) must be judged alike."""
    by_measure: dict[Measure, list[str]] = {}
    for candidate in made:
        by_measure.setdefault(methods.method(candidate.config.train.method).measure, []).append(candidate.name)
    if len(by_measure) < 2:
        return []
    return ["the candidates are judged on different measures (" + "; ".join(
        f"{measure.label}: {', '.join(names)}" for measure, names in by_measure.items()) + "), and a sweep ranks on "
        "one: sweep train.method only over methods judged alike"]


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
                                f"(got {show(values)})")
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
            problems.append(f"candidate c{number} is {show(override)}, not a mapping of SECTION.FIELD keys to "
                            "values (e.g. {lora.r: 8})")
    return [o for o in candidates if isinstance(o, dict) and o]


def _key_problem(key: Any) -> str | None:
    """Why `key` cannot be swept, or None: it must name a field of RunConfig's lora, train or speed section."""
    if not isinstance(key, str):
        return f"{show(key)} is not a SECTION.FIELD key"
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
            + (f" (got {show(e['input'])})" if e["type"] != "missing" else "") for e in exc.errors()]


def _bad_grid(problems: list[str]) -> UserError:
    return UserError(f"The sweep's grid has {len(problems)} problem(s); no stage ran: " + "; ".join(problems)
                     + ". Keys are SECTION.FIELD names of the lora, train or speed section (as with --set, e.g. "
                     "lora.r or train.learning_rate); docs/configuration.md lists them and their allowed values.")


def _label(override: dict[str, Any]) -> str:
    return ", ".join(f"{k}={show(v)}" for k, v in override.items())


def show(value: Any) -> str:
    """A value as short text for messages, labels and table cells: JSON (a string as it is), at most 80 characters."""
    text = json.dumps(value, default=str) if not isinstance(value, str) else value
    return text if len(text) <= 80 else text[:77] + "..."
