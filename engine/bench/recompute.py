"""recompute: why a KV cache at all. Without one ('none') every new token reruns the whole sequence, so the total
time to generate n tokens grows as O(n^2); with one it grows as O(n). One greedy generation per strategy to the
longest length; the cumulative wall-clock time at 10, 100, ... tokens is the total time to generate that many.

'none' to 1,000 tokens would take about 500,000 token-forwards (over ten minutes on two cores), so it generates
for real up to NONE_MEASURED tokens; beyond, its step latency is measured at NONE_SAMPLES evenly spaced positions
(the same forward over the whole sequence that generate runs there) and integrated, linearly interpolated.
"""

from __future__ import annotations

import time

import numpy as np

from engine.bench import report
from engine.bench.common import (
    ENGINE_STRATEGIES,
    BenchContext,
    bar,
    make_cache,
    random_ids,
    ratio,
    timed_ms,
    using_cache,
)
from engine.config import SamplingParams
from engine.events import StepEvent

LENGTHS = (10, 100, 1000)
QUICK_LENGTHS = (10, 100, 300)
NONE_MEASURED, QUICK_NONE_MEASURED = 300, 100
TINY_LENGTHS, TINY_NONE_MEASURED = (10, 50, 150), 50  # --tiny: every code path, on a random model
NONE_SAMPLES = 12
STEP_TOKENS = 250  # issue 20: a 'none' step at ~250 tokens grew from 0.6 s to ~20 s; it should cost one prefill
STEP_REPEATS = 5
STEP_TARGET = 1.5  # a 'none' step at n tokens costs at most this many prefills of n tokens
PROMPT = "Tell me a long story about a lighthouse keeper and the ships she guided home."


def run(ctx: BenchContext, quick: bool) -> dict:
    lengths = TINY_LENGTHS if ctx.tiny else QUICK_LENGTHS if quick else LENGTHS
    n = max(lengths)
    measured = min(n, TINY_NONE_MEASURED if ctx.tiny else QUICK_NONE_MEASURED if quick else NONE_MEASURED)
    curves = {s: generation_curve(ctx, s, measured if s == "none" else n)
              for s in bar(ENGINE_STRATEGIES, "recompute strategies")}
    if measured < n:
        curves["none"] = extend_by_sampling(ctx, curves["none"], n)
    totals = {s: {str(k): c["wall_ms"][k - 1] for k in lengths} for s, c in curves.items()}
    lo, hi = str(min(lengths)), str(max(lengths))
    return {
        "method": "One greedy generation per strategy (temperature 0, stop token disabled); total = wall clock "
                  "from the call to generate until the n-th token's event; per-token latency = the step's "
                  "forward + sampling as the engine reports it (StepEvent.latency_ms)",
        "prompt": PROMPT,
        "lengths": list(lengths),
        "prompt_tokens": curves["paged"]["prompt_tokens"],
        "curves": curves,
        "total_ms": totals,
        "growth": {s: ratio(t[hi], t[lo]) for s, t in totals.items()},
        "none_over_paged": {k: ratio(totals["none"][k], totals["paged"][k]) for k in totals["paged"]},
        "none_measured_tokens": measured,
        "step_vs_prefill": step_vs_prefill(ctx, STEP_TOKENS),
    }


def step_vs_prefill(ctx: BenchContext, n: int, repeats: int = STEP_REPEATS) -> dict:
    """A 'none' step over n tokens (what generate runs there: one forward over the whole sequence) against a
    prefill of n tokens into a fresh paged sequence, alternating, `repeats` times each: the step's steadiness
    (last over first of consecutive steps) and its cost in prefills (median over median)."""
    e = ctx.engine
    ids = random_ids(n, e.model_config.vocab_size)
    none, paged = make_cache(e, "none"), make_cache(e, "paged", pool_tokens=2 * n)
    step_ms, prefill_ms = [], []
    for i in bar(range(repeats), "recompute step vs prefill"):
        with using_cache(e, none):
            none.prepare(0, ids)
            step_ms.append(timed_ms(lambda: e.step([0], [ids]), e.synchronize)[1])
        with using_cache(e, paged):
            paged.prepare(i + 1, ids)
            prefill_ms.append(timed_ms(lambda i=i: e.step([i + 1], [ids]), e.synchronize)[1])
            paged.release(i + 1)
    step, prefill = float(np.median(step_ms)), float(np.median(prefill_ms))
    return {"tokens": n, "none_step_ms": step_ms, "paged_prefill_ms": prefill_ms, "none_step_median_ms": step,
            "paged_prefill_median_ms": prefill, "step_over_prefill": ratio(step, prefill),
            "last_over_first_step": ratio(step_ms[-1], step_ms[0]), "target": STEP_TARGET,
            "weights": e.weight_format}


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


def extend_by_sampling(ctx: BenchContext, curve: dict, n: int) -> dict:
    """Continue a 'none' curve from its last generated token to n tokens: time the step (a forward over the
    whole sequence) at evenly spaced positions, interpolate between them, and add up."""
    e, prompt = ctx.engine, curve["prompt_tokens"]
    first, last = curve["positions"][-1] + 1, prompt + n - 2  # the positions that produce tokens len+1 .. n
    sampled = sorted({int(p) for p in np.linspace(first, last, NONE_SAMPLES)})
    ids = random_ids(prompt + n, e.model_config.vocab_size)
    with using_cache(e, make_cache(e, "none")) as cache:
        cache.prepare(0, ids)
        sampled_ms = [timed_ms(lambda p=p: e.step([0], [ids[:p + 1]]), e.synchronize)[1]
                      for p in bar(sampled, "recompute none (sampled steps)")]
    positions = list(range(first, last + 1))
    latency = np.interp(positions, sampled, sampled_ms)
    wall = curve["wall_ms"][-1] + np.cumsum(latency)
    return {**curve, "positions": curve["positions"] + positions, "latency_ms": curve["latency_ms"] + latency.tolist(),
            "wall_ms": curve["wall_ms"] + wall.tolist(), "estimated_after_token": len(curve["wall_ms"]),
            "sampled_positions": sampled, "sampled_ms": sampled_ms}


def summarize(r: dict) -> str:
    rows = [[s, *[_cell(r, s, k) for k in r["lengths"]], r["growth"][s]] for s in r["total_ms"]]
    hi, lo = max(r["lengths"]), min(r["lengths"])
    table = report.md_table(["strategy", *[f"{k} tokens (s)" for k in r["lengths"]], f"time({hi}) / time({lo})"],
                            rows)
    ideal = f"O(n) predicts time({hi})/time({lo}) ~ {hi // lo}x; O(n^2) up to {(hi // lo) ** 2:,}x."
    speedups = ", ".join(f"{k} tokens: {report.fmt(v)}x" for k, v in r["none_over_paged"].items())
    measured = r["none_measured_tokens"]
    note = "" if measured >= max(r["lengths"]) else (
        f"'none' generated {measured} tokens for real; values past that (marked ~) add its step latency measured "
        f"at {NONE_SAMPLES} evenly spaced positions, interpolated (forward time only).")
    return report.section(
        "recompute: no cache (O(n^2)) vs a cache (O(n))",
        f"Prompt of {r['prompt_tokens']} tokens. {r['method']}.", table, note, ideal,
        f"none / paged total time: {speedups}.", _step_line(r.get("step_vs_prefill")),
    )


def _step_line(s: dict | None) -> str:
    if not s:
        return ""
    met = "met" if s["step_over_prefill"] is not None and s["step_over_prefill"] <= s["target"] else "NOT met"
    steps = ", ".join(f"{ms:,.0f}" for ms in s["none_step_ms"])
    return (f"One 'none' step over {s['tokens']} tokens ({s['weights']} weights), {len(s['none_step_ms'])} in a "
            f"row, alternating with a paged prefill of the same tokens: {steps} ms (median "
            f"{s['none_step_median_ms']:,.0f}) vs prefill median {s['paged_prefill_median_ms']:,.0f} ms: "
            f"{report.fmt(s['step_over_prefill'])}x a prefill (target <= {s['target']:g}x: {met}); last/first "
            f"step {report.fmt(s['last_over_first_step'])}x.")


def _cell(r: dict, strategy: str, k: int) -> str:
    estimated = strategy == "none" and k > r["none_measured_tokens"]
    return ("~" if estimated else "") + report.fmt(r["total_ms"][strategy][str(k)] / 1000)


def plot(r: dict, path) -> None:
    fig, (ax1, ax2) = report.figure(2)
    for s, c in r["curves"].items():
        real = c.get("estimated_after_token", len(c["wall_ms"]))
        ax1.plot(c["positions"][1:real], c["latency_ms"][1:real], label=s, color=report.color(s), lw=1)
        ax2.plot(range(1, real + 1), [w / 1000 for w in c["wall_ms"][:real]], label=s, color=report.color(s))
        if real < len(c["wall_ms"]):
            ax1.plot(c["sampled_positions"], c["sampled_ms"], "o", color=report.color(s), label=f"{s} (sampled)")
            ax2.plot(range(real, len(c["wall_ms"]) + 1), [w / 1000 for w in c["wall_ms"][real - 1:]], "--",
                     color=report.color(s), label=f"{s} (integrated)")
    ax1.set(title="per-token decode latency vs position", xlabel="position (tokens)", ylabel="ms / token",
            yscale="log")  # 'none' is 10-20x the cached strategies: a linear axis would flatten them
    ax2.set(title="total time to generate n tokens", xlabel="tokens generated", ylabel="seconds",
            xscale="log", yscale="log")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    report.legend_outside(ax2, ax1)  # the same series in both panels: one legend, beside the plots
    report.save(fig, path)
