"""Data-parallel train_adapter: one process per GPU through torchrun, never a home-made launcher.

train_adapter (the Prefect task) stays in the parent process: it takes the stage lock and the GPU slot,
starts `torchrun --standalone --nproc_per_node N -m tasks.distributed ARGS.json` and, once every rank
has exited cleanly, writes the manifest from what rank 0 reported. Each rank loads the 4-bit model on
its own GPU (LOCAL_RANK) and the transformers Trainer wraps it in DDP; checkpoints, resume and the loss
log are rank 0's. On a machine without GPUs the ranks are CPU processes with the gloo backend (how the
CPU tests exercise this path). Multi-node: see the README's "Multi-GPU" section.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import deque
from pathlib import Path
from typing import Any

from tasks.config import LoraArgs, TrainArgs
from tasks.errors import UserError
from tasks.log import logger

RESULT = ".rank0-result.json"  # rank 0's metrics, read by the parent
USER_ERROR_PREFIX = "QLORA_USER_ERROR: "


def world_size(train: TrainArgs) -> int:
    """Processes to train with: train.num_gpus, with 'auto' = every visible GPU (1 on a CPU machine)."""
    if train.num_gpus != "auto":
        return int(train.num_gpus)
    import torch

    return max(torch.cuda.device_count(), 1)


def launch(lora: LoraArgs, train: TrainArgs, data_dir: str, model_dir: str, out: Path, nproc: int) -> dict[str, Any]:
    """Run the ranks under torchrun; relay their output to the log; rank 0's metrics, or the failing rank's error."""
    args_file = out / ".distributed-args.json"
    args_file.write_text(json.dumps({"lora": lora.model_dump(), "train": train.model_dump(), "data_dir": data_dir,
                                     "model_dir": model_dir, "out": str(out)}))
    (out / RESULT).unlink(missing_ok=True)
    # the ranks are not Prefect runs: no run context, so no artifacts or GPU slot of their own
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT__")}
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               "-m", "tasks.distributed", str(args_file)]
    logger().info("train_adapter: data-parallel over %d processes: %s", nproc, " ".join(command[1:]))
    tail: deque[str] = deque(maxlen=40)
    with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            tail.append(line.rstrip())
            if line.startswith(USER_ERROR_PREFIX):
                user_error = line[len(USER_ERROR_PREFIX):].strip()
            elif "train_adapter:" in line or "Error" in line:
                logger().info("%s", line.rstrip())
    if proc.returncode != 0:
        if "user_error" in locals():
            raise UserError(user_error)
        raise RuntimeError(f"train_adapter: a rank of the {nproc}-process group failed (exit {proc.returncode}); "
                           "its output ends:\n" + "\n".join(tail))
    return json.loads((out / RESULT).read_text())


def _rank_main(args_file: Path) -> None:
    """One rank: train (the Trainer sees torchrun's environment and uses DDP); rank 0 saves and reports."""
    import logging

    from tasks import train_adapter

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    spec = json.loads(args_file.read_text())
    out = Path(spec["out"])
    try:
        metrics = train_adapter.fit_and_save(LoraArgs(**spec["lora"]), TrainArgs(**spec["train"]),
                                             spec["data_dir"], spec["model_dir"], out)
    except UserError as exc:
        print(USER_ERROR_PREFIX + str(exc).replace("\n", " "), flush=True)
        raise SystemExit(2) from exc
    if int(os.environ.get("RANK", "0")) == 0:
        (out / RESULT).write_text(json.dumps(metrics))


if __name__ == "__main__":
    _rank_main(Path(sys.argv[1]))
