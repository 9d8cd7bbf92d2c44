"""turns: time to first token over a long conversation, with prefix reuse apart from paging.

Four series: 'contiguous, no reuse' (a new reservation every turn: the whole history is prefilled again),
'contiguous, reuse' (the same reservation keeps the common prefix, as llama.cpp keeps one cache per slot),
'paged, reuse' (the conversation keeps its blocks) and 'paged, prefix cache across conversations' (every turn
is a new sequence, as from a stateless API client: only the pool's hashed blocks serve the history)."""

from __future__ import annotations

from engine.bench import report
from engine.bench.common import BenchContext, bar, make_cache, ratio, using_cache
from engine.chat import Conversation
from engine.config import SamplingParams
from engine.events import DoneEvent, StepEvent

TURNS, QUICK_TURNS = 20, 6
USER_TOKENS, REPLY_TOKENS = 60, 100
BASELINE = "contiguous, no reuse"
SERIES = (BASELINE, "contiguous, reuse", "paged, reuse", "paged, prefix cache across conversations")

METHOD = (
    "User messages are ~60-token passages of real English (the Python docs' topic pages); every reply is 100 "
    "greedy tokens (stop token disabled), identical under every cache. 'contiguous, no reuse' replays the "
    "conversation 'contiguous, reuse' generated (the same token ids), stopping each reply after its first "
    "token, since a cache rebuilt every turn makes time to first token depend only on the prompt. 'paged, "
    "prefix cache across "
    "conversations' starts a new sequence every turn and releases the previous one, so only the pool's hashed "
    "full blocks serve the history. TTFT = DoneEvent.ttft_ms."
)


def run(ctx: BenchContext, quick: bool) -> dict:
    n = QUICK_TURNS if quick else TURNS
    messages = user_messages(ctx, n)
    series = {}
    series["contiguous, reuse"], history = kept_turns(ctx, "contiguous", messages)
    series["paged, reuse"], _ = kept_turns(ctx, "paged", messages)
    series["paged, prefix cache across conversations"] = fresh_sequence_turns(ctx, messages)
    series[BASELINE] = rebuilt_turns(ctx, messages, history)
    series = {name: series[name] for name in SERIES}
    return {
        "method": METHOD,
        "turns": n,
        "series": series,
        "paged": series["paged, reuse"],
        "contiguous": series[BASELINE],
        "last_over_second": {name: ratio(s[-1]["ttft_ms"], s[1]["ttft_ms"]) for name, s in series.items()},
        "last_turn": n,
    }


def user_messages(ctx: BenchContext, n: int) -> list[str]:
    """n passages of about USER_TOKENS tokens each, taken from spread-out places in the text."""
    ids = ctx.text_ids()
    stride = len(ids) // n
    return [ctx.engine.tokenizer.decode(ids[i * stride:i * stride + USER_TOKENS]).strip() for i in range(n)]


def _turn(ctx: BenchContext, conv, message: str, first_token_only: bool = False) -> DoneEvent:
    """A greedy reply of REPLY_TOKENS tokens; first_token_only: cancelled after its first token (the same
    prompt, the same room kept for the reply, so the same trimming at the context limit)."""
    e = ctx.engine
    params = SamplingParams(temperature=0, max_new_tokens=REPLY_TOKENS, stop_token_ids=(-1,))
    done = None
    for ev in e.generate(conv, message, params):
        if first_token_only and isinstance(ev, StepEvent) and ev.token_id is not None:
            e.cancel()
        done = ev if isinstance(ev, DoneEvent) else done
    return done


def _record(turn: int, done: DoneEvent) -> dict:
    return {"turn": turn, "ttft_ms": done.ttft_ms, "prompt_tokens": done.n_prompt_tokens,
            "prefix_hit_tokens": done.prefix_hit_tokens, "generated_tokens": done.n_generated_tokens}


def _pool_tokens(messages: list[str]) -> int:
    return 2 * len(messages) * (USER_TOKENS + REPLY_TOKENS + 64)


def kept_turns(ctx: BenchContext, strategy: str, messages: list[str]) -> tuple[list[dict], Conversation]:
    """One conversation that keeps its sequence (and its cache, prefix reuse on) from turn to turn."""
    e = ctx.engine
    pool = _pool_tokens(messages) if strategy.startswith("paged") else None
    with using_cache(e, make_cache(e, strategy, pool_tokens=pool)) as cache:
        cache.prefix_reuse = True
        conv = e.new_conversation()
        rows = [_record(i, _turn(ctx, conv, m)) for i, m in enumerate(bar(messages, strategy), 1)]
        e.forget(conv)
    return rows, conv


def fresh_sequence_turns(ctx: BenchContext, messages: list[str]) -> list[dict]:
    """Every turn a new sequence with the whole history; the previous one is released (its blocks stay cached)."""
    e = ctx.engine
    rows, history = [], e.new_conversation()
    with using_cache(e, make_cache(e, "paged", pool_tokens=_pool_tokens(messages))) as cache:
        cache.prefix_reuse = True
        for i, message in enumerate(bar(messages, "paged, across conversations"), 1):
            conv = Conversation(system_prompt=history.system_prompt, messages=list(history.messages))
            rows.append(_record(i, _turn(ctx, conv, message)))
            e.forget(conv)
            history = conv
    return rows


def rebuilt_turns(ctx: BenchContext, messages: list[str], history: Conversation) -> list[dict]:
    """Without reuse: each turn prefills the same prompt as `history` had, from an empty cache."""
    e = ctx.engine
    rows = []
    with using_cache(e, make_cache(e, "contiguous")) as cache:
        cache.prefix_reuse = False
        conv = e.new_conversation(history.system_prompt)
        for i, message in enumerate(bar(messages, BASELINE), 1):
            rows.append(_record(i, _turn(ctx, conv, message, first_token_only=True)))
            conv.messages[-1] = history.messages[2 * i - 1]  # the reply, with its token ids, the kept run had
        e.forget(conv)
    return rows


def summarize(r: dict) -> str:
    series = r["series"]
    names = list(series)
    rows = [[turn["turn"], turn["prompt_tokens"]]
            + [s[k]["prefix_hit_tokens"] for s in (series["contiguous, reuse"],
                                                   series["paged, prefix cache across conversations"])]
            + [series[name][k]["ttft_ms"] for name in names]
            for k, turn in enumerate(series[BASELINE])]
    table = report.md_table(["turn", "prompt tokens", "reused (kept sequence)", "reused (across conversations)"]
                            + [f"{name} TTFT (ms)" for name in names], rows)
    growth = ", ".join(f"{name} {report.fmt(g)}x" for name, g in r["last_over_second"].items())
    return report.section(f"turns: time to first token over {r['turns']} turns", r["method"], table,
                          f"TTFT turn {r['last_turn']} / turn 2: {growth}.")


def plot(r: dict, path) -> None:
    fig, (ax,) = report.figure(1, width=7.5)
    for name, s in r.get("series", {"paged": r["paged"], "contiguous": r["contiguous"]}).items():
        report.line(ax, name, [t["turn"] for t in s], [t["ttft_ms"] for t in s])
    ax.set(title="time to first token per turn", xlabel="turn", ylabel="TTFT (ms)")
    report.integer_ticks(ax.xaxis)
    ax.grid(alpha=0.3)
    report.legend_outside(ax)
    report.save(fig, path)
