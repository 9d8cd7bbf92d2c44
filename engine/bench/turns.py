"""turns: time to first token over a long conversation. 'paged' keeps the conversation's blocks between turns
(the prefix cache), so each turn prefills only the new message; 'contiguous' starts a new reservation and
prefills the whole history again every turn."""

from __future__ import annotations

from engine.bench import report
from engine.bench.common import BenchContext, bar, make_cache, ratio, using_cache
from engine.config import SamplingParams
from engine.events import DoneEvent

TURNS, QUICK_TURNS = 20, 6
USER_TOKENS, REPLY_TOKENS = 60, 100

METHOD = (
    "User messages are ~60-token passages of real English (the Python docs' topic pages). 'paged' generates "
    "every reply in full (greedy, 100 tokens, stop token disabled). 'contiguous' then replays the same "
    "conversation: each turn it prefills the identical history (the user messages and paged's replies) and "
    "generates 1 token, since time to first token depends only on the prompt. TTFT = DoneEvent.ttft_ms."
)


def run(ctx: BenchContext, quick: bool) -> dict:
    n = QUICK_TURNS if quick else TURNS
    messages = user_messages(ctx, n)
    paged, replies = paged_turns(ctx, messages)
    contiguous = contiguous_turns(ctx, messages, replies)
    return {
        "method": METHOD,
        "turns": n,
        "paged": paged,
        "contiguous": contiguous,
        "last_over_second": {"paged": ratio(paged[-1]["ttft_ms"], paged[1]["ttft_ms"]),
                             "contiguous": ratio(contiguous[-1]["ttft_ms"], contiguous[1]["ttft_ms"])},
        "last_turn": n,
    }


def user_messages(ctx: BenchContext, n: int) -> list[str]:
    """n passages of about USER_TOKENS tokens each, taken from spread-out places in the text."""
    ids = ctx.text_ids()
    stride = len(ids) // n
    return [ctx.engine.tokenizer.decode(ids[i * stride:i * stride + USER_TOKENS]).strip() for i in range(n)]


def _turn(ctx: BenchContext, conv, message: str, max_new_tokens: int) -> DoneEvent:
    params = SamplingParams(temperature=0, max_new_tokens=max_new_tokens, stop_token_ids=(-1,))
    done = [ev for ev in ctx.engine.generate(conv, message, params) if isinstance(ev, DoneEvent)]
    return done[0]


def _record(turn: int, done: DoneEvent) -> dict:
    return {"turn": turn, "ttft_ms": done.ttft_ms, "prompt_tokens": done.n_prompt_tokens,
            "prefix_hit_tokens": done.prefix_hit_tokens, "generated_tokens": done.n_generated_tokens}


def paged_turns(ctx: BenchContext, messages: list[str]) -> tuple[list[dict], list[str]]:
    e = ctx.engine
    pool = 2 * len(messages) * (USER_TOKENS + REPLY_TOKENS + 64)
    rows, replies = [], []
    with using_cache(e, make_cache(e, "paged", pool_tokens=pool)):
        conv = e.new_conversation()
        for i, message in enumerate(bar(messages, "turns paged"), 1):
            rows.append(_record(i, _turn(ctx, conv, message, REPLY_TOKENS)))
            replies.append(conv.messages[-1].content)
        e.forget(conv)
    return rows, replies


def contiguous_turns(ctx: BenchContext, messages: list[str], replies: list[str]) -> list[dict]:
    e = ctx.engine
    rows = []
    with using_cache(e, make_cache(e, "contiguous")):
        conv = e.new_conversation()
        for i, (message, reply) in enumerate(bar(list(zip(messages, replies)), "turns contiguous"), 1):
            rows.append(_record(i, _turn(ctx, conv, message, 1)))
            conv.messages[-1].content = reply  # the history paged's run had
        e.forget(conv)
    return rows


def summarize(r: dict) -> str:
    rows = [[p["turn"], p["prompt_tokens"], p["prefix_hit_tokens"], p["ttft_ms"], c["ttft_ms"],
             ratio(c["ttft_ms"], p["ttft_ms"])] for p, c in zip(r["paged"], r["contiguous"])]
    table = report.md_table(["turn", "prompt tokens", "paged prefix hit", "paged TTFT (ms)",
                             "contiguous TTFT (ms)", "contiguous / paged"], rows)
    growth = r["last_over_second"]
    return report.section(
        f"turns: time to first token over {r['turns']} turns", r["method"], table,
        f"TTFT turn {r['last_turn']} / turn 2: paged {report.fmt(growth['paged'])}x, "
        f"contiguous {report.fmt(growth['contiguous'])}x.",
    )


def plot(r: dict, path) -> None:
    fig, (ax,) = report.figure(1, width=7)
    for name in ("paged", "contiguous"):
        ax.plot([t["turn"] for t in r[name]], [t["ttft_ms"] for t in r[name]], "o-", label=name,
                color=report.color(name))
    ax.set(title="time to first token per turn", xlabel="turn", ylabel="TTFT (ms)")
    ax.grid(alpha=0.3)
    ax.legend()
    report.save(fig, path)
