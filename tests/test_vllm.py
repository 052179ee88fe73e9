"""vLLM itself, as a tested target: the server docs/serving.md starts (the session's vllm_server, the base model
alone) takes the exported adapter at run time and answers held-out prompts as transformers does, as does the merged
folder served alone; the nightly hot-load (tasks/export_adapter/serving.py) puts each new champion into that server,
keeps the old one on any failure, says so in the run's exit status and final state, and a rollback (`qlora-pipeline
promote`) serves the chosen version again; and the stable name switches under load without a failed request."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from deployments.cli import SERVING_NOT_UPDATED_EXIT
from tasks.config import (
    EMBEDDED_DATA,
    EMBEDDED_MODEL,
    PROJECT_ROOT,
    EvalArgs,
    ExportArgs,
    LoraArgs,
    ServeArgs,
    SpeedArgs,
    TrainArgs,
)
from tests.conftest import VLLM_API_KEY as API_KEY
from tests.conftest import (
    VLLM_PYTHON,
    cli_env,
    documented_vllm_command,
    free_port,
    require_vllm,
    run_flow,
    stop_group,
    wait_for_vllm,
)

BASE = "data/tiny-llama"  # the base model's name in the documented server: its --model
NEW_TOKENS = 12
# Both sides compute in float32 on the same weights: vLLM's CPU kernels and transformers differ only in the order of
# summation (a bound, not measured, as test_gguf's f32). Greedy tokens are compared up to where transformers' top two
# logits come within twice that (there the rounding may pick the other one); first-step log-probabilities within it.
TOLERANCE = 1e-3
EVAL = EvalArgs(max_samples=8, generation_samples=2, max_new_tokens=8)


def start_vllm(model: Path, log: Path) -> tuple[subprocess.Popen, str]:
    """vLLM's OpenAI-compatible server for `model` alone (served as "base"; no adapters, no middleware) on a free
    localhost port, in its own process group, with the API key; it and its URL once /health answers."""
    require_vllm()
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_API_KEY": API_KEY, "VLLM_NO_USAGE_STATS": "1",
           "HF_HUB_OFFLINE": "1"}
    # the module form: the distribution is named vllm-cpu, and its `vllm` command looks up "vllm"'s metadata
    proc = subprocess.Popen([str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                             "--served-model-name", "base", "--dtype", "float32", "--max-model-len", "512",
                             "--host", "127.0.0.1", "--port", str(port)],
                            env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_for_vllm(proc, url, log)
    return proc, url


def call(url: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    """(status, JSON or text) of one request to the server, with the API key."""
    request = urllib.request.Request(url + path, data=json.dumps(body).encode() if body is not None else None,
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            text = response.read().decode()
            status = response.status
    except urllib.error.HTTPError as exc:
        text, status = exc.read().decode(), exc.code
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def served(url: str) -> dict[str, str]:
    """{LoRA name: folder} the server serves now."""
    return {m["id"]: m["root"] for m in call(url, "/v1/models")[1]["data"] if m.get("parent")}


def vllm_greedy(url: str, model: str, prompts: list[list[int]], eos: int) -> list[dict[str, Any]]:
    """Per prompt: NEW_TOKENS greedy tokens (cut at eos) and the first step's top-5 log-probabilities by token id."""
    out = []
    for prompt in prompts:
        status, body = call(url, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": NEW_TOKENS,
                                                      "temperature": 0, "logprobs": 5,
                                                      "return_tokens_as_token_ids": True})
        assert status == 200, body
        lp = body["choices"][0]["logprobs"]
        tokens = [int(t.removeprefix("token_id:")) for t in lp["tokens"]]
        out.append({"greedy": tokens[:tokens.index(eos)] if eos in tokens else tokens,
                    "first": {int(t.removeprefix("token_id:")): p for t, p in lp["top_logprobs"][0].items()}})
    return out


def hf_greedy(model: Any, prompts: list[list[int]], eos: int) -> list[dict[str, Any]]:
    """transformers' answer per prompt: greedy tokens (cut at eos), the first step's log-probabilities, and the margin
    between the top two logits at each step."""
    import torch

    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            run = model.eval().generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                        max_new_tokens=NEW_TOKENS, pad_token_id=0, eos_token_id=eos,
                                        output_logits=True, return_dict_in_generate=True)
        tokens = run.sequences[0, ids.shape[1]:].tolist()
        out.append({"greedy": tokens[:tokens.index(eos)] if eos in tokens else tokens,
                    "logprobs": run.logits[0][0].float().log_softmax(-1),
                    "margins": [float(top[0, 0] - top[0, 1]) for top in (s.topk(2).values for s in run.logits)]})
    return out


def assert_answers_as(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    """vLLM's greedy tokens are transformers' up to where transformers' top two logits come within 2 x TOLERANCE
    (or to its end), and its first-step top-5 log-probabilities are transformers' within 2 x TOLERANCE
    (log-softmax moves by at most twice the largest logit change)."""
    for i, (v, h) in enumerate(zip(got, want, strict=True)):
        sure = next((j for j, m in enumerate(h["margins"]) if m < 2 * TOLERANCE), len(h["greedy"]))
        assert v["greedy"][:sure] == h["greedy"][:sure], (i, v["greedy"], h["greedy"], h["margins"])
        for token, logprob in v["first"].items():
            assert abs(logprob - float(h["logprobs"][token])) < 2 * TOLERANCE, (i, token, logprob)


@pytest.fixture(scope="module")
def held_out(stages: dict[str, Any]) -> dict[str, Any]:
    """The first held-out prompts of the shared eval split (token ids, as evaluate_adapter picks them)."""
    from transformers import AutoTokenizer

    from tasks.on_disk.parquet_dataset import ParquetExamples, split_prompt

    examples = ParquetExamples(Path(stages["data"]) / "eval.parquet")
    prompts = [p for p, _ in filter(None, (split_prompt(**examples[i]) for i in range(len(examples))))][:6]
    return {"prompts": prompts, "eos": AutoTokenizer.from_pretrained(stages["model"]).eos_token_id}


@pytest.fixture(scope="module")
def exported(stages: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An adapter trained through the pipeline on the embedded tiny Llama (head size 32, which vLLM's CPU attention
    takes), evaluated and exported with its merged float32 folder: the published version folder."""
    from tasks.evaluate_adapter.stage import evaluate_adapter
    from tasks.export_adapter.stage import export_adapter
    from tasks.train_adapter.stage import train_adapter

    runs = stages["runs"]
    adapter = train_adapter.fn(LoraArgs(r=8, lora_alpha=16), TrainArgs(max_steps=24, learning_rate=3e-3,
                               logging_steps=4), SpeedArgs(), runs, stages["data"], stages["model"])
    evals = evaluate_adapter.fn(EVAL, runs, stages["data"], stages["model"], adapter)
    out = tmp_path_factory.mktemp("vllm-export")
    export_adapter.fn(ExportArgs(name="vllmtest", merge=True, merged_dtype="float32"), out, stages["data"],
                      stages["model"], adapter, evals)
    return out.resolve() / "exports" / "vllmtest" / "v0001"


@pytest.mark.slow
def test_the_documented_command_starts_a_server_the_pipeline_can_update(vllm_server: str) -> None:
    """docs/serving.md's command, run as written (the session's vllm_server): the base model alone answers, with the
    stable-name middleware in place; a first run then loads its champion into it (the nightly test's night 1)."""
    assert "--middleware model_aliases.ModelAliases" in documented_vllm_command(8000)
    status, body = call(vllm_server, "/v1/completions", {"model": BASE, "prompt": "hello", "max_tokens": 2})
    assert status == 200 and body["model"] == BASE, body
    assert call(vllm_server, "/v1/model_aliases")[0] == 200


@pytest.mark.slow
def test_the_adapter_answers_in_vllm_as_the_merged_full_precision_model_in_transformers(
        exported: Path, vllm_server: str, held_out: dict[str, Any]) -> None:
    """The exported version folder loaded into vLLM at run time, on the full-precision base that adapter_config.json
    names: vLLM applies the adapter to that base, not to the 4-bit one it was trained against, so the reference is
    transformers on that same base with the adapter merged."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    prompts, eos = held_out["prompts"], held_out["eos"]
    named = json.loads((exported / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert PROJECT_ROOT / named == EMBEDDED_MODEL  # as model.base_model names it: the checkout's data/tiny-llama
    base = AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL, dtype=torch.float32)
    want_base = hf_greedy(base, prompts, eos)
    want = hf_greedy(PeftModel.from_pretrained(base, exported).merge_and_unload(), prompts, eos)
    assert [w["greedy"] for w in want] != [w["greedy"] for w in want_base]  # the adapter changes the answers
    assert_answers_as(vllm_greedy(vllm_server, BASE, prompts, eos), want_base)

    status, text = call(vllm_server, "/v1/load_lora_adapter", {"lora_name": "at-run-time", "lora_path": str(exported)})
    assert status == 200, text
    assert_answers_as(vllm_greedy(vllm_server, "at-run-time", prompts, eos), want)
    assert call(vllm_server, "/v1/unload_lora_adapter", {"lora_name": "at-run-time"})[0] == 200
    assert call(vllm_server, "/v1/completions", {"model": "at-run-time", "prompt": prompts[0],
                                                 "max_tokens": 1})[0] == 404


@pytest.mark.slow
def test_the_merged_folder_answers_in_vllm_as_in_transformers(exported: Path, held_out: dict[str, Any],
                                                              tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`merged/` (the 4-bit base dequantized, the adapter merged in, float32) served by vLLM as the model itself."""
    import torch
    from transformers import AutoModelForCausalLM

    from tasks.export_adapter import serving

    prompts, eos = held_out["prompts"], held_out["eos"]
    want = hf_greedy(AutoModelForCausalLM.from_pretrained(exported / "merged", dtype=torch.float32), prompts, eos)
    proc, url = start_vllm(exported / "merged", tmp_path / "merged.log")
    try:
        assert_answers_as(vllm_greedy(url, "base", prompts, eos), want)
        # a server started otherwise than docs/serving.md says: the hot-load says how to start it
        monkeypatch.setenv("VLLM_API_KEY", API_KEY)
        outcome = serving.sync(ServeArgs(url=url), "vllmtest", exported.parent.parent.parent)
        assert outcome["status"] == serving.NOT_UPDATED
        said = " ".join(outcome["message"].split())
        assert "does not keep stable names: start it as docs/serving.md does, with --middleware " \
               "model_aliases.ModelAliases and PYTHONPATH=" in said, said
        assert "--enable-lora and the environment variable VLLM_ALLOW_RUNTIME_LORA_UPDATING=True" in said
    finally:
        stop_group(proc)


@pytest.fixture(scope="module")
def two_versions(exported: Path, stages: dict[str, Any]) -> Path:
    """The registry of `exported` with a second version, trained longer and promoted over the first: its root."""
    from tasks.evaluate_adapter.champion import score_champion
    from tasks.evaluate_adapter.stage import evaluate_adapter
    from tasks.export_adapter.stage import export_adapter
    from tasks.registry import store as registry
    from tasks.train_adapter.stage import train_adapter

    runs, runs_dir, export = stages["runs"], exported.parent.parent.parent, ExportArgs(name="vllmtest")
    adapter = train_adapter.fn(LoraArgs(r=8, lora_alpha=16), TrainArgs(max_steps=48, learning_rate=3e-3,
                               logging_steps=4), SpeedArgs(), runs, stages["data"], stages["model"])
    evals = evaluate_adapter.fn(EVAL, runs, stages["data"], stages["model"], adapter)
    judged = score_champion.fn(EVAL, runs_dir, stages["data"], stages["model"], adapter, evals, export)
    export_adapter.fn(export, runs_dir, stages["data"], stages["model"], adapter, evals, judged)
    assert registry.current(exported.parent)["champion_version"] == "v0002"  # both promoted: either may be champion
    return exported.parent


CLIENTS, SWITCHES = 8, 4  # the former unload + load switch failed a few requests per switch at this load


@pytest.mark.slow
def test_switches_under_load_fail_no_request(two_versions: Path, vllm_server: str, held_out: dict[str, Any],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """CLIENTS clients ask the stable name without pause while it switches SWITCHES times between two versions (as
    `qlora-pipeline promote` does: the registry's champion, then serving.sync); one long answer is in flight across a
    switch. Every request is answered (200), each by one of the two versions, and the long one by the version it was
    routed to from its first token to its last."""
    from tasks.export_adapter import serving
    from tasks.registry import store as registry

    monkeypatch.setenv("VLLM_API_KEY", API_KEY)
    root, name, prompt = two_versions, "loadtest", held_out["prompts"][0]
    args = ServeArgs(url=vllm_server, adapter_name=name)
    registry.promote(root, "v0001")
    assert serving.sync(args, "vllmtest", root.parent.parent)["status"] == "updated"
    answers: list[tuple[int, str]] = []
    stop = threading.Event()

    def client() -> None:
        while not stop.is_set():
            status, body = call(vllm_server, "/v1/completions", {"model": name, "prompt": prompt, "max_tokens": 8,
                                                                 "temperature": 0})
            answers.append((status, body["model"] if status == 200 else str(body)[:300]))

    long: dict[str, Any] = {}
    threads = [threading.Thread(target=client) for _ in range(CLIENTS)]
    threads.append(threading.Thread(target=lambda: long.update(answer=_long_answer(vllm_server, name, prompt))))
    for thread in threads:
        thread.start()
    try:
        outcomes = []
        for version in ("v0002", "v0001") * (SWITCHES // 2):
            registry.promote(root, version)
            outcomes.append(serving.sync(args, "vllmtest", root.parent.parent))
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    failed = [a for a in answers if a[0] != 200]
    print(f"load test: {CLIENTS} clients, {SWITCHES} switches, {len(answers)} requests, {len(failed)} not 200")
    assert [o["status"] for o in outcomes] == ["updated"] * SWITCHES, outcomes
    assert not failed, failed[:5]
    assert {model for _, model in answers} <= {f"{name}-v0001", f"{name}-v0002"}
    routed = long["answer"]["model"]  # the long answer, by the version it was routed to alone
    assert long["answer"]["ids"] == _long_answer(vllm_server, routed, prompt)["ids"]
    assert served(vllm_server)[name] == str(root / "v0001") and f"{name}-v0002" not in served(vllm_server)


def _long_answer(url: str, model: str, prompt: list[int]) -> dict[str, Any]:
    """A greedy answer of 64 tokens (the end of sequence ignored): long enough to be in flight during a switch."""
    status, body = call(url, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 64,
                                                 "temperature": 0, "ignore_eos": True, "logprobs": 0,
                                                 "return_tokens_as_token_ids": True})
    assert status == 200, body
    return {"model": body["model"], "ids": body["choices"][0]["logprobs"]["tokens"]}


@pytest.mark.slow
def test_nightly_runs_put_each_champion_into_the_server_and_keep_it_on_failure(
        vllm_server: str, prefect_env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Night 1 publishes v0001 and the documented server, started with the base model alone, serves it under the
    stable name; a losing night leaves it serving; a winning night switches the name to v0003 and unloads v0001's
    versioned name; a refused key leaves `serving not updated`; a `qlora-pipeline run` whose server is down publishes
    v0004 and exits 3, its flow run Failed with the reason and tagged not-served; `qlora-pipeline promote` rolls back
    to v0001; a version that does not answer as its evaluation did is not served (promote exits 3, the old champion
    keeps serving)."""
    from tasks.export_adapter import serving
    from tasks.registry import store as registry

    server = vllm_server
    monkeypatch.setenv("VLLM_API_KEY", API_KEY)
    data = tmp_path / "small.jsonl"
    data.write_text("".join(EMBEDDED_DATA.read_text().splitlines(keepends=True)[:240]))
    runs = tmp_path / "runs"
    root = runs.resolve() / "exports" / "nightly"

    def overrides(steps: int, url: str = server) -> list[str]:
        return [f"runs_dir={runs}", f"data.source={data}", f"train.max_steps={steps}", "train.learning_rate=0.003",
                "train.logging_steps=4", "train.save_steps=1000", "eval.max_samples=16", "eval.generation_samples=4",
                "eval.max_new_tokens=12", "lora.r=8", "lora.lora_alpha=16", "export.name=nightly", f"serve.url={url}"]

    assert "nightly" not in served(server)
    first = run_flow(overrides(8))
    assert first["metrics"]["promotion"] == "promoted" and first["serving"]["status"] == "updated", first["serving"]
    assert served(server)["nightly"] == str(root / "v0001")
    answers_v1 = greedy_ids(server, "nightly", root / "v0001")
    assert answers_v1 == greedy_ids(server, "nightly-v0001", root / "v0001")

    # a load the server refuses (a rank above its --max-lora-rank) leaves it serving: what switch() relies on
    too_large = tmp_path / "rank-128"
    _random_adapter(too_large, rank=128)
    status, text = call(server, "/v1/load_lora_adapter", {"lora_name": "too-large", "lora_path": str(too_large)})
    assert status != 200 and "max_lora_rank" in str(text)
    assert greedy_ids(server, "nightly", root / "v0001") == answers_v1

    loser = run_flow(overrides(1))  # one step: a higher eval loss than v0001's, rejected
    assert loser["metrics"]["promotion"] == "rejected" and loser["serving"]["status"] == "unchanged"
    assert served(server)["nightly"] == str(root / "v0001")

    winner = run_flow(overrides(40))
    assert winner["metrics"]["export_version"] == "v0003" and winner["metrics"]["promotion"] == "promoted"
    assert winner["serving"]["status"] == "updated", winner["serving"]
    now = served(server)
    assert now["nightly"] == str(root / "v0003") and "nightly-v0001" not in now and "nightly-v0003" in now
    assert greedy_ids(server, "nightly", root / "v0003") == greedy_ids(server, "nightly-v0003", root / "v0003")

    monkeypatch.setenv("VLLM_API_KEY", "not-the-key")
    refused = serving.sync(ServeArgs(url=server), "nightly", runs)
    assert refused["status"] == serving.NOT_UPDATED and "refused the API key" in refused["message"]
    monkeypatch.setenv("VLLM_API_KEY", API_KEY)

    _a_night_whose_server_is_down(overrides(60, url=f"http://127.0.0.1:{free_port()}"), tmp_path)
    assert registry.current(root)["champion_version"] == "v0004"
    assert served(server)["nightly"] == str(root / "v0003")  # the real server kept its champion

    env = {**cli_env(tmp_path / "prefect-home"), "VLLM_API_KEY": API_KEY}
    done = subprocess.run([sys.executable, "-m", "deployments.cli", "promote", "nightly", "v0001", "--set",
                           f"runs_dir={runs}", "--set", f"serve.url={server}"], cwd=PROJECT_ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "champion now v0001" in done.stdout and "nightly now serves v0001" in done.stdout, done.stdout
    assert registry.current(root)["champion_version"] == "v0001"
    assert served(server)["nightly"] == str(root / "v0001")
    assert greedy_ids(server, "nightly", root / "v0001") == answers_v1

    # a version whose evaluation the server does not reproduce is not served: the evaluation's recorded answers
    # rewritten on disk, as if the server applied the adapter to another base model
    v4 = registry.version_record(root, "v0004")
    upstream = json.loads((registry.source_dir(root, v4) / "manifest.json").read_text())["upstream"]
    samples = runs.resolve() / "evaluate_adapter" / upstream["evaluate_adapter"]["key"] / "samples.jsonl"
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    samples.write_text("".join(json.dumps({**r, "tuned_output": "Quite another answer."}) + "\n" for r in rows))
    done = subprocess.run([sys.executable, "-m", "deployments.cli", "promote", "nightly", "v0004", "--set",
                           f"runs_dir={runs}", "--set", f"serve.url={server}"], cwd=PROJECT_ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == SERVING_NOT_UPDATED_EXIT, (done.stdout, done.stderr[-3000:])
    said = " ".join(done.stdout.split())
    assert "serving not updated: nightly-v0004 does not answer as v0004's evaluation did" in said, said
    assert "Quite another answer." in said and "nightly still serves v0001" in said
    now = served(server)
    assert now["nightly"] == str(root / "v0001") and "nightly-v0004" not in now
    assert greedy_ids(server, "nightly", root / "v0001") == answers_v1


def _a_night_whose_server_is_down(overrides: list[str], tmp_path: Path) -> None:
    """`qlora-pipeline run` as a nightly job runs it, reporting to the session's Prefect server, with serve.url where
    nothing listens: it publishes and promotes v0004, says `serving not updated`, exits 3, and its flow run is Failed
    with the reason, tagged promoted and not-served."""
    from prefect import get_client
    from prefect.client.schemas.sorting import FlowRunSort
    from prefect.settings import PREFECT_API_URL

    env = {**cli_env(tmp_path / "prefect-home"), "VLLM_API_KEY": API_KEY, "PREFECT_API_URL": PREFECT_API_URL.value()}
    done = subprocess.run([sys.executable, "-m", "deployments.cli", "run", "--json",
                           *[a for o in overrides for a in ("--set", o)]], cwd=PROJECT_ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == SERVING_NOT_UPDATED_EXIT, (done.stdout[-2000:], done.stderr[-3000:])
    down = json.loads(done.stdout.strip().splitlines()[-1])
    assert down["metrics"]["export_version"] == "v0004" and down["metrics"]["promotion"] == "promoted"
    message = " ".join(down["serving"]["message"].split())
    assert message.startswith("serving not updated: the vLLM server at") and "cannot be reached" in message
    assert "whatever the server serves is unchanged" in message
    prefix = Path(down["run_dir"]).name.rsplit("-", 1)[1]  # runs/<time>-<the flow run id's first 8 characters>
    with get_client(sync_client=True) as client:
        [run] = [r for r in client.read_flow_runs(sort=FlowRunSort.START_TIME_DESC, limit=50)
                 if str(r.id).startswith(prefix)]
    assert run.state.is_failed() and "nightly v0004 promoted: " in run.state.message, run.state
    assert message in " ".join(run.state.message.split()) and {"promoted", "not-served"} <= set(run.tags)


def _random_adapter(out: Path, rank: int) -> None:
    """A LoRA adapter of `rank` with random weights for the embedded tiny Llama, saved by peft in `out`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL)
    get_peft_model(model, LoraConfig(r=rank, target_modules=["q_proj"], init_lora_weights=False)).save_pretrained(out)


def greedy_ids(url: str, name: str, version: Path) -> list[list[int]]:
    """`name`'s greedy token ids for the first held-out prompts of `version`'s own evaluation."""
    from tasks.export_adapter.serving import check_material

    prompt = check_material(version.parent, version.name)[0]
    status, body = call(url, "/v1/completions", {"model": name, "prompt": prompt, "max_tokens": NEW_TOKENS,
                                                 "temperature": 0, "logprobs": 1, "return_tokens_as_token_ids": True})
    assert status == 200, body
    return [int(t.removeprefix("token_id:")) for t in body["choices"][0]["logprobs"]["tokens"]]


def test_the_promote_command_refuses_an_unknown_version_in_one_paragraph(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    (runs / "exports" / "nightly").mkdir(parents=True)
    done = subprocess.run([sys.executable, "-m", "deployments.cli", "promote", "nightly", "v0009", "--set",
                           f"runs_dir={runs}"], cwd=PROJECT_ROOT, env=cli_env(tmp_path / "home"), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "has no version v0009 (versions: none); nothing was changed" in " ".join(done.stderr.split())



def test_serve_url_is_a_server_root_without_credentials() -> None:
    from pydantic import ValidationError

    from tasks.config import RunConfig

    assert ServeArgs(url="http://127.0.0.1:8000/v1/").url == "http://127.0.0.1:8000"
    assert ServeArgs().url is None and RunConfig().serve.url is None
    for bad, said in [("http://user:pw@host:8000", "holds credentials (a user:password@ part before the host)"),
                      ("http://host:8000?api_key=abc", "holds credentials (the query parameter api_key)"),
                      ("ftp://host:8000", "is not the root URL of a vLLM server"),
                      ("http://host:8000/v1/models", "is not the root URL of a vLLM server")]:
        with pytest.raises(ValidationError) as error:
            ServeArgs(url=bad)
        message = error.value.errors()[0]["msg"]  # the CLI quotes the value itself, masked (cli._masked)
        assert said in message and "pw" not in message and "abc" not in message, message
    with pytest.raises(ValidationError, match="put the server's API key in the VLLM_API_KEY environment variable"):
        ServeArgs(url="http://a:b@h")
    with pytest.raises(ValidationError, match="must be a model name"):
        ServeArgs(adapter_name="../x")
    # what Prefect's server checks a deployment run's parameters against (the UI form) refuses them too
    from prefect.utilities.callables import parameter_schema
    from prefect.utilities.schema_tools import validate

    from flows.qlora_pipeline import qlora_pipeline

    schema = parameter_schema(qlora_pipeline).model_dump_for_openapi()
    assert validate({"config": {"serve": {"url": "http://user:pw@host:8000"}}}, schema)
    assert not validate({"config": {"serve": {"url": "http://127.0.0.1:8000"}}}, schema)


def test_the_check_takes_equal_answers_and_near_ties_only(stages: dict[str, Any]) -> None:
    """agreement(): equal answers pass; answers that part where the evaluated continuation was the server's runner-up
    pass within serve.tolerance and fail beyond it; an answer unrelated to the evaluated one fails."""
    from transformers import AutoTokenizer

    from tasks.export_adapter.serving import agreement

    tokenizer = AutoTokenizer.from_pretrained(stages["model"])
    want = tokenizer("The opposite of hot is cold.", add_special_tokens=False).input_ids
    other = tokenizer(" warm.", add_special_tokens=False).input_ids
    parted = len(want) - len(tokenizer(" cold.", add_special_tokens=False).input_ids)

    def answer(ids: list[int], margin: float) -> dict[str, Any]:
        top = [{t: -0.1} for t in ids]
        if len(ids) > parted:
            top[parted] = {ids[parted]: -0.1, want[parted]: -0.1 - margin}
        return {"ids": ids, "top": top, "finish": "stop"}

    expected = tokenizer.decode(want, skip_special_tokens=True)
    assert agreement(answer(want, 0.0), expected, tokenizer.decode, 0.5) == \
        (True, "its greedy answer equals the evaluated one")
    near = want[:parted] + other
    agrees, how = agreement(answer(near, 0.3), expected, tokenizer.decode, 0.5)
    assert agrees and f"parts from the evaluated one at token {parted}" in how and "by 0.300 nats" in how
    agrees, how = agreement(answer(near, 0.8), expected, tokenizer.decode, 0.5)
    assert not agrees and f"they part at token {parted}" in how and "warm" in how
    assert not agreement(answer(other, 0.0), expected, tokenizer.decode, 0.5)[0]
    assert not agreement(answer(near, 0.3), expected, tokenizer.decode, 0.0)[0]
