"""recompute: why a KV cache at all. Without one ('none') every new token reruns the whole sequence, so the total
time to generate n tokens grows as O(n^2); with one it grows as O(n). One greedy generation per strategy to the
longest length; the cumulative wall-clock time at 10, 100, ... tokens is the total time to generate that many.
"""

from __future__ import annotations

import time

from engine.bench import report
from engine.bench.common import ENGINE_STRATEGIES, BenchContext, bar, make_cache, ratio, using_cache
from engine.config import SamplingParams
from engine.events import StepEvent

LENGTHS = (10, 100, 1000)
QUICK_LENGTHS = (10, 100, 300)
PROMPT = "Tell me a long story about a lighthouse keeper and the ships she guided home."


def run(ctx: BenchContext, quick: bool) -> dict:
    lengths = QUICK_LENGTHS if quick else LENGTHS
    n = max(lengths)
    curves = {s: generation_curve(ctx, s, n) for s in bar(ENGINE_STRATEGIES, "recompute strategies")}
    totals = {s: {str(k): c["wall_ms"][k - 1] for k in lengths} for s, c in curves.items()}
    lo, hi = str(min(lengths)), str(max(lengths))
    return {
        "method": "one greedy generation per strategy (temperature 0, stop token disabled); total = wall clock "
                  "from the call to generate until the n-th token's event; per-token latency = the step's "
                  "forward + sampling as the engine reports it (StepEvent.latency_ms)",
        "prompt": PROMPT,
        "lengths": list(lengths),
        "prompt_tokens": curves["paged"]["prompt_tokens"],
        "curves": curves,
        "total_ms": totals,
        "growth": {s: ratio(t[hi], t[lo]) for s, t in totals.items()},
        "none_over_paged": {k: ratio(totals["none"][k], totals["paged"][k]) for k in totals["paged"]},
    }


def generation_curve(ctx: BenchContext, strategy: str, n: int) -> dict:
    """Per generated token: its position, the step latency, and the cumulative wall time since the start."""
    e = ctx.engine
    params = SamplingParams(temperature=0, max_new_tokens=n, stop_token_ids=(-1,))
    positions, latency, wall = [], [], []
    with using_cache(e, make_cache(e, strategy, pool_tokens=2 * n + 512)):
        conv = e.new_conversation()
        start, pending = time.perf_counter(), 0.0
        for ev in bar(e.generate(conv, PROMPT, params), f"recompute {strategy}", total=n):
            if not isinstance(ev, StepEvent):
                continue
            pending += ev.latency_ms
            if ev.token_id is not None:
                positions.append(ev.pos)
                latency.append(pending)
                wall.append((time.perf_counter() - start) * 1000)
                pending = 0.0
        e.forget(conv)
    return {"positions": positions, "latency_ms": latency, "wall_ms": wall, "prompt_tokens": positions[0] + 1}


def summarize(r: dict) -> str:
    rows = [[s, *[r["total_ms"][s][str(k)] / 1000 for k in r["lengths"]], r["growth"][s]] for s in r["total_ms"]]
    hi, lo = max(r["lengths"]), min(r["lengths"])
    table = report.md_table(["strategy", *[f"{k} tokens (s)" for k in r["lengths"]], f"time({hi}) / time({lo})"],
                            rows)
    ideal = f"O(n) predicts time({hi})/time({lo}) ~ {hi // lo}x; O(n^2) up to {(hi // lo) ** 2:,}x."
    speedups = ", ".join(f"{k} tokens: {report.fmt(v)}x" for k, v in r["none_over_paged"].items())
    return report.section(
        "recompute: no cache (O(n^2)) vs a cache (O(n))",
        f"Prompt of {r['prompt_tokens']} tokens, greedy. {r['method']}.", table, ideal,
        f"none / paged total time: {speedups}.",
    )


def plot(r: dict, path) -> None:
    fig, (ax1, ax2) = report.figure(2)
    for s, c in r["curves"].items():
        ax1.plot(c["positions"][1:], c["latency_ms"][1:], label=s, color=report.color(s), lw=1)
        tokens = range(1, len(c["wall_ms"]) + 1)
        ax2.plot(tokens, [w / 1000 for w in c["wall_ms"]], label=s, color=report.color(s))
    ax1.set(title="per-token decode latency vs position", xlabel="position (tokens)", ylabel="ms / token")
    ax2.set(title="total time to generate n tokens", xlabel="tokens generated", ylabel="seconds",
            xscale="log", yscale="log")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    report.save(fig, path)
