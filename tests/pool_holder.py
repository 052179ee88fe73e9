"""A run that holds GPUs of the pool until told to let go, for tests that need runs in processes of their own:
`python -m tests.pool_holder GPUS FOLDER`. It writes FOLDER/flow-run (its flow run's id) at once, FOLDER/held (the
devices it holds) once it holds them, and lets go when FOLDER/release exists."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from prefect import flow, task

from tasks.pool.gpus import gpu_slot


def _write(path: Path, text: str) -> None:
    """Write `text` whole before `path` exists: the test polls for the file and reads it at once (written in place,
    it was read empty between its creation and its write on a loaded machine)."""
    path.with_suffix(".part").write_text(text)
    path.with_suffix(".part").replace(path)


@task(name="train_adapter")  # the pool's own task name: "Waiting for GPU" is judged among a run's trainings
def hold(gpus: int, folder: str) -> None:
    from prefect.runtime import flow_run

    _write(Path(folder) / "flow-run", str(flow_run.id))
    with gpu_slot(gpus) as devices:
        _write(Path(folder) / "held", ",".join(devices or []))
        while not (Path(folder) / "release").exists():
            time.sleep(0.2)


@flow(name="pool-holder")
def pool_holder(gpus: int, folder: str) -> None:
    hold(gpus, folder)


if __name__ == "__main__":
    pool_holder(int(sys.argv[1]), sys.argv[2])
