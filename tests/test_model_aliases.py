"""The model_aliases middleware (tasks/export_adapter/vllm_server/model_aliases.py) on its own, in front of a small
ASGI app that answers what it was asked: requests are rerouted as they arrive and counted until they end, /v1/models
lists the aliases, the table takes the server's key. tests/test_vllm.py runs it inside vLLM's real server."""

from __future__ import annotations

import asyncio
import importlib.util
import json
from types import SimpleNamespace
from typing import Any

import pytest

from tasks.config import PROJECT_ROOT

_SPEC = importlib.util.spec_from_file_location(
    "model_aliases", PROJECT_ROOT / "tasks" / "export_adapter" / "vllm_server" / "model_aliases.py")
model_aliases = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(model_aliases)


class Echo:
    """An ASGI app: /v1/models lists two adapters; any other request is answered with the body it received, after
    `hold` (an event) is set, so a test can look at the counts while a request runs."""

    def __init__(self) -> None:
        self.hold = asyncio.Event()
        self.hold.set()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["path"] == "/v1/models":
            body = {"object": "list", "data": [{"id": "base", "root": "/m", "parent": None},
                                               {"id": "bot-v0001", "root": "/r/v0001", "parent": "base"},
                                               {"id": "bot", "root": "/old", "parent": "base"}]}
        else:
            await self.hold.wait()
            body = {"received": json.loads((await receive())["body"] or b"null"),
                    "length": dict(scope["headers"]).get(b"content-length", b"").decode()}
        data = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data})


async def _ask(app: Any, method: str, path: str, body: Any = None, key: str | None = None,
               args: Any = None) -> tuple[int, Any]:
    """One HTTP request through `app`: (status, JSON body)."""
    data = json.dumps(body).encode() if body is not None else b""
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    headers += [(b"authorization", f"Bearer {key}".encode())] if key else []
    scope = {"type": "http", "method": method, "path": path, "root_path": "", "headers": headers,
             "app": SimpleNamespace(state=SimpleNamespace(args=args or SimpleNamespace(api_key=None)))}
    messages = [{"type": "http.request", "body": data, "more_body": False}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return sent[0]["status"], json.loads(b"".join(m.get("body", b"") for m in sent[1:]))


def test_a_request_for_an_alias_goes_to_its_target_and_is_counted_until_it_ends(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_API_KEY", raising=False)

    async def scenario() -> None:
        inner = Echo()
        app = model_aliases.ModelAliases(inner)
        ask = {"model": "bot", "prompt": "hi"}
        assert (await _ask(app, "POST", "/v1/completions", ask))[1]["received"] == ask  # no alias: as sent
        status, table = await _ask(app, "POST", "/v1/model_aliases", {"alias": "bot", "target": "bot-v0001"})
        assert status == 200 and table == {"aliases": {"bot": "bot-v0001"}, "in_flight": {}}
        inner.hold.clear()
        running = asyncio.create_task(_ask(app, "POST", "/v1/completions", ask))
        await asyncio.sleep(0.05)
        assert (await _ask(app, "GET", "/v1/model_aliases"))[1]["in_flight"] == {"bot-v0001": 1}
        await _ask(app, "POST", "/v1/model_aliases", {"alias": "bot", "target": "bot-v0002"})  # a switch meanwhile
        inner.hold.set()
        answer = (await running)[1]
        assert answer["received"] == {"model": "bot-v0001", "prompt": "hi"}  # where it was routed on arrival
        assert answer["length"] == str(len(json.dumps(answer["received"])))
        assert (await _ask(app, "GET", "/v1/model_aliases"))[1] == {"aliases": {"bot": "bot-v0002"}, "in_flight": {}}
        other = {"model": "base", "prompt": "hi"}
        assert (await _ask(app, "POST", "/v1/completions", other))[1]["received"] == other

    asyncio.run(scenario())


def test_the_model_list_shows_each_alias_as_its_target(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_API_KEY", raising=False)

    async def scenario() -> None:
        app = model_aliases.ModelAliases(Echo())
        await _ask(app, "POST", "/v1/model_aliases", {"alias": "bot", "target": "bot-v0001"})
        await _ask(app, "POST", "/v1/model_aliases", {"alias": "gone", "target": "bot-v0009"})  # not loaded
        cards = {card["id"]: card for card in (await _ask(app, "GET", "/v1/models"))[1]["data"]}
        # in place of an adapter loaded under the alias's own name: requests for it go to the alias
        assert cards["bot"] == {"id": "bot", "root": "/r/v0001", "parent": "base", "alias_of": "bot-v0001"}
        assert "gone" not in cards and cards["bot-v0001"]["root"] == "/r/v0001"
        await _ask(app, "POST", "/v1/model_aliases", {"alias": "bot", "target": None})
        assert (await _ask(app, "GET", "/v1/model_aliases"))[1]["aliases"] == {"gone": "bot-v0009"}

    asyncio.run(scenario())


def test_the_table_takes_the_servers_key_and_says_what_it_expects(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_API_KEY", "from-env")

    async def scenario() -> None:
        app = model_aliases.ModelAliases(Echo())
        assert (await _ask(app, "GET", "/v1/model_aliases"))[0] == 401
        assert (await _ask(app, "GET", "/v1/model_aliases", key="wrong"))[0] == 401
        assert (await _ask(app, "GET", "/v1/model_aliases", key="from-env"))[0] == 200
        # vLLM's --api-key, where given, is the key (as vLLM's own routes take it)
        flag = SimpleNamespace(api_key=["from-flag"])
        assert (await _ask(app, "GET", "/v1/model_aliases", key="from-env", args=flag))[0] == 401
        assert (await _ask(app, "GET", "/v1/model_aliases", key="from-flag", args=flag))[0] == 200
        status, body = await _ask(app, "POST", "/v1/model_aliases", {"alias": "bot"}, key="from-env")
        assert status == 400 and "takes {\"alias\": NAME, \"target\": MODEL_NAME or null}" in body["error"]["message"]
        status, body = await _ask(app, "POST", "/v1/model_aliases", {"alias": "", "target": "x"}, key="from-env")
        assert status == 400 and "alias must be a model name" in body["error"]["message"]

    asyncio.run(scenario())
