"""No secret in a data source's URI: refused by the config, the CLI and the run form (Prefect's server) before anything
stores it, and a source that needs a secret reads it from the environment of the process that runs the flow."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError

from tasks.config import EMBEDDED_DATA, PROJECT_ROOT, load_config
from tests.conftest import cli_env

SECRET = "dAtA-s3cr3t-9f41"  # a password no output, record or database of a test may hold
BAD = [f"http://bot:{SECRET}@127.0.0.1:9/d.jsonl", f"https://{SECRET}@data.example.com/shards/*.jsonl",
       f"https://data.example.com/d.jsonl?X-Amz-Signature={SECRET}", f"s3://bucket/d.jsonl?token={SECRET}"]


def _holds_secret(folder: Path) -> list[str]:
    return [str(p) for p in folder.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]


@pytest.mark.parametrize("field", ["data.source", "data.eval_source"])
def test_a_data_uri_with_credentials_is_refused_by_the_config_and_the_form(field: str) -> None:
    from prefect.utilities.callables import parameter_schema
    from prefect.utilities.schema_tools import validate

    from flows.qlora_pipeline import qlora_pipeline

    schema = parameter_schema(qlora_pipeline).model_dump_for_openapi()  # what Prefect's server checks parameters by
    section, name = field.split(".")
    for uri in BAD:
        with pytest.raises(ValidationError) as refused:
            load_config(None, [f"{field}={uri}"])
        message = refused.value.errors()[0]["msg"]
        assert "holds credentials" in message and "FSSPEC_HTTP" in message and "AWS_SECRET_ACCESS_KEY" in message
        assert SECRET not in message, message
        assert validate({"config": {section: {name: uri}}}, schema), uri
    for fine in ("s3://bucket/shards/", "https://data.example.com/d.jsonl?page=2", "data/sample/instructions.jsonl",
                 "/srv/team@example/d.jsonl", "databricks/databricks-dolly-15k"):
        assert not validate({"config": {section: {name: fine}}}, schema), fine


def test_the_command_line_refuses_it_and_writes_it_nowhere(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    done = subprocess.run([sys.executable, "-m", "deployments.cli", "run", "--set", f"runs_dir={runs}",
                           "--set", f"data.source={BAD[0]}"], capture_output=True, text=True, cwd=PROJECT_ROOT,
                          env=cli_env(tmp_path / "prefect"), timeout=300)
    assert done.returncode == 2, done.stderr
    assert "http://***@127.0.0.1:9/d.jsonl holds credentials" in " ".join(done.stderr.split())
    assert SECRET not in done.stdout + done.stderr and "Traceback" not in done.stderr
    assert not runs.exists() and not _holds_secret(tmp_path)


@pytest.fixture
def guarded_server(tmp_path: Path) -> Iterator[str]:
    """An HTTP server on localhost that serves data.jsonl only to a request that carries the bearer token."""
    data = "".join(EMBEDDED_DATA.read_text().splitlines(keepends=True)[:60]).encode()

    class Guarded(http.server.BaseHTTPRequestHandler):
        def _answer(self, body: bool) -> None:
            if self.headers.get("Authorization") != f"Bearer {SECRET}":
                self.send_response(401)
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if body:
                self.wfile.write(data)

        def do_HEAD(self) -> None:  # noqa: N802 - http.server's names
            self._answer(body=False)

        def do_GET(self) -> None:  # noqa: N802
            self._answer(body=True)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Guarded)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/data.jsonl"
    finally:
        server.shutdown()


def test_a_source_that_needs_a_secret_takes_it_from_the_environment(guarded_server: str, tmp_path: Path) -> None:
    """docs/data.md's way: the header in FSSPEC_HTTP of the process that runs the flow. Without it, the server's
    refusal is one paragraph that says where the secret goes; with it, the data is read and no record holds it."""
    from tasks.config import DataArgs, ModelArgs
    from tasks.errors import UserError
    from tasks.prepare_data.stage import prepare_data

    assert "FSSPEC_HTTP" not in os.environ
    with pytest.raises(UserError) as refused:
        prepare_data.fn(DataArgs(source=guarded_server), ModelArgs(), tmp_path / "refused")
    assert "the server refused access (401" in str(refused.value) and "FSSPEC_HTTP" in str(refused.value)

    runs = tmp_path / "runs"
    header = json.dumps({"client_kwargs": {"headers": {"Authorization": f"Bearer {SECRET}"}}})
    script = ("from pathlib import Path; from tasks.config import DataArgs, ModelArgs; "
              "from tasks.prepare_data.stage import prepare_data; "
              f"print(prepare_data.fn(DataArgs(source={guarded_server!r}), ModelArgs(), Path({str(runs)!r})))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=PROJECT_ROOT,
                          env={**os.environ, "FSSPEC_HTTP": header}, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    manifest = json.loads((Path(done.stdout.strip().splitlines()[-1]) / "manifest.json").read_text())
    assert manifest["metrics"]["rows_in"] == 60 and manifest["params"]["data"]["source"] == guarded_server
    assert not _holds_secret(runs)


@pytest.mark.slow
def test_the_run_form_is_refused_before_prefect_stores_it(prefect_env: Path) -> None:
    from prefect import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
    from prefect.settings import PREFECT_SERVER_DATABASE_CONNECTION_URL
    from prefect.utilities.callables import parameter_schema

    from flows.qlora_pipeline import qlora_pipeline

    with get_client(sync_client=True) as client:
        flow_id = client.create_flow_from_name("qlora-pipeline")
        deployment = client.create_deployment(
            flow_id, "data-credentials-refused", enforce_parameter_schema=True,
            parameter_openapi_schema=parameter_schema(qlora_pipeline).model_dump_for_openapi())
        for config in ({"data": {"source": BAD[0]}}, {"data": {"eval_source": BAD[2]}}):
            with pytest.raises(Exception, match="409") as refused:  # what the UI form's Submit gets (its own value
                client.create_flow_run_from_deployment(deployment, parameters={"config": config})  # quoted back)
            assert "source" in str(refused.value)
        assert not client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment])))
    url = PREFECT_SERVER_DATABASE_CONNECTION_URL.value()
    database = Path(getattr(url, "get_secret_value", lambda: url)().split("///", 1)[1])
    stored = b"".join(path.read_bytes() for path in database.parent.glob(f"{database.name}*"))
    assert stored and SECRET.encode() not in stored
