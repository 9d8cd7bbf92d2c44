"""serve: `main.py serve` under load over loopback, against llama.cpp's `llama-server` when present, and how many
concurrent requests fit the pool.

1. The same story prompts at 1, 4, 8 and 16 concurrent streaming clients (temperature 0), all at once
   ("batched") and one after another ("one at a time"), alternating the servers at every step: aggregate
   tokens/s, TTFT and inter-token latency (p50, p99), and greedy equality of each concurrent stream with the same
   request run alone, for both servers. llama-server (engine.bench.llama_server) runs on the same GGUF with the
   same threads, --parallel 16, a KV of one context and --metrics, loopback only; it is trusted only after one
   batch evaluation, and reported absent (with why) otherwise.
2. The engine's own decode step, in this process, for the one-client target (the serving path's cost per token).
3. Concurrent requests that fit one KV budget: paged (measured: the scheduler's peak running batch over a real
   run) against contiguous (the budget over one reservation, which is a whole context per sequence).
4. The ratio targets' client counts (1, 4 and 16) on `main.py serve` in turns, after the peer stops: the table's
   runs are minutes apart and the machine's speed moves between them, so each ratio's two sides are also measured
   round by round in the same minutes, and the targets read those.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import time
from collections.abc import Callable

import numpy as np

from engine.bench import report
from engine.bench.common import BenchContext, make_cache, rotated, status, using_cache
from engine.chat import Message, prompt_ids
from engine.config import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig

CLIENTS = (1, 4, 8, 16)
MODES = ("batched", "one at a time")
KVSCOPE, LLAMA_SERVER = "kvscope", "llama-server"
MAX_TOKENS, QUICK_MAX_TOKENS = 64, 24
STEP_SAMPLES, QUICK_STEP_SAMPLES = 32, 12
TURN_CLIENTS, TURN_ROUNDS = (1, 4, 16), 3  # the ratio targets' client counts, measured in turns
FIT_REQUESTS, FIT_PROMPT_TOKENS, FIT_NEW_TOKENS = 96, 100, 16
TINY_MAX_TOKENS, TINY_FIT_REQUESTS = 8, 24  # --tiny: every code path, on a random model
TOPICS = ("a lighthouse keeper", "a lost robot", "the first bakery on Mars", "a dragon who feared heights",
          "an old clockmaker", "a river that flowed uphill", "a chess-playing cat", "a city under the sea",
          "a time-travelling librarian", "a garden on a train", "the last snowflake", "a shy volcano",
          "a detective ant", "a moonlit orchestra", "a map that redrew itself", "a kite that would not land")

METHOD = (
    "The servers run in child processes with the benchmark's thread count: `main.py serve` (paged cache, block "
    "16, its pool held whole from the start, max concurrency 16, the engine's weights {weights} and KV "
    "{kv_dtype}; after each tick its engine thread waits, up to 2 ms, for the event loop to stream the tick's "
    "tokens) and, when present, llama.cpp's `llama-server` on the same GGUF (`{peer_args}`). Clients stream "
    "over loopback with httpx (temperature 0, "
    "`max_tokens` {max_tokens}, one story prompt per client, the same prompts for both servers, a new connection "
    "per request). Batched: all "
    "clients at once. One at a time: the same requests sent one after another; their texts are the greedy "
    "reference (each batched stream must equal its request run alone on the same server). At every (clients, "
    "mode) the servers alternate, the first one swapping with each client count. Aggregate tok/s = completion "
    "tokens (from the usage chunk) / wall time from the first request to the last token; inter-token latency = "
    "gaps between content chunks as the client received them (first token excluded); TTFT = request sent to the "
    "first content chunk. Engine step = median of {step_samples} single-token decode forwards of the engine in "
    "this process (paged, one sequence at the prompt's length plus half a reply; half before the servers start, "
    "half after they stop). Pool fit: {fit_requests} "
    "requests of ~{fit_prompt} prompt tokens and {fit_new} new tokens submitted at once to the scheduler in this "
    "process, with a KV budget of one context; paged = the largest running batch seen; contiguous = budget / one "
    "reservation (it reserves a whole context per sequence). In turns: after the peer stops, {rounds} rounds of "
    "batched runs of {turn_clients} clients on `main.py serve`, each round starting one count later, every run's "
    "prompts new (the story prompts with 'This is draft k.' added: their last blocks are computed, not cached); "
    "the ratio targets (16 streams / 1, p99 at 4 clients / the one-client median) read these (tok/s: the rounds' "
    "median; latencies: all rounds' gaps), so both sides of a ratio ran in the same minutes; so does the serving "
    "path's (one client's ITL p50 / the engine's own step, timed in this process right before each one-client run)."
)


def run(ctx: BenchContext, quick: bool) -> dict:
    from engine.bench import llama_server
    from server.process import ServerProcess  # the benchmark drives the servers as any client would

    max_tokens = TINY_MAX_TOKENS if ctx.tiny else QUICK_MAX_TOKENS if quick else MAX_TOKENS
    fit_requests = TINY_FIT_REQUESTS if ctx.tiny else FIT_REQUESTS
    engine = ctx.engine
    threads = int(os.environ.get("OMP_NUM_THREADS") or 0) or __import__("torch").get_num_threads()
    samples = QUICK_STEP_SAMPLES if quick else STEP_SAMPLES
    step = engine_step_ms(ctx, max_tokens, samples)  # before the servers start and again after they stop:
    # on a loaded machine one stretch of time can be slower than another
    args = ["--max-concurrency", str(max(CLIENTS)), "--weights", engine.weight_format,
            "--kv-dtype", engine.kv_dtype_name, *(["--model", str(ctx.model_arg)] if ctx.model_arg else [])]
    status(f"starting main.py serve ({threads} torch thread(s))")
    with ServerProcess(args, threads=threads) as server:
        status("starting llama-server, if present")
        peer, peer_status = llama_server.start_peer(ctx.gguf_path, threads, parallel=max(CLIENTS),
                                                    context=engine.max_context)
        status(f"llama-server: {peer_status}")
        try:
            urls = {KVSCOPE: server.url, **({LLAMA_SERVER: peer.url} if peer else {})}
            raw = measure(urls, max_tokens)
        finally:
            if peer is not None:
                peer.stop()
        status(f"serve: {', '.join(map(str, TURN_CLIENTS))} clients in turns ({TURN_ROUNDS} rounds)")
        turns = in_turns(server.url, max_tokens, TURN_ROUNDS,
                         engine_step=lambda: engine_step_ms(ctx, max_tokens, max(4, samples // 2)))
    step += engine_step_ms(ctx, max_tokens, samples)
    peer_args = peer.config.describe() if peer else "absent"
    status("serve: concurrent requests that fit one KV budget, paged vs contiguous")
    return {"method": METHOD.format(max_tokens=max_tokens, weights=engine.weight_format, kv_dtype=engine.kv_dtype_name,
                                    peer_args=peer_args, step_samples=len(step), fit_requests=fit_requests,
                                    fit_prompt=FIT_PROMPT_TOKENS, fit_new=FIT_NEW_TOKENS, rounds=TURN_ROUNDS,
                                    turn_clients=", ".join(map(str, TURN_CLIENTS))),
            "clients": list(CLIENTS), "max_tokens": max_tokens, "threads": threads,
            "engine_step_ms": statistics.median(step), "engine_step_samples_ms": step,
            **stream_results(raw, peer_status, peer_args), "turns": turns, "pool_fit": pool_fit(ctx, fit_requests)}


def stream_results(raw: dict[str, dict], peer_status: str, peer_args: str) -> dict:
    """The results' streams (kvscope's), greedy equality, and the peer's (empty streams when it was absent)."""
    theirs = raw.get(LLAMA_SERVER, {})
    return {"streams": {k: _summary(v) for k, v in raw[KVSCOPE].items()}, "greedy": greedy_equality(raw[KVSCOPE]),
            "peer": {"name": LLAMA_SERVER, "status": peer_status, "args": peer_args,
                     "streams": {k: _summary(v) for k, v in theirs.items()},
                     "greedy": greedy_equality(theirs) if theirs else {}}}


def measure(urls: dict[str, str], max_tokens: int) -> dict[str, dict[str, dict]]:
    """{server: {"<mode>/<clients>": raw streams}}: every (clients, mode) on each server in turn, the first server
    swapping with each client count so that neither always runs after the other."""
    models = {name: _model_id(url) for name, url in urls.items()}
    for name, url in urls.items():  # warm-up, not counted
        asyncio.run(_clients(url, models[name], 1, 4, together=True))
    raw: dict[str, dict] = {name: {} for name in urls}
    for i, n in enumerate(CLIENTS):
        order = list(urls) if i % 2 == 0 else list(reversed(urls))
        for mode in MODES:
            for name in order:
                status(f"serve: {name}, {n} client(s), {mode}")
                raw[name][f"{mode}/{n}"] = asyncio.run(_clients(urls[name], models[name], n, max_tokens,
                                                                mode == "batched"))
    return raw


def turn_order(clients: tuple[int, ...], rounds: int) -> list[int]:
    """Each round every client count once, the round starting one count later than the one before."""
    return [n for r in range(rounds) for n in rotated(clients, r)]


def in_turns(url: str, max_tokens: int, rounds: int, clients: tuple[int, ...] = TURN_CLIENTS,
             engine_step: Callable[[], list[float]] | None = None) -> dict:
    """Batched runs of each client count on one server, `rounds` times, each round starting one count later:
    {"rounds", "clients": {n: {"tok_s" (the rounds' median), "tok_s_runs", "itl_p50_ms", "itl_p99_ms" (all rounds'
    gaps), "gaps"}}}; with engine_step (the engine's own steps in this process, ms), it runs right before each
    one-client run, its samples in "engine_step_ms" (median) and "engine_step_samples_ms"."""
    model = _model_id(url)
    runs: dict[int, list[dict]] = {n: [] for n in clients}
    steps: list[float] = []
    for k, n in enumerate(turn_order(clients, rounds)):
        if n == 1 and engine_step is not None:
            steps += engine_step()
        # prompts of their own each run: their last blocks computed, not served by the prefix cache
        runs[n].append(asyncio.run(_clients(url, model, n, max_tokens, together=True, draft=k + 1)))
    out = {}
    for n, done in runs.items():
        rates = [d["tokens"] / d["wall_s"] for d in done]
        gaps = np.array([g for d in done for g in d["gaps_ms"]] or [np.nan])
        out[str(n)] = {"tok_s": float(np.median(rates)), "tok_s_runs": rates, "gaps": int(np.isfinite(gaps).sum()),
                       "itl_p50_ms": float(np.nanpercentile(gaps, 50)), "itl_p99_ms": float(np.nanpercentile(gaps, 99))}
    return {"rounds": rounds, "clients": out,
            **({"engine_step_ms": statistics.median(steps), "engine_step_samples_ms": steps} if steps else {})}


def _model_id(url: str) -> str:
    import httpx

    return httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]


async def _clients(url: str, model: str, n: int, max_tokens: int, together: bool, draft: int = 0) -> dict:
    import httpx

    # a new connection per request: a kept-alive one that the server closes as the next request goes out would
    # fail that request ("disconnected without sending a response"), seen once against llama-server
    limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        start = time.perf_counter()
        jobs = [_stream(client, model, TOPICS[i % len(TOPICS)], max_tokens, draft) for i in range(n)]
        if together:
            results = await asyncio.gather(*jobs)
        else:
            results = [await job for job in jobs]
        wall = time.perf_counter() - start
    return {"wall_s": wall, "tokens": sum(r["tokens"] for r in results),
            "gaps_ms": [g for r in results for g in r["gaps_ms"]], "ttft_ms": [r["ttft_ms"] for r in results],
            "texts": [r["text"] for r in results]}


async def _stream(client, model: str, topic: str, max_tokens: int, draft: int = 0) -> dict:
    ask = f"Write a long story about {topic}." + (f" This is draft {draft}." if draft else "")
    body = {"model": model, "messages": [{"role": "user", "content": ask}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    sent, arrivals, tokens, parts = time.perf_counter(), [], None, []
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("error"):  # a server that fails mid-stream must fail the run, not count as 0 tokens
                raise RuntimeError(f"{client.base_url}: the stream failed: {chunk['error']}")
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            content = "".join((c.get("delta") or {}).get("content") or "" for c in chunk.get("choices") or ())
            if content:
                arrivals.append(time.perf_counter())
                parts.append(content)
    if tokens is None:
        raise RuntimeError(f"{client.base_url}: the stream ended without its usage chunk ({len(parts)} chunks)")
    gaps = np.diff(arrivals) * 1000 if len(arrivals) > 1 else np.empty(0)
    return {"tokens": tokens, "gaps_ms": gaps.tolist(), "text": "".join(parts),
            "ttft_ms": (arrivals[0] - sent) * 1000 if arrivals else None}


def _summary(s: dict) -> dict:
    gaps = np.array(s["gaps_ms"]) if s["gaps_ms"] else np.array([np.nan])
    ttft = [t for t in s["ttft_ms"] if t is not None]
    return {"tok_s": s["tokens"] / s["wall_s"], "tokens": s["tokens"], "wall_s": s["wall_s"],
            "itl_p50_ms": float(np.nanpercentile(gaps, 50)), "itl_p99_ms": float(np.nanpercentile(gaps, 99)),
            "ttft_median_ms": float(np.median(ttft)) if ttft else None,
            "ttft_p99_ms": float(np.percentile(ttft, 99)) if ttft else None}


def greedy_equality(raw: dict[str, dict]) -> dict[str, dict]:
    """{clients: {"equal", "total", "differ"}}: each batched stream against the same request run alone on the same
    server (temperature 0, so they must be the same text); differ lists (stream, first differing character)."""
    out = {}
    for n in CLIENTS:
        batched, alone = raw.get(f"batched/{n}"), raw.get(f"one at a time/{n}")
        if batched is None or alone is None:
            continue
        differ = [[i, _first_difference(a, b)] for i, (a, b) in enumerate(zip(batched["texts"], alone["texts"]))
                  if a != b]
        out[str(n)] = {"equal": len(batched["texts"]) - len(differ), "total": len(batched["texts"]),
                       "differ": differ}
    return out


def _first_difference(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# ---- the engine's own step, in process
def engine_step_ms(ctx: BenchContext, max_tokens: int, samples: int) -> list[float]:
    """Single-token decode forwards (ms) of the engine, paged, one sequence at a 1-client request's context: the
    first topic's chat prompt plus half a reply."""
    from engine.bench.peers import EnginePeer

    engine = ctx.engine
    prompt = prompt_ids(engine.tokenizer, None, [Message("user", f"Write a long story about {TOPICS[0]}.")])
    context = len(prompt) + max_tokens // 2
    filler = ctx.text_ids()
    ids = (prompt + filler * (1 + (context + samples) // max(len(filler), 1)))[:context + samples]
    status(f"serve: the engine's own decode step at {context} tokens ({samples} samples)")
    peer = EnginePeer(engine, "paged", pool_tokens=max(1024, context + samples + 16))
    return peer.decode_ms(ids, [context], samples)[context]


# ---- pool fit, in process
def pool_fit(ctx: BenchContext, requests: int = FIT_REQUESTS) -> dict:
    engine = ctx.engine
    budget_tokens = engine.max_context
    paged = make_cache(engine, "paged", 16, pool_tokens=budget_tokens)
    with using_cache(engine, paged):
        sched = Scheduler(engine, SchedulerConfig(max_concurrency=requests))
        done = []
        params = SamplingParams(temperature=0, repetition_penalty=1.0, max_new_tokens=FIT_NEW_TOKENS)
        for i in range(requests):
            sched.submit(_fit_prompt(engine, i), params, lambda out: done.append(out) if out.finished else None)
        while len(done) < requests:
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
            "requests": requests}


def _fit_prompt(engine, i: int) -> list[int]:
    words = " ".join(TOPICS[(i + j) % len(TOPICS)] for j in range(12))
    ids = prompt_ids(engine.tokenizer, None, [Message("user", f"Request {i}: tell me about {words}.")])
    return ids[:FIT_PROMPT_TOKENS]


# ---- report
def _row(n: int, server: str, streams: dict, greedy: dict) -> list:
    b, s = streams[f"batched/{n}"], streams[f"one at a time/{n}"]
    g = greedy.get(str(n))
    return [n, server, b["tok_s"], s["tok_s"], b["tok_s"] / s["tok_s"] if s["tok_s"] else None, b["ttft_median_ms"],
            b["itl_p50_ms"], b["itl_p99_ms"], s["itl_p50_ms"], s["itl_p99_ms"],
            f"{g['equal']} / {g['total']}" if g else "-"]


def summarize(r: dict) -> str:
    from engine.bench.targets import serve_targets

    peer = r.get("peer") or {}
    rows = []
    for n in r["clients"]:
        rows.append(_row(n, KVSCOPE, r["streams"], r.get("greedy") or {}))
        if peer.get("streams"):
            rows.append(_row(n, LLAMA_SERVER, peer["streams"], peer.get("greedy") or {}))
    headers = ["clients", "server", "batched tok/s", "one-at-a-time tok/s", "batched / one-at-a-time",
               "batched TTFT median ms", "batched ITL p50 ms", "batched ITL p99 ms", "one-at-a-time ITL p50 ms",
               "one-at-a-time ITL p99 ms", "batched streams = alone (greedy)"]
    fit = r["pool_fit"]
    fit_rows = [["paged (block 16)", fit["paged"], f"{fit['paged_preemptions']} preemptions, {fit['paged_errors']} "
                 "errors"], ["contiguous", fit["contiguous"], f"{fit['contiguous_reservation_bytes'] / 2**20:.0f} MiB "
                             "reserved per sequence"]]
    target_rows = [[t.name.removeprefix("serve: "), t.goal, report.fmt(t.measured) if "%" not in t.goal
                    else report.pct(t.measured), t.verdict, t.why] for t in serve_targets(r)]
    return report.section(
        "serve: continuous batching over loopback, against llama-server", r["method"],
        f"llama-server: {peer.get('status', 'not run')}.",
        report.md_table(headers, rows),
        f"The engine's own decode step (in process, one sequence): median {report.fmt(r.get('engine_step_ms'))} ms.",
        _turns_line(r.get("turns")),
        f"Concurrent requests that fit a KV budget of {fit['budget_tokens']:,} tokens "
        f"({fit['budget_bytes'] / 2**20:.0f} MiB), {fit['requests']} submitted:",
        report.md_table(["strategy", "concurrent requests", "note"], fit_rows),
        report.md_table(["target", "goal", "measured", "verdict", "why"], target_rows))


def _turns_line(turns: dict | None) -> str:
    if not turns:
        return ""
    runs = [f"{n} client(s) {report.fmt(c['tok_s'])} tok/s, ITL p50 {report.fmt(c['itl_p50_ms'])} ms and p99 "
            f"{report.fmt(c['itl_p99_ms'])} ms" for n, c in turns["clients"].items()]
    head = f"kvscope in turns ({turns['rounds']} rounds, batched; what the ratio targets read): "
    return head + "; ".join(runs) + "."


SERIES_COLORS = {KVSCOPE: report.color("paged"), LLAMA_SERVER: report.color("llama.cpp")}


def plot(r: dict, path) -> None:
    """Aggregate tokens/s (batched solid, one at a time dashed) and the batched runs' inter-token latency (p50
    solid, p99 dashed): one colour per server."""
    fig, (left, right) = report.figure(2, width=6)
    clients = r["clients"]
    servers = {KVSCOPE: r["streams"], **({LLAMA_SERVER: r["peer"]["streams"]} if (r.get("peer") or {}).get("streams")
                                        else {})}
    for server, streams in servers.items():
        color = SERIES_COLORS[server]
        for mode, style in zip(MODES, ("o-", "s--")):
            left.plot(clients, [streams[f"{mode}/{n}"]["tok_s"] for n in clients], style, color=color, ms=4,
                      label=f"{server}, {mode}")
        batched = [streams[f"batched/{n}"] for n in clients]
        right.plot(clients, [s["itl_p50_ms"] for s in batched], "o-", color=color, ms=4, label=f"{server} p50")
        right.plot(clients, [s["itl_p99_ms"] for s in batched], "x--", color=color, ms=5, label=f"{server} p99")
    left.set(title="aggregate throughput", xlabel="concurrent streaming clients", ylabel="tokens / s", xscale="log")
    right.set(title="inter-token latency (batched)", xlabel="concurrent streaming clients", ylabel="ms",
              xscale="log")
    for ax in (left, right):
        ax.set_xticks(clients, [str(n) for n in clients])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
        report.legend_outside(ax)
    report.save(fig, path)
