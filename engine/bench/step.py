"""step: the decode step against llama.cpp, alternating runners in one process, at one and two threads; a batch
of 8 sequences against one; how the step grows with the bytes it reads (the first and the last context in turns);
where one step's time goes.

Every engine runner holds its own prefilled sequence; the runners take turns, TURN steps each, ROUNDS times, so
a change of machine load falls on all of them alike. A turn's first step is not counted, and an engine runner that
follows llama.cpp or the read probe waits for the engine's pace to come back first (`schedule`). llama.cpp
(llama-cpp-python, when installed) decodes the same GGUF with the same number of threads.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from engine.bench import report, roofline
from engine.bench.common import (
    BenchContext,
    make_cache,
    median,
    prefill,
    random_ids,
    ratio,
    rotated,
    status,
    timed_ms,
    using_cache,
)
from engine.bench.peers import llama_cpp_status

CONTEXTS, QUICK_CONTEXTS = (512, 2048, 4096), (512, 2048)
THREADS = (1, 2)
ROUNDS, TURN = 6, 8
WARMUP = 1  # a turn's first steps, not counted: the runner's own memory comes back into the caches
# After llama.cpp's turn (or the read probe's) the engine's steps take 100-300 ms to come back to their pace
# (2-core Xeon: 9.2 ms then 7.4, 7.0 ... 5.3 at 512 tokens, two threads, ~80 ms; 12.5, 11.5 ... 9.6 on one thread,
# ~300 ms), so the engine runner that came next was measured slower than the others (int4's turn after llama.cpp's:
# 6.5 ms a step against 5.3 in the rounds that ran the other way). A runner of its own steps first instead, not
# counted, until SETTLE_MS have passed (at least SETTLE_MIN steps, at most SETTLE_MAX).
SETTLE_MS, SETTLE_MIN, SETTLE_MAX = 300.0, 8, 96
SETTLER = "settle"
GROWTH = ROUNDS * TURN  # tokens a measured runner's sequence grows by during `alternate`
SETTLE_GROWTH = ROUNDS * 2 * SETTLE_MAX  # and the settle runner's, at most
STRATEGIES = ("paged", "contiguous", "paged-int8", "paged, KV bfloat16", "paged, KV int4")  # paged: the engine's KV
BATCH = 8
PROFILE_TOP = 12
PROBE = "read probe"  # a one-thread runner that reads a buffer past the caches: each row's own bandwidth
PROBE_MB = 256

METHOD = (
    f"Each runner holds one sequence prefilled to the context; runners alternate, {TURN} single-token steps each, "
    f"{ROUNDS} rounds, each round starting one runner later (no runner takes two turns in a row); the first round's "
    f"steps and the first {WARMUP} step(s) of each turn are discarded, and an engine runner that follows llama.cpp "
    f"or the read probe first waits {SETTLE_MS:.0f} ms of steps of an engine runner of its own (not counted: the "
    "engine takes 100-300 ms to come back to its pace after them); the median step is reported. Engine steps are "
    "engine.step (the forward, no sampling); llama.cpp's are Llama.eval of one token on the same GGUF with "
    "n_threads = n_threads_batch = the engine's threads. At one thread a read probe (a sum over a "
    f"{PROBE_MB} MB buffer) takes its turns beside them, and each context's roofline uses the bandwidth it measured "
    "in those minutes (the machine's own speed drifts between rows)."
)


def run(ctx: BenchContext, quick: bool) -> dict:
    room = ctx.engine.max_context - SETTLE_GROWTH - 8
    contexts = [c for c in (QUICK_CONTEXTS if quick else CONTEXTS) if c <= room] or [room // 2]
    threads_before = torch.get_num_threads()
    llama = llama_cpp_status(ctx.gguf_path) == "available"
    out = {"method": METHOD, "contexts": contexts, "threads": list(THREADS[:1] if ctx.tiny else THREADS),
           "llama_cpp": llama,
           "latency_ms": {}, "speed_vs_llama_cpp": {}}
    try:
        for threads in THREADS[:1] if ctx.tiny else THREADS:
            torch.set_num_threads(threads)
            peer = LlamaCppRunner(ctx.gguf_path, max(contexts) + GROWTH + 8, threads) if llama else None
            probe = ReadProbe() if threads == 1 else None
            for context in contexts:
                status(f"step: {threads} thread(s), context {context}")
                latency = alternate(ctx, context, peer, probe)
                key = f"{threads}t/{context}"
                if probe is not None:
                    out.setdefault("read_gbs", {})[key] = probe.gbs(latency.pop(PROBE))
                out["latency_ms"][key] = latency
                if peer is not None:
                    out["speed_vs_llama_cpp"][key] = {n: ratio(latency["llama.cpp"], ms) for n, ms in latency.items()
                                                      if n != "llama.cpp"}
        torch.set_num_threads(1)
        out["batch"] = batch_scaling(ctx, contexts[0])
        out["bytes"] = bytes_figures(ctx, out["latency_ms"], contexts, out.get("read_gbs", {}))
        out["growth"] = {}
        bytes_growth = out["bytes"]["growth"]["paged"]["bytes"]
        for threads in THREADS[:1] if ctx.tiny else THREADS:
            torch.set_num_threads(threads)
            out["growth"][f"{threads}t"] = growth_in_turns(ctx, contexts[0], contexts[-1], bytes_growth)
        out["profile"] = {str(c): profile_step(ctx, c) for c in dict.fromkeys((contexts[0], contexts[-1]))}
    finally:
        torch.set_num_threads(threads_before)
    return out


class LlamaCppRunner:
    def __init__(self, gguf_path, n_ctx: int, threads: int):
        from llama_cpp import Llama

        self.llm = Llama(model_path=str(gguf_path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                         n_batch=512, verbose=False)

    def start(self, ids: list[int]) -> None:
        self.llm.reset()
        self.llm.eval(ids)
        self.position = len(ids)

    def step(self, ids: list[int]) -> float:
        _, ms = timed_ms(lambda: self.llm.eval([ids[self.position]]))
        self.position += 1
        return ms


class EngineRunner:
    def __init__(self, ctx: BenchContext, strategy: str, ids: list[int], context: int, growth: int = GROWTH):
        self.engine, self.ids, self.position = ctx.engine, ids, context
        self.cache = make_cache(ctx.engine, strategy, block_size=16, pool_tokens=context + growth + 8)
        with using_cache(self.engine, self.cache):
            self.cache.prepare(0, ids[:context])
            prefill(self.engine, 0, ids[:context])

    def step(self, ids: list[int]) -> float:
        with using_cache(self.engine, self.cache):
            _, ms = timed_ms(lambda: self.engine.step([0], [[ids[self.position]]]))
        self.position += 1
        return ms


class ReadProbe:
    """A runner whose turn reads a buffer far larger than the caches once: the read bandwidth of the same minutes
    as the steps it alternates with."""

    def __init__(self, mb: int = PROBE_MB):
        self.buffer = torch.ones(mb * 2**20 // 4, dtype=torch.float32)
        self.buffer.sum()  # paged in

    def step(self, ids: list[int]) -> float:
        start = time.perf_counter()
        self.buffer.sum()
        return (time.perf_counter() - start) * 1e3

    def gbs(self, ms: float) -> float:
        return self.buffer.nbytes / ms / 1e6


def schedule(names: list[str], engines: set[str]) -> list[tuple[str, int, bool]]:
    """The turns `alternate` takes, in order: (runner, steps, counted). Round r starts at the r-th runner and goes
    round the list, so no runner takes two turns in a row (forwards then backwards, the two ends did, and the engine
    runner at the front ran on its own warm caches); each turn is WARMUP steps not counted, then the rest of TURN,
    counted after the first round; an engine runner right after one that is not an engine (llama.cpp, the read
    probe) is preceded by the SETTLER's steps, not counted (SETTLE_MAX: at most; `settle` stops at SETTLE_MS)."""
    turns, previous = [], None
    for round_ in range(ROUNDS):
        for name in rotated(names, round_):
            if name in engines and previous is not None and previous not in engines:
                turns.append((SETTLER, SETTLE_MAX, False))
            turns += [(name, WARMUP, False), (name, TURN - WARMUP, round_ > 0)]
            previous = name
    return turns


def alternate(ctx: BenchContext, context: int, peer: LlamaCppRunner | None,
              probe: ReadProbe | None = None) -> dict[str, float]:
    ids = random_ids(context + SETTLE_GROWTH + 8, ctx.engine.model_config.vocab_size)
    runners: dict[str, object] = {s: EngineRunner(ctx, s, ids, context) for s in STRATEGIES}
    engines = set(runners)
    if peer is not None:
        peer.start(ids[:context])
        runners["llama.cpp"] = peer
    if probe is not None:
        runners[PROBE] = probe
    turns = schedule(list(runners), engines)
    settler = None
    if any(name == SETTLER for name, _, _ in turns):
        settler = EngineRunner(ctx, "paged", ids, context, growth=SETTLE_GROWTH)
    samples: dict[str, list[float]] = {name: [] for name in runners}
    for name, steps, counted in turns:
        if name == SETTLER:
            settle(lambda: settler.step(ids), steps)
            continue
        times = [runners[name].step(ids) for _ in range(steps)]
        if counted:
            samples[name] += times
    for runner in [*runners.values(), settler]:
        if isinstance(runner, EngineRunner):
            runner.cache.release(0)
    return {name: median(ms) for name, ms in samples.items()}


def settle(step_once: Callable[[], object], most: int) -> int:
    """Settle steps, not counted, until SETTLE_MS have passed (at least SETTLE_MIN, at most `most`); how many."""
    start, steps = time.perf_counter(), 0
    while steps < most and (steps < SETTLE_MIN or (time.perf_counter() - start) * 1e3 < SETTLE_MS):
        step_once()
        steps += 1
    return steps


def batch_scaling(ctx: BenchContext, context: int) -> dict:
    """One paged pool: a step of BATCH sequences at `context` tokens each against a step of one of them, in turns as
    `alternate` takes them: a turn's first WARMUP steps not counted, and before the one-sequence turn, which follows
    a batch turn, `settle` steps of a sequence of its own (after a batch turn the one-sequence steps took 12.5, 11.5,
    then 10.2 ms: counted from the first, they made one sequence's step 5% longer and the ratio smaller)."""
    e = ctx.engine
    ids = random_ids((BATCH + 1) * (context + 64), e.model_config.vocab_size)
    settler = BATCH  # the settle sequence
    cache = make_cache(e, "paged", block_size=16,
                       pool_tokens=BATCH * (context + GROWTH + 16) + context + ROUNDS * SETTLE_MAX + 16)
    seqs = list(range(BATCH))
    with using_cache(e, cache):
        for s in [*seqs, settler]:
            prompt = ids[s * context:(s + 1) * context]
            cache.prepare(s, prompt)
            prefill(e, s, prompt)
        one, many = [], []
        for round_ in range(ROUNDS):
            settle(lambda: e.step([settler], [[7]]), SETTLE_MAX)
            a = [timed_ms(lambda: e.step([0], [[7]]))[1] for _ in range(TURN)]
            b = [timed_ms(lambda: e.step(seqs, [[7]] * BATCH))[1] for _ in range(TURN)]
            if round_:
                one += a[WARMUP:]
                many += b[WARMUP:]
    return {"context": context, "batch": BATCH, "one_ms": median(one), "batch_ms": median(many),
            "batch_over_one": ratio(median(many), median(one))}


def growth_in_turns(ctx: BenchContext, first: int, last: int, bytes_growth: float) -> dict:
    """The paged step at the first and the last context, the two runners taking turns (TURN steps each, ROUNDS
    rounds, the first round and each turn's first WARMUP steps not counted), so that both sides of the ratio see
    the same minutes of the machine: its growth against the growth of the bytes it reads."""
    ids = random_ids(last + GROWTH + 8, ctx.engine.model_config.vocab_size)
    runners = {c: EngineRunner(ctx, "paged", ids, c) for c in (first, last)}
    samples: dict[int, list[float]] = {c: [] for c in runners}
    for round_ in range(ROUNDS):
        for c, runner in runners.items():
            times = [runner.step(ids) for _ in range(TURN)]
            if round_:
                samples[c] += times[WARMUP:]
    for runner in runners.values():
        runner.cache.release(0)
    latency = ratio(median(samples[last]), median(samples[first]))
    return {"first": first, "last": last, "first_ms": median(samples[first]), "last_ms": median(samples[last]),
            "latency": latency, "bytes": bytes_growth, "over_bytes": ratio(latency, bytes_growth)}


def bytes_figures(ctx: BenchContext, latency: dict, contexts: list[int], read_gbs: dict[str, float]) -> dict:
    """Bytes each strategy's step reads at each context, the lower bound they give at the read bandwidth measured
    beside that context's steps (read_gbs, by row key; a probe now where a row has none), and the multiple."""
    e = ctx.engine
    weights = roofline.weight_bytes(e.model)
    per_token = {s: make_cache(e, s, block_size=16, pool_tokens=16).bytes_per_block() / 16 if s != "contiguous"
                 else e.model_config.kv_bytes_per_token(e.cache.bytes_per_element) for s in STRATEGIES}
    bw = roofline.measure_bandwidth(256)
    gbs = {c: read_gbs.get(f"1t/{c}") or bw.single_thread_gbs for c in contexts}
    rows = {}
    for s in STRATEGIES:
        for c in contexts:
            read = roofline.step_bytes(weights, per_token[s], c)
            ms = latency.get(f"1t/{c}", {}).get(s)
            bound = roofline.lower_bound_ms(read, gbs[c])
            rows[f"{s}/{c}"] = {"bytes": read, "read_gbs": gbs[c], "bound_ms": bound, "ms": ms,
                                "multiple": ratio(ms, bound)}
    first, last = contexts[0], contexts[-1]
    return {"weights": weights, "kv_bytes_per_token": per_token, "bandwidth": bw.__dict__, "rows": rows,
            "growth": {s: growth(rows[f"{s}/{first}"], rows[f"{s}/{last}"]) for s in STRATEGIES},
            "first": first, "last": last}


def growth(first: dict, last: dict) -> dict:
    """From one context's row to another's: the latency's growth, the same at the first row's read bandwidth (the
    machine's drift between the two rows taken out), and the growth of the bytes read."""
    latency = ratio(last["ms"], first["ms"])
    steady = latency * last["read_gbs"] / first["read_gbs"] if latency is not None else None
    return {"latency": latency, "latency_at_equal_bandwidth": steady, "bytes": ratio(last["bytes"], first["bytes"])}


def profile_step(ctx: BenchContext, context: int) -> list[dict]:
    """The ops of one paged decode step at `context` tokens (1 thread), by self time."""
    from torch.profiler import ProfilerActivity, profile

    e = ctx.engine
    ids = random_ids(context + 16, e.model_config.vocab_size)
    cache = make_cache(e, "paged", block_size=16, pool_tokens=context + 16)
    with using_cache(e, cache):
        cache.prepare(0, ids[:context])
        prefill(e, 0, ids[:context])
        for i in range(3):
            e.step([0], [[ids[context + i]]])
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for i in range(5):
                e.step([0], [[ids[context + 3 + i]]])
    events = sorted(prof.key_averages(), key=lambda ev: ev.self_cpu_time_total, reverse=True)
    total = sum(ev.self_cpu_time_total for ev in events) or 1
    return [{"op": ev.key, "calls_per_step": ev.count / 5, "ms_per_step": ev.self_cpu_time_total / 5 / 1000,
             "share": ev.self_cpu_time_total / total} for ev in events[:PROFILE_TOP]]


def summarize(r: dict) -> str:
    names = [*STRATEGIES, *(["llama.cpp"] if r["llama_cpp"] else [])]
    rows = []
    for key, latency in r["latency_ms"].items():
        speed = r["speed_vs_llama_cpp"].get(key, {})
        rows.append([key, *[latency.get(n) for n in names], *[speed.get(s) for s in STRATEGIES if r["llama_cpp"]]])
    heads = ["threads/context", *[f"{n} (ms)" for n in names],
             *([f"{s} speed vs llama.cpp" for s in STRATEGIES] if r["llama_cpp"] else [])]
    b = r["batch"]
    by = r["bytes"]
    byte_rows = [[k, v["bytes"] / 1e6, v.get("read_gbs"), v["bound_ms"], v["ms"], v["multiple"]]
                 for k, v in by["rows"].items()]
    grown = "; ".join(f"{s}: latency x{report.fmt(g['latency'])} (x{report.fmt(g.get('latency_at_equal_bandwidth'))} "
                      f"at equal read bandwidth) for bytes x{report.fmt(g['bytes'])}" for s, g in by["growth"].items())
    profiles = [report.md_table(["op", "calls / step", "ms / step", "share"],
                                [[p["op"], p["calls_per_step"], p["ms_per_step"], report.pct(p["share"])]
                                 for p in prof]) for prof in r["profile"].values()]
    return report.section(
        "step: the decode step against llama.cpp (alternating, one process)", r["method"],
        report.md_table(heads, rows),
        f"Batch: {b['batch']} sequences at {b['context']} tokens each take {report.fmt(b['batch_ms'])} ms a step, "
        f"one takes {report.fmt(b['one_ms'])} ms: x{report.fmt(b['batch_over_one'])}.",
        *[f"The paged step at {g['first']} and {g['last']} tokens in turns, {key.replace('t', ' thread(s)')}: "
          f"{report.fmt(g['first_ms'])} and {report.fmt(g['last_ms'])} ms, x{report.fmt(g['latency'])} for bytes "
          f"x{report.fmt(g['bytes'])}: x{report.fmt(g['over_bytes'])} of its bytes' growth."
          for key, g in r.get("growth", {}).items()],
        f"Bytes read per step (weights {by['weights'] / 1e6:.1f} MB) and the lower bound they give at one thread, at "
        "the read bandwidth the probe measured beside each context's steps (a probe after the runs: "
        f"{by['bandwidth']['single_thread_gbs']:.1f} GB/s). From {by['first']} to {by['last']} tokens: {grown}.",
        report.md_table(["strategy/context", "MB read", "read GB/s", "bound (ms)", "measured (ms)",
                         "measured / bound"], byte_rows),
        *[f"Profile of a paged step at {c} tokens (1 thread):\n\n{t}" for c, t in zip(r["profile"], profiles)],
    )


def plot(r: dict, path) -> None:
    fig, (ax1, ax2) = report.figure(2, width=7)
    for threads in r["threads"]:
        keys = [k for k in r["latency_ms"] if k.startswith(f"{threads}t/")]
        xs = [int(k.split("/")[1]) for k in keys]
        for name in [*STRATEGIES, *(["llama.cpp"] if r["llama_cpp"] else [])]:  # colour: runner; line: threads
            ax1.plot(xs, [r["latency_ms"][k].get(name) for k in keys], "o-" if threads == 1 else "s--", ms=4,
                     color=report.color(name), label=f"{name}, {threads} thread{'s' if threads > 1 else ''}")
    ax1.set(xlabel="context (tokens)", ylabel="ms per decode step", title="decode step (alternating runners)")
    rows = r["bytes"]["rows"]
    for s in STRATEGIES:
        keys = [k for k in rows if k.startswith(f"{s}/")]
        report.line(ax2, s, [int(k.split("/")[1]) for k in keys], [rows[k]["multiple"] for k in keys])
    ax2.axhline(1.5, color="grey", linestyle=":", label="1.5x the roofline")
    ax2.set(xlabel="context (tokens)", ylabel="measured / lower bound", title="step vs its bytes (1 thread)")
    report.legend_outside(ax1)
    report.legend_outside(ax2)
    report.save(fig, path)
