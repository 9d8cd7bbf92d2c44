"""speculative: decode tokens/s with and without prompt-lookup speculative decoding, per strategy, on an
input-grounded workload and on free chat.

The input-grounded workload is what prompt lookup is for: replies that quote or rework the prompt. The default
model paraphrases more than it copies, so candidate prompts (repeat, fix the typos in, add a docstring to a
passage or a function) are kept only when their plain greedy reply shares at least half of its word 4-grams with
the prompt; the overlap is reported beside each prompt's speed-up. Free chat asks open questions.
"""

from __future__ import annotations

import inspect
import shlex
import textwrap

from engine.bench import report
from engine.bench.common import (
    BenchContext,
    bar,
    make_cache,
    median,
    prefill,
    random_ids,
    ratio,
    status,
    timed_ms,
    using_cache,
)
from engine.config import SamplingParams, SpeculativeConfig
from engine.events import DoneEvent

STRATEGIES, QUICK_STRATEGIES = ("none", "contiguous", "paged", "paged-int8"), ("paged", "paged-int8")
REPLY_TOKENS, QUICK_REPLY_TOKENS, NONE_REPLY_TOKENS = 256, 128, 64
TINY_REPLY_TOKENS, TINY_CANDIDATES = 32, 4  # --tiny: every code path, on a random model
MIN_OVERLAP = 0.5
SPECULATION = SpeculativeConfig("lookup", max_draft_tokens=8)  # what the app's "prompt lookup" setting runs
FREE_CHAT = (
    "What should I think about before adopting a dog?",
    "Explain how a refrigerator keeps food cold.",
    "Give me three tips for learning a new language.",
    "Why is the sky blue?",
)
PLAIN_COLOR, SPEC_COLOR = "#7f7f7f", "#1f77b4"
FORWARD_WIDTHS, FORWARD_CONTEXT, FORWARD_REPEATS = (1, 3, 5, 9), 256, 7
TARGETS = {"input-grounded": 1.6, "free chat": 0.95}  # paged: speculative / plain decode tokens/s

METHOD = (
    "Greedy replies (temperature 0, no repetition penalty, the model's stop tokens) of at most REPLY tokens per "
    "prompt, each prompt run plain and then with prompt-lookup speculation (up to 8 draft tokens, adaptive: k "
    "follows the acceptance rate and speculation stands down for the rest of a reply when it does not pay), "
    "alternating so that both see the same machine load. Decode tokens/s = decode tokens / decode time "
    "(DoneEvent), summed over a workload's prompts; speed-up = speculative / plain, within this run. Each "
    "candidate input-grounded prompt (repeat, fix the typos in, or document a passage or a function) is kept "
    "only if its plain greedy reply shares >= 50% of its word 4-grams with the prompt (overlap). Both runs must "
    "produce the same tokens (checked)."
)


def run(ctx: BenchContext, quick: bool) -> dict:
    reply_tokens = TINY_REPLY_TOKENS if ctx.tiny else QUICK_REPLY_TOKENS if quick else REPLY_TOKENS
    strategies = QUICK_STRATEGIES if quick else STRATEGIES
    candidates = grounded_candidates(ctx, TINY_CANDIDATES if ctx.tiny else 8)
    free = list(FREE_CHAT[:1] if ctx.tiny else FREE_CHAT[:2] if quick else FREE_CHAT)
    results = {}
    for strategy in bar(strategies, "speculative strategies"):
        tokens = NONE_REPLY_TOKENS if strategy == "none" else reply_tokens  # 'none' reruns the whole context
        grounded = compare(ctx, strategy, candidates, tokens, min_overlap=MIN_OVERLAP)
        results[strategy] = {"input-grounded": summarise(grounded), "free chat": summarise(
            compare(ctx, strategy, free, tokens)), "forward_ms": forward_cost(ctx, strategy)}
    return {"method": METHOD.replace("REPLY", str(reply_tokens)), "strategies": list(strategies),
            "reply_tokens": reply_tokens, "min_overlap": MIN_OVERLAP, "candidates": len(candidates),
            "results": results, "targets": TARGETS,
            "weights": ctx.engine.weight_format}


# ---- the workload
def grounded_candidates(ctx: BenchContext, n: int) -> list[str]:
    """Prompts that ask to reproduce or lightly edit a passage of real text or code given in the prompt."""
    tok = ctx.engine.tokenizer
    ids = ctx.text_ids()
    stride = len(ids) // (n + 1)
    passages = [tok.decode(ids[i * stride: i * stride + 70]).strip() for i in range(1, n + 1)]
    code = [textwrap.dedent(inspect.getsource(f)) for f in (shlex.quote, textwrap.indent)]
    asks = ("Repeat the following text exactly, word for word:\n\n{}",
            "Fix any typos in this paragraph and write it out again in full:\n\n{}",
            "Add a one-line docstring to this Python function and write out the whole function:\n\n{}",
            "Copy this passage, then add one sentence at the end:\n\n{}")
    return [asks[i % len(asks)].format(code[i // len(asks) % 2] if i % len(asks) == 2 else p)
            for i, p in enumerate(passages)]


def word_4gram_overlap(reply: str, prompt: str) -> float:
    """The share of the reply's word 4-grams that also occur in the prompt."""
    def grams(text: str) -> set[tuple[str, ...]]:
        words = text.split()
        return {tuple(words[i:i + 4]) for i in range(len(words) - 3)}

    mine = grams(reply)
    return len(mine & grams(prompt)) / len(mine) if mine else 0.0


# ---- measuring
def reply(ctx: BenchContext, strategy: str, prompt: str, max_new_tokens: int,
          speculative: SpeculativeConfig) -> tuple[DoneEvent, list[int]]:
    e = ctx.engine
    params = SamplingParams(temperature=0, repetition_penalty=1.0, max_new_tokens=max_new_tokens,
                            speculative=speculative)
    with using_cache(e, make_cache(e, strategy, pool_tokens=4096)):
        conv = e.new_conversation()
        done = [ev for ev in e.generate(conv, prompt, params) if isinstance(ev, DoneEvent)][-1]
        e.forget(conv)
    return done, list(conv.messages[-1].token_ids)


def compare(ctx: BenchContext, strategy: str, prompts: list[str], max_new_tokens: int,
            min_overlap: float = 0.0) -> list[dict]:
    """Plain then speculative, per prompt; a prompt whose plain reply overlaps it less than min_overlap is
    dropped before its speculative run."""
    rows = []
    for prompt in bar(prompts, strategy):
        plain, plain_ids = reply(ctx, strategy, prompt, max_new_tokens, SpeculativeConfig())
        if word_4gram_overlap(plain.text, prompt) < min_overlap:
            continue
        spec, spec_ids = reply(ctx, strategy, prompt, max_new_tokens, SPECULATION)
        if spec_ids != plain_ids:
            status(f"speculative output differs from plain output ({strategy}): {prompt[:40]!r}")
        rows.append({
            "prompt": prompt[:60], "overlap": word_4gram_overlap(plain.text, prompt),
            "decode_tokens": plain.n_decode_tokens, "same_output": spec_ids == plain_ids,
            "plain_ms": 1000 * plain.n_decode_tokens / plain.decode_tok_s if plain.decode_tok_s else 0.0,
            "spec_ms": 1000 * spec.n_decode_tokens / spec.decode_tok_s if spec.decode_tok_s else 0.0,
            "speedup": ratio(spec.decode_tok_s, plain.decode_tok_s), "acceptance": spec.acceptance_rate,
            "tokens_per_forward": spec.tokens_per_forward, "drafted": spec.n_drafted,
        })
    return rows


def forward_cost(ctx: BenchContext, strategy: str) -> dict[int, float]:
    """Median ms of one forward of 1, 3, 5, 9 tokens at context FORWARD_CONTEXT (rolled back after each): what a
    verify step of k drafts costs against a plain step. Widths are interleaved so load drifts hit all alike."""
    e = ctx.engine
    ids = random_ids(FORWARD_CONTEXT + max(FORWARD_WIDTHS), e.model_config.vocab_size)
    samples: dict[int, list[float]] = {w: [] for w in FORWARD_WIDTHS}
    with using_cache(e, make_cache(e, strategy, pool_tokens=1024)) as cache:
        if not cache.keeps_kv:
            return {}
        cache.prepare(0, ids)
        prefill(e, 0, ids[:FORWARD_CONTEXT])
        for _ in range(FORWARD_REPEATS):
            for w in FORWARD_WIDTHS:
                tokens = ids[FORWARD_CONTEXT:FORWARD_CONTEXT + w]
                _, ms = timed_ms(lambda t=tokens: e.step([0], [t], all_logits=True), e.synchronize)
                cache.truncate(0, FORWARD_CONTEXT)
                samples[w].append(ms)
        cache.release(0)
    return {w: median(v) for w, v in samples.items()}


def summarise(rows: list[dict]) -> dict:
    tokens = sum(r["decode_tokens"] for r in rows)
    plain_s, spec_s = sum(r["plain_ms"] for r in rows) / 1000, sum(r["spec_ms"] for r in rows) / 1000
    plain, spec = ratio(tokens, plain_s), ratio(tokens, spec_s)
    drafted = sum(r["drafted"] for r in rows)
    accepted = sum(r["acceptance"] * r["drafted"] for r in rows)
    return {"prompts": rows, "decode_tokens": tokens, "plain_tok_s": plain, "spec_tok_s": spec,
            "speedup": ratio(spec, plain), "acceptance": ratio(accepted, drafted),
            "same_output": all(r["same_output"] for r in rows)}


# ---- report
def summarize(r: dict) -> str:
    rows = [[strategy, workload, len(s["prompts"]), s["decode_tokens"], s["plain_tok_s"], s["spec_tok_s"],
             s["speedup"], report.pct(s["acceptance"]), report.fmt(s["same_output"])]
            for strategy, by_workload in r["results"].items() for workload, s in _workloads(by_workload)]
    table = report.md_table(["strategy", "workload", "prompts", "decode tokens", "plain (tok/s)",
                             "speculative (tok/s)", "speed-up", "drafts accepted", "same output"], rows)
    per_prompt = [[strategy, workload, p["prompt"].split("\n")[0][:48], report.pct(p["overlap"]), p["speedup"],
                   report.pct(p["acceptance"]), p["tokens_per_forward"]]
                  for strategy, by_workload in r["results"].items() for workload, s in _workloads(by_workload)
                  for p in s["prompts"]]
    prompts = report.md_table(["strategy", "workload", "prompt", "4-gram overlap", "speed-up", "accepted",
                               "tokens / forward"], per_prompt)
    cost = [[strategy, *[f.get(str(w), f.get(w)) for w in FORWARD_WIDTHS],
             ratio(f.get(str(9), f.get(9)), f.get(str(1), f.get(1)))]
            for strategy, by in r["results"].items() if (f := by.get("forward_ms"))]
    costs = report.md_table(["strategy", *[f"{w} token{'s' * (w > 1)} (ms)" for w in FORWARD_WIDTHS],
                             "9 / 1"], cost) if cost else ""
    return report.section("speculative: prompt-lookup speculative decoding", r["method"], table, prompts,
                          f"One forward of w tokens at context {FORWARD_CONTEXT} (median of {FORWARD_REPEATS}): "
                          "a verify step of k drafts costs the (k+1)-token forward.", costs, targets_line(r))


def _workloads(by_workload: dict) -> list[tuple[str, dict]]:
    return [(w, s) for w, s in by_workload.items() if w != "forward_ms"]


def targets_line(r: dict) -> str:
    paged = r["results"].get("paged", {})
    parts = []
    for workload, goal in r["targets"].items():
        got = paged.get(workload, {}).get("speedup")
        verdict = "n/a" if got is None else ("PASS" if got >= goal else "MISS")
        parts.append(f"paged {workload}: {report.fmt(got)}x (target >= {goal}x) {verdict}")
    kept = len(paged.get("input-grounded", {}).get("prompts", []))
    return (f"Targets: {'; '.join(parts)}. {kept} of {r['candidates']} candidate prompts passed the overlap filter. "
            f"Model weights: {r.get('weights')}.")


def plot(r: dict, path) -> None:
    groups = [(f"{strategy}, {workload}", s) for strategy, by in r["results"].items() for workload, s in _workloads(by)]
    fig, (bars, scatter) = report.figure_for_rows(len(groups), 2, width=6.0)
    height = 0.38
    for y, (_label, s) in enumerate(groups):
        bars.barh(y - height / 2, s["plain_tok_s"] or 0, height, color=PLAIN_COLOR, label="plain" if y == 0 else "_")
        bars.barh(y + height / 2, s["spec_tok_s"] or 0, height, color=SPEC_COLOR,
                  label="prompt lookup" if y == 0 else "_")
    report.categories(bars, [label for label, _ in groups])
    bars.set(title="decode tokens/s", xlabel="tokens/s")
    for strategy, by_workload in r["results"].items():
        points = [p for _w, s in _workloads(by_workload) for p in s["prompts"] if p["speedup"]]
        scatter.plot([p["overlap"] for p in points], [p["speedup"] for p in points], "o", label=strategy,
                     color=report.color(strategy))
    scatter.axhline(1.0, color="#888888", lw=0.8)
    scatter.set_xlim(-0.02, 1.02)
    scatter.set(title="speed-up per prompt", xlabel="word 4-gram overlap of the reply with the prompt",
                ylabel="speculative / plain tokens/s")
    report.legend_outside(scatter, bars)
    report.save(fig, path)
