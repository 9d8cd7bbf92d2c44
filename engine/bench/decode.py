"""decode: per-token decode latency at growing contexts, every KV strategy against transformers (same weights,
same process and threads) and llama.cpp when installed, and the memory-bandwidth roofline."""

from __future__ import annotations

from engine.bench import peers, report, roofline
from engine.bench.common import BenchContext, bar, make_cache, median, random_ids, ratio, status
from engine.bench.report import kv_row, weights_row
from engine.kv.precision import PRECISIONS, bytes_per_token

CONTEXTS = (16, 512, 2048, 4096, 8192)
QUICK_CONTEXTS = (16, 512, 2048)
TINY_CONTEXTS = (16, 256)  # --tiny: every code path, on a random model whose figures mean nothing
STEPS, QUICK_STEPS = 32, 16
CACHED_STRATEGIES = ("contiguous", "paged", "paged-int8")
WEIGHT_FORMATS = ("float32", "bfloat16", "int8", "int4")  # 'paged' with each format beside the auto one
NONE_CONTEXTS, NONE_STEPS = (16, 512), 6  # 'none' reruns the whole context per token: see the recompute bench

METHOD = (
    "Random token ids are prefilled (chunks of 1,024) up to each context, then STEPS single-token forwards are "
    "timed one by one and the median is reported; contexts are visited in ascending order on one sequence. "
    "The time is the forward alone (engine.step; for transformers model(input_ids, cache=...), formerly "
    "past_key_values, with its DynamicCache, which is what its generate loop runs per token, minus sampling "
    "and stopping checks), so the peer pays no generate-loop overhead."
)


def run(ctx: BenchContext, quick: bool) -> dict:
    steps = QUICK_STEPS if quick else STEPS
    requested = TINY_CONTEXTS if ctx.tiny else QUICK_CONTEXTS if quick else CONTEXTS
    limit = ctx.engine.max_context - steps - 1
    contexts = clamp_contexts(requested, limit)
    ids = random_ids(max(contexts) + steps + 1, ctx.engine.model_config.vocab_size)
    runners, notes = make_peers(ctx, contexts, steps, max(contexts) + steps + 8)
    if max(requested) > limit:
        notes.insert(0, f"context {max(requested)} is measured at {limit}: the model's context limit is "
                        f"{ctx.engine.max_context} and the {steps} timed steps must fit in it.")
    samples = {}
    for name, (peer, its_contexts, its_steps) in bar(list(runners.items()), "decode peers"):
        samples[name] = {str(c): ms for c, ms in peer.decode_ms(ids, its_contexts, its_steps).items()}
    latency = {name: {c: median(ms) for c, ms in s.items()} for name, s in samples.items()}
    return {
        "method": METHOD.replace("STEPS", str(steps)),
        "contexts": contexts,
        "steps": steps,
        "notes": notes,
        "latency_ms": latency,
        "samples_ms": samples,
        "roofline": roofline_figures(ctx, latency, quick),
    }


def clamp_contexts(contexts: tuple[int, ...], limit: int) -> list[int]:
    return sorted({min(c, limit) for c in contexts})


def make_peers(ctx: BenchContext, contexts: list[int], steps: int, pool_tokens: int) -> tuple[dict, list[str]]:
    """name -> (peer, contexts, steps), and notes on what was skipped."""
    e = ctx.engine
    none_contexts = [c for c in NONE_CONTEXTS if c <= max(contexts)]
    runners = {"none": (peers.EnginePeer(e, "none", pool_tokens), none_contexts, NONE_STEPS)}
    for s in CACHED_STRATEGIES:
        runners[s] = (peers.EnginePeer(e, s, pool_tokens), contexts, steps)
    for kv in PRECISIONS:
        if kv != e.kv_dtype_name:
            runners[kv_row("paged", kv)] = (peers.EnginePeer(e, kv_row("paged", kv), pool_tokens), contexts, steps)
    for fmt in WEIGHT_FORMATS:
        if fmt != e.weight_format:
            runners[weights_row(fmt)] = (peers.EnginePeer(ctx.engine_with_weights(fmt), "paged", pool_tokens),
                                         contexts, steps)
    notes = [f"the engine's strategies run with the auto weight format, which chose {e.weight_format} here; "
             f"'paged, X weights' rows run the same cache with the other formats.",
             f"'paged' keeps keys and values in the engine's KV precision ({e.kv_dtype_name} here); 'paged, KV X' "
             "rows the same pool in each other precision.",
             f"'none' only at contexts {none_contexts} with {NONE_STEPS} steps: each of its steps reruns the whole "
             "context (the recompute benchmark measures it in full)."]
    others, more_notes = peers.external_peers(ctx, pool_tokens)
    runners.update({name: (peer, contexts, steps) for name, peer in others.items()})
    return runners, notes + more_notes


def kv_bytes_per_token(ctx: BenchContext) -> dict[str, float]:
    """Bytes of keys and values per token each runner reads (paged-int8 measured: int8 plus its scales;
    llama.cpp: its default float16 cache)."""
    e = ctx.engine
    full = bytes_per_token(e.model_config, e.kv_dtype_name, 16)  # contiguous and paged: the engine's KV precision
    int8 = make_cache(e, "paged-int8", block_size=16, pool_tokens=16)
    kv_rows = {kv_row("paged", kv): bytes_per_token(e.model_config, kv, 16) for kv in PRECISIONS}
    return {**kv_rows, "none": full, "contiguous": full, "paged": full, "paged-int8": int8.bytes_per_block() / 16,
            "transformers": full, "llama.cpp": e.model_config.kv_bytes_per_token(2),
            **{weights_row(f): full for f in WEIGHT_FORMATS}}


def weight_bytes_read(ctx: BenchContext, name: str) -> int:
    """Bytes of weights the runner's decode step reads, in the format it holds them."""
    for fmt in WEIGHT_FORMATS:
        if name == weights_row(fmt):
            return roofline.weight_bytes(ctx.engine_with_weights(fmt).model)
    if name == "llama.cpp" and ctx.gguf_path is not None:
        return ctx.gguf_path.stat().st_size  # its own blocks, read once a step
    if name.startswith("transformers"):
        return roofline.weight_bytes(ctx.hf_model())
    return roofline.weight_bytes(ctx.engine.model)


def roofline_figures(ctx: BenchContext, latency: dict, quick: bool) -> dict:
    status("measuring memory bandwidth")
    bw = roofline.measure_bandwidth(256 if quick else 512)
    weights = roofline.weight_bytes(ctx.engine.model)
    per_token = kv_bytes_per_token(ctx)
    bound, multiple = {}, {}
    for name, by_context in latency.items():
        kv = per_token.get(name, per_token["transformers"])
        w = weight_bytes_read(ctx, name)
        bound[name] = {c: roofline.lower_bound_ms(roofline.step_bytes(w, kv, int(c)), bw.all_threads_gbs)
                       for c in by_context}
        multiple[name] = {c: ratio(ms, bound[name][c]) for c, ms in by_context.items()}
    return {"bandwidth": bw.__dict__, "weight_bytes": weights, "kv_bytes_per_token": per_token,
            "bound_ms": bound, "multiple": multiple,
            "method": "bound = (weight bytes, lm_head once, + KV bytes/token x context) / all-thread read bandwidth "
                      "(best of 5 sums of a large float32 buffer)"}


def summarize(r: dict) -> str:
    names = list(r["latency_ms"])
    rows = [[c, *[r["latency_ms"][n].get(str(c)) for n in names]] for c in r["contexts"]]
    table = report.md_table(["context", *[f"{n} (ms)" for n in names]], rows)
    rf = r["roofline"]
    bw = rf["bandwidth"]
    roof_rows = [[c, roofline.step_bytes(rf["weight_bytes"], rf["kv_bytes_per_token"]["paged"], c) / 1e6,
                  rf["bound_ms"]["paged"].get(str(c)), r["latency_ms"]["paged"].get(str(c)),
                  rf["multiple"]["paged"].get(str(c))] for c in r["contexts"]]
    roof = report.md_table(["context", "bytes read / step (MB)", "lower bound (ms)", "paged (ms)",
                            "paged / bound"], roof_rows)
    return report.section(
        "decode: per-token latency (median) by context", r["method"], table,
        "\n".join(f"- {n}" for n in r["notes"]),
        f"Roofline: read bandwidth {bw['single_thread_gbs']:.1f} GB/s on 1 thread, {bw['all_threads_gbs']:.1f} "
        f"GB/s on {bw['threads']}; weights read per step {rf['weight_bytes'] / 1e6:.1f} MB. {rf['method']}.",
        roof,
    )


def plot(r: dict, path) -> None:
    fig, (ax1, ax2) = report.figure(2)
    for name, by_context in r["latency_ms"].items():
        xs = [int(c) for c in by_context]
        ax1.plot(xs, list(by_context.values()), "o-", label=name, color=report.color(name))
        mult = r["roofline"]["multiple"][name]
        ax2.plot(xs, list(mult.values()), "o-", label=name, color=report.color(name))
    bound = r["roofline"]["bound_ms"]["paged"]
    ax1.plot([int(c) for c in bound], list(bound.values()), "k--", label="bandwidth bound (paged)")
    ax1.set(title="decode latency per token", xlabel="context (tokens)", ylabel="ms", xscale="log", yscale="log")
    ax2.axhline(2, color="gray", ls=":", label="2x bound")
    ax2.set(title="latency / bandwidth lower bound", xlabel="context (tokens)", ylabel="x bound", xscale="log",
            yscale="log")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    report.legend_outside(ax2, ax1)  # the same series in both panels: one legend, beside the plots
    report.save(fig, path)
