"""memory: bytes per token, measured from the caches' own KVStats after a known number of tokens, against the
article's formula 2 x bytes/element x layers x KV heads x head_dim; the grouped-query saving; the 7B example."""

from __future__ import annotations

import dataclasses

import torch

from engine.bench import report
from engine.bench.common import BenchContext, bar, make_cache, prefill, random_ids, ratio, using_cache
from engine.config import EngineConfig, ModelConfig
from engine.engine import Engine
from engine.kv import quant
from engine.model import LlamaModel

TOKENS = 256  # a multiple of every block size
ODD_TOKENS = 250  # shows the last block's rounding
SMALL = dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
             max_position_embeddings=1024, tie_word_embeddings=True)
# the article's example: a 7B Llama-2-shaped model, multi-head attention, float16
SEVEN_B = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32, num_heads=32,
               num_kv_heads=32, head_dim=128, max_position_embeddings=4096)
STRATEGIES = ("none", "contiguous", "paged", "paged-int8")


def run(ctx: BenchContext, quick: bool) -> dict:
    e = ctx.engine
    rows = [measure(e, s, TOKENS) for s in bar(STRATEGIES, "memory strategies")]
    rows.append(measure(e, "paged", ODD_TOKENS))
    rows.append(measure(e, "contiguous", TOKENS, full_reservation=True))
    small = small_engine(ctx)
    for dtype in bar(("float16", "bfloat16"), "memory dtypes"):
        engine = small(dtype)
        rows += [measure(engine, s, TOKENS) for s in ("contiguous", "paged", "paged-int8")]
    return {"tokens": TOKENS, "rows": rows, "formula_by_dtype": formula_by_dtype(e.model_config),
            "grouped_query": grouped_query(e.model_config), "seven_b": seven_b()}


def small_engine(ctx: BenchContext):
    """A factory: a small random Llama with the real tokenizer, in a given dtype (float16/bfloat16 caches)."""
    tok = ctx.engine.tokenizer
    config = ModelConfig(vocab_size=len(tok), **SMALL)

    def make(dtype: str) -> Engine:
        model = LlamaModel.random(config, seed=0, std=0.05)
        return Engine(model, tok, EngineConfig(cache="paged", dtype=dtype, device=str(ctx.engine.device),
                                               pool_tokens=64), f"small-random-{dtype}")

    return make


def int8_scale_bytes_per_token(c: ModelConfig, block_size: int) -> float:
    """paged-int8's scales: one per key channel per block, one per value token, each float16."""
    scale = torch.tensor([], dtype=quant.SCALE_DTYPE).element_size()
    return c.num_layers * c.num_kv_heads * (c.head_dim * scale / block_size + scale)


def measure(engine: Engine, strategy: str, n: int, full_reservation: bool = False) -> dict:
    """Run n tokens into a fresh cache of the strategy and read its KVStats."""
    cache = make_cache(engine, strategy, block_size=16, pool_tokens=n + 64)
    seq, ids = 1, random_ids(n, engine.model_config.vocab_size)
    with using_cache(engine, cache):
        if strategy == "contiguous":
            cache.prepare(seq, ids, reserve_tokens=None if full_reservation else n)
        else:
            cache.prepare(seq, ids)
        prefill(engine, seq, ids, chunk=len(ids))
        stats = cache.stats(seq)
    formula = engine.model_config.kv_bytes_per_token(cache.bytes_per_element)  # its precision's, not the activations'
    if strategy == "paged-int8":
        formula += int8_scale_bytes_per_token(engine.model_config, 16)
    used = stats.bytes_allocated if strategy == "contiguous" else stats.bytes_used
    label = strategy + (" (full-context reservation)" if full_reservation else "")
    dtype = f"int8 ({engine.dtype_name} window)" if strategy == "paged-int8" else cache.precision
    return {"strategy": label, "model": engine.model_name, "dtype": dtype, "tokens": n,
            "bytes_held": used, "bytes_allocated": stats.bytes_allocated, "measured_per_token": used / n,
            "formula_per_token": 0.0 if strategy == "none" else formula,
            "measured_over_formula": ratio(used / n, formula) if strategy != "none" else None}


def formula_by_dtype(c: ModelConfig) -> dict:
    return {name: c.kv_bytes_per_token(size) for name, size in
            (("float32", 4), ("float16", 2), ("bfloat16", 2), ("int8 (elements only)", 1))}


def grouped_query(c: ModelConfig) -> dict:
    mha = dataclasses.replace(c, num_kv_heads=c.num_heads)
    return {"num_heads": c.num_heads, "num_kv_heads": c.num_kv_heads,
            "gqa_bytes_per_token_fp32": c.kv_bytes_per_token(4), "mha_bytes_per_token_fp32": mha.kv_bytes_per_token(4),
            "saving": mha.kv_bytes_per_token(4) / c.kv_bytes_per_token(4)}


def seven_b() -> dict:
    c = ModelConfig(**SEVEN_B)
    per_token = c.kv_bytes_per_token(2)
    return {"config": SEVEN_B, "dtype": "float16", "bytes_per_token": per_token, "mib_per_token": per_token / 2**20,
            "bytes_at_4096": per_token * 4096, "gib_at_4096": per_token * 4096 / 2**30}


def summarize(r: dict) -> str:
    rows = [[x["strategy"], x["model"], x["dtype"], x["tokens"], x["bytes_held"], x["measured_per_token"],
             x["formula_per_token"], x["measured_over_formula"]] for x in r["rows"]]
    table = report.md_table(["strategy", "model", "cache dtype", "tokens", "bytes held", "measured B/token",
                             "formula B/token", "measured / formula"], rows)
    g, s = r["grouped_query"], r["seven_b"]
    formulas = ", ".join(f"{k} {report.fmt(v)} B" for k, v in r["formula_by_dtype"].items())
    return report.section(
        "memory: bytes per token, measured vs formula",
        "Bytes held = what the cache's KVStats reports after the tokens ran through the model: contiguous its "
        "reservation, paged the whole blocks in use, paged-int8 its blocks (int8 + float16 scales) plus the "
        "sequence's full-precision window of one block. The formula for paged-int8 includes its scales.",
        table,
        f"Formula for this model per token: {formulas}.",
        f"Grouped-query attention: {g['num_heads']} query heads share {g['num_kv_heads']} KV heads, so a token "
        f"takes {report.fmt(g['gqa_bytes_per_token_fp32'])} B instead of {report.fmt(g['mha_bytes_per_token_fp32'])}"
        f" B in float32: {report.fmt(g['saving'])}x smaller (H / H_kv).",
        f"The article's 7B example (L=32, H=32, d=128, float16), by the same code: "
        f"{report.fmt(s['bytes_per_token'])} B = {report.fmt(s['mib_per_token'])} MiB per token, "
        f"{report.fmt(s['gib_at_4096'])} GiB at 4,096 tokens.",
    )


def plot(r: dict, path) -> None:
    rows = [x for x in r["rows"] if "full-context" not in x["strategy"] and x["strategy"] != "none"]
    fig, (ax,) = report.figure_for_rows(len(rows), width=8)
    labels = [f"{x['strategy']}, {x['dtype'].split(' (')[0]}, {x['tokens']} tokens, "
              f"{'small model' if 'small' in x['model'] else 'real model'}" for x in rows]
    ys = range(len(rows))
    for name, key, shift in (("measured", "measured_per_token", -0.2), ("formula", "formula_per_token", 0.2)):
        ax.barh([y + shift for y in ys], [x[key] for x in rows], 0.4, label=name, color=report.color(name))
    report.categories(ax, labels)
    ax.set(title="KV bytes per token: measured vs formula", xlabel="bytes / token", xscale="log")
    ax.grid(alpha=0.3, axis="x")
    report.legend_outside(ax)
    report.save(fig, path)
