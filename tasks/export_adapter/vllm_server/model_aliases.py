"""Stable model names in vLLM's OpenAI-compatible server: clients ask for NAME, the server answers as the version
NAME points at, and pointing NAME at another version leaves no moment in which NAME is unknown.

An ASGI middleware that vLLM's server loads itself (`--middleware model_aliases.ModelAliases`, this folder on
PYTHONPATH: docs/serving.md); standard library only, because it runs in vLLM's own environment, not the pipeline's.
Each version is loaded into vLLM under a name of its own (NAME-vNNNN, by vLLM's /v1/load_lora_adapter, once) and
NAME is an alias of one of them: a request whose JSON body asks for NAME is passed on asking for that version,
decided once as the request arrives, so it runs to its end on one version, and pointing NAME elsewhere is one
assignment. vLLM 0.32 alone cannot switch a name without harm: unload + load leaves NAME unknown while the load
runs (404, also for requests already past vLLM's name check), and its in-place load re-reads the adapter folder at
every engine step, mixes two versions in an answer in flight, and stops the engine when that folder is gone.

    GET  /v1/model_aliases   {"aliases": {NAME: VERSION_NAME}, "in_flight": {VERSION_NAME: routed requests running}}
    POST /v1/model_aliases   {"alias": NAME, "target": VERSION_NAME} points NAME there; "target": null removes NAME
    GET  /v1/models          vLLM's list, each alias in it too: its target's card under the alias's id (in
                             place of an adapter loaded under that name), with "alias_of" naming the target

/v1/model_aliases takes the server's API key as vLLM's own /v1 routes do (--api-key, else VLLM_API_KEY). The table
lives in the API server process and is empty after a restart; with several API server processes
(--api-server-count) each would hold its own, so serve with one (vLLM's default without data parallelism).
"""

from __future__ import annotations

import hmac
import json
import os
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ROUTE = "/v1/model_aliases"


class ModelAliases:
    """The middleware: the aliases of one server process, and how many requests routed to each target are running."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.aliases: dict[str, str] = {}
        self.in_flight: Counter[str] = Counter()

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path, method = scope["path"].removeprefix(scope.get("root_path", "")), scope["method"]
        if path == ROUTE:
            await self._table(scope, receive, send)
        elif path == "/v1/models" and method == "GET" and self.aliases:
            await self.app(scope, receive, self._listing(send))
        elif method == "POST" and self.aliases and not _header(scope, b"content-type").startswith("multipart/"):
            await self._routed(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def _routed(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        """Pass the request on, asking for the alias's target if it asks for an alias."""
        body = await _body(receive)
        if body is None:  # the client left before its request was read: nothing to answer
            return
        target = self._target(body)
        if target is not None:
            body = json.dumps({**json.loads(body), "model": target}).encode()
            scope = {**scope, "headers": _with_length(scope["headers"], len(body))}
            # counted in the same step as the look-up (no await between): a switch that then reads the counts sees
            # every request the old target still has to answer
            self.in_flight[target] += 1
        try:
            await self.app(scope, _replay(body, receive), send)
        finally:
            if target is not None:
                self.in_flight[target] -= 1
                if self.in_flight[target] <= 0:
                    del self.in_flight[target]

    def _target(self, body: bytes) -> str | None:
        try:
            request = json.loads(body)
        except ValueError:
            return None
        model = request.get("model") if isinstance(request, dict) else None
        return self.aliases.get(model) if isinstance(model, str) else None

    def _listing(self, send: Send) -> Send:
        """A send that adds the aliases to vLLM's /v1/models answer (buffered: it is one small JSON body)."""
        start: Message = {}
        chunks: list[bytes] = []

        async def listing(message: Message) -> None:
            if message["type"] == "http.response.start":
                start.update(message)
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body"):
                return
            body = b"".join(chunks)
            if start.get("status") == 200:
                body = self._with_aliases(body)
            await send({**start, "headers": _with_length(start.get("headers", []), len(body))})
            await send({"type": "http.response.body", "body": body})

        return listing

    def _with_aliases(self, body: bytes) -> bytes:
        listing = json.loads(body)
        cards = {card["id"]: card for card in listing["data"]}
        for alias, target in self.aliases.items():
            if target in cards:  # in place of an adapter loaded under the alias's name: requests go to the alias
                cards[alias] = {**cards[target], "id": alias, "alias_of": target}
        listing["data"] = list(cards.values())
        return json.dumps(listing).encode()

    async def _table(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        """GET: the aliases and the counts; POST: point an alias, then the same answer."""
        if not _authorized(scope):
            await _answer(send, 401, {"error": "Unauthorized"})
            return
        if scope["method"] == "POST":
            problem = self._point(await _body(receive))
            if problem:
                await _answer(send, 400, {"error": {"message": problem, "type": "BadRequestError", "code": 400}})
                return
        elif scope["method"] != "GET":
            await _answer(send, 405, {"error": {"message": f"{ROUTE} takes GET and POST", "code": 405}})
            return
        await _answer(send, 200, {"aliases": self.aliases, "in_flight": dict(self.in_flight)})

    def _point(self, body: bytes | None) -> str:
        """Apply {"alias": NAME, "target": VERSION_NAME or null}; what is wrong with it, or ''."""
        try:
            change = json.loads(body or b"")
            alias, target = change["alias"], change["target"]
        except (ValueError, TypeError, KeyError):
            return f'{ROUTE} takes {{"alias": NAME, "target": MODEL_NAME or null}}'
        if not isinstance(alias, str) or not alias or not (target is None or isinstance(target, str) and target):
            return "alias must be a model name, target a model name or null"
        if target is None:
            self.aliases.pop(alias, None)
        else:
            self.aliases[alias] = target
        return ""


def _authorized(scope: dict[str, Any]) -> bool:
    """The keys vLLM's own authentication takes (its --api-key, else VLLM_API_KEY; none: open), checked the same way.
    This middleware runs before vLLM's (vLLM adds --middleware last, outermost), so it checks for itself."""
    args = getattr(getattr(scope.get("app"), "state", None), "args", None)  # vLLM keeps its parsed arguments there
    keys = [key for key in (getattr(args, "api_key", None) or [os.environ.get("VLLM_API_KEY")]) if key]
    if not keys:
        return True
    scheme, _, given = _header(scope, b"authorization").partition(" ")
    return scheme.lower() == "bearer" and any(hmac.compare_digest(given.encode(), key.encode()) for key in keys)


def _header(scope: dict[str, Any], name: bytes) -> str:
    return next((value.decode("latin-1") for key, value in scope["headers"] if key.lower() == name), "")


def _with_length(headers: list[tuple[bytes, bytes]], length: int) -> list[tuple[bytes, bytes]]:
    return [*((k, v) for k, v in headers if k.lower() != b"content-length"), (b"content-length", str(length).encode())]


async def _body(receive: Receive) -> bytes | None:
    """The whole request body; None when the client disconnected first."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that gives `body` first, then the client's own messages (its disconnect, which vLLM listens for)."""
    given = False

    async def replay() -> Message:
        nonlocal given
        if given:
            return await receive()
        given = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


async def _answer(send: Send, status: int, content: Any) -> None:
    body = json.dumps(content).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
