"""A table of bad requests (malformed bodies, wrong types, out-of-range values, unsupported fields, wrong routes and
methods): each gets the documented status with an OpenAI-shaped JSON error naming the field where there is one,
and after each the server still serves and holds no block."""

from __future__ import annotations

import json

import httpx
import pytest
from test_serve_api import MODEL, InProcessServer

CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
HI = [{"role": "user", "content": "hi"}]


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": HI, "max_tokens": 2, **fields}


def text(**fields) -> dict:
    return {"model": MODEL, "prompt": "hi", "max_tokens": 2, **fields}


CASES = [
    # (case, method, path, body: dict | str | bytes | None, status, param)
    ("not JSON", "POST", CHAT, "{not json", 400, None),
    ("an empty body", "POST", CHAT, b"", 400, None),
    ("a JSON array", "POST", CHAT, "[1, 2]", 400, None),
    ("a JSON string", "POST", CHAT, '"hello"', 400, None),
    ("JSON nested too deeply", "POST", CHAT, "[" * 100_000 + "]" * 100_000, 400, None),
    ("bytes that are not UTF-8", "POST", CHAT, b'{"model": "\xff\xfe"}', 400, None),
    ("NaN temperature", "POST", CHAT, json.dumps(chat(temperature=float("nan"))), 400, "temperature"),
    ("infinite max_tokens", "POST", CHAT, json.dumps(chat(max_tokens=float("inf"))), 400, "max_tokens"),
    ("no model", "POST", CHAT, {"messages": HI}, 400, "model"),
    ("no messages", "POST", CHAT, {"model": MODEL}, 400, "messages"),
    ("messages not a list", "POST", CHAT, chat(messages="hi"), 400, "messages"),
    ("a message without a role", "POST", CHAT, chat(messages=[{"content": "hi"}]), 400, "messages"),
    ("a tool message", "POST", CHAT, chat(messages=[{"role": "tool", "content": "x"}]), 400, "messages"),
    ("content a number", "POST", CHAT, chat(messages=[{"role": "user", "content": 5}]), 400, "messages"),
    ("an image part", "POST", CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), 400,
     "messages"),
    ("only a system message", "POST", CHAT, chat(messages=[{"role": "system", "content": "x"}]), 400, "messages"),
    ("a system message after the user's", "POST", CHAT,
     chat(messages=[*HI, {"role": "system", "content": "x"}]), 400, "messages"),
    ("a lone surrogate in content", "POST", CHAT, chat(messages=[{"role": "user", "content": "\ud800x"}]), 400,
     "messages.0.content"),
    ("a lone surrogate in a key", "POST", CHAT, {**chat(), "\udc00": 1}, 400, "\\udc00"),
    ("seed 2**70", "POST", CHAT, chat(seed=2**70), 400, "seed"),
    ("seed negative", "POST", CHAT, chat(seed=-5), 400, "seed"),
    ("seed a string", "POST", CHAT, chat(seed="abc"), 400, "seed"),
    ("seed a fraction", "POST", CHAT, chat(seed=1.5), 400, "seed"),
    ("max_tokens 0", "POST", CHAT, chat(max_tokens=0), 400, "max_tokens"),
    ("max_tokens a word", "POST", CHAT, chat(max_tokens="ten"), 400, "max_tokens"),
    ("max_completion_tokens negative", "POST", CHAT, chat(max_completion_tokens=-1), 400, "max_completion_tokens"),
    ("temperature above 2", "POST", CHAT, chat(temperature=2.5), 400, "temperature"),
    ("top_p 0", "POST", CHAT, chat(top_p=0), 400, "top_p"),
    ("n 0", "POST", CHAT, chat(n=0), 400, "n"),
    ("n 100", "POST", CHAT, chat(n=100), 400, "n"),
    ("17 stop strings", "POST", CHAT, chat(stop=[str(i) for i in range(17)]), 400, "stop"),
    ("stop a number", "POST", CHAT, chat(stop=5), 400, "stop"),
    ("stream a word", "POST", CHAT, chat(stream="maybe"), 400, "stream"),
    ("stream_options a list", "POST", CHAT, chat(stream=True, stream_options=[1]), 400, "stream_options"),
    ("logprobs a number", "POST", CHAT, chat(logprobs=5), 400, "logprobs"),
    ("top_logprobs without logprobs", "POST", CHAT, chat(top_logprobs=2), 400, "top_logprobs"),
    ("logit_bias a list", "POST", CHAT, chat(logit_bias=[1, 2]), 400, "logit_bias"),
    ("response_format json_object", "POST", CHAT, chat(response_format={"type": "json_object"}), 400,
     "response_format"),
    ("tools", "POST", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools"),
    ("an unknown field", "POST", CHAT, chat(temprature=0.5), 400, "temprature"),
    ("an unknown model", "POST", CHAT, chat(model="gpt-4o"), 404, "model"),
    ("a prompt longer than the context", "POST", CHAT,
     chat(messages=[{"role": "user", "content": "word " * 400}]), 400, "messages"),
    ("a huge max_tokens is cut to the room left", "POST", CHAT, chat(max_tokens=10**30), 200, None),
    ("a completion prompt that is an object", "POST", TEXT, text(prompt={"a": 1}), 400, "prompt"),
    ("a completion prompt of objects", "POST", TEXT, text(prompt=[{"a": 1}]), 400, "prompt"),
    ("a completion prompt of floats", "POST", TEXT, text(prompt=[1.5, 2.5]), 400, "prompt"),
    ("GET on a POST route", "GET", CHAT, None, 405, None),
    ("POST on a GET route", "POST", "/v1/models", {}, 405, None),
    ("an unknown route", "GET", "/v1/engines", None, 404, None),
    ("a body over the limit", "POST", CHAT, chat(user="x" * (2 << 20)), 413, None),
]


@pytest.fixture(scope="module")
def server(tiny_config, tokenizer):
    with InProcessServer(tiny_config, tokenizer) as s:
        yield s


def send(server, method: str, path: str, body) -> httpx.Response:
    if isinstance(body, dict):
        body = json.dumps(body)
    return httpx.request(method, server.url + path, content=body, timeout=60,
                         headers={"Content-Type": "application/json"})


@pytest.mark.parametrize("case, method, path, body, status, param", CASES, ids=[c[0] for c in CASES])
def test_a_bad_request_gets_its_status_and_a_json_error(server, case, method, path, body, status, param):
    response = send(server, method, path, body)
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    if status != 200:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        if param is not None:
            assert error["param"] == param, error
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    server.wait_idle()
    assert server.scheduler.cache.pool.num_used == 0
