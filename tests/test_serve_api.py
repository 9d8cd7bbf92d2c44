"""Every parameter of the OpenAI requests honoured or refused with a 400 that names it, /v1/completions,
GET /v1/models/{id}, metrics with finish reasons and vLLM's per-request histograms, and the server's limits.

The server runs in this process (uvicorn on a thread, a tiny random model with the real tokenizer, the scheduler
on its own thread) and is reached over real loopback HTTP; `InProcessServer` is shared with the fuzz tests."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn

from app.backends.metrics_parser import parse_exposition
from engine.config import EngineConfig
from engine.engine import Engine
from engine.model import LlamaModel
from engine.scheduler import Scheduler
from server.app import HANDOFF_TIMEOUT_S, LoopHandoff, create_app
from server.limits import JSONErrorH11Protocol

MODEL = "tiny"
CONTEXT = 256
A, B = 1000, 1001  # two ordinary tokens (never in the chat template)


class InProcessServer:
    """with InProcessServer(tiny_config, tokenizer, ...) as s: s.url, s.port, s.scheduler, s.app."""

    def __init__(self, tiny_config, tokenizer, api_key: str | None = None, max_body_bytes: int = 1 << 20,
                 max_concurrency: int = 16):
        engine = Engine(LlamaModel.random(tiny_config, seed=0, std=0.1), tokenizer,
                        EngineConfig(cache="paged", block_size=16, max_context=CONTEXT), MODEL)
        from engine.scheduler import SchedulerConfig

        self.scheduler = Scheduler(engine, SchedulerConfig(max_concurrency=max_concurrency))
        self.app = create_app(self.scheduler, MODEL, api_key, max_body_bytes=max_body_bytes)
        config = uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="critical", lifespan="off",
                                http=JSONErrorH11Protocol)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="test-uvicorn", daemon=True)

    def __enter__(self) -> InProcessServer:
        self.scheduler.start()
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.scheduler.close()

    def metrics(self) -> dict[str, float]:
        """name{label=value,...} -> value, and name -> the sum over its series."""
        out: dict[str, float] = {}
        for s in parse_exposition(httpx.get(self.url + "/metrics", timeout=10).text):
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
            if labels:
                out[s.name] = out.get(s.name, 0.0) + s.value
        return out

    def wait_idle(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            s = self.scheduler.stats()
            if s.num_running == 0 and s.num_waiting == 0:
                return
            time.sleep(0.02)
        raise AssertionError("the scheduler still runs requests")


@pytest.fixture(scope="module")
def server(tiny_config, tokenizer):
    with InProcessServer(tiny_config, tokenizer) as s:
        yield s


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def chat(text: str = "Hello") -> list[dict]:
    return [{"role": "user", "content": text}]


def post(server, path: str, payload, headers: dict | None = None) -> httpx.Response:
    content = payload if isinstance(payload, (str, bytes)) else json.dumps(payload)
    return httpx.post(server.url + path, content=content, timeout=60,
                      headers={"Content-Type": "application/json", **(headers or {})})


def ask(server, **fields) -> httpx.Response:
    return post(server, "/v1/chat/completions", {"model": MODEL, "messages": chat(), "max_tokens": 4, **fields})


def complete(server, **fields) -> httpx.Response:
    return post(server, "/v1/completions", {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, **fields})


def assert_error(response: httpx.Response, status: int, param: str | None = None, code: str | None = None):
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    err = response.json()["error"]
    assert err["message"] and err["type"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err


def tokens_of(response: httpx.Response, choice: int = 0) -> list[str]:
    return response.json()["choices"][choice]["logprobs"]["tokens"]


def events(response: httpx.Response) -> list[dict]:
    lines = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


# ---- no 500, no plain text -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [2**70, 2**64, -1])
def test_a_seed_outside_what_a_generator_takes_is_a_400_naming_seed(server, seed):
    assert_error(ask(server, seed=seed), 400, "seed")


def test_the_largest_seed_is_served(server):
    assert ask(server, seed=2**64 - 1, temperature=1).status_code == 200


@pytest.mark.parametrize("where, fields, param", [
    ("content", {"messages": [{"role": "user", "content": "\ud800x"}]}, "messages.0.content"),
    ("a text part", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a\udfffb"}]}]},
     "messages.0.content.0.text"),
    ("a stop string", {"stop": ["ok", "\udc80"]}, "stop.1"),
    ("the model name", {"model": "tiny\ud83d"}, "model"),
])
def test_a_lone_surrogate_is_refused_with_a_400_naming_the_field(server, where, fields, param):
    body = json.dumps({"model": MODEL, "messages": chat(), "max_tokens": 2, **fields})  # ASCII: \\udXXX escapes
    assert_error(post(server, "/v1/chat/completions", body), 400, param, "invalid_unicode")


def test_a_surrogate_pair_is_ordinary_text(server):
    body = json.dumps({"model": MODEL, "messages": chat("smile \U0001f600"), "max_tokens": 2})  # \\ud83d\\ude00
    assert post(server, "/v1/chat/completions", body).status_code == 200


def requests_on_one_connection(server, requests: list[tuple[str, str, bytes]]) -> list[tuple[int, dict]]:
    """Each request on the same kept-alive connection -> (status, JSON body); fails if the server closed it."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    answers, sock = [], None
    for method, path, body in requests:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        answers.append((response.status, json.loads(response.read())))
        assert not response.will_close, "the server closed the connection"
        assert sock is None or conn.sock is sock, "the client had to reconnect"
        sock = conn.sock
    conn.close()
    return answers


def test_an_unexpected_exception_is_an_openai_500_and_the_connection_stays_open(server, monkeypatch):
    service, calls = server.app.state.service, []
    real = service.encode

    def broken_once(body):
        calls.append(body)
        if len(calls) == 1:
            raise TypeError("a bug nobody foresaw")
        return real(body)

    monkeypatch.setattr(service, "encode", broken_once)
    good = json.dumps({"model": MODEL, "messages": chat(), "max_tokens": 1}).encode()
    (first, error), (second, reply) = requests_on_one_connection(server, [("POST", "/v1/chat/completions", good)] * 2)
    assert first == 500 and error["error"]["type"] == "server_error" and "TypeError" in error["error"]["message"]
    assert second == 200 and reply["choices"]


def test_a_bad_request_keeps_the_connection_for_the_next_one(server):
    good = json.dumps({"model": MODEL, "messages": chat(), "max_tokens": 1}).encode()
    bad = json.dumps({"model": MODEL, "messages": chat("\ud800"), "seed": 2**70}).encode()
    answers = requests_on_one_connection(server, [("POST", "/v1/chat/completions", bad),
                                                  ("POST", "/v1/chat/completions", good)])
    assert [status for status, _ in answers] == [400, 200]


# ---- n -------------------------------------------------------------------------------------------------------------
def test_n_returns_n_choices_and_counts_the_prompt_once(server):
    one = ask(server, temperature=0).json()
    many = ask(server, n=3, temperature=0).json()
    assert [c["index"] for c in many["choices"]] == [0, 1, 2]
    assert {c["message"]["content"] for c in many["choices"]} == {one["choices"][0]["message"]["content"]}
    assert many["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]
    assert many["usage"]["completion_tokens"] == 3 * one["usage"]["completion_tokens"]


def test_n_choices_of_one_seeded_request_differ_and_repeat(server):
    first = [c["message"]["content"] for c in ask(server, n=4, temperature=1, seed=7, max_tokens=8).json()["choices"]]
    again = [c["message"]["content"] for c in ask(server, n=4, temperature=1, seed=7, max_tokens=8).json()["choices"]]
    assert first == again and len(set(first)) > 1


def test_four_choices_put_the_prompt_into_the_prompt_token_counter_once(server):
    before = server.metrics()["kvscope:prompt_tokens_total"]
    reply = complete(server, prompt=list(range(3000, 3040)), n=4, temperature=0).json()
    server.wait_idle()
    assert reply["usage"]["prompt_tokens"] == 40
    assert server.metrics()["kvscope:prompt_tokens_total"] - before == 40


def test_n_choices_stream_with_their_own_index_and_finish(server):
    response = ask(server, n=2, temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = events(response)
    for i in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
        assert mine[0]["delta"]["role"] == "assistant" and mine[-1]["finish_reason"] in ("stop", "length")
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] >= 2


@pytest.mark.parametrize("n", [0, 17, -1, 1.5])
def test_n_outside_one_to_sixteen_is_refused(server, n):
    assert_error(ask(server, n=n), 400, "n")


# ---- log-probabilities ---------------------------------------------------------------------------------------------
def test_chat_logprobs_give_each_token_and_its_most_likely_alternatives(server):
    reply = ask(server, temperature=0, logprobs=True, top_logprobs=3, max_tokens=5).json()
    choice = reply["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == reply["usage"]["completion_tokens"]
    assert "".join(e["token"] for e in content) == choice["message"]["content"]
    for entry in content:
        assert entry["logprob"] <= 0 and len(entry["top_logprobs"]) == 3
        assert entry["top_logprobs"][0]["token"] == entry["token"]  # greedy: the most likely one
        assert entry["bytes"] == list(entry["token"].encode())


def test_the_openai_client_reads_logprobs(client):
    reply = client.chat.completions.create(model=MODEL, messages=chat(), max_tokens=3, temperature=0, logprobs=True,
                                           top_logprobs=2)
    assert len(reply.choices[0].logprobs.content[0].top_logprobs) == 2


def test_logprobs_stream_with_their_tokens(server):
    chunks = events(ask(server, temperature=0, logprobs=True, stream=True, max_tokens=4))
    entries = [e for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
               for e in c["choices"][0]["logprobs"]["content"]]
    assert len(entries) == 4 and all(e["top_logprobs"] == [] for e in entries)


def test_no_logprobs_unless_asked(server):
    assert ask(server).json()["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("fields, param", [
    ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": "yes please"}, "logprobs"),
])
def test_bad_logprobs_are_refused(server, fields, param):
    assert_error(ask(server, **fields), 400, param)


# ---- logits: bias, penalties, top-k, min-p -------------------------------------------------------------------------
def text_tokens(server, **fields) -> list[str]:
    reply = complete(server, prompt=[5000, 5001, 5002], temperature=0, logprobs=0, max_tokens=6, **fields)
    assert reply.status_code == 200, reply.text
    return tokens_of(reply)


def test_logit_bias_steers_every_token(server, tokenizer):
    assert text_tokens(server, logit_bias={str(A): 100}) == [tokenizer.decode([A])] * 6


@pytest.mark.parametrize("penalty", [{"presence_penalty": 2.0}, {"frequency_penalty": 2.0},
                                     {"repetition_penalty": 3.0}])
def test_penalties_turn_a_repeated_token_away(server, penalty):
    tied = {"logit_bias": {str(A): 60, str(B): 60}}  # two tokens far above the rest, nearly tied
    assert len(set(text_tokens(server, **tied))) == 1  # without a penalty: the same token six times
    assert len(set(text_tokens(server, **tied, **penalty))) == 2  # with one: the two take turns


@pytest.mark.parametrize("fields", [{"top_k": 1}, {"min_p": 1.0}])
def test_top_k_one_and_min_p_one_sample_the_greedy_token(server, fields):
    greedy = complete(server, temperature=0, max_tokens=6).json()["choices"][0]["text"]
    sampled = complete(server, temperature=1.5, seed=3, max_tokens=6, **fields).json()["choices"][0]["text"]
    assert sampled == greedy


def test_top_k_minus_one_is_off_as_in_vllm(server):
    assert ask(server, top_k=-1, temperature=1).status_code == 200


@pytest.mark.parametrize("fields, param", [
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
])
def test_logits_parameters_out_of_range_are_refused(server, fields, param):
    assert_error(ask(server, **fields), 400, param)


# ---- what is refused -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"best_of": 2}, "best_of"),
    ({"guided_json": {}}, "guided_json"),
    ({"frobnicate": True}, "frobnicate"),
])
def test_unsupported_fields_are_refused_by_name(server, fields, param):
    assert_error(ask(server, **fields), 400, param)


@pytest.mark.parametrize("fields", [{"response_format": {"type": "text"}}, {"user": "u-1"}, {"tool_choice": "none"},
                                    {"metadata": {"k": "v"}}, {"temperature": None, "top_p": None, "n": None},
                                    {"stream": False, "stream_options": None}])
def test_fields_that_change_nothing_are_accepted(server, fields):
    assert ask(server, **fields).status_code == 200


# ---- /v1/completions and /v1/models/{id} ---------------------------------------------------------------------------
def test_completions_take_a_prompt_and_return_text(client):
    reply = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0)
    assert reply.object == "text_completion" and reply.choices[0].text
    assert reply.usage.completion_tokens <= 5 and reply.choices[0].finish_reason in ("stop", "length")


def test_completions_default_to_sixteen_tokens(server):
    body = post(server, "/v1/completions", {"model": MODEL, "prompt": "Hi", "temperature": 0,
                                            "logit_bias": {"2": -100}}).json()
    assert body["usage"]["completion_tokens"] == 16


def test_completions_stream_equals_the_whole_reply(client):
    whole = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0)
    stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0,
                                       stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == whole.choices[0].text


def test_the_engine_thread_hands_each_ticks_outputs_to_the_loop_that_streams_them(server, client):
    stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0,
                                       stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices)
    handoff = server.app.state.service.handoff
    assert isinstance(handoff, LoopHandoff) and handoff.timeout_s == HANDOFF_TIMEOUT_S
    assert handoff.loop.is_running() and server.scheduler._handoff is handoff  # uvicorn's loop, on its thread


def test_a_prompt_of_token_ids_equals_its_text(server, tokenizer):
    ids = tokenizer.encode("Once upon a time")
    by_text = complete(server, temperature=0).json()
    by_ids = complete(server, prompt=ids, temperature=0).json()
    assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"]
    assert complete(server, prompt=["Once upon a time"], temperature=0).json()["choices"] == by_text["choices"]


def test_echo_puts_the_prompt_before_the_reply(server):
    plain = complete(server, temperature=0).json()["choices"][0]["text"]
    assert complete(server, temperature=0, echo=True).json()["choices"][0]["text"] == "Once upon a time" + plain


def test_completion_logprobs_have_the_legacy_shape(server):
    lp = complete(server, temperature=0, logprobs=2).json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"])
    assert all(len(top) <= 2 for top in lp["top_logprobs"]) and lp["text_offset"][0] == 0


@pytest.mark.parametrize("fields, status, param", [
    ({"prompt": ["one", "two"]}, 400, "prompt"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": [1, -5]}, 400, "prompt"),
    ({"prompt": [10**9]}, 400, "prompt"),
    ({"prompt": "word " * 400}, 400, "prompt"),
    ({"suffix": "the end"}, 400, "suffix"),
    ({"echo": True, "logprobs": 1}, 400, "echo"),
    ({"logprobs": 21}, 400, "logprobs"),
    ({"model": "gpt-3.5-turbo-instruct"}, 404, "model"),
])
def test_bad_completion_requests_are_refused_by_name(server, fields, status, param):
    assert_error(complete(server, **fields), status, param)


def test_a_model_card_by_id(server, client):
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    assert_error(httpx.get(server.url + "/v1/models/gpt-4", timeout=10), 404, "model", "model_not_found")
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("someone/else")


# ---- metrics -------------------------------------------------------------------------------------------------------
def test_cancelled_and_finished_requests_are_counted_apart(server):
    server.wait_idle()
    before = server.metrics()
    ask(server, max_tokens=3, logit_bias={"2": -100})  # never stops early: length
    body = {"model": MODEL, "messages": chat("a long story"), "max_tokens": 200, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as response:
        next(response.iter_lines())  # the client goes away after the first event
    server.wait_idle()
    after = server.metrics()

    def grew(series: str) -> float:
        return after.get(series, 0) - before.get(series, 0)

    assert grew("kvscope:request_success_total{finished_reason=length}") == 1
    assert grew("kvscope:request_success_total{finished_reason=abort}") == 1
    assert grew("kvscope:request_success_total{finished_reason=error}") == 0
    assert grew("kvscope:e2e_request_latency_seconds_count") == 2


def test_per_request_histograms_have_vllm_names(server):
    server.wait_idle()
    before = server.metrics()
    reply = ask(server, max_tokens=5, temperature=0, logit_bias={"2": -100}).json()
    server.wait_idle()
    after = server.metrics()
    for name in ("e2e_request_latency_seconds", "time_per_output_token_seconds", "request_queue_time_seconds",
                 "request_prompt_tokens", "request_generation_tokens"):
        assert f"kvscope:{name}_count" in after and f"kvscope:{name}_bucket" in after, name
    grew = {k: after[k] - before.get(k, 0) for k in after}
    assert grew["kvscope:request_prompt_tokens_sum"] == reply["usage"]["prompt_tokens"]
    assert grew["kvscope:request_generation_tokens_sum"] == 5
    assert grew["kvscope:time_per_output_token_seconds_count"] == 4  # the gaps between 5 tokens
    assert grew["kvscope:e2e_request_latency_seconds_sum"] >= grew["kvscope:request_queue_time_seconds_sum"]


# ---- limits --------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_server(tiny_config, tokenizer):
    with InProcessServer(tiny_config, tokenizer, api_key="s3cret", max_body_bytes=64 * 1024) as s:
        yield s


KEY = {"Authorization": "Bearer s3cret"}


def test_a_body_over_the_limit_is_a_413_json(small_server):
    big = {"model": MODEL, "messages": chat("x" * 100_000)}
    assert_error(post(small_server, "/v1/chat/completions", big, KEY), 413, code="request_too_large")


def test_a_chunked_body_over_the_limit_is_a_413_json(small_server):
    def pieces():
        yield b'{"model": "tiny", "messages": [{"role": "user", "content": "'
        for _ in range(100):
            yield b"x" * 1024
        yield b'"}]}'

    response = httpx.post(small_server.url + "/v1/chat/completions", content=pieces(), timeout=30,
                          headers={"Content-Type": "application/json", **KEY})
    assert_error(response, 413, code="request_too_large")


def test_a_body_under_the_limit_is_served(small_server):
    padded = {"model": MODEL, "messages": chat(), "max_tokens": 1, "user": "x" * 60_000}  # under 64 KiB
    assert post(small_server, "/v1/chat/completions", padded, KEY).status_code == 200


def raw_exchange(server, request: bytes) -> tuple[int, dict, bytes]:
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(request)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    headers = dict(line.split(b": ", 1) for line in head.split(b"\r\n")[1:])
    return status, {k.lower(): v for k, v in headers.items()}, body


@pytest.mark.parametrize("end", [b"\r\n\r\n", b""])  # a whole request head, or one still arriving
@pytest.mark.parametrize("size", [17_000, 40_000])
def test_oversized_headers_get_a_431_json(small_server, size, end):
    request = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * size + end
    status, headers, body = raw_exchange(small_server, request)
    assert status == 431 and headers[b"content-type"] == b"application/json"
    assert json.loads(body)["error"]["code"] == "request_header_fields_too_large"


def test_a_request_http_cannot_parse_gets_a_400_json(small_server):
    status, headers, body = raw_exchange(small_server, b"NOT HTTP AT ALL\r\n\r\n")
    assert status == 400 and json.loads(body)["error"]["code"] == "invalid_http_request"


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER", "bEaReR"])
def test_the_bearer_scheme_is_case_insensitive(small_server, scheme):
    response = httpx.get(small_server.url + "/v1/models", headers={"Authorization": f"{scheme} s3cret"}, timeout=10)
    assert response.status_code == 200


@pytest.mark.parametrize("value", ["Basic s3cret", "Bearer S3CRET", "Bearers3cret", "s3cret", "Bearer"])
def test_a_wrong_scheme_or_key_is_a_401_json(small_server, value):
    response = httpx.get(small_server.url + "/v1/models", headers={"Authorization": value}, timeout=10)
    assert_error(response, 401, code="invalid_api_key")
