"""Talking to an OpenAI-compatible server over HTTP (httpx): models, a streamed chat completion, /metrics.

No Qt here. Every failure becomes a RemoteError with a sentence a user can act on: the server is unreachable,
it answered an error status (its OpenAI-style message is quoted), or it closed the stream mid-reply.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import httpx

from app.backends.metrics_parser import ServerKV, server_kv

CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 120.0  # between two chunks of a stream (a long prompt's prefill comes before the first)
NETWORK_ERRORS = (httpx.HTTPError, httpx.InvalidURL)  # InvalidURL: a URL httpx cannot even parse


class RemoteError(RuntimeError):
    """The server could not be used for this request; the message says why."""


@dataclass(frozen=True)
class RemoteModel:
    id: str
    max_context: int | None  # vLLM and kvscope publish max_model_len; others may not


@dataclass(frozen=True)
class Delta:
    """One streamed piece of the reply, with when it arrived (perf_counter seconds)."""

    text: str
    at: float


@dataclass(frozen=True)
class StreamEnd:
    finish_reason: str  # "stop", "length" or "cancelled"
    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None  # usage.prompt_tokens_details.cached_tokens, where the server reports it


def base_url(url: str) -> str:
    """'http://host:8000', 'http://host:8000/' and 'http://host:8000/v1' all mean the same server."""
    url = url.strip().rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def headers(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def make_client() -> httpx.Client:
    return httpx.Client(timeout=httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S))


def _fail(url: str, e: Exception) -> RemoteError:
    if isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout)):
        return RemoteError(f"Cannot reach the server at {url}: {e}. Is it running, and is the URL right?")
    if isinstance(e, (httpx.RemoteProtocolError, httpx.ReadError)):
        return RemoteError(f"The server at {url} closed the connection in the middle of the reply ({e}).")
    if isinstance(e, (httpx.InvalidURL, httpx.UnsupportedProtocol)):
        return RemoteError(f"{url!r} is not a server URL: {str(e).rstrip('.')}. Write it like http://127.0.0.1:8000")
    if isinstance(e, httpx.TimeoutException):
        return RemoteError(f"The server at {url} stopped answering (timed out).")
    return RemoteError(f"Request to {url} failed: {e}")


def _status_error(response: httpx.Response) -> RemoteError:
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text[:300] or response.reason_phrase
    return RemoteError(f"The server answered {response.status_code}: {message}")


def list_models(client: httpx.Client, url: str, api_key: str | None) -> list[RemoteModel]:
    url = base_url(url)
    try:
        response = client.get(f"{url}/v1/models", headers=headers(api_key), timeout=CONNECT_TIMEOUT_S * 2)
    except NETWORK_ERRORS as e:
        raise _fail(url, e) from None
    if response.status_code != 200:
        raise _status_error(response)
    try:
        data = response.json()["data"]
        return [RemoteModel(m["id"], m.get("max_model_len")) for m in data]
    except (ValueError, KeyError, TypeError):
        raise RemoteError(f"{url}/v1/models did not answer an OpenAI model list") from None


def fetch_server_kv(client: httpx.Client, url: str, api_key: str | None) -> ServerKV | None:
    """The server's KV figures; None when it publishes no /metrics; ServerKV(reachable=False) when it cannot be
    reached right now."""
    try:
        response = client.get(f"{base_url(url)}/metrics", headers=headers(api_key), timeout=CONNECT_TIMEOUT_S)
    except NETWORK_ERRORS:
        return ServerKV(reachable=False)
    return server_kv(response.text) if response.status_code == 200 else None


def stream_chat(client: httpx.Client, url: str, api_key: str | None, body: dict,
                stopped: Callable[[], bool]) -> Iterator[Delta | StreamEnd]:
    """POST a streaming chat completion; yields Deltas, then one StreamEnd. Leaving early closes the connection
    (the server then releases the request's KV blocks). stopped() is checked after every line."""
    url = base_url(url)
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    try:
        with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers(api_key)) as response:
            if response.status_code != 200:
                response.read()
                raise _status_error(response)
            yield from _events(response, stopped)
    except NETWORK_ERRORS as e:
        raise _fail(url, e) from None


def _events(response: httpx.Response, stopped: Callable[[], bool]) -> Iterator[Delta | StreamEnd]:
    finish, usage = None, {}
    for line in response.iter_lines():
        if stopped():
            yield StreamEnd("cancelled", None, None, None)
            return
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if "error" in chunk:
            raise RemoteError(f"The server failed in the middle of the reply: {chunk['error'].get('message')}")
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices") or ():
            text = (choice.get("delta") or {}).get("content")
            if text:
                yield Delta(text, time.perf_counter())
            finish = choice.get("finish_reason") or finish
    if finish is None:
        raise RemoteError("The server closed the stream before the reply was complete.")
    details = usage.get("prompt_tokens_details") or {}
    yield StreamEnd(finish, usage.get("prompt_tokens"), usage.get("completion_tokens"), details.get("cached_tokens"))
