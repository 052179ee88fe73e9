"""train_adapter in child processes: one per GPU through torchrun (never a home-made launcher), or one alone.

train_adapter (the Prefect task) stays in the parent process: it takes the stage lock and the GPU slot, starts
torchrun (`python -m tasks.train_adapter.launch launch PID --standalone --nproc_per_node N -m
tasks.train_adapter.launch ARGS.json`: torch.distributed.run's own main, in a process that ends with the task)
and, once every rank has exited cleanly, writes the manifest from what rank 0 reported. Each rank loads the 4-bit
model on its own GPU (LOCAL_RANK); the transformers Trainer wraps it in DDP, or with speed.fsdp shards it with
FSDP2. Checkpoints, resume and the loss log are rank 0's. On a machine without GPUs the ranks are CPU processes
with the gloo backend (how the CPU tests exercise this path). Several nodes: docs/multi-gpu.md.

A single-GPU run whose GPU came from the pool trains in one child process the same way, without torchrun: the
flow-run process has usually initialised CUDA already (prepare_model quantizes on the GPU), after which a
CUDA_VISIBLE_DEVICES set there no longer changes what it sees; a new process reads it when it starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tasks.config import LoraArgs, SpeedArgs, TrainArgs
from tasks.errors import UserError
from tasks.log import logger
from tasks.pool.cpus import THREADS_VARIABLE

RESULT = ".rank0-result.json"  # rank 0's metrics, read by the parent
USER_ERROR_PREFIX = "QLORA_USER_ERROR: "
LAUNCHER_PID = "QLORA_LAUNCHER_PID"
LOG = "distributed.log"  # the ranks' output, beside the checkpoints in the stage folder
ARGS_FILE = ".distributed-args.json"  # what each rank trains (write_args)
DUMP_STACKS_EVERY = "QLORA_DUMP_STACKS_EVERY"  # seconds; each rank then prints its Python stacks that often


def launch(lora: LoraArgs, train: TrainArgs, speed: SpeedArgs, data_dir: str, model_dir: str, out: Path, nproc: int,
           devices: list[str] | None = None, threads: int | None = None) -> dict[str, Any]:
    """Run the ranks under torchrun (one process without it); relay their output to the log; rank 0's metrics, or
    the failing rank's error. `devices`: the GPUs the pool gave this run, the only ones the ranks see; `threads`:
    torch's threads per rank."""
    args_file = write_args(lora, train, speed, data_dir, model_dir, out)
    run_ranks(args_file, nproc, devices, threads)
    return json.loads((out / RESULT).read_text())


def write_args(lora: LoraArgs, train: TrainArgs, speed: SpeedArgs, data_dir: str, model_dir: str, out: Path) -> Path:
    """The ranks' arguments, ARGS_FILE in the stage folder (every node of a training across hosts reads it there)."""
    args_file = out / ARGS_FILE
    sections = {"lora": lora.model_dump(), "train": train.model_dump(), "speed": speed.model_dump()}
    args_file.write_text(json.dumps({**sections, "data_dir": data_dir, "model_dir": model_dir, "out": str(out)}))
    (out / RESULT).unlink(missing_ok=True)
    return args_file


def run_ranks(args_file: Path, nproc: int, devices: list[str] | None = None, threads: int | None = None,
              rendezvous: list[str] | None = None, log_name: str = LOG,
              started: Callable[[subprocess.Popen], None] | None = None) -> None:
    """Run this host's `nproc` ranks on ARGS_FILE `args_file` (torchrun, standalone or with the `rendezvous`
    arguments of a training across hosts; one process alone without either), their output relayed to the log and
    kept whole in `log_name` beside it. Raises the failing rank's error. `started` gets the process once started."""
    out = args_file.parent
    # the ranks are not Prefect runs: no run context, so no artifacts or GPU slot of their own
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT__")}
    if devices:  # set before the child starts: CUDA reads it once, when it initialises
        env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
    threads = threads or max(1, (os.cpu_count() or 1) // nproc)
    env.update(OMP_NUM_THREADS=str(threads), **{THREADS_VARIABLE: str(threads)})
    rank = ["-m", "tasks.train_adapter.launch", str(args_file)]
    command = [sys.executable, *rank] if nproc == 1 and not rendezvous else [
        sys.executable, "-m", "tasks.train_adapter.launch", "launch", str(os.getpid()),
        *(rendezvous or ["--standalone"]), f"--nproc_per_node={nproc}", *rank]
    logger().info("train_adapter: %s on GPU(s) %s: %s", "one process" if nproc == 1 and not rendezvous else
                  f"data-parallel over {nproc} processes" + (" on this host" if rendezvous else ""),
                  ",".join(devices) if devices else "none (CPU)", " ".join(command[1:]))
    tail: deque[str] = deque(maxlen=40)
    with (subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc,
          (out / log_name).open("w", buffering=1) as log):  # the ranks' whole output, line by line (a killed run's too)
        try:
            if started:
                started(proc)
            for line in proc.stdout:
                log.write(line)
                tail.append(line.rstrip())
                if line.startswith(USER_ERROR_PREFIX):
                    user_error = line[len(USER_ERROR_PREFIX):].strip()
                elif "train_adapter:" in line or "Error" in line:
                    logger().info("%s", line.rstrip())
        except BaseException:  # SIGTERM to this process alone (Prefect raises it here), a cancel, an error
            stop(proc)
            raise
    if proc.returncode != 0:
        if "user_error" in locals():
            raise UserError(user_error)
        raise RanksFailed(f"train_adapter: a rank of the {nproc}-process training failed (exit {proc.returncode}); "
                          f"all output in {out / log_name}; it ends:\n" + "\n".join(tail))


STOP_SECONDS = 30  # how long the training gets to end on SIGTERM before SIGKILL (torchrun gives its ranks as long)


def stop(proc: subprocess.Popen) -> None:
    """End the training child now, as the run that started it ends: SIGTERM (torchrun passes it to its ranks), then
    SIGKILL if it outlives STOP_SECONDS. Without this a SIGTERM to the run's process alone (systemd and Kubernetes
    signal one process) left the child training to the end while the run waited for it (Popen's exit waits), then
    finishing, which removes the checkpoints, with no manifest to show for it: the next run trained from step 1.
    Stopped here, its latest complete checkpoint stays and the next run resumes from it."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=STOP_SECONDS)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class RanksFailed(RuntimeError):
    """A rank (or torchrun) ended with an error; the message ends with the output's last lines."""


def exit_with_parent(parent: int) -> None:
    """End this process within a second of `parent` ending. torchrun starts every rank in a session of its own,
    out of reach of a kill aimed at the run's process group: without this, a killed run would leave its ranks
    training on, holding the GPUs and writing into the stage folder beside the run that resumes it."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def dump_stacks_every(seconds: float) -> None:
    """Print every thread's Python stack to stderr every `seconds`, from a daemon thread. It holds the GIL while
    it reads the other threads' frames: faulthandler's timer reads them without it, and crashed a rank with
    SIGSEGV in the middle of a dump (2 gloo processes on CPU, dumps every 3 s). The price: a rank stuck in C
    code that holds the GIL prints nothing."""
    def dump() -> None:
        while True:
            time.sleep(seconds)
            names = {t.ident: t.name for t in threading.enumerate()}
            lines = [f"--- Python stacks of rank {os.environ.get('RANK', '0')}, every {seconds:g} s"]
            for ident, frame in sys._current_frames().items():
                lines.append(f"Thread {ident:#x} ({names.get(ident, '?')}), most recent call last:")
                lines.extend(line.rstrip("\n") for line in traceback.format_stack(frame))
            print("\n".join(lines), file=sys.stderr, flush=True)

    threading.Thread(target=dump, daemon=True, name="qlora-stack-dumps").start()


def _torchrun_main(parent: int, torchrun_args: list[str]) -> None:
    """torchrun itself, in a process that ends with the train_adapter task that started it."""
    from torch.distributed import run

    exit_with_parent(parent)
    os.environ[LAUNCHER_PID] = str(os.getpid())  # the ranks' parent, for their own exit_with_parent
    run.main(torchrun_args)


def _rank_main(args_file: Path) -> None:
    """One rank: train (the Trainer sees torchrun's environment and uses DDP); rank 0 saves and reports."""
    import logging

    from tasks.train_adapter.builder import fit_and_save
    from tasks.train_adapter.methods import unit

    exit_with_parent(int(os.environ.get(LAUNCHER_PID, os.getppid())))
    if threads := os.environ.get(THREADS_VARIABLE):  # the parent's share of the host for each rank
        import torch

        torch.set_num_threads(int(threads))
    if every := os.environ.get(DUMP_STACKS_EVERY):  # where a stuck rank waits: its stacks, into distributed.log
        dump_stacks_every(float(every))

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    print(f"train_adapter: rank {os.environ.get('RANK', '0')} sees CUDA_VISIBLE_DEVICES="
          f"{os.environ.get('CUDA_VISIBLE_DEVICES', '(unset: every GPU)')}, {threads or 'default'} torch threads",
          flush=True)
    spec = json.loads(args_file.read_text())
    out = Path(spec["out"])
    try:
        train = TrainArgs(**spec["train"])
        metrics = fit_and_save(unit(train.method), LoraArgs(**spec["lora"]), train, SpeedArgs(**spec["speed"]),
                               spec["data_dir"], spec["model_dir"], out)
    except UserError as exc:
        print(USER_ERROR_PREFIX + str(exc).replace("\n", " "), flush=True)
        raise SystemExit(2) from exc
    if int(os.environ.get("RANK", "0")) == 0:
        (out / RESULT).write_text(json.dumps(metrics))
    _leave_process_group()


def _leave_process_group() -> None:
    """Destroy the rank's process group before the interpreter exits: left to its teardown, gloo's threads can
    abort a rank that finished training ("terminate called without an active exception", SIGABRT), which fails
    the run."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] == "launch":  # python -m tasks.train_adapter.launch launch PARENT_PID TORCHRUN_ARGS...
        _torchrun_main(int(sys.argv[2]), sys.argv[3:])
    else:  # a rank: python -m tasks.train_adapter.launch ARGS.json
        _rank_main(Path(sys.argv[1]))
