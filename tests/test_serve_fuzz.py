"""A property-based fuzz of the HTTP API (hypothesis, derandomized, a bounded number of examples): any method on
any route, with bodies that are near-valid requests with random values (lone surrogates, NaN, huge integers,
wrong types, unknown fields), arbitrary JSON or arbitrary bytes. Whatever comes in, the answer has a documented
status, a JSON body (or a well-formed event stream), and the server stays alive and leaks no block."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_serve_api import MODEL, InProcessServer

DOCUMENTED = {200, 400, 404, 405, 413}  # no key on this server: no 401
TEXT = st.one_of(st.text(max_size=12), st.text(st.characters(categories=["Cs"]), min_size=1, max_size=2),
                 st.sampled_from(["", "hi", "\ud800x", "x" * 300]))
NUMBER = st.one_of(st.integers(min_value=-2**80, max_value=2**80), st.floats(), st.integers(-3, 20))
JSON = st.recursive(st.one_of(st.none(), st.booleans(), NUMBER, TEXT),
                    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(TEXT, inner, max_size=3)),
                    max_leaves=8)


def mostly(valid: st.SearchStrategy) -> st.SearchStrategy:
    """A value of the field's type three times in four (in range or not), any JSON value otherwise."""
    return st.integers(0, 3).flatmap(lambda i: JSON if i == 0 else valid)


MESSAGE = st.fixed_dictionaries({"role": mostly(st.sampled_from(["system", "user", "assistant", "tool", "x"])),
                                 "content": mostly(TEXT)})
FIELDS = {
    "model": mostly(st.sampled_from([MODEL, "other"])),
    "messages": mostly(st.lists(MESSAGE, max_size=3)),
    "prompt": mostly(TEXT | st.lists(st.integers(-2, 70_000), max_size=5)),
    "max_tokens": mostly(st.integers(-2, 12)),
    "temperature": mostly(st.floats(-1, 3)),
    "top_p": mostly(st.floats(-0.5, 1.5)),
    "n": mostly(st.integers(-1, 4)),
    "seed": mostly(st.integers(-2**70, 2**70)),
    "stop": mostly(TEXT | st.lists(TEXT, max_size=3)),
    "stream": mostly(st.booleans()),
    "stream_options": mostly(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "logprobs": mostly(st.booleans() | st.integers(-1, 25)),
    "top_logprobs": mostly(st.integers(-1, 25)),
    "logit_bias": mostly(st.dictionaries(st.integers(-5, 70_000).map(str) | TEXT, st.floats(-200, 200), max_size=3)),
    "presence_penalty": mostly(st.floats(-3, 3)),
    "frequency_penalty": mostly(st.floats(-3, 3)),
    "top_k": mostly(st.integers(-3, 50)),
    "min_p": mostly(st.floats(-0.5, 1.5)),
    "repetition_penalty": mostly(st.floats(-1, 3)),
    "echo": mostly(st.booleans()),
    "response_format": mostly(st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])})),
    "tools": JSON,
    "user": TEXT,
}
BASE = {"/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]}, "/v1/completions": {"prompt": "hi"}}


def bodies(path: str) -> st.SearchStrategy[bytes]:
    """Near-valid requests for the route (a valid one with random fields over it, sometimes unknown ones too),
    arbitrary JSON, arbitrary bytes."""
    base = {"model": MODEL, "max_tokens": 3, **BASE.get(path, {})}
    fields = st.lists(st.sampled_from(sorted(FIELDS)), max_size=4, unique=True).flatmap(
        lambda names: st.fixed_dictionaries({name: FIELDS[name] for name in names}))
    unknown = st.integers(0, 4).flatmap(lambda i: st.dictionaries(TEXT, JSON, max_size=2) if i == 0 else st.just({}))
    near = st.tuples(fields, unknown).map(lambda t: json.dumps({**base, **t[1], **t[0]}).encode())  # NaN, \udXXX
    return st.integers(0, 5).flatmap(lambda i: near if i < 4 else  # near-valid two times in three
                                     JSON.map(lambda v: json.dumps(v).encode()) if i == 4 else st.binary(max_size=64))


POSTS = st.sampled_from([("POST", "/v1/chat/completions"), ("POST", "/v1/completions")])
OTHERS = st.one_of(st.sampled_from([("GET", "/v1/models"), ("GET", "/health"), ("GET", "/metrics"),
                                    ("GET", "/v1/chat/completions"), ("DELETE", "/v1/models"),
                                    ("PUT", "/v1/completions"), ("POST", "/v1/models")]),
                   st.tuples(st.sampled_from(["GET", "POST"]),
                             st.text("abcz/%.-_~0", max_size=12).map(lambda p: "/v1/models/" + p)),
                   st.tuples(st.sampled_from(["GET", "POST"]), st.text("abcv1/", max_size=10).map(lambda p: "/" + p)))
ROUTES = st.integers(0, 3).flatmap(lambda i: POSTS if i else OTHERS)  # three in four: completions


@pytest.fixture(scope="module")
def server(tiny_config, tokenizer):
    with InProcessServer(tiny_config, tokenizer) as s, httpx.Client(base_url=s.url, timeout=60) as client:
        s.client = client
        yield s


def check_event_stream(text: str) -> None:
    data = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert data, "an empty stream"
    for item in data[:-1]:
        assert isinstance(json.loads(item), dict)
    assert data[-1] == "[DONE]" or "error" in json.loads(data[-1])


def check_answer(response: httpx.Response, path: str) -> None:
    assert response.status_code in DOCUMENTED, (response.status_code, response.text[:300])
    kind = response.headers.get("content-type", "")
    if response.status_code != 200:
        assert kind.startswith("application/json"), kind
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"] and error["type"]
    elif kind.startswith("text/event-stream"):
        check_event_stream(response.text)
    elif path == "/metrics":
        assert "kvscope:num_requests_running" in response.text
    elif path != "/health":
        assert isinstance(response.json(), dict)


@settings(max_examples=200, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])
@given(route=ROUTES, data=st.data())
def test_any_request_gets_a_documented_status_and_json(server, route, data):
    method, path = route
    body = data.draw(bodies(path))
    response = server.client.request(method, path, content=body, headers={"Content-Type": "application/json"})
    check_answer(response, path)
    event(f"{method} {path if path in BASE else 'other'} -> {response.status_code}")  # --hypothesis-show-statistics
    assert server.thread.is_alive()


def test_after_the_fuzz_the_server_serves_and_holds_no_block(server):
    server.wait_idle()
    assert server.scheduler.cache.pool.num_used == 0
    server.scheduler.cache.pool.check_invariants()
    reply = server.client.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2,
                                                             "messages": [{"role": "user", "content": "hi"}]})
    assert reply.status_code == 200 and reply.json()["choices"]
