"""growth: what a pool that grows in chunks costs the decode step. Paged decode on a pool grown the way a chat
grows it (chunks of 64 tokens, then doubling) against a single-tensor pool of the same capacity, at the same
contexts, in the same run, steps interleaved."""

from __future__ import annotations

from engine.bench import report
from engine.bench.common import BenchContext, bar, median, random_ids, ratio, status, timed_ms, using_cache
from engine.kv.paged import PagedCache

CONTEXTS, QUICK_CONTEXTS = (512, 4096), (512, 1024)
STEPS, QUICK_STEPS = 48, 12
TARGET = 1.05  # grown / single-tensor decode latency
GROWN, SINGLE = "grown, chunked pool", "single-tensor pool"

METHOD = (
    "Two paged pools of the same capacity (float, block 16): one grown on demand (its first chunk 64 tokens, "
    "each next chunk doubling the pool, up to 4,096 tokens a chunk), one a single tensor from its first block. "
    "Each holds one sequence of the same random token ids, prefilled (chunks of 1,024) up to each context; then "
    "STEPS single-token forwards are timed on each, alternating which goes first so drift hits both alike, and "
    "the medians are compared. In the grown pool the sequence spans several chunks: it is read in place, one "
    "slice per chunk, and attended piece by piece (one softmax over all pieces) instead of as one slice."
)


def run(ctx: BenchContext, quick: bool) -> dict:
    e = ctx.engine
    steps = QUICK_STEPS if quick else STEPS
    contexts = [c for c in (QUICK_CONTEXTS if quick else CONTEXTS) if c + steps < e.max_context]
    capacity = max(contexts) + steps + 16
    pools = {GROWN: new_pool(ctx, capacity, grown=True), SINGLE: new_pool(ctx, capacity, grown=False)}
    ids = random_ids(capacity, e.model_config.vocab_size)
    for pool in pools.values():
        pool.prepare(0, ids)
    samples, shapes = {name: {} for name in pools}, {}
    for context in bar(contexts, "growth contexts"):
        for pool in pools.values():
            fill_to(ctx, pool, ids, context)
        shapes[str(context)] = pool_shape(pools[GROWN], context)
        times = interleaved_steps(ctx, pools, ids, steps)
        for name in pools:
            samples[name][str(context)] = times[name]
    latency = {name: {c: median(ms) for c, ms in s.items()} for name, s in samples.items()}
    ratios = {c: ratio(latency[GROWN][c], latency[SINGLE][c]) for c in latency[GROWN]}
    return {"method": METHOD.replace("STEPS", str(steps)), "contexts": contexts, "steps": steps,
            "capacity_tokens": capacity, "target": TARGET, "latency_ms": latency, "ratio": ratios,
            "grown_pool": shapes, "samples_ms": samples}


def new_pool(ctx: BenchContext, capacity: int, grown: bool) -> PagedCache:
    e = ctx.engine
    first = {} if grown else {"first_chunk_tokens": capacity}
    return PagedCache(e.model_config, e.dtype, e.device, e.max_context, block_size=16, pool_tokens=capacity, **first)


def fill_to(ctx: BenchContext, pool: PagedCache, ids: list[int], context: int) -> None:
    """Prefill the pool's sequence up to `context` tokens (chunks of 1,024), from what it holds."""
    with using_cache(ctx.engine, pool):
        for start in range(pool.tokens_held(0), context, 1024):
            ctx.engine.step([0], [ids[start:min(start + 1024, context)]])


def interleaved_steps(ctx: BenchContext, pools: dict[str, PagedCache], ids: list[int], steps: int) -> dict:
    e, times = ctx.engine, {name: [] for name in pools}
    for step in range(steps):
        order = list(pools.items()) if step % 2 == 0 else list(pools.items())[::-1]  # neither always goes first
        for name, pool in order:
            with using_cache(e, pool):
                feed = [[ids[pool.tokens_held(0)]]]
                _, ms = timed_ms(lambda feed=feed: e.step([0], feed), e.synchronize)
            times[name].append(ms)
    return times


def pool_shape(pool: PagedCache, context: int) -> dict:
    pieces = pool.read_plan(pool.seqs[0].blocks, context).pieces
    status(f"grown pool at {context}: chunks {pool.layout.sizes} blocks, the sequence in {len(pieces)} pieces")
    return {"chunk_blocks": list(pool.layout.sizes), "pieces": len(pieces),
            "allocated_bytes": pool.stats(0).bytes_allocated, "used_bytes": pool.stats(0).bytes_used,
            "budget_bytes": pool.budget_bytes()}


def summarize(r: dict) -> str:
    rows = []
    for c in r["contexts"]:
        c = str(c)
        shape, measured = r["grown_pool"][c], r["ratio"][c]
        verdict = "-" if measured is None else ("PASS" if measured <= r["target"] else "MISS")
        rows.append([c, r["latency_ms"][GROWN][c], r["latency_ms"][SINGLE][c], measured, verdict,
                     ", ".join(map(str, shape["chunk_blocks"])), shape["pieces"],
                     shape["allocated_bytes"] / 2**20, shape["budget_bytes"] / 2**20])
    table = report.md_table(["context", f"{GROWN} (ms)", f"{SINGLE} (ms)", "grown / single",
                             f"<= {r['target']}x", "grown chunks (blocks)", "pieces read", "grown allocated (MiB)",
                             "capacity (MiB)"], rows)
    return report.section("growth: decode on a grown, chunked pool vs a single-tensor pool", r["method"], table)


def plot(r: dict, path) -> None:
    fig, (ax1, ax2) = report.figure(2)
    contexts = [str(c) for c in r["contexts"]]
    width = 0.38
    for i, name in enumerate((GROWN, SINGLE)):
        xs = [j + (i - 0.5) * width for j in range(len(contexts))]
        ax1.bar(xs, [r["latency_ms"][name][c] for c in contexts], width, label=name,
                color=report.color("paged" if name == GROWN else "contiguous"))
    ax1.set_xticks(range(len(contexts)), contexts)
    ax1.set(title="decode latency per token (median)", xlabel="context (tokens)", ylabel="ms")
    ax2.bar(contexts, [r["ratio"][c] or 0 for c in contexts], color=report.color("paged"))
    ax2.axhline(r["target"], color="gray", ls=":", label=f"target {r['target']}x")
    ax2.set(title="grown / single-tensor latency", xlabel="context (tokens)", ylabel="ratio",
            ylim=(0.8, max(1.2, *[(r["ratio"][c] or 0) * 1.05 for c in contexts])))
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3, axis="y")
    report.legend_outside(ax2, ax1)
    report.save(fig, path)
