"""The training methods: one row each, the one place a method is declared.

A row says what the rest of the pipeline needs to know of a method without asking which one ran: the kind of data
it trains on and the data formats of that kind it takes, whether it compares with a reference model, the train
fields that are its own, the losses it offers, what it allows (several GPUs, hosts, FSDP, packing and the memory
plan), how evaluate_adapter scores it, and the promotion gate's measure (a metric, the direction that wins, the unit
of export.promotion_margin). config.py builds train.method's choices, its help text and the form's rules from these
rows; the gate, the sweep's ranking, the run record, `history`, the model card and the CLI summary read the measure
and the metrics to show from them. Each stage that trains or scores a method differently has one module for it
(train_adapter/methods/, evaluate_adapter's SCORERS); docs/contributing.md, "A training method", walks through
adding one.

Base layer: imports nothing of the pipeline (and nothing heavy), so the config and the UI form can use it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

# The data formats of prepare_data by the kind of example they make; a method trains on one kind.
DATA_KINDS: dict[str, tuple[str, ...]] = {
    "sequences": ("dolly", "alpaca", "prompt_completion", "chat", "text"),  # token ids with a loss mask
    "preference": ("preference", "unpaired_preference"),  # TRL's pair columns, or answers rated good or bad
    "prompts": ("prompts",),  # prompts to answer, with the columns reward functions read
}


def data_kind(fmt: str) -> str:
    """The kind of examples prepare_data makes of data format `fmt`."""
    return next((kind for kind, formats in DATA_KINDS.items() if fmt in formats), "sequences")


@dataclass(frozen=True)
class Measure:
    """What the promotion gate compares for a method: `key` names the metrics base_<key>, tuned_<key> and
    champion_<key>; the challenger must beat the champion (or, for a first version, the base model) by more than
    export.promotion_margin, a share of the incumbent's value (relative) or in the metric's own units (absolute)."""

    key: str
    label: str
    higher_wins: bool
    margin: Literal["relative", "absolute"]
    digits: int  # shown in verdicts and tables
    count: str  # the metric that says on how many held-out examples it was measured
    noun: str  # what they are: "held-out pairs"

    def needed(self, best: float, margin: float) -> float:
        """What a challenger must do better than to beat `best` by `margin`."""
        sign = 1 if self.higher_wins else -1
        if self.margin == "relative":  # a share of the incumbent's value (a positive loss: the same rule at 0.5 and 5)
            return best * (1 + sign * margin)
        return best + sign * margin

    def beats(self, value: float, best: float, margin: float) -> bool:
        """Whether `value` beats `best` by more than `margin` (a NaN never does)."""
        needed = self.needed(best, margin)
        return value > needed if self.higher_wins else value < needed

    def describe_margin(self) -> str:
        """How export.promotion_margin reads for this measure."""
        if self.margin == "relative":
            return f"its {self.label} must be {'higher' if self.higher_wins else 'lower'} by more than this share"
        return f"its {self.label} must be {'higher' if self.higher_wins else 'lower'} by more than this (absolute)"


LOSS = Measure("eval_loss", "eval loss", higher_wins=False, margin="relative", digits=4, count="eval_examples",
               noun="held-out examples")
REWARD_ACCURACY = Measure("reward_accuracy", "reward accuracy", higher_wins=True, margin="absolute", digits=3,
                          count="eval_examples", noun="held-out pairs or rated answers")
MEAN_REWARD = Measure("mean_reward", "mean reward", higher_wins=True, margin="absolute", digits=3,
                      count="eval_prompts", noun="held-out prompts, greedy")
PAIRWISE_ACCURACY = Measure("pairwise_accuracy", "pairwise accuracy", higher_wins=True, margin="absolute", digits=3,
                            count="eval_pairs", noun="held-out pairs")

# train fields in every method's train_adapter key, read or not: they were keyed for every method before methods
# declared their own fields, and taking them out would change every existing key (a runs_dir would retrain)
ALWAYS_KEYED = ("beta", "loss_type")

# (form rule, message): a JSON schema a train field must meet when this method is chosen, and the sentence the CLI
# says when it does not (the form gets the same rule as `then` of an if/then on train.method)
Requirement = tuple[dict[str, Any], str]


@dataclass(frozen=True)
class Method:
    """One training method (see the module docstring)."""

    name: str
    summary: str  # train.method's help text for it
    data_kind: str  # a key of DATA_KINDS
    formats: tuple[str, ...]  # the data formats it trains on (data.format auto detects one)
    measure: Measure
    reference_model: bool = False  # compares the tuned model with the base (or init adapter) while training
    fields: tuple[str, ...] = ()  # train fields only some methods read, this one among them
    losses: tuple[str, ...] = ()  # train.loss_type's choices (TRL's names); empty: no choice
    default_loss: str | None = None  # what loss_type auto means
    requires: dict[str, Requirement] = field(default_factory=dict)  # train fields' rules for this method
    check: Callable[[Any], str] | None = None  # a rule JSON schema cannot say (between two train fields): problem
    several_gpus: bool = True  # speed.num_gpus > 1 (data-parallel)
    across_hosts: bool = True  # speed.num_nodes > 1
    fsdp: bool = False  # speed.fsdp
    packing: bool = True  # speed.packing and, on a GPU, the memory plan
    scorer: str = ""  # evaluate_adapter's SCORERS entry; default: its data kind
    head: Literal["causal_lm", "score"] = "causal_lm"  # what the adapter is trained on: the LM head or a score head
    shown: tuple[tuple[str, str], ...] = ()  # metrics besides eval loss, perplexity and the answers' scores
    registry: str | None = None  # export.name when left at its default: a registry of its own kind
    rewards: bool = False  # learns from train.rewards (reward functions)
    card_note: str = ""  # the model card's sentence on what its numbers are

    @property
    def score_with(self) -> str:
        return self.scorer or self.data_kind


def _generations_divide(train: Any) -> str:
    answers = train.per_device_train_batch_size * train.gradient_accumulation_steps
    if answers % train.num_generations:
        return (f"train.method=grpo samples train.num_generations={train.num_generations} answers per prompt, which "
                f"must divide the answers of an optimizer step (per_device_train_batch_size x "
                f"gradient_accumulation_steps = {answers}); e.g. set "
                f"train.per_device_train_batch_size={train.num_generations}")
    return ""


# DPO's, KTO's and GRPO's losses as TRL names them (DPOConfig.loss_type, KTOConfig.loss_type, GRPOConfig.loss_type:
# those that need no other setting)
DPO_LOSSES = ("sigmoid", "hinge", "ipo", "robust", "bco_pair", "sppo_hard", "nca_pair", "apo_zero", "apo_down")
KTO_LOSSES = ("kto", "apo_zero_unpaired")
GRPO_LOSSES = ("grpo", "dapo", "dr_grpo", "bnpo")
GRPO_FIELDS = ("beta", "loss_type", "rewards", "reward_pattern", "num_generations", "max_completion_length",
               "temperature", "reward_timeout_s")
_PAIRS_SHOWN = (("reward accuracy", "reward_accuracy"), ("reward margin", "reward_margin"))

METHODS: tuple[Method, ...] = (
    Method("sft", "supervised fine-tuning on instruction, chat or text data.", "sequences",
           DATA_KINDS["sequences"], LOSS, fsdp=True),
    Method("dpo", "Direct Preference Optimization on pairs of a preferred and a rejected answer (data format "
           "preference).", "preference", ("preference",), REWARD_ACCURACY, reference_model=True,
           fields=("beta", "loss_type"), losses=DPO_LOSSES, default_loss="sigmoid", shown=_PAIRS_SHOWN),
    Method("kto", "Kahneman-Tversky Optimization on single answers rated good or bad (format unpaired_preference; "
           "pairs are split into one good and one bad answer).", "preference", DATA_KINDS["preference"],
           REWARD_ACCURACY, reference_model=True, fields=("beta", "loss_type"), losses=KTO_LOSSES,
           default_loss="kto", shown=_PAIRS_SHOWN,
           requires={"per_device_train_batch_size": ({"minimum": 2}, "train.method=kto estimates its KL term from "
                     "the other answers of a micro-batch: set train.per_device_train_batch_size to 2 or more")}),
    Method("grpo", "Group Relative Policy Optimization: the model answers each prompt (format prompts) "
           "num_generations times and learns from the answers' rewards (train.rewards).", "prompts", ("prompts",),
           MEAN_REWARD, reference_model=True, fields=GRPO_FIELDS, losses=GRPO_LOSSES, default_loss="dapo",
           requires={"rewards": ({"minItems": 1}, "train.method=grpo learns from rewards, but train.rewards is "
                                 "empty: name at least one, e.g. [format] or [numeric_match] (docs/preference.md)")},
           check=_generations_divide, several_gpus=False, across_hosts=False, packing=False,
           shown=(("mean reward", "mean_reward"), ("reward", "rewards")), rewards=True,
           card_note="Trained with GRPO: the rewards are the run's reward functions on those greedy answers (mean "
           "reward: their sum, averaged over the answers; the promotion gate compares it); the loss is that of the "
           "prompts' own tokens."),
    Method("orpo", "Odds Ratio Preference Optimization on pairs (format preference): the chosen answers' loss plus "
           "an odds-ratio term against the rejected ones, with no reference model (less memory than dpo).",
           "preference", ("preference",), REWARD_ACCURACY, fields=("beta",), packing=False, shown=_PAIRS_SHOWN,
           card_note="Trained with ORPO; reward accuracy is measured as for DPO: the share of held-out pairs whose "
           "chosen answer gained more log-probability over the base model than the rejected one."),
    Method("reward_model", "a reward model: the base with a scalar score head, trained on pairs (format "
           "preference) to score the chosen answer above the rejected one; usable as a grpo reward "
           "(train.rewards: [registry:NAME]).", "preference", ("preference",), PAIRWISE_ACCURACY, packing=False,
           scorer="scores", head="score", registry="reward-model",
           shown=(("pairwise accuracy", "pairwise_accuracy"), ("score margin", "score_margin")),
           card_note="A reward model: the base model with a LoRA adapter and a scalar score head (peft task "
           "SEQ_CLS). Pairwise accuracy is the share of held-out pairs whose chosen answer it scores above the "
           "rejected one; the base model has no score head, so it scores every pair a tie (0.5)."),
)
BY_NAME = {m.name: m for m in METHODS}
NAMES = tuple(BY_NAME)


def method(name: str) -> Method:
    """The row of train.method `name`."""
    return BY_NAME[name]


def method_fields() -> tuple[str, ...]:
    """Every train field that is some method's own (TrainArgs fields other than these are every method's)."""
    return tuple(dict.fromkeys(f for m in METHODS for f in m.fields))


def keyed_fields(row: Method) -> set[str]:
    """The method-specific train fields out of this method's train_adapter key: other methods' own, except
    ALWAYS_KEYED."""
    return set(method_fields()) - set(row.fields) - set(ALWAYS_KEYED)


def all_losses() -> tuple[str, ...]:
    return tuple(dict.fromkeys(loss for m in METHODS for loss in m.losses))
