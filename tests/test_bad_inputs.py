"""Every bad input fails before training with one paragraph that names the problem and its fix (issue 17).

Data decoding, config bounds, models and hub ids, runs_dir, what the worker allows a run to read (QLORA_DATA_ROOTS),
a source changing while it is read. Stages run alone through .fn(); the CLI only where its exit code and stderr are
the behaviour.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from deployments.cli import USER_ERROR_EXIT, main
from tasks.config import EMBEDDED_DATA, EMBEDDED_MODEL, PROJECT_ROOT, DataArgs, ModelArgs, load_config
from tasks.errors import UserError
from tasks.prepare_data.stage import prepare_data


def dolly(n: int, **override: Any) -> list[dict[str, Any]]:
    return [{"instruction": f"Question {i}?", "response": f"Answer number {i}.", **override} for i in range(n)]


def jsonl(path: Path, records: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def fails(tmp_path: Path, source: Path | str, *fragments: str, model: ModelArgs | None = None, **data: Any) -> str:
    """prepare_data raises a UserError holding every fragment and leaves no manifest."""
    with pytest.raises(UserError) as info:
        prepare_data.fn(DataArgs(source=str(source), **data), model or ModelArgs(), tmp_path / "runs")
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, message
    assert "\n" not in message  # one paragraph
    assert not list((tmp_path / "runs").glob("prepare_data/*/manifest.json"))
    return message


# ---- data decoding -------------------------------------------------------------------------------------------


def test_utf8_bom_in_jsonl_is_accepted(tmp_path: Path) -> None:
    path = jsonl(tmp_path / "bom.jsonl", dolly(12))
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    out = prepare_data.fn(DataArgs(source=str(path), eval_fraction=0.3), ModelArgs(), tmp_path / "runs")
    assert json.loads((Path(out) / "manifest.json").read_text())["metrics"]["rows_in"] == 12


def test_lone_surrogates_and_values_that_are_not_text_are_listed_by_line(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    lines = [json.dumps(r) for r in dolly(6)]
    lines[1] = '{"instruction": "Q?", "response": "bad \\ud800 escape"}'
    lines[2] = json.dumps({"instruction": "Q?", "response": {"a": 1}})
    lines[3] = json.dumps({"instruction": "Q?", "response": [1, 2]})
    lines[4] = json.dumps({"instruction": "Q?", "response": True})
    lines[5] = '{"instruction": "Q?", "response": NaN}'
    path.write_text("\n".join(lines) + "\n")
    message = fails(tmp_path, path, "lone surrogate", "line 2", "dict, not text", "line 3", "list, not text",
                    "line 4", "bool, not text", "line 5", "nan, not text", "line 6")
    assert "line 1" not in message


def test_compressed_or_csv_content_named_jsonl_says_what_it_is(tmp_path: Path) -> None:
    packed = tmp_path / "packed.jsonl"
    packed.write_bytes(gzip.compress(jsonl(tmp_path / "plain.jsonl", dolly(5)).read_bytes()))
    fails(tmp_path, packed, "gzip-compressed", "packed.jsonl line 1", "decompress")
    csv_named_jsonl = tmp_path / "table.jsonl"
    csv_named_jsonl.write_text("instruction,response\nQ?,A.\nQ2?,A2.\n")
    message = fails(tmp_path, csv_named_jsonl, "not valid JSON", "line 1, line 2, line 3")
    assert "holds no rows" not in message


def test_records_longer_than_max_record_bytes_are_listed_by_line_and_never_held(tmp_path: Path) -> None:
    """data.max_record_bytes bounds what one record may hold, whatever the file kind: each longer record is named by
    its line or row; lines are read as the file gives them otherwise (a limit changes no key)."""
    import io
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq

    from tasks.prepare_data.sources import _bounded_lines

    rows = dolly(12)
    rows[3]["response"] = rows[7]["response"] = "x" * 500
    message = fails(tmp_path, jsonl(tmp_path / "d.jsonl", rows), "2 row(s) are longer than data.max_record_bytes "
                    "(300 bytes)", "d.jsonl line 4 (", "line 8 (", "split such records", max_record_bytes=300)
    assert "line 5" not in message
    (tmp_path / "d.txt").write_text("short\n" + "y" * 400 + "\nshort again\n")
    fails(tmp_path, tmp_path / "d.txt", "d.txt line 2 (401 bytes)", max_record_bytes=300)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    fails(tmp_path, tmp_path / "d.parquet", "d.parquet row 4 (", "row 8 (", max_record_bytes=300)
    (tmp_path / "d.csv").write_text("instruction,response\nQ?," + "z" * 200_000 + "\nQ2?,A2\n")
    fails(tmp_path, tmp_path / "d.csv", "cannot be read as CSV (field larger than field limit (131072)", "line 2")
    kept = prepare_data.fn(DataArgs(source=str(tmp_path / "d.jsonl"), max_record_bytes=600), ModelArgs(),
                           tmp_path / "runs-kept")
    assert Path(kept).name == Path(prepare_data.fn(DataArgs(source=str(tmp_path / "d.jsonl")), ModelArgs(),
                                                   tmp_path / "runs-kept")).name  # the same key: reused

    generator = random.Random(7)
    for _ in range(50):  # within the limit, the lines of iterating the file, however the blocks cut them
        data = b"".join(generator.choice([b"\n", b"ab", b"\r\n", b"x" * generator.randint(0, 3000)])
                        for _ in range(generator.randint(0, 400)))
        f = io.BytesIO(data)
        assert list(_bounded_lines(f, f.read(4), 10**9)) == list(io.BytesIO(data))
        f = io.BytesIO(data)
        bounded = list(_bounded_lines(f, f.read(4), 1000))
        assert bounded == [line if len(line) <= 1000 else len(line) for line in io.BytesIO(data)]


@pytest.mark.slow
def test_a_50_mb_line_is_a_user_error_under_a_memory_limit(tmp_path: Path) -> None:
    """A 50 MB JSON line in a run limited to 3 GiB of address space (tokenized whole, it took 13.7 GB and the OOM
    killer): exit 2, the one paragraph with its line number, nothing written."""
    import resource

    from tests.conftest import cli_env

    path = tmp_path / "big.jsonl"
    lines = [json.dumps(r) for r in dolly(40)]
    lines.insert(6, json.dumps({"instruction": "Summarize.", "response": "x" * (50 << 20)}))
    path.write_text("\n".join(lines) + "\n")

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))

    done = subprocess.run([sys.executable, "-m", "deployments.cli", "run", "--set", f"runs_dir={tmp_path / 'runs'}",
                           "--set", f"data.source={path}"], capture_output=True, text=True, cwd=PROJECT_ROOT,
                          env=cli_env(tmp_path / "prefect"), preexec_fn=limited, timeout=600)
    said = " ".join(done.stderr.split())
    assert done.returncode == 2, done.stderr[-3000:]
    assert f"{path} line 7 (52,428,846 bytes)" in said and "data.max_record_bytes (8,388,608 bytes)" in said, said
    assert "Traceback" not in done.stderr and "panicked" not in done.stderr
    assert not list((tmp_path / "runs").glob("*/*/manifest.json"))


# ---- data sources ----------------------------------------------------------------------------------------------


def test_the_workers_operator_confines_the_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a run may read is its worker's operator's (QLORA_DATA_ROOTS): a link or '..' does not get out; an old
    config's data.allowed_roots only narrows it, and one that asks for more is refused before any stage."""
    from tasks.prepare_data.sources import check_access

    allowed = tmp_path / "allowed"
    allowed.mkdir()
    inside = jsonl(allowed / "d.jsonl", dolly(12))
    monkeypatch.setenv("QLORA_DATA_ROOTS", f"{allowed},s3://bucket/")
    prepare_data.fn(DataArgs(source=str(inside), eval_fraction=0.3), ModelArgs(), tmp_path / "ok-runs")
    check_access(DataArgs(source=str(inside), eval_source=str(inside)))
    outside = "outside what the worker allows (QLORA_DATA_ROOTS)"
    fails(tmp_path, "/etc/hostname", outside, "ask whoever runs the worker")
    link = allowed / "escape.jsonl"  # a link inside that points outside does not get out
    link.symlink_to(jsonl(tmp_path / "outside.jsonl", dolly(12)))
    fails(tmp_path, link, outside)
    fails(tmp_path, f"{allowed}/../outside.jsonl", outside)
    fails(tmp_path, "memory://x/d.jsonl", outside)
    with pytest.raises(UserError, match=r"data.eval_source='/etc/hostname' reads /etc/hostname, outside what"):
        check_access(DataArgs(source=str(inside), eval_source="/etc/hostname"))

    # an old config that still names its places: they narrow the operator's, and cannot widen them
    fails(tmp_path, inside, "outside data.allowed_roots", allowed_roots=[str(tmp_path / "other")])
    with pytest.raises(UserError) as wider:
        check_access(DataArgs(source="/etc/hostname", allowed_roots=["/", str(allowed)]))
    assert str(wider.value).startswith("data.allowed_roots names /, outside what the worker allows "
                                       f"(QLORA_DATA_ROOTS={allowed},s3://bucket/)"), wider.value
    monkeypatch.delenv("QLORA_DATA_ROOTS")  # no operator's confinement (a terminal's own run): the config's holds
    fails(tmp_path, "/etc/hostname", "outside data.allowed_roots", allowed_roots=[str(allowed)])


def test_url_whose_filesystem_lacks_a_package_names_that_package(tmp_path: Path) -> None:
    """The first of these URL kinds whose filesystem package is not installed (aiohttp comes with the tracking
    extra's mlflow; s3fs, gcsfs and adlfs with none of the project's extras)."""
    import importlib.util

    kinds = [("https://example.com/d.jsonl", "aiohttp"), ("s3://bucket/d.jsonl", "s3fs"),
             ("gs://bucket/d.jsonl", "gcsfs"), ("az://container/d.jsonl", "adlfs")]
    url, package = next((k for k in kinds if importlib.util.find_spec(k[1]) is None), (None, None))
    if url is None:
        pytest.skip("every filesystem package tried here is installed")
    message = fails(tmp_path, url, f"needs the {package} package", f"pip install {package}")
    assert "fsspec package" not in message


_APPENDER = """
import sys, time
path, stop = sys.argv[1], time.time() + float(sys.argv[2])
while time.time() < stop:
    with open(path, "a") as f:
        f.write('{"instruction": "More?", "response": "Appended at %f."}\\n' % time.time())
    time.sleep(0.005)
"""


def test_data_appended_while_it_is_read_fails_and_writes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "growing.jsonl"
    path.write_text("".join(EMBEDDED_DATA.read_text().splitlines(keepends=True)[:400]))
    writer = subprocess.Popen([sys.executable, "-c", _APPENDER, str(path), "60"])
    try:
        size = path.stat().st_size
        while path.stat().st_size == size:
            time.sleep(0.01)
        fails(tmp_path, path, "changed while prepare_data was reading it", "nothing was written")
    finally:
        writer.kill()
        writer.wait()


# ---- models and hub ids ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["broken_config", "no_model_type", "no_weights"])
def test_broken_model_folder_fails_with_the_fix(tmp_path: Path, damage: str) -> None:
    model = tmp_path / "model"
    shutil.copytree(EMBEDDED_MODEL, model)
    if damage == "broken_config":
        (model / "config.json").write_text('{"model_type": "llama", ')
        expected = "config.json cannot be read as JSON"
    elif damage == "no_model_type":
        (model / "config.json").write_text("{}")
        expected = "config.json has no model_type"
    else:
        for weights in model.glob("*.safetensors"):
            weights.unlink()
        expected = "has no weights"
    if damage != "no_weights":
        fails(tmp_path, jsonl(tmp_path / "d.jsonl", dolly(12)), expected, model=ModelArgs(base_model=str(model)))
        return
    # prepare_data reads the tokenizer only (a tokenizer-only folder serves it); prepare_model fails before loading
    from tasks.prepare_model.stage import prepare_model

    with pytest.raises(UserError, match=expected):
        prepare_model.fn(ModelArgs(base_model=str(model)), tmp_path / "runs")
    assert not list((tmp_path / "runs").glob("prepare_model/*/manifest.json"))


def test_max_seq_length_beyond_the_models_positions(tmp_path: Path) -> None:
    positions = json.loads((EMBEDDED_MODEL / "config.json").read_text())["max_position_embeddings"]
    fails(tmp_path, jsonl(tmp_path / "d.jsonl", dolly(12)), f"more than the {positions} positions",
          max_seq_length=positions + 1)


@pytest.mark.parametrize("offline", ["1", "0"])
def test_hub_ids_that_cannot_be_resolved_fail_fast_without_retries(tmp_path: Path, offline: str) -> None:
    """Online mode cannot connect (the hub endpoint is a closed localhost port), offline mode has no cache entry;
    both fail at once."""
    code = ("from tasks.models.sources import resolve_hub_revision\n"
            "resolve_hub_revision('nobody/no-such-model-xyz', None)")
    with socket.socket() as s:  # a port nothing listens on: bound, never listened to, released
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "HF_HUB_OFFLINE": offline, "HF_HOME": str(tmp_path / "hf"),
           "HF_ENDPOINT": f"http://127.0.0.1:{port}"}
    started = time.time()
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=PROJECT_ROOT)
    assert time.time() - started < 30
    assert "UserError: model.base_model='nobody/no-such-model-xyz'" in done.stderr
    assert ("HF_HUB_OFFLINE=1 and the model is not in the local hub cache" if offline == "1"
            else "set HF_HUB_OFFLINE=1") in done.stderr


# ---- config bounds (the CLI's own message path) -----------------------------------------------------------------


@pytest.mark.parametrize(("override", "fragment"), [
    ("train.max_steps=0", "0 steps would train nothing"),
    ("data.eval_fraction=0", "data.eval_fraction: Input should be greater than 0"),
    ("data.max_seq_length=1000000000000", "data.max_seq_length: Input should be less than or equal to"),
    ("export.name=..", "export.name: Value error, must be one folder name"),
    ("export.name=.", "must be one folder name"),
    ("export.name=a/b", "must be one folder name"),
])
def test_config_bounds(override: str, fragment: str) -> None:
    from deployments.cli import _config_message

    with pytest.raises(Exception) as info:  # noqa: PT011 - pydantic's ValidationError, read by the CLI
        load_config(None, [override])
    assert fragment in _config_message(info.value)


# ---- secrets ---------------------------------------------------------------------------------------------------


def test_notify_url_with_credentials_is_kept_secret(prefect_env: Path) -> None:
    from prefect import get_client
    from prefect.blocks.notifications import CustomWebhookNotificationBlock

    from deployments.setup import NOTIFY_BLOCK, apply_automations

    url = "https://alerts:s3cret-pass@hooks.example.com/services/T0/B0/tok3n?key=k3y"
    said = apply_automations(url)
    assert "hooks.example.com" in said
    assert not any(secret in said for secret in ("s3cret-pass", "tok3n", "k3y", "alerts"))
    block = CustomWebhookNotificationBlock.load(NOTIFY_BLOCK)
    assert block.url == "{{notify_url}}"  # the plain field only names the secret
    assert block._build_request_args("body", "subject")["url"] == url  # delivery still gets the real URL
    with get_client(sync_client=True) as client:
        stored = client.read_block_document_by_name(NOTIFY_BLOCK, block_type_slug="custom-webhook",
                                                    include_secrets=False)
    assert "s3cret-pass" not in json.dumps(stored.data, default=str)


# ---- the CLI: exit 2, one paragraph, no traceback ----------------------------------------------------------------


def _cli(args: list[str], tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    from tests.conftest import cli_env

    done = subprocess.run([sys.executable, "-m", "deployments.cli", *args], cwd=PROJECT_ROOT, capture_output=True,
                          text=True, env={**cli_env(tmp_path / "prefect-home"), **env}, timeout=300)
    done.stderr = " ".join(done.stderr.split())  # the CLI wraps its message at 100 columns
    return done


def test_runs_dir_that_is_a_file_fails_at_once(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    runs.write_text("not a folder")
    for runs_dir in (runs, runs / "below"):
        done = _cli(["run", "--set", f"runs_dir={runs_dir}"], tmp_path)
        assert done.returncode == 2, done.stderr
        assert "cannot be used: it, or a folder above it, is a file" in done.stderr
        assert "Traceback" not in done.stderr + done.stdout


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_runs_dir_fails_at_once(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    runs.mkdir()
    runs.chmod(0o500)
    try:
        done = _cli(["run", "--set", f"runs_dir={runs}"], tmp_path)
    finally:
        runs.chmod(0o700)
    assert done.returncode == 2 and "Permission denied" in done.stderr and "Traceback" not in done.stderr


def test_server_that_does_not_start_in_time_gets_longer_and_one_retry() -> None:
    """A real timeout leaves Prefect's half-started server behind, so the retry is checked on a stand-in flow."""
    from deployments import cli

    calls: list[int] = []

    def slow_server_once(config: Any) -> str:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError(cli._SERVER_TIMEOUT + ".")
        return "summary"

    assert cli._start(slow_server_once, None) == "summary" and len(calls) == 2
    env = subprocess.run([sys.executable, "-c", "import os; from deployments import cli; cli.main(['presets']); "
                          "print(os.environ['PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS'])"],
                         cwd=PROJECT_ROOT, capture_output=True, text=True, check=True)
    assert env.stdout.split()[-1] == str(cli.EPHEMERAL_STARTUP_S) and cli.EPHEMERAL_STARTUP_S >= 60


# ---- speed.num_gpus against the machine (issue 41) ---------------------------------------------------------------


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the CPU bounds: cores and CUDA_VISIBLE_DEVICES")
def test_num_gpus_beyond_what_this_machine_has_fails_before_anything_runs(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """On a machine without CUDA, N > 1 starts N CPU processes: at most one per core, or as many as
    CUDA_VISIBLE_DEVICES lists where it stands for GPUs; beyond that, exit 2 at validate time (and in the stage,
    for a run started from the form)."""
    from deployments.cli import USER_ERROR_EXIT, main
    from tasks.pool.cpus import host_cores
    from tasks.pool.gpus import gpu_slot

    cores = host_cores()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    runs = tmp_path / "runs"
    for command in ("validate", "run"):
        assert main([command, "--set", "speed.num_gpus=64", "--set", f"runs_dir={runs}"]) == USER_ERROR_EXIT
        err = " ".join(capsys.readouterr().err.split())
        assert f"speed.num_gpus=64, but this machine has no CUDA: {cores} core(s)" in err, err
        assert f"Set speed.num_gpus to {cores} or less" in err and "Traceback" not in err
    assert not runs.exists()  # nothing started
    assert main(["validate", "--set", f"speed.num_gpus={cores}"]) == 0
    with pytest.raises(UserError, match="speed.num_gpus=64, but this machine has"), gpu_slot(64):
        pass

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")  # how a CPU machine stands for a 2-GPU worker
    capsys.readouterr()
    assert main(["validate", "--set", "speed.num_gpus=3"]) == USER_ERROR_EXIT
    assert "no CUDA, and CUDA_VISIBLE_DEVICES lists 2 device(s)" in " ".join(capsys.readouterr().err.split())
    assert main(["validate", "--set", "speed.num_gpus=2"]) == 0


def test_num_nodes_without_a_server_or_a_host_name_fails_before_anything_runs(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """speed.num_nodes > 1 trains across the hosts of a Prefect server: `run` without one, or on a host without a
    name, is refused at validate time with the way to do it (tasks/train_adapter/nodes.py nodes_problem)."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from deployments.cli import USER_ERROR_EXIT, main

    runs = tmp_path / "runs"
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    with temporary_settings(restore_defaults={PREFECT_API_URL}):  # no server, whatever the session's tests use
        assert main(["run", "--set", "speed.num_nodes=2", "--set", f"runs_dir={runs}"]) == USER_ERROR_EXIT
    err = " ".join(capsys.readouterr().err.split())
    assert "speed.num_nodes=2 trains across GPU hosts of one Prefect server, and there is none here" in err, err
    assert "qlora-pipeline start DEPLOYMENT --set speed.num_nodes=" in err and "Traceback" not in err
    assert not runs.exists()
    monkeypatch.delenv("QLORA_HOST", raising=False)
    with temporary_settings({PREFECT_API_URL: "http://127.0.0.1:9/api"}):  # never asked: no host name comes first
        assert main(["validate", "--set", "speed.num_nodes=2"]) == USER_ERROR_EXIT
    assert "this process has no host name (QLORA_HOST)" in " ".join(capsys.readouterr().err.split())


# ---- hostile configs, through the CLI -----------------------------------------------------------------------------


def _fails(capsys: pytest.CaptureFixture[str], argv: list[str], *fragments: str) -> str:
    started = time.monotonic()
    assert main(argv) == USER_ERROR_EXIT
    assert time.monotonic() - started < 30  # at once, not after minutes of wrapping or a server's refusal
    err = " ".join(capsys.readouterr().err.split())
    for fragment in fragments:
        assert fragment in err, err[:2000]
    assert len(err) < 3000  # one paragraph, never the value itself
    return err


def test_huge_config_file_fails_at_once_with_the_limit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "huge.yaml"
    path.write_text("train:\n  colour: " + "x" * 3_000_000 + "\n")
    runs = tmp_path / "runs"
    _fails(capsys, ["run", "--config", str(path), "--set", f"runs_dir={runs}"], "3,000,", "limit of 524,288 bytes",
           str(path))
    assert not runs.exists()


def test_long_value_is_quoted_by_a_prefix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = _fails(capsys, ["validate", "--set", "train.colour=" + "y" * 200_000],
                 "train.colour: Extra inputs are not permitted", "yyy...yyy")
    assert "y" * 100 not in err


def test_many_bad_entries_show_a_few(capsys: pytest.CaptureFixture[str]) -> None:
    entries = ",".join(f"c{i}: {i}" for i in range(5000))
    _fails(capsys, ["validate", "--set", f"data.column_mapping={{{entries}}}"],
           "5000 problem(s)", "data.column_mapping.c0: Input should be a valid string (got 0)", "and 4,990 more")


def test_parameters_over_prefects_limit_fail_before_a_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # under the file limit as YAML, over Prefect's 524,288 bytes as JSON parameters (the quotes add up)
    path = tmp_path / "mapping.yaml"
    path.write_text("data:\n  column_mapping: {" + ",".join(f"c{i}: d{i}" for i in range(36_000)) + "}\n")
    assert path.stat().st_size < 524_288
    runs = tmp_path / "runs"
    _fails(capsys, ["run", "--config", str(path), "--set", f"runs_dir={runs}"],
           "as flow-run parameters, more than the 524,288 bytes", "nothing was started")
    assert not runs.exists()


@pytest.mark.parametrize("text", ["train: " + "[" * 5000 + "]" * 5000,
                                  "data: {column_mapping: " + "{a: " * 3000 + "b" + "}" * 3001])
def test_deep_nesting_names_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str) -> None:
    path = tmp_path / "deep.yaml"
    path.write_text(text + "\n")
    err = _fails(capsys, ["validate", "--config", str(path)], f"{path} is nested too deeply")
    assert "recursion" not in err
