"""Trainer callbacks of train_adapter: checkpoint completion marker, loss log, progress."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from tasks.log import logger
from tasks.on_disk.parquet_dataset import pad_collator
from tasks.reporting.artifacts import TrainingProgress, loss_curve
from tasks.train_adapter.resume import write_marker


class mark_complete(TrainerCallback):  # noqa: N801
    """Writes the complete marker after the Trainer has saved everything for a checkpoint."""

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not state.is_world_process_zero:  # rank 0 writes the checkpoint folder
            return
        write_marker(Path(args.output_dir) / f"checkpoint-{state.global_step}", state.global_step)


# what loss.jsonl keeps of a logged step; grpo's mean reward, KL and answer length too (TRL's names)
LOGGED = ("loss", "learning_rate", "grad_norm", "reward", "reward_std", "kl", "completions/mean_length")


class LossLog(TrainerCallback):
    """Appends one JSON line per logged step, the last step always among them; on resume, drops lines after the
    checkpoint's step.

    Also redraws the run's loss-curve artifact: at the first logged step, then at most every PLOT_SECONDS.
    """

    PLOT_SECONDS = 30.0

    def __init__(self, path: Path) -> None:
        self.path = path
        self.plotted = 0.0  # time.monotonic() of the last redraw

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not state.is_world_process_zero:
            return
        if self.path.exists():
            lines = [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
            kept = [line for line in lines if line["step"] <= state.global_step]
            self.path.write_text("".join(json.dumps(line) + "\n" for line in kept))
        else:
            self.path.touch()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # the Trainer logs at multiples of logging_steps only: a training shorter than that left loss.jsonl empty,
        # and one ending between two left its last steps out
        if state.global_step >= state.max_steps:
            control.should_log = True

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
        if logs and "loss" in logs and state.is_world_process_zero:
            entry = {"step": state.global_step, "epoch": round(state.epoch or 0, 4),
                     **{k: logs[k] for k in LOGGED if k in logs}}
            with self.path.open("a") as f:
                f.write(json.dumps(entry) + "\n")
            if time.monotonic() - self.plotted >= self.PLOT_SECONDS:
                self.plotted = time.monotonic()
                loss_curve(self.path)


class Progress(TrainerCallback):
    """Logs step / total, loss, real tokens/s and ETA at each logging step."""

    def __init__(self, collator: pad_collator) -> None:
        self.collator = collator
        self.start = time.time()
        self.first_step = 0
        self.artifact = TrainingProgress()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.start, self.first_step, self.collator.real_tokens = time.time(), state.global_step, 0
        self.marks = [(time.perf_counter(), 0)]  # (time, real tokens so far): start, end of step 1, end of the last
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # Only the two timed steps wait for the GPU (so their times are real, not queued): a wait at every step
        # would let the GPU idle while the host prepares the next one.
        if state.global_step - self.first_step == 1 or state.global_step >= state.max_steps:
            self._mark()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step < state.max_steps and state.global_step - self.first_step > 1:  # stopped early
            self._mark()
        if state.is_world_process_zero:  # the last logged step is rarely the last step: end the bar at 100%
            self.artifact.update(1, 1, f"done: {state.global_step}/{state.max_steps} steps in "
                                       f"{time.time() - self.start:.0f}s")

    def _mark(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.marks.append((time.perf_counter(), self.collator.real_tokens))

    def summary(self) -> dict[str, float]:
        """Real (non-padding) tokens/s of all ranks together, from the end of the first optimizer step (warm-up)
        to the end of the last, and the peak GPU memory of the busiest rank. Every rank must call it."""
        marks = self.marks[1:] if len(self.marks) >= 3 else self.marks
        (t0, k0), (t1, k1) = marks[0], marks[-1]
        peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
        tokens, seconds = float(k1 - k0), max(t1 - t0, 1e-9)
        if dist.is_available() and dist.is_initialized():
            device = "cuda" if dist.get_backend() == "nccl" else "cpu"
            total = torch.tensor([tokens], dtype=torch.float64, device=device)
            slowest = torch.tensor([seconds, peak], dtype=torch.float64, device=device)
            dist.all_reduce(total, op=dist.ReduceOp.SUM)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            tokens, (seconds, peak) = total.item(), slowest.tolist()
        out = {"real_tokens_per_s": round(tokens / seconds, 1)}
        if torch.cuda.is_available():
            out["peak_gpu_allocated_gib"] = round(peak, 2)
        return out

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
        if not logs or "loss" not in logs or not state.is_world_process_zero:
            return
        elapsed = max(time.time() - self.start, 1e-9)
        done = state.global_step - self.first_step
        eta = elapsed / max(done, 1) * (state.max_steps - state.global_step)
        text = (f"step {state.global_step}/{state.max_steps} loss {logs['loss']:.4f}, "
                f"{self.collator.real_tokens / elapsed:.0f} tokens/s, ETA {eta:.0f}s")
        logger().info("train_adapter: %s", text)
        self.artifact.update(state.global_step, state.max_steps, text)
