"""`main.py serve` over real HTTP on loopback, started as a subprocess on a free port (a tiny random model in a
real Hugging Face folder): the official openai client, concurrent streams equal to one-at-a-time greedy output,
disconnects that give blocks back, 1,000 requests without a leak, OpenAI-style errors, the API key, /metrics."""

from __future__ import annotations

import asyncio
import json
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from serve_helpers import metric, write_tiny_model

from server.process import ServerProcess

MODEL = "tiny"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("serve") / MODEL, tokenizer)


@pytest.fixture(scope="module")
def server(model_dir):
    with ServerProcess(["--model", str(model_dir), "--max-concurrency", "16"]) as s:
        yield s


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def ask(text: str) -> list[dict]:
    return [{"role": "system", "content": "You are terse."}, {"role": "user", "content": text}]


def stream_text(client: openai.OpenAI, text: str, max_tokens: int = 12) -> str:
    stream = client.chat.completions.create(model=MODEL, messages=ask(text), max_tokens=max_tokens, temperature=0,
                                            stream=True)
    return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


def wait_until_idle(server, timeout_s: float = 60.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (metric(server.url, "kvscope:num_requests_running") == 0
                and metric(server.url, "kvscope:num_requests_waiting") == 0):
            return
        time.sleep(0.05)
    raise AssertionError("the server still runs requests")


def threads_of(server) -> int:
    status = Path(f"/proc/{server.proc.pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("Threads:")))


# ---- the OpenAI API ------------------------------------------------------------------------------------------------
def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list()] == [MODEL]


def test_openai_client_without_streaming(client):
    reply = client.chat.completions.create(model=MODEL, messages=ask("Hello"), max_tokens=8, temperature=0)
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert reply.usage.completion_tokens <= 8 and reply.usage.prompt_tokens > 0
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_openai_client_streaming_with_usage_equals_the_non_streamed_reply(client):
    stream = client.chat.completions.create(model=MODEL, messages=ask("Hello"), max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens <= 8
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    whole = client.chat.completions.create(model=MODEL, messages=ask("Hello"), max_tokens=8, temperature=0)
    assert text == whole.choices[0].message.content


def test_stop_strings_cut_the_reply(client):
    full = client.chat.completions.create(model=MODEL, messages=ask("Hello"), max_tokens=10, temperature=0)
    text = full.choices[0].message.content
    stop = text[len(text) // 2:len(text) // 2 + 2]
    cut = client.chat.completions.create(model=MODEL, messages=ask("Hello"), max_tokens=10, temperature=0, stop=stop)
    assert cut.choices[0].message.content == text[:text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_eight_concurrent_streams_equal_the_same_prompts_one_at_a_time(client):
    prompts = [f"Question {i}: " + "why is the sky blue? " * (i + 1) for i in range(8)]
    alone = [stream_text(client, p) for p in prompts]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda p: stream_text(client, p), prompts))
    assert together == alone
    assert len(set(alone)) > 1  # different prompts, different replies: the comparison means something


def test_same_system_prompt_is_served_from_the_prefix_cache(client, server):
    system = "You are a careful assistant who explains things step by step. " * 4
    before = metric(server.url, "kvscope:prefix_cache_hits_total")
    for question in ("What is a block?", "What is a page?"):
        client.chat.completions.create(model=MODEL, max_tokens=2, temperature=0,
                                       messages=[{"role": "system", "content": system},
                                                 {"role": "user", "content": question}])
    assert metric(server.url, "kvscope:prefix_cache_hits_total") - before >= 16


# ---- disconnects and leaks -----------------------------------------------------------------------------------------
def test_a_client_that_disconnects_mid_stream_frees_its_blocks(server):
    wait_until_idle(server)
    baseline = metric(server.url, "kvscope:kv_blocks_used")
    generated = metric(server.url, "kvscope:generation_tokens_total")
    body = {"model": MODEL, "messages": ask("Tell me a long story " * 20), "max_tokens": 900, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        for _ in range(6):
            next(lines)
        assert metric(server.url, "kvscope:kv_blocks_used") > baseline
    wait_until_idle(server)
    assert metric(server.url, "kvscope:kv_blocks_used") == baseline
    assert metric(server.url, "kvscope:generation_tokens_total") - generated < 900  # cut short, not finished


async def _one_request(client: httpx.AsyncClient, rng: random.Random, i: int) -> None:
    body = {"model": MODEL, "messages": ask(f"Request {i} " + "x " * rng.randrange(1, 30)),
            "max_tokens": rng.randrange(1, 6), "temperature": 0.8, "seed": i, "stream": True}
    drop_after = rng.choice([0, 1, 2, None, None])  # lines read before disconnecting; None: read it all
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        read = 0
        async for line in response.aiter_lines():
            if drop_after is not None and read >= drop_after:
                return  # leaving the block closes the connection mid-stream
            read += bool(line)


async def _many_requests(url: str, n: int, concurrency: int, seed: int) -> None:
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        gate = asyncio.Semaphore(concurrency)

        async def one(i: int) -> None:
            async with gate:
                await _one_request(client, rng, i)

        await asyncio.gather(*(one(i) for i in range(n)))


def test_a_thousand_short_requests_with_random_disconnects_leak_no_block_and_no_thread(server):
    asyncio.run(_many_requests(server.url, 64, 16, seed=0))  # warm up: worker threads reach their steady number
    wait_until_idle(server)
    threads = threads_of(server)
    finished = metric(server.url, "kvscope:request_success_total")
    asyncio.run(_many_requests(server.url, 1000, 16, seed=1))
    wait_until_idle(server)
    assert metric(server.url, "kvscope:kv_blocks_used") == 0
    assert metric(server.url, "kvscope:request_success_total") - finished == 1000  # each one ended, one way or another
    assert threads_of(server) <= threads


# ---- errors --------------------------------------------------------------------------------------------------------
def post(server, payload, headers=None) -> httpx.Response:
    content = payload if isinstance(payload, (str, bytes)) else json.dumps(payload)
    return httpx.post(server.url + "/v1/chat/completions", content=content, timeout=30,
                      headers={"Content-Type": "application/json", **(headers or {})})


def assert_error(response: httpx.Response, status: int, code: str | None = None, param: str | None = None):
    assert response.status_code == status, response.text
    err = response.json()["error"]
    assert err["message"] and err["type"]
    if code is not None:
        assert err["code"] == code
    if param is not None:
        assert err["param"] == param


@pytest.mark.parametrize("payload, status, code, param", [
    ({"model": "gpt-4", "messages": ask("hi")}, 404, "model_not_found", "model"),
    ("{not json", 400, "invalid_json", None),
    ({"model": MODEL, "messages": ask("word " * 2000)}, 400, "context_length_exceeded", "messages"),
    ({"model": MODEL, "messages": ask("hi"), "max_tokens": 0}, 400, None, "max_tokens"),
    ({"model": MODEL, "messages": ask("hi"), "max_tokens": -3}, 400, None, "max_tokens"),
    ({"model": MODEL, "messages": ask("hi"), "max_completion_tokens": 0}, 400, None, "max_completion_tokens"),
    ({"model": MODEL, "messages": []}, 400, None, "messages"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, None, "messages"),
    ({"model": MODEL, "messages": ask("hi"), "temperature": -1}, 400, None, "temperature"),
])
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, client, payload, status, code, param):
    assert_error(post(server, payload), status, code, param)
    assert client.chat.completions.create(model=MODEL, messages=ask("still there?"), max_tokens=2).choices


def test_unknown_route_is_an_openai_style_404(server):
    assert_error(httpx.get(server.url + "/v1/nothing", timeout=10), 404)


def test_the_openai_client_raises_its_own_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=ask("hi"))
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.chat.completions.create(model=MODEL, messages=ask("word " * 2000))


def test_an_api_key_guards_every_route_but_health(model_dir):
    with ServerProcess(["--model", str(model_dir)], api_key="s3cret") as server:
        ok = {"model": MODEL, "messages": ask("hi"), "max_tokens": 2}
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            assert_error(post(server, ok, headers), 401, "invalid_api_key")
            assert_error(httpx.get(server.url + "/v1/models", headers=headers, timeout=10), 401)
            assert_error(httpx.get(server.url + "/metrics", headers=headers, timeout=10), 401)
        assert post(server, ok, server.headers()).status_code == 200
        assert post(server, ok, {"Authorization": "bearer s3cret"}).status_code == 200  # the scheme in any case
        keyed = openai.OpenAI(base_url=server.url + "/v1", api_key="s3cret", max_retries=0)
        assert keyed.chat.completions.create(model=MODEL, messages=ask("hi"), max_tokens=2).choices
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.url + "/v1", api_key="bad", max_retries=0).models.list()


def test_metrics_publish_vllm_style_names_and_the_pool(server):
    text = httpx.get(server.url + "/metrics", timeout=10).text
    for name in ("kvscope:kv_cache_usage_perc", "kvscope:prefix_cache_queries_total", "kvscope:prefix_cache_hits_total",
                 "kvscope:num_requests_running", "kvscope:num_requests_waiting", "kvscope:prompt_tokens_total",
                 "kvscope:generation_tokens_total", "kvscope:time_to_first_token_seconds_bucket",
                 "kvscope:inter_token_latency_seconds_bucket", "kvscope:kv_blocks_used", "kvscope:kv_blocks_free",
                 "kvscope:kv_blocks_cached", "kvscope:kv_cache_bytes_allocated", "kvscope:kv_cache_bytes_used",
                 "kvscope:kv_cache_bytes_theoretical"):
        assert f"\n{name}" in text, name
    assert 'model_name="tiny"' in text


def test_the_server_holds_its_whole_kv_pool_from_the_start_and_keeps_it(server, client):
    """No chunk grows beside the decode steps or goes back between requests: the pool's budget is held and its
    pages written before the first request (engine.kv.paged.PagedCache.reserve)."""
    total = metric(server.url, "kvscope:kv_blocks_total")
    held = metric(server.url, "kvscope:kv_cache_bytes_allocated")
    assert total > 0 and metric(server.url, "kvscope:kv_blocks_allocated") == total
    stream_text(client, "Tell me a long story " * 20, max_tokens=40)
    wait_until_idle(server)
    assert metric(server.url, "kvscope:kv_blocks_allocated") == total
    assert metric(server.url, "kvscope:kv_cache_bytes_allocated") == held
    assert "KV pool" in server.log.read_text()


def test_serve_limits_the_body_and_answers_unparsable_http_in_json(model_dir):
    import socket

    server = ServerProcess(["--model", str(model_dir), "--max-body-bytes", "10000"])
    server.env["KVSCOPE_MAX_BODY_BYTES"] = "999999"  # the flag wins over the environment
    with server:
        big = {"model": MODEL, "messages": ask("hi"), "user": "x" * 20_000}
        assert_error(post(server, big), 413, "request_too_large")
        assert post(server, {"model": MODEL, "messages": ask("hi"), "max_tokens": 1}).status_code == 200
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
            s.sendall(b"NOT HTTP\r\n\r\n")
            answer = s.makefile("rb").read()
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400") and json.loads(body)["error"]["code"] == "invalid_http_request"


def test_a_port_in_use_is_reported_at_once_before_any_model_loads(tmp_path):
    import socket
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "main.py", "serve", "--model", str(tmp_path / "no-such-model"),
                               "--port", str(port)], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                              text=True, timeout=120)
    assert done.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in done.stderr  # not the missing model


def test_a_port_another_process_took_before_the_server_bound_it_is_retried_on_a_new_port(model_dir):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = ServerProcess(["--model", str(model_dir)])
        server.use_port(taken.getsockname()[1])
        with server:
            assert server.port != taken.getsockname()[1]
            assert httpx.get(server.url + "/health", timeout=60).status_code == 200
