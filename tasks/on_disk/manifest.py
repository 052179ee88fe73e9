"""manifest.json: the schema of every stage's record, and the check that a stage folder is finished and intact.

A stage's output is `runs_dir/<stage>/<key>/` (tasks/on_disk/folders.py). The folder is done only when its
manifest.json exists, validates as a `Manifest` (with the metrics type of its stage), names the same key, lists
every output its stage must have (REQUIRED: a manifest cannot vouch for less), and every output file it lists has
the recorded size and sha256: the manifest is written last and atomically (StageRun.finish), so a crash at any
moment leaves either no manifest or a complete one, and damaged output (truncated, or bytes changed in place) is
caught. The hashes are read through the memo of tasks/hashing/files.py (the stage folder's `.hashes.json`), so a
reused stage costs a stat per file, not a read. Manifests are read here and written by StageRun.finish only; every
other module reads them as typed objects.
"""

from __future__ import annotations

import fnmatch
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from tasks import methods
from tasks.hashing.files import HashMemo

MANIFEST = "manifest.json"
# The outputs each stage must have (fnmatch patterns, relative to the folder); a manifest lists them all.
REQUIRED: dict[str, tuple[str, ...]] = {
    "prepare_data": ("train.parquet", "eval.parquet"),
    "prepare_model": ("config.json", "modules.json", "*.safetensors"),
    "train_adapter": ("adapter/adapter_config.json", "adapter/adapter_model.safetensors", "loss.jsonl"),
    "evaluate_adapter": ("metrics.json", "samples.jsonl"),
    "export_adapter": ("adapter_config.json", "adapter_model.safetensors", "run_config.yaml", "README.md",
                       "published/version.json"),
}


class _Metrics(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DataMetrics(_Metrics):
    """prepare_data: the format chosen, what was dropped or cut, token-length percentiles."""

    format: str
    completion_only_loss: bool
    chat_template: str | None
    pack_examples: bool
    rows_in: int
    dropped_empty: int
    dropped_prompt_too_long: int
    truncated: int
    truncated_tokens: int
    rows_out: int
    train_examples: int
    eval_examples: int
    train_rows: int
    truncation_rate: float
    len_p50: int
    len_p90: int
    len_p99: int
    len_max: int
    len_min: int
    tokens: int
    train_label_tokens: int
    padding_waste: float
    # a source of several files is tokenized per file into parts reused by content (None: one file or the hub)
    parts_tokenized: int | None = None
    parts_reused: int | None = None
    # eval examples that are training examples too (tasks/prepare_data/overlap.py): 0 by construction for a split by
    # data.eval_fraction; None in manifests written before it was counted
    eval_overlap: int | None = None
    # format prompts (train.method grpo): the columns besides prompt, handed to the reward functions
    prompt_columns: list[str] | None = None


class ModelMetrics(_Metrics):
    """prepare_model: what later stages need to load the 4-bit checkpoint as it was made."""

    memory_footprint_bytes: int
    compute_dtype: str
    device: str
    linear_4bit_layers: int
    attn_implementation: str


class TrainMetrics(_Metrics):
    """train_adapter: loss, steps, throughput and the micro-batches actually used."""

    real_tokens_per_s: float
    peak_gpu_allocated_gib: float | None = None
    train_loss: float
    optimizer_steps: int
    train_examples: int
    train_seconds: float | None
    trainable_parameters: int
    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    processes: int
    sharding: Literal["none", "ddp", "fsdp"]
    method: Literal[methods.NAMES] = methods.METHODS[0].name  # type: ignore[valid-type]
    # methods that learn from rewards: the reward functions (train.rewards; a reward model pinned to its version) and
    # the last logged step's mean reward and KL (loss.jsonl has each logged step's)
    rewards: list[str] | None = None
    last_reward: float | None = None
    last_kl: float | None = None
    # on a GPU with packing: the memory plan (tasks/train_adapter/memory_plan.py MemoryPlan: tokens, recompute_layers,
    # recompute_mlp_layers, chunk_recomputed, offloads, predicted_peak_gib, budget_gib); compare predicted_peak_gib
    # with peak_gpu_allocated_gib
    memory_plan: dict[str, Any] | None = None
    # pairs and rated answers: TRL's loss on the real tokens only (speed.packing; train_adapter/levers/padding_free.py),
    # and for DPO the micro-batches of whole pairs per epoch that packing made (None: TRL's batches of per_device pairs)
    padding_free: bool | None = None
    micro_batches_per_epoch: int | None = None
    tracking: dict[str, dict[str, str]] = {}  # the tracking runs this training reported into, by backend
    gpu_wait_seconds: float | None = None  # of the stage's seconds, waiting for the GPU slot (other runs' training)
    devices: list[str] | None = None  # the GPUs of the pool it trained on (CUDA_VISIBLE_DEVICES); None: no pool
    host: str | None = None  # the GPU host whose pool gave them (QLORA_HOST); None: a single host without a name
    # speed.num_nodes > 1: each node's host and devices, node 0 (this run's host) first (tasks/train_adapter/nodes.py)
    nodes: list[dict[str, Any]] | None = None


class ChampionScores(_Metrics):
    """The export registry's champion scored on a run's eval data, on the same batches and prompts as the adapter
    (evaluate_adapter's score_champion; README: Nightly retraining); absent when there is none or it cannot be
    scored (another base model, damaged, an old record)."""

    judged_against: str | None = None  # the champion's version (champion_version is the export's: champion now)
    champion_adapter: str | None = None  # its identity: a hash of its adapter files' sha256, not a path
    champion_eval_loss: float | None = None
    champion_perplexity: float | None = None
    champion_exact_match: float | None = None
    champion_rouge_l: float | None = None
    champion_reward_accuracy: float | None = None
    champion_reward_margin: float | None = None
    champion_chosen_logps: float | None = None
    champion_rejected_logps: float | None = None
    champion_preference_accuracy: float | None = None
    champion_mean_reward: float | None = None
    champion_rewards: dict[str, float | None] | None = None
    champion_pairwise_accuracy: float | None = None
    champion_score_margin: float | None = None
    # regression suites (eval.suites; evaluate_adapter/suites.py): the champion's score per suite, by task name
    champion_suites: dict[str, float | None] | None = None
    # the pairwise judge (eval.judge; evaluate_adapter/judging.py): the challenger against the champion (or, with none,
    # the base model): status (judged, or why not), against, wins, ties, losses, unparseable, win_rate, lower_bound,
    # min_win_rate, confidence, prompts, the judge's model and URL, verdicts (the file of them)
    judge: dict[str, Any] | None = None


class EvalMetrics(ChampionScores):
    """evaluate_adapter: base vs tuned on the held-out split (the champion_* fields: manifests written before the
    champion was scored apart, by score_champion)."""

    base_eval_loss: float
    tuned_eval_loss: float
    base_perplexity: float | None  # None for a scorer (a reward model), whose loss is no language model's
    tuned_perplexity: float | None
    eval_examples: int
    eval_tokens: int
    relative_improvement: float
    base_exact_match: float | None
    tuned_exact_match: float | None
    base_rouge_l: float | None
    tuned_rouge_l: float | None
    generation_samples: int
    max_new_tokens: int
    lm_eval: str | None = None
    # preference data (evaluate_adapter/preference.py; docs/preference.md). reward = log p(answer) - log p_base(answer),
    # summed over the answer's tokens; accuracy = share of held-out pairs with reward(chosen) > reward(rejected)
    # (ties count half, so the base model scores 0.5); margin = mean reward(chosen) - reward(rejected)
    eval_pairs: int | None = None
    base_reward_accuracy: float | None = None
    tuned_reward_accuracy: float | None = None
    base_reward_margin: float | None = None
    tuned_reward_margin: float | None = None
    base_chosen_logps: float | None = None
    tuned_chosen_logps: float | None = None
    base_rejected_logps: float | None = None
    tuned_rejected_logps: float | None = None
    base_preference_accuracy: float | None = None  # share with log p(chosen) > log p(rejected), no reference
    tuned_preference_accuracy: float | None = None
    # prompts (evaluate_adapter/prompts.py): the run's reward functions on greedy answers to the
    # held-out prompts; mean_reward = the mean over answers of their summed rewards (the gate compares it), rewards =
    # each function's mean; eval loss and perplexity are the prompts' own tokens' (a drift check)
    eval_prompts: int | None = None
    base_mean_reward: float | None = None
    tuned_mean_reward: float | None = None
    base_rewards: dict[str, float | None] | None = None
    tuned_rewards: dict[str, float | None] | None = None
    # a scorer (evaluate_adapter/scores.py): the share of held-out pairs it scores the right way round (ties half; the
    # base model, without a score head, ties every pair: 0.5) and the mean score(chosen) - score(rejected)
    base_pairwise_accuracy: float | None = None
    tuned_pairwise_accuracy: float | None = None
    base_score_margin: float | None = None
    tuned_score_margin: float | None = None
    # regression suites (eval.suites; evaluate_adapter/suites.py): per suite (by task name) its task, metric,
    # tolerance, whether higher is better and on how many examples; and the base and tuned scores
    suites: dict[str, dict[str, Any]] | None = None
    base_suites: dict[str, float | None] | None = None
    tuned_suites: dict[str, float | None] | None = None
    # eval.judge: the judge (model at URL) whose verdict the gate needs; its verdict is score_champion's (judge)
    judged_by: str | None = None
    # where the base model's results on this eval data are remembered (runs_dir/evaluate_adapter/.memo/<memo>), so
    # the champion's are looked up there without loading the model (score_champion); None: eval.parquet unhashed
    memo: str | None = None


class ExportMetrics(ChampionScores):
    """export_adapter: the registry verdict for the version this stage published, with the champion's scores the
    gate compared (champion_*)."""

    export_name: str
    export_version: str
    export_path: str  # relative to runs_dir (exports/<name>/vNNNN): the run summary names it under its own runs_dir
    promotion: str
    promotion_reason: str
    champion_version: str | None
    champion_tuned_eval_loss: float | None
    gate_rule: str | None = None  # first | same-data | cross-night | same-adapter | unlike (tasks/registry/gate.py)
    # False: this stage published nothing (the champion's own adapter again, with nothing to add); None: older
    # manifests, which published whenever they computed
    published_now: bool | None = None


METRICS: dict[str, type[_Metrics]] = {"prepare_data": DataMetrics, "prepare_model": ModelMetrics,
                                      "train_adapter": TrainMetrics, "evaluate_adapter": EvalMetrics,
                                      "export_adapter": ExportMetrics}
StageName = Literal["prepare_data", "prepare_model", "train_adapter", "evaluate_adapter", "export_adapter"]


class Upstream(BaseModel):
    key: str
    dir: str


class Manifest(BaseModel):
    """manifest.json: what produced a stage folder, what it holds, and the stage's typed metrics."""

    model_config = ConfigDict(extra="forbid")

    stage: StageName
    key: str
    version: str
    params: dict[str, Any]  # the stage's config sections by name, e.g. {"model": {...}}
    upstream: dict[str, Upstream]
    fingerprint: dict[str, str]
    outputs: dict[str, int]  # file name relative to the folder -> size in bytes
    hashes: dict[str, str] = {}  # file name relative to the folder -> sha256 of its bytes
    metrics: DataMetrics | ModelMetrics | TrainMetrics | EvalMetrics | ExportMetrics
    versions: dict[str, str]
    run_attempt: str | None
    started_at: float
    seconds: float
    resumed_from_step: int | None = None

    @model_validator(mode="before")
    @classmethod
    def _metrics_of_stage(cls, data: Any) -> Any:
        """Parse metrics with its stage's type (a union alone would take the first type that fits)."""
        if isinstance(data, dict) and isinstance(data.get("metrics"), dict) and data.get("stage") in METRICS:
            data = {**data, "metrics": METRICS[data["stage"]].model_validate(data["metrics"])}
        return data

    def method(self) -> methods.Method:
        """The training method of a train_adapter manifest (its train.method; the first row's for manifests from
        before there were methods)."""
        return methods.method(self.params.get("train", {}).get("method", methods.METHODS[0].name))


def read_manifest(folder: Path) -> Manifest | None:
    """The folder's manifest if the stage finished there and its outputs are intact, else None."""
    return check_stage(folder)[0]


def check_stage(folder: Path) -> tuple[Manifest | None, str]:
    """(manifest, "") for a finished, intact stage folder; (None, why not) otherwise."""
    try:
        manifest = Manifest.model_validate_json((folder / MANIFEST).read_bytes())
    except FileNotFoundError:
        return None, f"no {MANIFEST}"
    except (OSError, ValidationError) as exc:
        return None, f"{MANIFEST} is unreadable ({type(exc).__name__})"
    if manifest.key != folder.name:
        return None, f"{MANIFEST} names key {manifest.key}"
    lacking = [p for p in REQUIRED[manifest.stage] if not fnmatch.filter(manifest.outputs, p)]
    if lacking:
        return None, f"{MANIFEST} does not list {', '.join(lacking)}"
    unhashed = sorted(set(manifest.outputs) - set(manifest.hashes))
    if unhashed:
        return None, f"{MANIFEST} records no content hash for {', '.join(unhashed)}"
    for name, size in manifest.outputs.items():
        out = folder / name
        if not out.is_file():
            return None, f"{name} is missing"
        if out.stat().st_size != size:
            return None, f"{name} has {out.stat().st_size} bytes, not the {size} recorded"
    memo = HashMemo(folder)
    hashes = memo.sha256_all(list(manifest.outputs))
    memo.save()
    damaged = [name for name in manifest.outputs if hashes[name] != manifest.hashes[name]]
    if damaged:
        return None, f"{damaged[0]} is damaged (its sha256 differs from the one recorded)"
    return manifest, ""


def upstream_key(folder: Path | str) -> str:
    """The key of a finished upstream stage folder; fails if that stage is not done."""
    manifest = read_manifest(Path(folder))
    if manifest is None:
        raise RuntimeError(f"{folder} has no valid {MANIFEST}: its stage did not finish")
    return manifest.key
