"""concurrency: how many sequences of a realistic chat workload fit a fixed KV memory budget, and how much of the
reserved memory holds live tokens, per strategy; then one batched decode of the admitted sequences.

Admission uses the real caches' accounting: ContiguousCache reservations (prepare(..., reserve_tokens)) counted
against the budget, and PagedCache / PagedInt8Cache pools sized to the budget. Requests are admitted in arrival
order until the first that does not fit. At the snapshot every admitted sequence holds its whole prompt and reply
(each at its largest, the worst case for paged). Admission runs only the caches' bookkeeping (begin_step /
commit_step, no forward); the batched decode then runs the real model over really prefilled caches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.bench import report
from engine.bench.common import (
    BenchContext,
    bar,
    make_cache,
    median,
    prefill,
    random_ids,
    ratio,
    timed_ms,
    using_cache,
)
from engine.bench.workload import Request, WorkloadShape, describe, make_workload
from engine.kv.base import KVCache, KVCacheFull

NUM_REQUESTS = 400
BUDGET_CONTEXTS, QUICK_BUDGET_CONTEXTS = 8, 3  # the budget, in full-context float reservations
PAGED_BLOCK_SIZES = (8, 16, 32, 64)
DECODE_STEPS, QUICK_DECODE_STEPS = 6, 3
NUM_BUCKETS = 4
SEED = 2024


@dataclass(frozen=True)
class Config:
    name: str
    strategy: str
    block_size: int = 16
    reserve: str = ""  # contiguous: "full" (the context limit) or "request" (prompt + max new tokens)


CONFIGS = (
    Config("contiguous (full context)", "contiguous", reserve="full"),
    Config("contiguous (prompt + max new)", "contiguous", reserve="request"),
    *(Config(f"paged bs={bs}", "paged", bs) for bs in PAGED_BLOCK_SIZES),
    Config("paged-int8 bs=16", "paged-int8", 16),
)


def run(ctx: BenchContext, quick: bool) -> dict:
    e, shape = ctx.engine, WorkloadShape()
    requests = make_workload(NUM_REQUESTS, SEED, shape)
    per_token = e.model_config.kv_bytes_per_token(torch.tensor([], dtype=e.dtype).element_size())
    budget = int((QUICK_BUDGET_CONTEXTS if quick else BUDGET_CONTEXTS) * shape.context_limit * per_token)
    results = [admit_config(e, c, requests, shape, budget) for c in bar(CONFIGS, "admission")]
    by_name = {r["name"]: r for r in results}
    steps = QUICK_DECODE_STEPS if quick else DECODE_STEPS
    batched = {name: batched_decode(e, requests[:by_name[name]["admitted"]], shape, steps, name)
               for name in bar(["paged bs=16", "contiguous (full context)"], "batched decode")}
    admitted = max(by_name[n]["admitted"] for n in by_name)
    return {
        "shape": shape.__dict__, "num_requests": NUM_REQUESTS, "seed": SEED,
        "workload": describe(requests), "admitted_workload": describe(requests[:admitted]),
        "budget_bytes": budget, "budget_tokens_at_model_dtype": int(budget / per_token),
        "kv_dtype": e.cache.precision, "budget_tokens_at_kv_dtype": int(budget / e.cache.store_bytes_per_token()),
        "configs": results,
        "paged16_over_contiguous_full": ratio(by_name["paged bs=16"]["admitted"],
                                              by_name["contiguous (full context)"]["admitted"]),
        "batched": batched, "decode_steps": steps, "num_buckets": NUM_BUCKETS,
    }


# ---- admission
def admit_config(e, config: Config, requests: list[Request], shape: WorkloadShape, budget: int) -> dict:
    if config.strategy == "contiguous":
        cache = make_cache(e, "contiguous", max_context=shape.context_limit)
        return _figures(config, cache, admit(cache, config, requests, shape, budget), budget)
    if config.strategy == "paged":
        cache = _pool(e, config, budget, shape)
        return _figures(config, cache, admit(cache, config, requests, shape, budget), budget)
    return _admit_int8(e, config, requests, shape, budget)


def _pool(e, config: Config, pool_bytes: int, shape: WorkloadShape) -> KVCache:
    """A paged cache whose pool takes as many whole blocks as pool_bytes holds."""
    probe = make_cache(e, config.strategy, config.block_size, pool_tokens=config.block_size)
    num_blocks = max(1, pool_bytes // probe.bytes_per_block())
    return make_cache(e, config.strategy, config.block_size, pool_tokens=num_blocks * config.block_size,
                      max_context=shape.context_limit)


def _admit_int8(e, config, requests, shape, budget) -> dict:
    """paged-int8 keeps a full-precision window per sequence outside its pool, so its pool gets the budget less
    the windows of the k sequences it admits: the largest k whose smaller pool still admits k sequences."""
    window = _window_bytes(e, config.block_size)

    def admitted_with(k: int) -> int:
        return admit(_pool(e, config, budget - k * window, shape), config, requests, shape, None)

    k = admitted_with(admitted_with(0))  # the pool alone gives an upper bound; this k is feasible
    while admitted_with(k + 1) >= k + 1:
        k += 1
    cache = _pool(e, config, budget - k * window, shape)
    return _figures(config, cache, admit(cache, config, requests, shape, budget), budget)


def _window_bytes(e, block_size: int) -> int:
    """Memory a paged-int8 sequence takes outside the pool: measured on a probe cache around prepare()."""
    probe = make_cache(e, "paged-int8", block_size, pool_tokens=block_size)
    before = probe.stats().bytes_allocated
    probe.prepare(0, [1])
    return probe.stats().bytes_allocated - before


def admit(cache: KVCache, config: Config, requests: list[Request], shape: WorkloadShape,
          budget: int | None) -> int:
    """Admit requests in order until one does not fit (the cache is full, or its memory would pass the budget);
    each ends up holding its prompt and reply."""
    vocab = cache.config.vocab_size
    for i, r in enumerate(requests):
        ids = random_ids(r.total_tokens, vocab, seed=SEED + i)
        if not _try_admit(cache, config, i, ids, r, shape, budget):
            return i
    return len(requests)


def _try_admit(cache, config: Config, seq: int, ids: list[int], r: Request, shape, budget: int | None) -> bool:
    try:
        if config.strategy == "contiguous":
            reserve = shape.context_limit if config.reserve == "full" else r.prompt_tokens + shape.max_new_tokens
            cache.prepare(seq, ids, reserve_tokens=reserve)
        else:
            cache.prepare(seq, ids)
        if budget is not None and cache.stats().bytes_allocated > budget:
            raise KVCacheFull("over the memory budget")
        cache.commit_step(cache.begin_step([seq], [ids]))  # bookkeeping only: no forward
        return True
    except KVCacheFull:
        cache.release(seq)
        return False


def _figures(config: Config, cache: KVCache, admitted: int, budget: int) -> dict:
    """Utilisation = live tokens / tokens the memory holding them could hold (at the strategy's bytes/token)."""
    stats = cache.stats()
    per_token = _bytes_per_token(cache)
    live = sum(cache.tokens_held(s) for s in range(admitted))
    holding = stats.bytes_allocated if config.strategy == "contiguous" else stats.bytes_used
    return {"name": config.name, "strategy": config.strategy, "block_size": config.block_size,
            "admitted": admitted, "live_tokens": live, "bytes_per_token": per_token,
            "bytes_reserved": stats.bytes_allocated, "bytes_holding_live": holding,
            "utilisation": live * per_token / holding if holding else None,
            "budget_share_live": live * per_token / budget}


def _bytes_per_token(cache: KVCache) -> float:
    if hasattr(cache, "bytes_per_block"):
        return cache.bytes_per_block() / cache.block_size
    return cache.config.kv_bytes_per_token(cache.bytes_per_element)


# ---- batched decode of the admitted sequences
def batched_decode(e, requests: list[Request], shape: WorkloadShape, steps: int, name: str) -> dict:
    """Prefill the admitted sequences for real, then decode them all: one forward for the whole batch, or one
    per length bucket (sorted by length). The cache gets room for the timed steps on top of the budget."""
    total = sum(r.total_tokens for r in requests)
    headroom = len(requests) * (steps + 2) * 2 + 64
    if name.startswith("paged"):
        cache = make_cache(e, "paged", 16, pool_tokens=total + 16 * len(requests) + headroom,
                           max_context=shape.context_limit + steps + 2)
    else:
        cache = make_cache(e, "contiguous", max_context=shape.context_limit + steps + 2)
    with using_cache(e, cache):
        seqs = _fill(e, requests)
        return {"batch": len(seqs), "prefilled_tokens": total,
                "unsorted": _decode_rounds(e, [seqs], steps), "bucketed": _decode_rounds(e, _buckets(e, seqs), steps)}


def _fill(e, requests: list[Request]) -> list[int]:
    seqs = []
    for i, r in enumerate(bar(requests, "prefilling admitted sequences")):
        ids = random_ids(r.total_tokens, e.model_config.vocab_size, seed=SEED + i)
        e.cache.prepare(i, ids)
        prefill(e, i, ids)
        seqs.append(i)
    return seqs


def _buckets(e, seqs: list[int]) -> list[list[int]]:
    ordered = sorted(seqs, key=e.cache.tokens_held)
    size = -(-len(ordered) // NUM_BUCKETS)
    return [ordered[i:i + size] for i in range(0, len(ordered), size)]


def _decode_rounds(e, groups: list[list[int]], steps: int) -> dict:
    """Each round: one decode step for every sequence (one forward per group). Median round time."""
    padded = slots = 0
    round_ms = []
    for step in range(steps + 1):  # the first round warms up and is not timed
        lengths = [[e.cache.tokens_held(s) + 1 for s in g] for g in groups]
        ms = sum(timed_ms(lambda g=g: e.step(g, [[13]] * len(g)), e.synchronize)[1] for g in groups)
        if step:
            round_ms.append(ms)
            padded += sum(len(ls) * max(ls) - sum(ls) for ls in lengths)
            slots += sum(len(ls) * max(ls) for ls in lengths)
    batch = sum(len(g) for g in groups)
    return {"forwards_per_round": len(groups), "round_ms": median(round_ms), "tokens_per_s":
            batch / (median(round_ms) / 1000), "padding_waste": padded / slots if slots else 0.0}


def summarize(r: dict) -> str:
    rows = [[c["name"], c["admitted"], c["live_tokens"], c["bytes_reserved"] / 2**20, report.pct(c["utilisation"]),
             report.pct(c["budget_share_live"])] for c in r["configs"]]
    table = report.md_table(["strategy", "concurrent sequences", "live tokens", "reserved (MiB)",
                             "utilisation", "budget holding live tokens"], rows)
    b_rows = [[name, b["batch"], mode, m["forwards_per_round"], report.pct(m["padding_waste"]), m["round_ms"],
               m["tokens_per_s"]] for name, b in r["batched"].items() for mode, m in
              (("one batch", b["unsorted"]), ("sorted into length buckets", b["bucketed"]))]
    b_table = report.md_table(["admitted set", "sequences", "grouping", "forwards / step", "padding waste",
                               "step (ms)", "tokens/s"], b_rows)
    w, s = r["workload"], r["shape"]
    kv_tokens = f", {r['budget_tokens_at_kv_dtype']:,} in the caches' {r['kv_dtype']}" if "kv_dtype" in r else ""
    return report.section(
        "concurrency: sequences in a fixed KV budget",
        f"Budget {r['budget_bytes'] / 2**20:,.0f} MiB (= {r['budget_tokens_at_model_dtype']:,} tokens at the "
        f"model's dtype{kv_tokens}). "
        f"Workload: {r['num_requests']} seeded log-normal requests (seed {r['seed']}), a serving "
        f"context limit of {s['context_limit']} (what 'full context' reserves), max new tokens "
        f"{s['max_new_tokens']}; prompt mean "
        f"{w['prompt']['mean']:.0f} / median {w['prompt']['median']:.0f} / p99 {w['prompt']['p99']:.0f}, reply "
        f"mean {w['output']['mean']:.0f} / median {w['output']['median']:.0f} / p99 {w['output']['p99']:.0f} "
        "tokens. Utilisation = live tokens / tokens the memory holding them could hold.",
        table,
        f"paged bs=16 runs {report.fmt(r['paged16_over_contiguous_full'])}x the sequences of contiguous "
        "(full context).",
        "Batched decode (engine.step with all sequence ids; padding waste = padded key slots / all key slots "
        f"attended; median of {r['decode_steps']} steps):",
        b_table,
    )


def plot(r: dict, path) -> None:
    names = [c["name"] for c in r["configs"]]
    fig, (ax1, ax2) = report.figure_for_rows(len(names), 2, width=5.5)
    colors = [report.color(n.split(" ")[0]) for n in names]  # by strategy: contiguous, paged, paged-int8
    ax1.barh(range(len(names)), [c["admitted"] for c in r["configs"]], color=colors)
    ax1.set(title="concurrent sequences in the budget", xlabel="sequences")
    report.integer_ticks(ax1.xaxis)
    ax2.barh(range(len(names)), [100 * (c["utilisation"] or 0) for c in r["configs"]], color=colors)
    ax2.axvline(95, color="gray", ls=":")
    ax2.set(title="utilisation of the memory holding tokens", xlabel="%", xlim=(0, 100))
    for ax in (ax1, ax2):
        report.categories(ax, names)
        ax.grid(alpha=0.3, axis="x")
    ax2.tick_params(labelleft=False)  # the same rows as the left panel
    report.save(fig, path)
