"""A reward model of the exports registry as a reward function: train.rewards entry `registry:NAME` (the champion of
registry NAME when the run starts) or `registry:NAME/vNNNN` (that version).

The version must have been trained as a scorer (tasks/methods.py's row whose head is "score": train.method
reward_model) on the same base model as the run that uses it: its score head reads that base's hidden states. The
run pins the entry to its version (`pin`), so training and evaluation score with the same one and a new champion of
NAME is a new training (train_adapter's key holds the version's files: `fingerprint`). The scorer is loaded once,
on the device the run trains on, the first time it is called, and scores each call's answers in batches.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tasks import methods
from tasks.errors import UserError
from tasks.hashing.keys import cache_key
from tasks.registry import store as registry
from tasks.rewards.builtin import text_of

PREFIX = "registry:"
_ENTRY = re.compile(r"^registry:([A-Za-z0-9_-][A-Za-z0-9._-]*)(?:/(v\d{4,}))?$")
BATCH = 8  # answers scored per forward


def is_reward_model(name: str) -> bool:
    return name.startswith(PREFIX)


def pin(name: str, runs_dir: Path) -> str:
    """The entry with its version: registry:NAME becomes registry:NAME/vNNNN, the champion's now."""
    return f"{PREFIX}{_parts(name)[0]}/{_resolve(name, runs_dir)[0]['version']}"


def check(name: str, runs_dir: Path) -> None:
    """UserError with the fix unless the entry names a reward model version of the registry, intact."""
    _resolve(name, runs_dir)


def fingerprint(name: str, runs_dir: Path) -> str:
    """The version and its adapter files' sha256 (what it scores with), as a train_adapter key holds them."""
    record, _ = _resolve(name, runs_dir)
    return cache_key({"version": record["version"], "files": record.get("files", {})}, digits=64)


def make(name: str, runs_dir: Path, model_dir: Path) -> Callable[..., list[float | None]]:
    """The reward function of the entry: the score of prompt + answer for each answer (loaded at its first call)."""
    record, folder = _resolve(name, runs_dir)
    if record.get("base_model") != registry.base_identity(model_dir):
        raise UserError(f"train.rewards {name}: {record['version']} of registry {_parts(name)[0]} was trained on "
                        "another base model than this run's, so its score head cannot read this model's states. "
                        f"Train a reward model on this run's model.base_model (train.method {_scorers()}), or name "
                        "one that was.")
    loaded: dict[str, Any] = {}

    def score(prompts: list[Any], completions: list[Any], **_: Any) -> list[float | None]:
        from tasks.models.loading import load_tokenizer
        from tasks.models.scorer import load_scorer, score_batches

        if not loaded:
            loaded.update(model=load_scorer(model_dir, folder), tokenizer=load_tokenizer(model_dir))
        tokenizer = loaded["tokenizer"]
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        rows = [tokenizer(text_of(p))["input_ids"] + tokenizer(text_of(c), add_special_tokens=False)["input_ids"]
                + eos for p, c in zip(prompts, completions, strict=True)]
        return list(score_batches(loaded["model"], rows, BATCH))

    return score


def _resolve(name: str, runs_dir: Path) -> tuple[dict[str, Any], Path]:
    """(the version's record, its folder); UserError naming the fix when there is none to score with."""
    registry_name, version = _parts(name)
    root = registry.registry_dir(runs_dir, registry_name)
    record = registry.version_record(root, version) if version else registry.champion(root)
    if record is None:
        what = f"has no version {version}" if version else "has no champion yet"
        raise UserError(f"train.rewards {name}: the exports registry {registry_name} at {root} {what}. Train a "
                        f"reward model into it first (train.method {_scorers()}, export.name {registry_name}), or "
                        "name a registry and version that exist (qlora-pipeline history --export-name NAME).")
    trained = registry.record_method(root, record)
    if trained.head != "score":
        raise UserError(f"train.rewards {name}: {record['version']} of registry {registry_name} was trained by "
                        f"{trained.name}, which makes no reward model; name a registry of {_scorers()} versions.")
    problem = registry.repaired(root, record) if record.get("files") else ""
    if problem:
        raise UserError(f"train.rewards {name}: {problem}. Name another version, or train the reward model again.")
    return record, root / record["version"]


def _parts(name: str) -> tuple[str, str | None]:
    found = _ENTRY.match(name)
    if not found:
        raise UserError(f"train.rewards {name!r}: a reward model is named registry:NAME (the champion of registry "
                        "NAME) or registry:NAME/vNNNN (a version), NAME an export.name.")
    return found.group(1), found.group(2)


def _scorers() -> str:
    """The methods that train a reward model (tasks/methods.py: a score head)."""
    return " or ".join(m.name for m in methods.METHODS if m.head == "score")
