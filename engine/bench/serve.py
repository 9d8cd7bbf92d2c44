"""serve: `main.py serve` under load over loopback, and how many concurrent requests fit the pool.

1. Aggregate tokens/s and inter-token latency (p50, p99) of 1, 4 and 16 concurrent streaming clients against one
   server with continuous batching, against the same requests sent one at a time.
2. Concurrent requests that fit one KV budget: paged (measured: the scheduler's peak running batch over a real
   run) against contiguous (the budget over one reservation, which is a whole context per sequence).
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import numpy as np

from engine.bench import report
from engine.bench.common import BenchContext, make_cache, status, using_cache
from engine.chat import Message, prompt_ids
from engine.config import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig

CLIENTS = (1, 4, 16)
MAX_TOKENS, QUICK_MAX_TOKENS = 64, 24
FIT_REQUESTS, FIT_PROMPT_TOKENS, FIT_NEW_TOKENS = 96, 100, 16
TOPICS = ("a lighthouse keeper", "a lost robot", "the first bakery on Mars", "a dragon who feared heights",
          "an old clockmaker", "a river that flowed uphill", "a chess-playing cat", "a city under the sea",
          "a time-travelling librarian", "a garden on a train", "the last snowflake", "a shy volcano",
          "a detective ant", "a moonlit orchestra", "a map that redrew itself", "a kite that would not land")

METHOD = (
    "The server (`main.py serve`, paged cache, block 16, max concurrency 16) runs in a child process with the same "
    "torch thread count as the benchmark; clients stream over loopback with httpx (temperature 0, `max_tokens` "
    "{max_tokens}, one story prompt per client). Batched: all clients at once. One at a time: the same requests "
    "sent one after another. Aggregate tok/s = completion tokens (from the usage chunk) / wall time from the first "
    "request to the last token; inter-token latency = gaps between content chunks as the client received them "
    "(first token excluded). Pool fit: {fit_requests} requests of ~{fit_prompt} prompt tokens and {fit_new} new "
    "tokens submitted at once to the scheduler in this process, with a KV budget of one context; paged = the "
    "largest running batch seen; contiguous = budget / one reservation (it reserves a whole context per "
    "sequence)."
)


def run(ctx: BenchContext, quick: bool) -> dict:
    max_tokens = QUICK_MAX_TOKENS if quick else MAX_TOKENS
    from server.process import ServerProcess  # the benchmark drives the server as any client would

    args = ["--max-concurrency", "16", *(["--model", str(ctx.model_arg)] if ctx.model_arg else []),
            *(["--weights", weights] if (weights := getattr(ctx.engine.config, "weights", None)) else [])]
    threads = int(os.environ.get("OMP_NUM_THREADS") or 0) or __import__("torch").get_num_threads()
    status(f"starting main.py serve ({threads} torch thread(s))")
    with ServerProcess(args, threads=threads) as server:
        model = _model_id(server.url)
        asyncio.run(_clients(server.url, model, 1, 4, together=True))  # warm-up, not counted
        streams = {}
        for n in CLIENTS:
            for mode in ("batched", "one at a time"):
                status(f"serve: {n} client(s), {mode}")
                streams[f"{mode}/{n}"] = asyncio.run(_clients(server.url, model, n, max_tokens, mode == "batched"))
    status("serve: concurrent requests that fit one KV budget, paged vs contiguous")
    return {"method": METHOD.format(max_tokens=max_tokens, fit_requests=FIT_REQUESTS, fit_prompt=FIT_PROMPT_TOKENS,
                                    fit_new=FIT_NEW_TOKENS),
            "clients": list(CLIENTS), "max_tokens": max_tokens, "threads": threads,
            "streams": {k: _summary(v) for k, v in streams.items()}, "pool_fit": pool_fit(ctx)}


def _model_id(url: str) -> str:
    import httpx

    return httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]


async def _clients(url: str, model: str, n: int, max_tokens: int, together: bool) -> dict:
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        start = time.perf_counter()
        jobs = [_stream(client, model, TOPICS[i % len(TOPICS)], max_tokens) for i in range(n)]
        if together:
            results = await asyncio.gather(*jobs)
        else:
            results = [await job for job in jobs]
        wall = time.perf_counter() - start
    return {"wall_s": wall, "tokens": sum(r["tokens"] for r in results),
            "gaps_ms": [g for r in results for g in r["gaps_ms"]], "ttft_ms": [r["ttft_ms"] for r in results]}


async def _stream(client, model: str, topic: str, max_tokens: int) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": f"Write a long story about {topic}."}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    sent, arrivals, tokens = time.perf_counter(), [], 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or ()):
                arrivals.append(time.perf_counter())
    gaps = np.diff(arrivals) * 1000 if len(arrivals) > 1 else np.empty(0)
    return {"tokens": tokens, "gaps_ms": gaps.tolist(), "ttft_ms": (arrivals[0] - sent) * 1000 if arrivals else None}


def _summary(s: dict) -> dict:
    gaps = np.array(s["gaps_ms"]) if s["gaps_ms"] else np.array([np.nan])
    ttft = [t for t in s["ttft_ms"] if t is not None]
    return {"tok_s": s["tokens"] / s["wall_s"], "tokens": s["tokens"], "wall_s": s["wall_s"],
            "itl_p50_ms": float(np.nanpercentile(gaps, 50)), "itl_p99_ms": float(np.nanpercentile(gaps, 99)),
            "ttft_median_ms": float(np.median(ttft)) if ttft else None}


# ---- pool fit, in process
def pool_fit(ctx: BenchContext) -> dict:
    engine = ctx.engine
    budget_tokens = engine.max_context
    paged = make_cache(engine, "paged", 16, pool_tokens=budget_tokens)
    with using_cache(engine, paged):
        sched = Scheduler(engine, SchedulerConfig(max_concurrency=FIT_REQUESTS))
        done = []
        params = SamplingParams(temperature=0, repetition_penalty=1.0, max_new_tokens=FIT_NEW_TOKENS)
        for i in range(FIT_REQUESTS):
            sched.submit(_fit_prompt(engine, i), params, lambda out: done.append(out) if out.finished else None)
        while len(done) < FIT_REQUESTS:
            sched.tick()
        stats = sched.stats()
        budget_bytes = paged.stats().bytes_allocated if not hasattr(paged, "budget_bytes") else paged.budget_bytes()
    contiguous = make_cache(engine, "contiguous")
    contiguous.prepare(0, [1])
    reservation = contiguous.stats().bytes_allocated
    contiguous.release(0)
    errors = sum(1 for o in done if o.finish_reason == "error")
    return {"budget_tokens": budget_tokens, "budget_bytes": budget_bytes, "paged": stats.peak_running,
            "paged_preemptions": stats.num_preemptions, "paged_errors": errors,
            "contiguous": budget_bytes // reservation, "contiguous_reservation_bytes": reservation,
            "requests": FIT_REQUESTS}


def _fit_prompt(engine, i: int) -> list[int]:
    words = " ".join(TOPICS[(i + j) % len(TOPICS)] for j in range(12))
    ids = prompt_ids(engine.tokenizer, None, [Message("user", f"Request {i}: tell me about {words}.")])
    return ids[:FIT_PROMPT_TOKENS]


# ---- report
def _ratio(r: dict, a: str, b: str, key: str = "tok_s") -> float | None:
    x, y = r["streams"].get(a, {}).get(key), r["streams"].get(b, {}).get(key)
    return x / y if x and y else None


def targets(r: dict) -> list[tuple[str, float | None, str, bool | None]]:
    """(name, measured, goal, passed) for the issue's two targets."""
    scale = _ratio(r, "batched/16", "batched/1")
    single_median = r["streams"]["batched/1"]["itl_p50_ms"]
    p99_4 = r["streams"]["batched/4"]["itl_p99_ms"]
    tail = p99_4 / single_median if single_median else None
    return [("aggregate tok/s, 16 streams / 1 stream", scale, ">= 4x", None if scale is None else scale >= 4),
            ("p99 inter-token latency with 4 clients / single-client median", tail, "<= 2x",
             None if tail is None else tail <= 2)]


def summarize(r: dict) -> str:
    rows = []
    for n in r["clients"]:
        b, s = r["streams"][f"batched/{n}"], r["streams"][f"one at a time/{n}"]
        rows.append([n, b["tok_s"], s["tok_s"], b["tok_s"] / s["tok_s"], b["itl_p50_ms"], b["itl_p99_ms"],
                     s["itl_p50_ms"], s["itl_p99_ms"], b["ttft_median_ms"]])
    headers = ["clients", "batched tok/s", "one-at-a-time tok/s", "batched / one-at-a-time", "batched ITL p50 ms",
               "batched ITL p99 ms", "one-at-a-time ITL p50 ms", "one-at-a-time ITL p99 ms", "batched TTFT median ms"]
    fit = r["pool_fit"]
    fit_rows = [["paged (block 16)", fit["paged"], f"{fit['paged_preemptions']} preemptions, {fit['paged_errors']} "
                 "errors"], ["contiguous", fit["contiguous"], f"{fit['contiguous_reservation_bytes'] / 2**20:.0f} MiB "
                             "reserved per sequence"]]
    target_rows = [[name, report.fmt(m), goal, "n/a" if ok is None else ("PASS" if ok else "MISS")]
                   for name, m, goal, ok in targets(r)]
    return report.section(
        "serve: continuous batching over loopback", r["method"], report.md_table(headers, rows),
        f"Concurrent requests that fit a KV budget of {fit['budget_tokens']:,} tokens "
        f"({fit['budget_bytes'] / 2**20:.0f} MiB), {fit['requests']} submitted:",
        report.md_table(["strategy", "concurrent requests", "note"], fit_rows),
        report.md_table(["target", "measured", "goal", "verdict"], target_rows))


def plot(r: dict, path) -> None:
    fig, (left, right) = report.figure(2, width=6)
    clients = r["clients"]
    for mode in ("batched", "one at a time"):
        series = [r["streams"][f"{mode}/{n}"] for n in clients]
        report.line(left, mode, clients, [s["tok_s"] for s in series])
        color = report.color(mode)  # one colour per mode: p50 solid, p99 dashed
        right.plot(clients, [s["itl_p50_ms"] for s in series], "o-", color=color, ms=4, label=f"{mode} p50")
        right.plot(clients, [s["itl_p99_ms"] for s in series], "x--", color=color, ms=5, label=f"{mode} p99")
    left.set(title="aggregate throughput", xlabel="concurrent streaming clients", ylabel="tokens / s", xscale="log")
    right.set(title="inter-token latency", xlabel="concurrent streaming clients", ylabel="ms", xscale="log")
    for ax in (left, right):
        ax.set_xticks(clients, [str(n) for n in clients])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
        report.legend_outside(ax)
    report.save(fig, path)
