"""export_adapter: the adapter ready to ship, published as a version in the exports registry.

Reads the adapter (train_adapter), the 4-bit checkpoint and tokenizer (prepare_model), the metrics
(evaluate_adapter) and the upstream manifests. Writes into runs_dir/export_adapter/<key>/ (the cached
stage output): adapter_model.safetensors and adapter_config.json (loadable with
PeftModel.from_pretrained), the tokenizer files, README.md (model card: metrics, base model and
revision, data fingerprint, settings, how to load), run_config.yaml (the RunConfig sections that
produced it) and, with export.merge, merged/ (base dequantized, adapter merged in; loads with
AutoModelForCausalLM).

Then publishes that folder as runs_dir/exports/<export.name>/vNNNN/ (tasks/registry/store.py): promoted to
champion when it passes the gate (tasks/registry/gate.py: beats the champion, scored on this run's eval data by
score_champion, or with none yet its base model, by export.promotion_margin), else kept as a rejected
candidate with the reason. An adapter with non-finite weights (a diverged training) is refused before anything
is written. Publishing happens once per stage key: a cached stage publishes nothing, and the manifest's
metrics record the version and the verdict. published/ keeps the version's record and card, from which a
reused stage restores a deleted version folder or champion.json.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import yaml
from prefect import task

from tasks import methods
from tasks.config import ExportArgs, RunConfig
from tasks.errors import UserError
from tasks.export_adapter.gguf import write_base_gguf, write_gguf, write_lora_gguf
from tasks.export_adapter.vllm import point_at_base_model
from tasks.log import logger
from tasks.models.sources import TOKENIZER_FILES
from tasks.on_disk import disk
from tasks.on_disk.caching import stage_task_options
from tasks.on_disk.folders import StageSpec, open_stage
from tasks.on_disk.manifest import ChampionScores, Manifest, read_manifest
from tasks.registry import store as registry

# 6: the base model's GGUF that gguf/Modelfile.adapter names; 5: the GGUF LoRA adapter (gguf/lora-f32.gguf); 4: GGUF
# files (export.gguf); 3: GPT-2 merged models keep their Conv1D layers; 2: registry, merged model, generation metrics
VERSION = "6"
# the key's version of an export without GGUF files: 6 changed only what export.gguf writes, so those exports keep
# the key they had (a runs_dir of before stays Cached)
_VERSION_WITHOUT_GGUF = "5"

METRIC_ROWS = [("eval loss", "eval_loss"), ("perplexity", "perplexity"), ("exact match", "exact_match"),
               ("ROUGE-L", "rouge_l")]


def spec(args: ExportArgs, runs_dir: Path, data_dir: str, model_dir: str, adapter_dir: str,
         eval_dir: str, judged: dict[str, Any] | None = None) -> StageSpec:
    """Cache-key inputs: export settings and the four upstream stages (not `judged`, the champion's scores: the
    champion changes as runs publish, while this export does not). One exception: a verdict given without the
    judge's say, because the judge could not be reached, is an export of its own (params' judge), so that the next
    run, the judge back, judges and publishes this adapter again instead of reusing that verdict."""
    unjudged = {"judge": UNJUDGED} if _unjudged(judged) else {}
    return StageSpec(stage="export_adapter", version=VERSION if args.gguf else _VERSION_WITHOUT_GGUF, runs_dir=runs_dir,
                     params={"export": registry.settings(args.model_dump()), **unjudged},
                     upstream={"prepare_data": Path(data_dir), "prepare_model": Path(model_dir),
                               "train_adapter": Path(adapter_dir), "evaluate_adapter": Path(eval_dir)})


UNJUDGED = "could not be reached"  # the judge's status behind such an export


def _unjudged(judged: dict[str, Any] | None) -> bool:
    return ((judged or {}).get("judge") or {}).get("status") == "unreachable"


@task(name="export_adapter", **stage_task_options(spec))
def export_adapter(args: ExportArgs, runs_dir: Path, data_dir: str, model_dir: str, adapter_dir: str,
                   eval_dir: str, judged: dict[str, Any] | None = None) -> str:
    """Write the adapter, tokenizer, model card and run config; publish them as a registry version, judged against
    the champion's scores on this run's eval data (`judged`: score_champion's, None when it scored none)."""
    with open_stage(spec(args, runs_dir, data_dir, model_dir, adapter_dir, eval_dir, judged)) as stage:
        if stage.done:
            registry.repair(registry.registry_dir(runs_dir, args.name), stage.dir)  # logs what it repaired
            return str(stage.dir)
        if problem := registry.non_finite(Path(adapter_dir) / "adapter"):  # before any copy, merge or GGUF
            raise UserError(f"export_adapter: the adapter in {adapter_dir} cannot be exported: {problem}: training "
                            "diverged. Nothing was exported or published. Train again with a lower "
                            "train.learning_rate (or from another train.init_adapter), then run again.")
        manifests = {m.stage: m for m in map(read_manifest, map(Path, (data_dir, model_dir, adapter_dir, eval_dir)))}
        tokenizer = sum((Path(model_dir) / name).stat().st_size for name in _tokenizer_files(Path(model_dir)))
        disk.require("export_adapter", runs_dir, stage.dir, disk.folder_bytes(Path(adapter_dir) / "adapter")
                     + tokenizer, "the adapter and its tokenizer")
        outputs = _copy_files(Path(adapter_dir) / "adapter", stage.dir,
                              names=["adapter_config.json", "adapter_model.safetensors"])
        outputs += _copy_files(Path(model_dir), stage.dir, names=_tokenizer_files(Path(model_dir)))
        outputs += _judge_verdicts(runs_dir, stage.dir, judged)
        config = _run_config(manifests, args)
        point_at_base_model(stage.dir / "adapter_config.json", config["model"]["base_model"])
        (stage.dir / "run_config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        if args.merge:
            outputs += merge(Path(model_dir), Path(adapter_dir) / "adapter", stage.dir / "merged", args,
                             manifests["train_adapter"].method().head)
        ggufs = _ggufs(Path(model_dir), stage.dir, args) if args.merge else []
        outputs += ggufs
        card = partial(model_card, args.name, manifests, config, ggufs=ggufs)
        (stage.dir / "README.md").write_text(card(stage.dir, None))
        root = registry.registry_dir(runs_dir, args.name)
        record = registry.publish(root, stage.dir, stage.key, _gate_metrics(manifests, judged), args.promotion_margin,
                                  manifests["prepare_data"].key, card,
                                  _lineage(manifests, Path(model_dir), args, _unjudged(judged)),
                                  accept_new_measure=args.accept_new_measure)
        logger().info("export_adapter: %s %s %s: %s", args.name, record["version"], record["promotion"],
                      record["reason"])
        published = [f"{registry.PUBLISHED}/README.md", f"{registry.PUBLISHED}/{registry.VERSION_FILE}"]
        stage.finish([*outputs, "run_config.yaml", "README.md", *published], _stage_metrics(root, args.name, record))
        return str(stage.dir)


def _gate_metrics(manifests: dict[str, Manifest], judged: dict[str, Any] | None) -> dict[str, Any]:
    """This run's eval metrics with the champion's scores on the same data (an evaluation written before the
    champion was scored apart may carry an older champion's: those are dropped)."""
    metrics = manifests["evaluate_adapter"].metrics.model_dump(exclude_unset=True, exclude={"memo"})
    own = {k: v for k, v in metrics.items() if k not in ChampionScores.model_fields}
    return {**own, **(judged or {})}


def _lineage(manifests: dict[str, Manifest], model_dir: Path, args: ExportArgs, unjudged: bool = False
             ) -> dict[str, Any]:
    """What the version record keeps for later runs: the base model and train_adapter key (to score it on their
    data), what its evaluation measured (like with like), its evaluation key and export settings (published; an
    export the judge could not judge is marked, so that a later run does not take it for published)."""
    return {"base_model": registry.base_identity(model_dir), "adapter_key": manifests["train_adapter"].key,
            "method": manifests["train_adapter"].method().name,
            "measure": registry.measure(manifests["prepare_data"].metrics.model_dump()),
            "evaluation": manifests["evaluate_adapter"].key,
            "export": {**registry.settings(args.model_dump(mode="json")), **({"judge": UNJUDGED} if unjudged else {})}}


def _judge_verdicts(runs_dir: Path, folder: Path, judged: dict[str, Any] | None) -> list[str]:
    """The judge's verdicts (both answers, both orders, the judge's text) copied beside the adapter, so that the
    version keeps what it was judged on: judge-verdicts.jsonl, or nothing without a judge."""
    kept = ((judged or {}).get("judge") or {}).get("verdicts")
    source = Path(runs_dir).expanduser().resolve() / kept if kept else None
    if source is None or not source.is_file():
        return []
    shutil.copyfile(source, folder / "judge-verdicts.jsonl")
    return ["judge-verdicts.jsonl"]


def _stage_metrics(root: Path, name: str, record: dict[str, Any]) -> dict[str, Any]:
    """The verdict, flat, for the manifest and the run summary; the version's path relative to runs_dir (a copied
    runs_dir's summary names its own copy: run_record)."""
    now = registry.champion(root)
    scores = {k: v for k, v in record["metrics"].items() if k in ChampionScores.model_fields}
    return {"export_name": name, "export_version": record["version"],
            "export_path": f"exports/{name}/{record['version']}", "promotion": record["promotion"],
            "promotion_reason": record["reason"],
            "champion_version": now and now["version"],
            "champion_tuned_eval_loss": now and now["metrics"]["tuned_eval_loss"], "gate_rule": record.get("rule"),
            "published_now": record.get("published_now", True), **scores}


def _fmt(value: Any) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def _ggufs(model_dir: Path, folder: Path, args: ExportArgs) -> list[str]:
    """export.gguf's files in folder/gguf: the merged model's, the LoRA's and, with the LoRA, the base model's that
    Modelfile.adapter names (the adapter's Ollama form, usable as exported)."""
    merged, out = folder / "merged", folder / "gguf"
    ggufs = write_gguf(merged, out, args.gguf)
    lora = write_lora_gguf(folder, merged / "config.json", out, args.gguf)
    if lora:
        lora += write_base_gguf(_dequantized_base(model_dir, merged, args), merged, out, args.gguf)
    return ggufs + lora


def _dequantized_base(model_dir: Path, merged: Path, args: ExportArgs) -> Iterator[tuple[str, Any]]:
    """The 4-bit base dequantized in export.merged_dtype, as merge() starts from it: merged/'s tensors by name, as
    float32 numpy arrays, one at a time (merged/ leaves out tied copies, so does this)."""
    import torch
    from safetensors import safe_open

    from tasks.models.loading import load_quantized
    from tasks.models.memory import release_device_memory

    names: list[str] = []
    for file in sorted(merged.glob("*.safetensors")):  # the order gguf._tensors reads merged/ in
        with safe_open(file, framework="pt") as f:
            names += f.keys()
    base = load_quantized(model_dir).dequantize().to(getattr(torch, args.merged_dtype))
    weights = base.state_dict()
    for name in names:
        yield name, weights[name].float().cpu().numpy()
    del base, weights
    release_device_memory()


def merge(model_dir: Path, adapter: Path, out: Path, args: ExportArgs, head: str = "causal_lm") -> list[str]:
    """Dequantize the 4-bit base, merge the adapter in, save safetensors and the tokenizer; the files written.
    `head`: the adapter's (a reward model's is a score head, saved with the merged model)."""
    import torch
    from peft import PeftModel

    from tasks.models.loading import load_quantized
    from tasks.models.memory import release_device_memory

    # merge into the dequantized NF4 weights, the very weights the adapter was trained against (not the
    # original full-precision ones, whose quantization error the adapter never saw)
    start = time.perf_counter()
    quantized = load_quantized(model_dir, head=head)
    loaded = time.perf_counter()
    conv1d = _conv1d_names(quantized)
    base = quantized.dequantize().to(getattr(torch, args.merged_dtype))
    merged = _restore_conv1d(PeftModel.from_pretrained(base, adapter).merge_and_unload(), conv1d)
    merged_at = time.perf_counter()
    disk.require("export_adapter", out.parents[2], out, merged.get_memory_footprint(),  # out: runs/stage/key/merged
                 f"the merged {args.merged_dtype} model")
    merged.save_pretrained(out, max_shard_size=args.max_shard_size)
    _copy_files(model_dir, out, names=_tokenizer_files(model_dir))
    logger().info("export_adapter: merged %s model (%s) in %s: load %.1fs, dequantize and merge %.1fs, save %.1fs",
                  args.merged_dtype, adapter, out, loaded - start, merged_at - loaded, time.perf_counter() - merged_at)
    del quantized, base, merged
    release_device_memory()
    return sorted(str(p.relative_to(out.parent)) for p in out.rglob("*") if p.is_file())


def _conv1d_names(model: Any) -> list[str]:
    """4-bit layers that were GPT-2 Conv1D layers before quantization (transformers keeps the source class)."""
    from transformers.pytorch_utils import Conv1D

    return [name for name, module in model.named_modules()
            if isinstance(getattr(module, "source_cls", None), type) and issubclass(module.source_cls, Conv1D)]


def _restore_conv1d(model: Any, names: list[str]) -> Any:
    """Put GPT-2's Conv1D layers back: dequantize() returns nn.Linear (weight out x in), while a GPT-2 checkpoint
    stores Conv1D weights in x out; saved as Linear they load transposed, or not at all."""
    from transformers.pytorch_utils import Conv1D

    for name in names:
        linear = model.get_submodule(name)
        conv = Conv1D(linear.out_features, linear.in_features).to(linear.weight.dtype)
        conv.weight.data = linear.weight.data.t().contiguous()
        if linear.bias is not None:
            conv.bias.data = linear.bias.data
        model.set_submodule(name, conv)
    return model


def _tokenizer_files(model_dir: Path) -> list[str]:
    return [name for name in TOKENIZER_FILES if (model_dir / name).is_file()]


def _copy_files(src: Path, dst: Path, names: list[str] | None = None) -> list[str]:
    names = names or [p.name for p in src.iterdir() if p.is_file()]
    for name in names:
        shutil.copy2(src / name, dst / name)
    return names


def _run_config(manifests: dict[str, Manifest], args: ExportArgs) -> dict[str, Any]:
    """The RunConfig sections that produced the adapter; `qlora-pipeline run --config` accepts the file as is."""
    params = {**manifests["prepare_data"].params, **manifests["prepare_model"].params,
              **manifests["train_adapter"].params, **manifests["evaluate_adapter"].params,
              "export": args.model_dump(mode="json")}
    # prepare_data's "tokenizer" entry repeats model.base_model/revision for its key: not a config section
    return RunConfig.model_validate({k: v for k, v in params.items() if k in RunConfig.model_fields}).model_dump(
        mode="json", exclude={"runs_dir"})


def _method_rows(method: methods.Method, metrics: dict[str, Any]) -> list[tuple[str, str]]:
    """The card's rows of what the method shows beside the loss (tasks/methods.py), its measure marked; a metric
    that is one number per name (a reward per function) is a row per name."""
    rows = []
    for label, key in method.shown:
        value = metrics.get(f"tuned_{key}")
        gated = " (gated)" if key == method.measure.key else ""
        rows += ([(f"{label} {name}", f"{key}.{name}") for name in value] if isinstance(value, dict)
                 else [(label + gated, key)])
    return rows


def _metric(metrics: dict[str, Any], who: str, key: str) -> Any:
    """metrics[f"{who}_{key}"]; a dotted key reads into a dict (rewards.format: {who}_rewards["format"])."""
    field, _, inner = key.partition(".")
    value = metrics.get(f"{who}_{field}")
    return (value or {}).get(inner) if inner else value


def _gated_answers(metrics: dict[str, Any], judged: str | None) -> str:
    """The card's regression suites (eval.suites) and the pairwise judge's verdict (eval.judge), when the run had
    them: what the gate judged besides the method's measure."""
    lines, suites = [], metrics.get("suites") or {}
    if suites:
        lines += ["", "Regression suites (lm-evaluation-harness; the gate allows each its tolerance below the "
                  f"{'champion' if judged else 'base model'}):", "",
                  "| suite | metric | base |" + (f" champion {judged} |" if judged else "") + " tuned | tolerance |",
                  "|---|---|---|---|---|" + ("---|" if judged else "")]
        for name, suite in suites.items():
            who = ["base", *(["champion"] if judged else []), "tuned"]
            lines.append(f"| {name} | {suite['metric']} | " + " | ".join(
                _fmt((metrics.get(f"{w}_suites") or {}).get(name)) for w in who) + f" | {suite['tolerance']:g} |")
    judge = metrics.get("judge")
    if judge and judge.get("status") == "judged":
        lines += ["", f"Pairwise judge `{judge['model']}`: win rate {judge['win_rate']:.3f} against {judge['against']} "
                  f"over {judge['prompts']} held-out prompts, each judged in both orders ({judge['wins']} won, "
                  f"{judge['ties']} tied, {judge['losses']} lost, {judge['unparseable']} unparseable); its "
                  f"{judge['confidence']:.0%} lower bound {judge['lower_bound']:.3f}, needed at least "
                  f"{judge['min_win_rate']:g}. The verdicts are in `judge-verdicts.jsonl`."]
    elif judge:
        lines += ["", f"Pairwise judge `{judge['model']}`: no verdict ({judge.get('reason')})."]
    return "\n".join(lines) + "\n" if lines else ""


def model_card(name: str, manifests: dict[str, Manifest], config: dict[str, Any], folder: Path,
               record: dict[str, Any] | None, ggufs: list[str] | None = None) -> str:
    """The README.md shipped with the adapter in `folder`; `record` is its registry verdict, once known."""
    data, model = manifests["prepare_data"], manifests["prepare_model"]
    # the verdict's metrics hold the champion scored beside it (score_champion); the stage's own card has none
    metrics = record["metrics"] if record is not None else manifests["evaluate_adapter"].metrics.model_dump()
    base, quant = config["model"]["base_model"], config["model"]
    revision = model.fingerprint.get("hub_commit") or config["model"]["revision"]
    judged = metrics.get("judged_against")
    who = ["base", *(["champion"] if judged else []), "tuned"]
    method = manifests["train_adapter"].method()
    rows = METRIC_ROWS + _method_rows(method, metrics)
    # a scorer (a reward model) loads as a sequence classifier with one output, its score head from the adapter
    loader, labels = (("AutoModelForCausalLM", "") if method.head == "causal_lm" else
                      ("AutoModelForSequenceClassification", ", num_labels=1"))
    table = "\n".join(f"| {label} | " + " | ".join(_fmt(_metric(metrics, w, key)) for w in who) + " |"
                      for label, key in rows)
    header = "| metric | base |" + (f" champion {judged} |" if judged else "") + " tuned (this adapter) |"
    header += "\n|---|---|---|" + ("---|" if judged else "")
    versus = f" vs base + the champion {judged}" if judged else ""
    verdict = "" if record is None else (f"\nRegistry: `{name}` **{record['version']}**, {record['promotion']}: "
                                         f"{record['reason']}.\n")
    merged = ("\nThe merged model (base dequantized, adapter merged in) is in `merged/`: "
              f"`{loader}.from_pretrained(\"{folder / 'merged'}\"{labels})`, no peft needed.\n"
              if config["export"]["merge"] else "")
    note = f"\n{method.card_note}" if method.card_note else ""
    named = [Path(g).name for g in ggufs or [] if g.endswith(".gguf")]
    loras, bases = ([g for g in named if g.startswith(prefix)] for prefix in ("lora-", "base-"))
    models = [g for g in named if g not in loras + bases]
    merged += (f"\nGGUF files for llama.cpp and Ollama in `gguf/`: {', '.join(f'`{g}`' for g in models)}, and "
               "`gguf/Modelfile` (`ollama create NAME -f gguf/Modelfile`).\n" if models else "")
    merged += (f"\nThe adapter as a GGUF LoRA in `gguf/`: `{loras[0]}`, on `{bases[0]}`, the base as the adapter "
               f"was trained against it (`llama-server -m gguf/{bases[0]} --lora gguf/{loras[0]}`; Ollama: "
               "`ollama create NAME -f gguf/Modelfile.adapter`).\n" if loras and bases else "")
    return f"""---
library_name: peft
base_model: {base}
tags: [qlora, lora, peft]
---

# {name}

A LoRA adapter for `{base}` trained ({method.name}) with QLoRA (4-bit {quant['bnb_4bit_quant_type']} base) by
qlora-pipeline.
{verdict}
- Base model: `{base}`, revision `{revision or 'local folder'}`, fingerprint `{json.dumps(model.fingerprint)}`
- Data: `{config['data']['source']}` ({data.metrics.format} format), fingerprint
  `{data.fingerprint['data']}`; {data.metrics.train_examples} train and
  {data.metrics.eval_examples} eval examples, max {config['data']['max_seq_length']} tokens
- LoRA: `{json.dumps(config['lora'])}`
- Training: `{json.dumps(config['train'])}`, speed: `{json.dumps(config['speed'])}`
- Optimizer steps: {manifests['train_adapter'].metrics.optimizer_steps}

## Evaluation

Loss and perplexity over {metrics['eval_examples']} held-out examples ({metrics['eval_tokens']} label tokens);
exact match and ROUGE-L of greedy answers to {metrics.get('generation_samples', 0)} held-out prompts (at most
{metrics.get('max_new_tokens', 'n/a')} new tokens), base model vs base + this adapter{versus}, in the same pass.{note}

{header}
{table}
{_gated_answers(metrics, judged)}
## Load it

```python
import torch
from peft import PeftModel
from transformers import {loader}, AutoTokenizer, BitsAndBytesConfig

quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="{quant['bnb_4bit_quant_type']}",
                           bnb_4bit_use_double_quant={quant['bnb_4bit_use_double_quant']},
                           bnb_4bit_compute_dtype=torch.{model.metrics.compute_dtype})
base = {loader}.from_pretrained("{base}", revision={revision!r}, quantization_config=quant{labels})
model = PeftModel.from_pretrained(base, "{folder}")
tokenizer = AutoTokenizer.from_pretrained("{folder}")
```
{merged}
The full settings are in `run_config.yaml`; `qlora-pipeline run --config run_config.yaml` retrains it.
"""
