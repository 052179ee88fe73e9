"""export_adapter: the adapter in PEFT format, ready to ship, with a model card and the run's config.

Reads the adapter (train_adapter), the tokenizer (prepare_model), metrics.json (evaluate_adapter) and
the upstream manifests. Writes into runs_dir/export_adapter/<key>/: adapter_model.safetensors and
adapter_config.json (loadable with PeftModel.from_pretrained), the tokenizer files, README.md (model
card: base model, data fingerprint, settings, metrics, how to load) and run_config.yaml (the
RunConfig sections that produced it).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import yaml
from prefect import task

from tasks.caching import stage_task_options
from tasks.config import ExportArgs
from tasks.manifest import StageSpec, open_stage, read_manifest

VERSION = "1"


def spec(args: ExportArgs, runs_dir: Path, data_dir: str, model_dir: str, adapter_dir: str,
         eval_dir: str) -> StageSpec:
    """Cache-key inputs: export settings and the four upstream stages."""
    return StageSpec(stage="export_adapter", version=VERSION, runs_dir=runs_dir,
                     params={"export": args.model_dump()},
                     upstream={"prepare_data": Path(data_dir), "prepare_model": Path(model_dir),
                               "train_adapter": Path(adapter_dir), "evaluate_adapter": Path(eval_dir)})


@task(name="export_adapter", **stage_task_options(spec))
def export_adapter(args: ExportArgs, runs_dir: Path, data_dir: str, model_dir: str, adapter_dir: str,
                   eval_dir: str) -> str:
    """Copy the adapter and tokenizer, and write the model card and run config."""
    with open_stage(spec(args, runs_dir, data_dir, model_dir, adapter_dir, eval_dir)) as stage:
        if stage.done:
            return str(stage.dir)
        manifests = {m["stage"]: m for m in map(read_manifest, map(Path, (data_dir, model_dir, adapter_dir,
                                                                           eval_dir)))}
        outputs = _copy_files(Path(adapter_dir) / "adapter", stage.dir,
                              names=["adapter_config.json", "adapter_model.safetensors"])
        outputs += _copy_files(Path(model_dir), stage.dir, names=_tokenizer_files(Path(model_dir)))
        config = _run_config(manifests, args)
        (stage.dir / "run_config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        (stage.dir / "README.md").write_text(model_card(args.name, manifests, config))
        stage.finish([*outputs, "run_config.yaml", "README.md"], {"name": args.name})
        return str(stage.dir)


def _tokenizer_files(model_dir: Path) -> list[str]:
    return [p.name for p in model_dir.iterdir() if p.name.startswith(("tokenizer", "special_tokens",
                                                                       "chat_template"))]


def _copy_files(src: Path, dst: Path, names: list[str] | None = None) -> list[str]:
    names = names or [p.name for p in src.iterdir() if p.is_file()]
    for name in names:
        shutil.copy2(src / name, dst / name)
    return names


def _run_config(manifests: dict[str, dict[str, Any]], args: ExportArgs) -> dict[str, Any]:
    return {**manifests["prepare_data"]["params"], **manifests["prepare_model"]["params"],
            **manifests["train_adapter"]["params"], **manifests["evaluate_adapter"]["params"],
            "export": args.model_dump()}


def model_card(name: str, manifests: dict[str, dict[str, Any]], config: dict[str, Any]) -> str:
    """The README.md shipped with the adapter."""
    data, model = manifests["prepare_data"], manifests["prepare_model"]
    metrics = manifests["evaluate_adapter"]["metrics"]
    base = config["model"]["base_model"]
    rows = [("eval loss", "base_eval_loss", "tuned_eval_loss"), ("perplexity", "base_perplexity",
                                                                  "tuned_perplexity")]
    table = "\n".join(f"| {label} | {metrics[b]:.4f} | {metrics[t]:.4f} |" for label, b, t in rows)
    return f"""---
library_name: peft
base_model: {base}
tags: [qlora, lora, peft]
---

# {name}

A LoRA adapter for `{base}` trained with QLoRA (4-bit {config['model']['bnb_4bit_quant_type']} base)
by qlora-pipeline.

- Base model: `{base}`, revision `{config['model']['revision'] or 'default'}`, fingerprint
  `{json.dumps(model['fingerprint'])}`
- Data: `{config['data']['source']}` ({data['metrics']['format']} format), fingerprint
  `{data['fingerprint']['data']}`; {data['metrics']['train_examples']} train and
  {data['metrics']['eval_examples']} eval examples, max {config['data']['max_seq_length']} tokens
- LoRA: `{json.dumps(config['lora'])}`
- Training: `{json.dumps(config['train'])}`
- Optimizer steps: {manifests['train_adapter']['metrics']['optimizer_steps']}

## Evaluation ({metrics['eval_examples']} held-out examples, {metrics['eval_tokens']} label tokens)

| metric | base | tuned |
|---|---|---|
{table}

## Load it

```python
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

base = AutoModelForCausalLM.from_pretrained("{base}", quantization_config=BitsAndBytesConfig(load_in_4bit=True))
model = PeftModel.from_pretrained(base, "path/to/this/folder")
tokenizer = AutoTokenizer.from_pretrained("path/to/this/folder")
```

The full settings are in `run_config.yaml`; `qlora-pipeline run --config run_config.yaml` retrains it.
"""
