"""deployments/watch.py: a deployment's run started with fields of its config changed (`qlora-pipeline start`), and
watched until it ends, its artifacts printed as text.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.conftest import flow_run_in


@pytest.mark.slow  # waits on purpose
def test_watch_waits_for_the_failure_card_and_skips_result_records(prefect_env: Path) -> None:
    import threading

    from prefect import get_client
    from prefect.client.schemas.actions import ArtifactCreate
    from prefect.states import Crashed

    from deployments.watch import watch

    run = flow_run_in(Crashed(message="Execution was aborted by a termination signal."))
    with get_client(sync_client=True) as client:  # what Prefect records for a persisted result: no key
        client.create_artifact(ArtifactCreate(type="result", data={"storage_key": "/x/abc"}, flow_run_id=run.id))

    def hook_later() -> None:  # the worker's on_crashed hook writes the card seconds after the state
        time.sleep(4)
        with get_client(sync_client=True) as client:
            client.create_artifact(ArtifactCreate(key="run-failure", type="markdown", flow_run_id=run.id,
                                                  data="## run crashed during train\\_adapter", description="Why"))

    threading.Thread(target=hook_later, daemon=True).start()
    printed: list[str] = []
    assert watch(run.id, out=printed.append, poll_seconds=0.5) == "CRASHED"
    text = "\n".join(printed)
    assert "run crashed during train_adapter" in text and "storage_key" not in text, text


def test_watch_prints_artifact_contents_not_ids(prefect_env: Path) -> None:
    from prefect import flow
    from prefect.artifacts import create_markdown_artifact, create_progress_artifact, create_table_artifact
    from prefect.runtime import flow_run

    from deployments.watch import watch

    @flow
    def with_artifacts() -> str:
        create_markdown_artifact("## Loss\n\n![training loss](data:image/png;base64,iVBORw0KGgo" + "A" * 4000 + ")",
                                 key="loss-curve", description="Training loss")
        create_table_artifact([{"model": "base", "eval loss": "2.1000"}, {"model": "tuned", "eval loss": "1.2000"}],
                              key="eval-metrics", description="v0001 promoted")
        create_progress_artifact(100.0, key="train-progress", description="done: 6/6 steps")
        return flow_run.id

    lines: list[str] = []
    assert watch(with_artifacts(), out=lines.append, poll_seconds=0.1) == "COMPLETED"
    text = "\n".join(lines)
    assert "[image: training loss, 2 KiB PNG" in text and "base64" not in text
    assert "tuned  1.2000" in text and "train-progress: 100% done: 6/6 steps" in text
    assert lines[-1] == "state: Completed"


def test_start_overrides_the_deployments_config_field_by_field() -> None:
    """`qlora-pipeline start NAME --set ...` runs the deployment's own config with those fields changed: Prefect
    merges run parameters only at the top level, so sending the fields alone ran the plain default instead (a
    `start dpo-embedded` trained SFT on the sample instructions)."""
    import yaml

    from deployments.watch import overridden
    from tasks.config import PROJECT_ROOT, RunConfig, load_config

    spec = yaml.safe_load((PROJECT_ROOT / "deployments" / "prefect.yaml").read_text())
    dpo = next(d for d in spec["deployments"] if d["name"] == "dpo-embedded")["parameters"]["config"]
    fields = load_config(None, ["train.max_steps=3", "runs_dir=/tmp/r"]).model_dump(mode="json", exclude_unset=True)
    config = overridden(dpo, fields)
    assert config["train"] == {**dpo["train"], "max_steps": 3} and config["runs_dir"] == "/tmp/r"
    assert config["export"] == {"name": "adapter-dpo"} and config["data"] == dpo["data"]
    assert RunConfig.model_validate(config).train.method == "dpo"
