"""The performance targets, as ratios computed from the results, each with PASS/MISS, the margin, and a why line."""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass

from engine.bench.report import fmt, md_table, pct, section, weights_row


@dataclass(frozen=True)
class Target:
    name: str
    measured: float | None
    goal: str  # e.g. ">= 2.5x"
    passed: bool | None  # None: not measured
    margin: str  # where missed: by how much
    why: str  # one short line: what the numbers say

    @property
    def verdict(self) -> str:
        return "n/a" if self.passed is None else ("PASS" if self.passed else "MISS")


OPS = {">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt}


def _check(name: str, measured: float | None, op: str, threshold: float, unit: str, why: str,
           pct_units: bool = False) -> Target:
    show = pct if pct_units else (lambda x: f"{fmt(x)}{unit}")
    goal = f"{op} {show(threshold)}"
    if measured is None:
        return Target(name, None, goal, None, "", why or "not measured in this run")
    passed = OPS[op](measured, threshold)
    margin = "" if passed else f"missed by {abs(measured / threshold - 1) * 100:.0f}% ({show(measured)})"
    return Target(name, measured, goal, passed, margin, why)


def _get(d: dict | None, *keys):
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def _div(a, b):
    return a / b if a is not None and b else None


# ---- decode
def decode_targets(r: dict) -> list[Target]:
    lat = r.get("latency_ms", {})
    out = []
    for c, goal in (("512", 0.6), ("4096", 0.8)):
        llama, paged = _get(lat, "llama.cpp", c), _get(lat, "paged", c)
        out.append(_check(f"paged decode vs llama.cpp at {c} (tok/s ratio, auto weights)", _div(llama, paged), ">=",
                          goal, "x", f"paged {fmt(paged)} ms vs llama.cpp {fmt(llama)} ms per token (same GGUF, "
                          "same threads; see the profile in the README)"))
    for c in ("512", "2048"):
        hf, paged = _get(lat, "transformers", c), _get(lat, "paged", c)
        out.append(_check(f"paged decode vs transformers at {c} (transformers / paged)", _div(hf, paged), ">=",
                          3.0, "x", f"paged {fmt(paged)} ms vs transformers {fmt(hf)} ms per token; transformers "
                          "reads float32 weights, the engine its auto format"))
    paged, contig, int8 = (_get(lat, s, "2048") for s in ("paged", "contiguous", "paged-int8"))
    out.append(_check("paged / contiguous latency at 2048", _div(paged, contig), "<=", 1.15, "x",
                      f"paged {fmt(paged)} ms vs contiguous {fmt(contig)} ms: the price of the block table"))
    out.append(_check("paged-int8 / paged latency at 2048", _div(int8, paged), "<=", 1.3, "x",
                      f"paged-int8 {fmt(int8)} ms vs paged {fmt(paged)} ms: dequantizing every held token per step"))
    out.append(_growth_target(lat.get("paged", {})))
    mult = _get(r, "roofline", "multiple", "paged", "512")
    bound = _get(r, "roofline", "bound_ms", "paged", "512")
    out.append(_check("paged decode / bandwidth lower bound at 512 (bytes actually read)", mult, "<=", 1.5, "x",
                      f"bound {fmt(bound)} ms vs {fmt(_get(lat, 'paged', '512'))} ms: the rest is compute and "
                      "per-op overhead"))
    per_token = _get(r, "roofline", "kv_bytes_per_token") or {}
    int4, f16 = per_token.get("paged, KV int4"), per_token.get("paged, KV float16")
    out.append(_check("int4 KV bytes per token / float16's (blocks of 16, scales included)", _div(int4, f16), "<=",
                      0.3, "x", f"{fmt(int4)} vs {fmt(f16)} bytes per token (the formula of engine/kv/precision.py)"))
    return out


def _growth_target(paged: dict) -> Target:
    contexts = sorted(int(c) for c in paged)
    top = 4096 if 4096 in contexts else (contexts[-1] if contexts else None)
    name = f"paged latency growth 16 -> {top}" + ("" if top == 4096 else " (4096 not measured)")
    growth = _div(paged.get(str(top)), paged.get("16")) if top else None
    return _check(name, growth, "<", 2.0, "x", f"{fmt(paged.get('16'))} ms at 16, {fmt(paged.get(str(top)))} ms "
                  f"at {top}: attention over the held keys grows with context")


# ---- turns
def turns_targets(r: dict) -> list[Target]:
    paged = r.get("paged") or []
    if len(paged) < 2:
        return []
    last, second = paged[-1], paged[1]
    name = f"TTFT turn {last['turn']} / turn 2 (paged)" + ("" if last["turn"] == 20 else " (quick run)")
    return [_check(name, _div(last["ttft_ms"], second["ttft_ms"]), "<=", 1.3, "x",
                   f"turn 2 prefilled {second['prompt_tokens'] - second['prefix_hit_tokens']} new tokens in "
                   f"{fmt(second['ttft_ms'])} ms, turn {last['turn']} "
                   f"{last['prompt_tokens'] - last['prefix_hit_tokens']} in {fmt(last['ttft_ms'])} ms over a "
                   f"{last['prompt_tokens']}-token history: the new tokens' attention over the whole history "
                   "(2 x T x context x head_dim x heads x layers FLOPs) grows with the context even when only the "
                   "new tokens are prefilled")]


# ---- concurrency
def concurrency_targets(r: dict) -> list[Target]:
    by_name = {c["name"]: c for c in r.get("configs", [])}
    p16, full = by_name.get("paged bs=16"), by_name.get("contiguous (full context)")
    if not p16 or not full:
        return []
    return [
        _check("paged bs=16 utilisation", p16["utilisation"], ">", 0.95, "", "the last block of each sequence "
               "is partly empty: about block_size / 2 tokens wasted per sequence", pct_units=True),
        _check("paged bs=16 concurrent sequences / contiguous (full context)", r["paged16_over_contiguous_full"],
               ">=", 2.5, "x", f"{p16['admitted']} vs {full['admitted']} sequences: contiguous reserves the whole "
               "context per sequence"),
    ]


# ---- prefill and the weights' memory
def prefill_targets(r: dict) -> list[Target]:
    tok = r.get("tokens_per_s", {})
    paged, f32, llama = (_get(tok, name, "512") for name in ("paged", weights_row("float32"), "llama.cpp"))
    w = r.get("weights") or {}
    out = [_check("prefill at 512: auto weights / float32 weights (tok/s)", _div(paged, f32), ">=", 0.8, "x",
                  f"{fmt(paged)} vs {fmt(f32)} tokens/s: {w.get('format')} weights, "
                  f"{w.get('prefill_kernel', 'dequantized once per layer per chunk, then multiplied in float32')}"),
           _check("prefill at 512 vs llama.cpp (tok/s)", _div(paged, llama), ">=", 1.6, "x",
                  f"{fmt(paged)} vs {fmt(llama)} tokens/s")]
    if w.get("file_bytes"):
        out.append(_check("weights resident / GGUF file", _div(w["resident_bytes"], w["file_bytes"]), "<=", 1.3, "x",
                          f"{w['resident_bytes'] / 1e6:.1f} MB of {w['format']} weights in memory vs a "
                          f"{w['file_bytes'] / 1e6:.1f} MB file"))
    return out


# ---- step (the step issue: alternating runners in one process)
def step_targets(r: dict) -> list[Target]:
    out = []
    for key, speed in r.get("speed_vs_llama_cpp", {}).items():
        lat = r["latency_ms"][key]
        for s in ("paged", "contiguous"):
            out.append(_check(f"{s} decode speed vs llama.cpp, {key.replace('t/', ' thread(s), context ')}",
                              speed.get(s), ">=", 1.0, "x", f"{s} {fmt(lat.get(s))} ms vs llama.cpp "
                              f"{fmt(lat.get('llama.cpp'))} ms per token (alternating, same GGUF and threads)"))
    by = r.get("bytes", {})
    grow = _get(by, "growth", "paged")
    for key, g in r.get("growth", {}).items():  # the two contexts in turns (results before it: the rows below)
        rows = f"; the rows measured apart: x{fmt(grow.get('latency'))}" if grow else ""
        out.append(_check(f"paged step growth {g['first']} -> {g['last']} tokens / growth of its bytes, "
                          f"{key.replace('t', ' thread(s)')}", g.get("over_bytes"), "<=", 1.25, "x",
                          f"{fmt(g.get('first_ms'))} -> {fmt(g.get('last_ms'))} ms in turns, x{fmt(g.get('latency'))} "
                          f"for bytes x{fmt(g.get('bytes'))}{rows}"))
    if "growth" not in r and grow and grow.get("latency") and grow.get("bytes"):
        steady = grow.get("latency_at_equal_bandwidth") or grow["latency"]  # (results before the alternating probe)
        out.append(_check(f"paged step growth {by['first']} -> {by['last']} tokens / growth of its bytes",
                          steady / grow["bytes"], "<=", 1.25, "x",
                          f"latency x{fmt(steady)} at equal read bandwidth (x{fmt(grow['latency'])} as measured) "
                          f"for bytes x{fmt(grow['bytes'])}"))
    for key, row in by.get("rows", {}).items():
        if key.split("/")[1] in (str(by.get("first")), str(by.get("last"))):
            out.append(_check(f"{key.replace('/', ' at ')} tokens: step / roofline (1 thread)", row["multiple"],
                              "<=", 1.5, "x", f"{fmt(row['ms'])} ms against a bound of {fmt(row['bound_ms'])} ms"))
    for key, lat in r.get("latency_ms", {}).items():
        if int(key.split("/")[1]) >= 2048:
            out.append(_check(f"paged-int8 / paged latency, {key.replace('t/', ' thread(s), context ')}",
                              _div(lat.get("paged-int8"), lat.get("paged")), "<=", 0.9, "x",
                              f"paged-int8 {fmt(lat.get('paged-int8'))} ms vs paged {fmt(lat.get('paged'))} ms"))
    for key, lat in r.get("latency_ms", {}).items():  # issue 17: the quantized precisions read fewer bytes
        if int(key.split("/")[1]) >= 4096:
            bf16 = lat.get("paged, KV bfloat16")
            for name, goal in (("paged, KV int4", 0.8), ("paged-int8", 0.9)):
                out.append(_check(f"{name} / paged, KV bfloat16 latency, {key.replace('t/', ' thread(s), context ')}",
                                  _div(lat.get(name), bf16), "<=", goal, "x",
                                  f"{name} {fmt(lat.get(name))} ms vs bfloat16 {fmt(bf16)} ms (alternating)"))
    b = r.get("batch", {})
    out.append(_check(f"a step of {b.get('batch')} sequences at {b.get('context')} tokens / one sequence's",
                      b.get("batch_over_one"), "<=", 2.5, "x",
                      f"{fmt(b.get('batch_ms'))} ms vs {fmt(b.get('one_ms'))} ms"))
    return out


# ---- quality (issue 17: each KV precision against a float32 cache)
QUALITY_BOUNDS = {"bfloat16": (0.0005, None), "float16": (0.0005, None), "int8": (0.0005, 0.985),
                  "int4": (0.0047, 0.97)}  # mean KL (nats), top-1 agreement


def quality_targets(r: dict) -> list[Target]:
    out = []
    for kv, (kl, top1) in QUALITY_BOUNDS.items():
        c = r.get(f"engine KV {kv} vs float32")
        if not isinstance(c, dict):
            continue
        why = f"{c['positions']} positions, perplexity {fmt(c['perplexity_quantized'])} vs {fmt(c['perplexity_full'])}"
        out.append(_check(f"KV {kv}: mean KL vs a float32 cache (nats)", c["mean_kl"], "<=", kl, "", why))
        if top1 is not None:
            out.append(_check(f"KV {kv}: top-1 agreement with a float32 cache", c["top1_agreement"], ">=", top1, "",
                              why, pct_units=True))
    return out


# ---- serve (issue 19: against llama-server, the serving path's cost, greedy equality)
SERVE_PEER_CLIENTS = (1, 4, 16)


def serve_targets(r: dict) -> list[Target]:
    streams, peer = r.get("streams", {}), r.get("peer") or {}
    theirs = peer.get("streams") or {}
    absent = f"llama-server {peer.get('status', 'absent: not run')}" if not theirs else ""
    one, sixteen, four = (streams.get(f"batched/{n}", {}) for n in (1, 16, 4))
    out = _serve_ratio_targets(one, sixteen, four, r.get("turns"))
    for n in SERVE_PEER_CLIENTS:
        ours, peers = streams.get(f"batched/{n}", {}), theirs.get(f"batched/{n}", {})
        out.append(_check(f"serve: aggregate tok/s vs llama-server, {n} client(s)",
                          _div(ours.get("tok_s"), peers.get("tok_s")), ">=", 1.0, "x",
                          absent or f"{fmt(ours.get('tok_s'))} vs {fmt(peers.get('tok_s'))} tokens/s"))
    for n in SERVE_PEER_CLIENTS:
        ours, peers = streams.get(f"batched/{n}", {}), theirs.get(f"batched/{n}", {})
        out.append(_check(f"serve: p99 inter-token latency vs llama-server, {n} client(s) (kvscope / llama-server)",
                          _div(ours.get("itl_p99_ms"), peers.get("itl_p99_ms")), "<=", 1.0, "x",
                          absent or f"{fmt(ours.get('itl_p99_ms'))} vs {fmt(peers.get('itl_p99_ms'))} ms"))
    out.append(_serving_path_target(one, r.get("engine_step_ms"), r.get("turns")))
    equal, total = _greedy_counts(r.get("greedy") or {})
    peer_equal, peer_total = _greedy_counts(peer.get("greedy") or {})
    out.append(_check("serve: concurrent greedy streams equal to the same request alone", _div(equal, total), ">=",
                      1.0, "", f"kvscope {equal} of {total} streams at 4-16 clients; llama-server "
                      + (f"{peer_equal} of {peer_total}" if peer_total else "not run"), pct_units=True))
    return out


def _serve_ratio_targets(one: dict, sixteen: dict, four: dict, turns: dict | None) -> list[Target]:
    """16 streams / 1 and p99 at 4 clients / the one-client median: from the runs in turns where the bench made
    them (both sides in the same minutes), the table's runs (minutes apart) kept in the why; else from the table."""
    throughput, p99 = _div(sixteen.get("tok_s"), one.get("tok_s")), _div(four.get("itl_p99_ms"), one.get("itl_p50_ms"))
    apart = ""
    if turns:
        apart = f"; the table's runs, minutes apart: {fmt(throughput)}x and {fmt(p99)}x"
        one, sixteen, four = (turns["clients"].get(str(n), {}) for n in (1, 16, 4))
        throughput, p99 = (_div(sixteen.get("tok_s"), one.get("tok_s")),
                           _div(four.get("itl_p99_ms"), one.get("itl_p50_ms")))
    where = f" ({turns['rounds']} rounds in turns)" if turns else ""
    return [_check("serve: aggregate tok/s, 16 streams / 1 stream", throughput, ">=", 6.0, "x",
                   f"{fmt(sixteen.get('tok_s'))} vs {fmt(one.get('tok_s'))} tokens/s{where}{apart}"),
            _check("serve: p99 inter-token latency with 4 clients / single-client median", p99, "<=", 2.0, "x",
                   f"{fmt(four.get('itl_p99_ms'))} ms vs {fmt(one.get('itl_p50_ms'))} ms{where}; one client alone: p99 "
                   f"{fmt(one.get('itl_p99_ms'))} ms, {fmt(_div(one.get('itl_p99_ms'), one.get('itl_p50_ms')))}x its "
                   f"own median{apart}")]


def _serving_path_target(one: dict, step: float | None, turns: dict | None) -> Target:
    """One client's inter-token p50 over the engine's own step: from the runs in turns where the engine's steps
    were timed between them, the table's figures kept in the why; else from the table's run and the step timed before
    and after the servers."""
    p50, apart = one.get("itl_p50_ms"), ""
    if turns and turns.get("engine_step_ms"):
        apart = f"; the table's run against the step timed before and after the servers: {fmt(_div(p50, step))}x"
        p50, step = turns["clients"].get("1", {}).get("itl_p50_ms"), turns["engine_step_ms"]
    return _check("serve: one client's inter-token p50 / the engine's own decode step", _div(p50, step), "<=", 1.1,
                  "x", f"{fmt(p50)} ms between tokens vs a {fmt(step)} ms step in process: the rest is the serving "
                  f"path (scheduler, detokenizing, HTTP, the client){apart}")


def _greedy_counts(greedy: dict) -> tuple[int, int]:
    """Equal streams and all streams over the concurrent runs (more than one client)."""
    runs = [g for n, g in greedy.items() if int(n) > 1]
    return sum(g["equal"] for g in runs), sum(g["total"] for g in runs)


EVALUATORS: dict[str, Callable[[dict], list[Target]]] = {
    "step": step_targets, "serve": serve_targets, "quality": quality_targets,
    "decode": decode_targets, "prefill": prefill_targets, "turns": turns_targets, "concurrency": concurrency_targets,
}


def evaluate(results: dict) -> list[Target]:
    out = []
    for name, fn in EVALUATORS.items():
        if isinstance(results.get(name), dict) and "error" not in results[name]:
            out += fn(results[name])
    return out


def summarize(targets: list[Target]) -> str:
    if not targets:
        return ""
    rows = [[t.name, t.goal, _show(t), t.verdict, t.margin, t.why] for t in targets]
    return section("Targets", "Ratios from this run; PASS/MISS against the goals of the benchmark issue.",
                   md_table(["target", "goal", "measured", "verdict", "margin", "why"], rows))


def _show(t: Target) -> str:
    if t.measured is None:
        return "-"
    return pct(t.measured) if "%" in t.goal else f"{fmt(t.measured)}x"
