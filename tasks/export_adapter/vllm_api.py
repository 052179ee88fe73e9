"""The few calls of a vLLM server that serving.py makes: vLLM's OpenAI-compatible routes and the stable-name table of
its model_aliases middleware (vllm_server/model_aliases.py), each bounded in time, each failure a ServingError that
says what to do."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from tasks.config import SERVE_API_KEY_ENV

ALIASES = "/v1/model_aliases"
MIDDLEWARE_DIR = Path(__file__).parent / "vllm_server"  # what the server's PYTHONPATH must hold
MIDDLEWARE = "model_aliases.ModelAliases"
DRAIN_POLL_S = 0.1


class ServingError(Exception):
    """The server could not be brought to serve the champion; the message says why and what to do."""


class Server:
    """A vLLM server at `url`, each call waiting at most `timeout` seconds; the API key from VLLM_API_KEY."""

    def __init__(self, url: str, timeout: float) -> None:
        import httpx

        key = os.environ.get(SERVE_API_KEY_ENV)
        self.url = url
        self.client = httpx.Client(base_url=url, timeout=timeout,
                                   headers={"Authorization": f"Bearer {key}"} if key else {})

    def close(self) -> None:
        self.client.close()

    def adapters(self) -> dict[str, str]:
        """{LoRA name: its folder} as vLLM loaded them (the base model, which has no parent, and aliases left out)."""
        models = _parsed(self._call("GET", "/v1/models"), lambda body: body["data"])
        return {m["id"]: m["root"] for m in models if m.get("parent") and not m.get("alias_of")}

    def aliases(self) -> tuple[dict[str, str], dict[str, int]]:
        """({stable name: the versioned name it points at}, {versioned name: requests routed to it still running})."""
        return _parsed(self._call("GET", ALIASES), lambda body: (dict(body["aliases"]), dict(body["in_flight"])))

    def point(self, alias: str, target: str | None) -> None:
        """From now on, requests for `alias` go to `target` (None: `alias` is no longer served)."""
        self._call("POST", ALIASES, {"alias": alias, "target": target})

    def drained(self, target: str, deadline: float) -> bool:
        """Wait until no request routed to `target` is running, or until `deadline` (time.monotonic()); whether none
        is."""
        while self.aliases()[1].get(target, 0) > 0:
            if time.monotonic() >= deadline:
                return False
            time.sleep(DRAIN_POLL_S)
        return True

    def load(self, name: str, path: str) -> None:
        self._call("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})

    def unload(self, name: str) -> None:
        self._call("POST", "/v1/unload_lora_adapter", {"lora_name": name})

    def answer(self, name: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
        """The greedy answer to `prompt` (token ids): its ids, the two likeliest tokens' log-probabilities at each
        step, and why it ended (stop: end of sequence; length: max_tokens)."""
        body = {"model": name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 2,
                "return_tokens_as_token_ids": True}

        def read(body: dict[str, Any]) -> dict[str, Any]:
            choice = body["choices"][0]
            return {"ids": [_token(t) for t in choice["logprobs"]["tokens"]], "finish": choice["finish_reason"],
                    "top": [{_token(t): p for t, p in top.items()} for top in choice["logprobs"]["top_logprobs"]]}

        return _parsed(self._call("POST", "/v1/completions", body), read)

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        import httpx

        try:
            response = self.client.request(method, path, json=body)
        except httpx.TimeoutException:
            raise ServingError(f"the vLLM server at {self.url} did not answer {path} within "
                               f"{self.client.timeout.read} s (serve.timeout_s)") from None
        except httpx.HTTPError as exc:
            raise ServingError(f"the vLLM server at {self.url} cannot be reached ({exc}); is it running?") from None
        if response.status_code == 401:
            raise ServingError(f"the vLLM server at {self.url} refused the API key: set {SERVE_API_KEY_ENV} to the "
                               "key it was started with (--api-key or its own VLLM_API_KEY)")
        # FastAPI's own 404 for a route that is not there (vLLM's is {"error": ...})
        if response.status_code == 404 and '"detail":"Not Found"' in response.text:
            if path == ALIASES:
                raise ServingError(f"the vLLM server at {self.url} does not keep stable names: start it as "
                                   f"docs/serving.md does, with --middleware {MIDDLEWARE} and PYTHONPATH="
                                   f"{MIDDLEWARE_DIR} (this checkout's), --enable-lora and the environment variable "
                                   "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True")
            if "lora_adapter" in path:
                raise ServingError(f"the vLLM server at {self.url} does not load adapters at run time: start it with "
                                   "--enable-lora and the environment variable VLLM_ALLOW_RUNTIME_LORA_UPDATING=True")
        if response.status_code != 200:
            raise ServingError(f"the vLLM server at {self.url} answered {method} {path} with {response.status_code}: "
                               f"{_error_text(response)}")
        return response


def _parsed(response: Any, read: Any) -> Any:
    """read(the response's JSON); a body of another shape is a ServingError (not vLLM's OpenAI-compatible server?)."""
    try:
        return read(response.json())
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        raise ServingError(f"{response.request.url} answered {response.text[:200]!r}, not what vLLM's "
                           "OpenAI-compatible server answers: is serve.url a vLLM server?") from None


def _token(text: str) -> int:
    """A token id as vLLM writes it with return_tokens_as_token_ids ("token_id:123")."""
    return int(text.removeprefix("token_id:"))


def _error_text(response: Any) -> str:
    """vLLM's error message ({"error": {"message": ...}}), else the body's start."""
    try:
        return str(response.json()["error"]["message"])[:500]
    except (ValueError, KeyError, TypeError):
        return response.text[:500]
