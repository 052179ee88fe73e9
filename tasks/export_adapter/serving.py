"""The champion in a running vLLM server: loaded, checked against its own evaluation, then served under one name.

serve.url names a vLLM server started as docs/serving.md says: --enable-lora, VLLM_ALLOW_RUNTIME_LORA_UPDATING=True
and the model_aliases middleware (vllm_server/model_aliases.py), which keeps stable names. Clients ask it for
serve.adapter_name (default export.name), NAME below. After each run, and after `qlora-pipeline promote`,
`serve_champion` makes NAME answer as the registry's champion:

1. the champion's version folder is loaded as NAME-vNNNN (vLLM's /v1/load_lora_adapter);
2. NAME-vNNNN answers one held-out prompt of the champion's own evaluation greedily, and the answer is compared with
   the tuned answer evaluate_adapter recorded for it (`agreement`);
3. only then is NAME pointed at NAME-vNNNN (the middleware's alias: one assignment in the server), and it must
   answer exactly as NAME-vNNNN did, else it is pointed back;
4. the previous NAME-vNNNN is unloaded once the requests routed to it have finished (at most serve.timeout_s; one
   still running then keeps it loaded until the next switch).

So a request for NAME never meets a moment without NAME, and runs to its end on the version it was routed to. Not
vLLM's unload + load of NAME (NAME unknown while the load runs: 404s, also for requests already past vLLM's name
check), nor its in-place reload (load_inplace: vLLM 0.32 keeps the flag on the served adapter, so every engine step
re-reads its folder; an answer in flight switches weights mid-answer when new requests join its batch; the engine
dies when the folder is gone): docs/serving.md has the measurements. The load path is the version folder: the
server must see runs_dir at the same path (a shared disk).

Any failure (the server down, a refused API key, a failed load, an answer that does not match) leaves NAME serving
the previous champion, and is reported: the run summary and a `serving` artifact say "serving not updated" and why,
and the flow run ends Failed with that message and the tag not-served (the version is published all the same). A NAME
that already serves the champion is left alone, so a run that promoted nothing changes nothing, and a restarted
server gets the champion back on the next run. The API key comes from the environment (VLLM_API_KEY, as vLLM's server
reads it), never from a file.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.config import ServeArgs
from tasks.export_adapter.vllm_api import Server, ServingError
from tasks.log import logger
from tasks.on_disk.parquet_dataset import split_prompt
from tasks.registry import store as registry
from tasks.reporting import artifacts

NOT_UPDATED = artifacts.NOT_UPDATED  # the status the run's final state and exit status are told by


def normalize(text: str) -> str:
    """As evaluate_adapter's exact match compares answers: whitespace runs as one space, none at the ends."""
    return " ".join(text.split())


def serve_champion(args: ServeArgs, export_name: str, runs_dir: Path) -> dict[str, Any] | None:
    """Make serve.url's vLLM server serve the registry's champion (see the module docstring): a task run of the flow
    that calls it; None without a URL, and then no task run either (a run without a server shows its five stages)."""
    return None if args.url is None else _serve_champion(args, export_name, runs_dir)


@task(name="serve_champion", cache_policy=NO_CACHE)  # the server's state is not an input: look every time
def _serve_champion(args: ServeArgs, export_name: str, runs_dir: Path) -> dict[str, Any]:
    outcome = sync(args, export_name, runs_dir)
    level = logger().warning if outcome["status"] == NOT_UPDATED else logger().info
    level("serving: %s", outcome["message"])
    artifacts.table("serving", [outcome], f"vLLM at {args.url}: {outcome['message']}")
    return outcome


def sync(args: ServeArgs, export_name: str, runs_dir: Path) -> dict[str, Any]:
    """{status: updated | unchanged | not updated, message, name, version, previous}: never raises for what the
    server or the registry's files do (the version stays published whatever happens here)."""
    name = args.adapter_name or export_name
    root = registry.registry_dir(runs_dir, export_name)
    now = registry.current(root)["champion_version"]
    outcome = {"url": args.url, "name": name, "version": now, "previous": None}
    if now is None:
        return {**outcome, "status": NOT_UPDATED, "message": f"serving not updated: registry {export_name} has no "
                f"champion at {root}"}
    server, loaded, versioned = Server(str(args.url), args.timeout_s), None, f"{name}-{now}"
    try:
        current = server.aliases()[0].get(name)
        loaded = server.adapters()
        outcome["previous"] = _version_of(loaded.get(current or name))  # or NAME loaded by an earlier release
        if current == versioned and loaded.get(versioned) == str(root / now):
            return {**outcome, "status": "unchanged", "message": f"{name} already serves {now}"}
        checked = switch(server, name, root, now, args, loaded, current)
    except ServingError as exc:
        kept = ("whatever the server serves is unchanged" if loaded is None else
                f"{name} still serves {outcome['previous']}" if outcome["previous"] else f"{name} is not served yet")
        return {**outcome, "status": NOT_UPDATED, "message": f"serving not updated: {exc}; {kept}"}
    finally:
        server.close()
    return {**outcome, "status": "updated", "message": f"{name} now serves {now} ({checked})"}


def switch(server: Server, name: str, root: Path, version: str, args: ServeArgs, loaded: dict[str, str],
           current: str | None) -> str:
    """Load `version` as NAME-vNNNN, check it, point NAME at it, retire what NAME served before (`current`: the
    versioned name NAME points at now); how it was checked."""
    path, versioned = str(root / version), f"{name}-{version}"
    prompt, expected, max_tokens, decode = check_material(root, version)
    if loaded.get(versioned) not in (None, path):  # loaded from another folder (a moved runs_dir)
        server.unload(versioned)
    if loaded.get(versioned) != path:
        server.load(versioned, path)
    answer = server.answer(versioned, prompt, max_tokens)
    agrees, how = agreement(answer, expected, decode, args.tolerance)
    if not agrees:
        if current != versioned:  # what NAME serves stays loaded
            server.unload(versioned)
        raise ServingError(f"{versioned} does not answer as {version}'s evaluation did: {how}. Is the server's base "
                           f"model the one {version} was trained on (its adapter_config.json names it)?")
    server.point(name, versioned)  # the switch: a request arriving from now on is routed to versioned
    if server.answer(name, prompt, max_tokens)["ids"] != answer["ids"]:
        server.point(name, current)
        raise ServingError(f"{name} answered otherwise than {versioned}, which it was pointed at, so it was pointed "
                           "back")
    return how + "".join(f"; {note}" for note in retire(server, name, versioned, loaded, args.timeout_s))


def retire(server: Server, name: str, kept: str, loaded: dict[str, str], timeout_s: float) -> list[str]:
    """Unload the other NAME-vNNNN (the previous champion, versions a failed run left loaded), each once the requests
    routed to it have finished, waiting at most timeout_s in all; a note for each left loaded. NAME serves `kept`
    already, so nothing here fails the switch. (A NAME loaded as an adapter of its own by an earlier release's unload
    + load switch stays: the alias hides it.)"""
    deadline, notes = time.monotonic() + timeout_s, []
    for other in (n for n in loaded if n != kept and re.fullmatch(re.escape(name) + r"-v\d{4,}", n)):
        try:
            if server.drained(other, deadline):
                server.unload(other)
            else:
                notes.append(f"{other} still answers requests after {timeout_s:g} s (serve.timeout_s) and stays "
                             "loaded until the next switch")
        except ServingError as exc:
            notes.append(f"{other} stays loaded until the next switch ({exc})")
    return notes


def _version_of(path: str | None) -> str | None:
    """The vNNNN a served folder is, for the messages."""
    return Path(path).name if path else None


def check_material(root: Path, version: str) -> tuple[list[int], str, int, Any]:
    """From `version`'s own evaluation: one held-out prompt's token ids, the tuned answer recorded for it, the most
    new tokens evaluation allowed, and a decoder of token ids (the version's tokenizer). The prompt is the first whose
    tuned answer differs from the base model's, so that a server that applies no adapter cannot pass."""
    record = registry.version_record(root, version)
    if record is None:
        raise ServingError(f"{root / version} has no {registry.VERSION_FILE}")
    runs_dir, export_dir = root.parent.parent, registry.source_dir(root, record)
    try:
        upstream = json.loads((export_dir / "manifest.json").read_text())["upstream"]
        eval_dir = _stage_dir(runs_dir, "evaluate_adapter", upstream["evaluate_adapter"])
        data_dir = _stage_dir(runs_dir, "prepare_data", upstream["prepare_data"])
        params = json.loads((eval_dir / "manifest.json").read_text())["params"]["eval"]
        samples = [json.loads(line) for line in (eval_dir / "samples.jsonl").read_text().splitlines() if line]
    except (OSError, KeyError, ValueError) as exc:
        raise ServingError(f"{version}'s evaluation cannot be read to check the server against ({exc}); its export "
                           f"stage folder {export_dir} and the evaluate_adapter and prepare_data folders it names "
                           "must still be under runs_dir") from None
    if not samples:
        raise ServingError(f"{version}'s evaluation holds no greedy answer to check the server against (it ran "
                           "with eval.generation_samples=0, or on data without a prompt/answer split)")
    pick = next((i for i, s in enumerate(samples) if normalize(s["tuned_output"]) != normalize(s["base_output"])), 0)
    prompt = _held_out_prompt(data_dir / "eval.parquet", params.get("max_samples"), pick)
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(root / version)
    except (OSError, ValueError) as exc:
        raise ServingError(f"the tokenizer in {root / version} does not load ({exc})") from None
    return prompt, samples[pick]["tuned_output"], params["max_new_tokens"], tokenizer.decode


def _stage_dir(runs_dir: Path, stage: str, upstream: dict[str, str]) -> Path:
    """An upstream stage folder: under this runs_dir by its key (a moved runs_dir), else where it was recorded."""
    here = runs_dir / stage / upstream["key"]
    return here if here.is_dir() else Path(upstream["dir"])


def _held_out_prompt(eval_parquet: Path, max_samples: int | None, index: int) -> list[int]:
    """The token ids of evaluation's `index`-th greedy prompt: as evaluate_adapter picks them, the examples with a
    masked prompt among the first eval.max_samples, in order."""
    from tasks.on_disk.parquet_dataset import ParquetExamples

    examples = ParquetExamples(eval_parquet)
    count = len(examples) if max_samples is None else min(max_samples, len(examples))
    found = (pair[0] for pair in (split_prompt(**examples[i]) for i in range(count)) if pair is not None)
    prompt = next((p for i, p in enumerate(found) if i == index), None)
    if prompt is None:
        raise ServingError(f"{eval_parquet} no longer holds the prompt its evaluation answered")
    return prompt


def agreement(answer: dict[str, Any], expected: str, decode: Any, tolerance: float) -> tuple[bool, str]:
    """(agrees, how): the served greedy answer equals the expected one (whitespace aside), or parts from it at a near
    tie: where they part, the expected continuation is the server's runner-up within `tolerance` nats of its choice.

    Past that token the two answers go on from different text, so nothing after it is compared."""
    ids, tops, want = answer["ids"], answer["top"], normalize(expected)
    if normalize(decode(ids, skip_special_tokens=True)) == want:
        return True, "its greedy answer equals the evaluated one"

    def on_track(tokens: list[int]) -> bool:
        return want.startswith(normalize(decode(tokens, skip_special_tokens=True)))

    parted = next((i for i in range(len(ids)) if not on_track(ids[: i + 1])), None)
    if parted is None:  # a prefix of the expected answer: the server stopped early (end of sequence) or ran out
        if answer["finish"] != "stop":
            return True, "its greedy answer agrees with the evaluated one as far as it goes"
        parted = len(ids) - 1
    chosen = tops[parted].get(ids[parted], 0.0)
    runners = [(chosen - logprob, token) for token, logprob in tops[parted].items() if token != ids[parted]]
    for margin, token in sorted(runners):
        text = normalize(decode([*ids[:parted], token], skip_special_tokens=True))
        if margin <= tolerance and (want.startswith(text) or text == want):
            return True, (f"its greedy answer parts from the evaluated one at token {parted}, where the evaluated "
                          f"continuation was its runner-up by {margin:.3f} nats (serve.tolerance {tolerance})")
    return False, (f"it answered {decode(ids, skip_special_tokens=True)!r} where the evaluation answered "
                   f"{expected!r}; they part at token {parted}, where the evaluated continuation is not within "
                   f"serve.tolerance={tolerance} nats of the server's choice")
