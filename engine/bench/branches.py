"""branches: what only blocks give. N conversations share a long system prompt; each asks a question, then
branches (a regenerated reply, an edited question) while every earlier branch stays alive, as in a chat app that
lets you flip between versions of a reply. Both caches fork the branch from its parent and cut it to the common
prefix. 'contiguous' holds one buffer per sequence: the fork copies the parent's buffer. 'paged' maps the same
physical blocks into the branch's block table (reference counts): the shared prefix is held once, and only the
partly filled block the branch writes into is copied (copy-on-write)."""

from __future__ import annotations

import time

from engine.bench import report
from engine.bench.common import BenchContext, bar, make_cache, median, ratio, using_cache
from engine.chat import Conversation, Message, prompt_ids
from engine.config import SamplingParams
from engine.events import DoneEvent

CONVERSATIONS, QUICK_CONVERSATIONS = 4, 3
BRANCHES = 2  # per conversation, alternately a regenerated reply and an edited question
SYSTEM_TOKENS, QUICK_SYSTEM_TOKENS = 1024, 512
USER_TOKENS = 40
REPLY_TOKENS, QUICK_REPLY_TOKENS = 48, 24
EDIT_SUFFIX = " Answer in one sentence."
STRATEGIES = ("contiguous", "paged")
KINDS = ("first conversation", "new conversation", "regenerate", "edit")

METHOD = (
    "A system prompt of real English (the Python docs' topic pages) is shared by every conversation. Each "
    "conversation asks a ~40-token question (greedy reply), then branches: a regenerated reply (sampled, seeded) "
    "and a branch with an edited question, each a new sequence while the earlier ones stay alive. Each branch "
    "(and each new conversation, from the first one) is forked from its parent and cut to the common prefix: "
    "'contiguous' (prefix reuse on, reservations sized to prompt + reply, its most frugal setting) copies the "
    "parent's buffer; 'paged' (block 16) shares the parent's blocks and copies only the partly filled block it "
    "writes into (tokens copied: the tokens of those blocks). TTFT includes the fork. Memory = bytes holding "
    "live tokens with every branch alive (KVStats.bytes_used); "
    "reserved = what the cache allocated (contiguous: its reservations; paged: its pool)."
)


def run(ctx: BenchContext, quick: bool) -> dict:
    n = QUICK_CONVERSATIONS if quick else CONVERSATIONS
    reply = QUICK_REPLY_TOKENS if quick else REPLY_TOKENS
    system, questions = texts(ctx, QUICK_SYSTEM_TOKENS if quick else SYSTEM_TOKENS, n)
    results = {s: Branching(ctx, s, system, reply).run(questions) for s in bar(STRATEGIES, "branches")}
    c, p = results["contiguous"], results["paged"]
    return {
        "method": METHOD, "conversations": n, "branches_per_conversation": BRANCHES, "reply_tokens": reply,
        "system_tokens": len(ctx.engine.tokenizer.encode(system, add_special_tokens=False)),
        **results,
        "contiguous_over_paged": {"bytes_used": ratio(c["bytes_used"], p["bytes_used"]),
                                  "prefill_tokens": ratio(c["prefill_tokens"], p["prefill_tokens"]),
                                  **{f"ttft {k}": ratio(c["ttft_ms"][k], p["ttft_ms"][k]) for k in KINDS}},
    }


def texts(ctx: BenchContext, system_tokens: int, n: int) -> tuple[str, list[str]]:
    """A system prompt of about system_tokens tokens and n questions of about USER_TOKENS, from the text."""
    ids, decode = ctx.text_ids(), ctx.engine.tokenizer.decode
    stride = (len(ids) - system_tokens) // (n + 1)
    starts = [system_tokens + (i + 1) * stride for i in range(n)]
    return decode(ids[:system_tokens]).strip(), [decode(ids[s:s + USER_TOKENS]).strip() for s in starts]


class Branching:
    """One strategy's run: every conversation and branch kept alive until the figures are read."""

    def __init__(self, ctx: BenchContext, strategy: str, system: str, reply_tokens: int):
        self.ctx, self.strategy, self.system, self.reply_tokens = ctx, strategy, system, reply_tokens
        self.alive: list[Conversation] = []
        self.rows: list[dict] = []
        self.copied_tokens = 0

    def run(self, questions: list[str]) -> dict:
        e = self.ctx.engine
        capacity = self._capacity(questions)
        n_seqs = len(questions) * (1 + BRANCHES)
        contiguous = self.strategy == "contiguous"
        cache = make_cache(e, self.strategy, pool_tokens=n_seqs * capacity,
                           max_context=capacity if contiguous else None)
        with using_cache(e, cache):
            cache.prefix_reuse = True
            for i, question in enumerate(questions):
                root = self._turn("first conversation" if i == 0 else "new conversation",
                                  Conversation(system_prompt=self.system), question, self.alive[0] if i else None)
                for b in range(BRANCHES):
                    self._branch(root, b, seed=1000 * i + b)
            result = self._figures(cache)
            for conv in self.alive:
                e.forget(conv)
        return result

    def _capacity(self, questions: list[str]) -> int:
        tok = self.ctx.engine.tokenizer
        longest = max(len(prompt_ids(tok, self.system, [Message("user", q + EDIT_SUFFIX)])) for q in questions)
        return longest + self.reply_tokens + 16

    def _branch(self, root: Conversation, b: int, seed: int) -> None:
        if b % 2 == 0:  # regenerate: the same question, another reply
            conv = Conversation(system_prompt=self.system, messages=list(root.messages))
            self._turn("regenerate", conv, None, root, seed)
        else:  # edit: a changed question, a new reply
            conv = Conversation(system_prompt=self.system, messages=list(root.messages[:-2]))
            self._turn("edit", conv, root.messages[-2].content + EDIT_SUFFIX, root, seed)

    def _turn(self, kind: str, conv: Conversation, message: str | None, parent: Conversation | None,
              seed: int | None = None) -> Conversation:
        fork_ms = self._fork(parent, conv) if parent is not None else 0.0
        params = SamplingParams(temperature=0 if seed is None else 0.8, seed=seed, stop_token_ids=(-1,),
                                max_new_tokens=self.reply_tokens)
        done = [ev for ev in self.ctx.engine.generate(conv, message, params) if isinstance(ev, DoneEvent)][0]
        if parent is not None and self.strategy == "paged":  # copy-on-write of the block cut in the middle
            self.copied_tokens += done.prefix_hit_tokens % self.ctx.engine.cache.block_size
        self.alive.append(conv)
        self.rows.append({"kind": kind, "ttft_ms": fork_ms + done.ttft_ms, "fork_ms": fork_ms,
                          "prompt_tokens": done.n_prompt_tokens, "prefix_hit_tokens": done.prefix_hit_tokens})
        return conv

    def _fork(self, parent: Conversation, conv: Conversation) -> float:
        """The branch starts holding what its parent holds: contiguous copies the buffer, paged shares blocks."""
        e = self.ctx.engine
        start = time.perf_counter()
        e.cache.fork(parent.seq_id, conv.seq_id)
        e.synchronize()
        if self.strategy == "contiguous":
            self.copied_tokens += e.cache.tokens_held(conv.seq_id)
        return (time.perf_counter() - start) * 1000

    def _figures(self, cache) -> dict:
        kv = cache.stats()
        live = sum(cache.tokens_held(c.seq_id) for c in self.alive)
        return {
            "branches": len(self.alive), "live_tokens": live, "bytes_used": kv.bytes_used,
            "bytes_allocated": kv.bytes_allocated, "bytes_theoretical": kv.bytes_theoretical,
            "prefill_tokens": sum(r["prompt_tokens"] - r["prefix_hit_tokens"] for r in self.rows),
            "copied_tokens": self.copied_tokens, "shared_blocks": shared_blocks(cache),
            "ttft_ms": {k: median(r["ttft_ms"] for r in self.rows if r["kind"] == k) for k in KINDS},
            "turns": self.rows,
        }


def shared_blocks(cache) -> int:
    """Physical blocks mapped into more than one sequence's block table (0 for contiguous)."""
    pool = getattr(cache, "pool", None)
    if pool is None:
        return 0
    return len({b for seq in cache.seqs.values() for b in seq.blocks if pool.refcount(b) > 1})


def summarize(r: dict) -> str:
    c, p = r["contiguous"], r["paged"]
    ratios = r["contiguous_over_paged"]
    rows = [["sequences alive", c["branches"], p["branches"], None],
            ["live tokens", c["live_tokens"], p["live_tokens"], None],
            ["memory holding them (MiB)", c["bytes_used"] / 2**20, p["bytes_used"] / 2**20,
             ratios["bytes_used"]],
            ["memory reserved (MiB)", c["bytes_allocated"] / 2**20, p["bytes_allocated"] / 2**20, None],
            ["tokens prefilled", c["prefill_tokens"], p["prefill_tokens"], ratios["prefill_tokens"]],
            ["tokens copied", c["copied_tokens"], p["copied_tokens"], None],
            ["blocks shared", c["shared_blocks"], p["shared_blocks"], None]]
    rows += [[f"TTFT, {k} (ms, median)", c["ttft_ms"][k], p["ttft_ms"][k], ratios[f"ttft {k}"]] for k in KINDS]
    table = report.md_table(["", "contiguous", "paged", "contiguous / paged"], rows)
    return report.section(
        f"branches: {r['conversations']} conversations x {1 + r['branches_per_conversation']} branches over a "
        f"{r['system_tokens']}-token system prompt", r["method"], table)


def plot(r: dict, path) -> None:
    fig, (ax1, ax2) = report.figure_for_rows(len(KINDS), 2, width=5.5)
    names = list(STRATEGIES)
    ax1.barh(range(len(names)), [r[s]["bytes_used"] / 2**20 for s in names], color=[report.color(s) for s in names])
    ax1.set(title="KV memory with every branch alive", xlabel="MiB holding live tokens")
    report.categories(ax1, names)
    height = 0.8 / len(names)
    for i, s in enumerate(names):
        ys = [j + (i - (len(names) - 1) / 2) * height for j in range(len(KINDS))]
        ax2.barh(ys, [r[s]["ttft_ms"][k] for k in KINDS], height, label=s, color=report.color(s))
    ax2.set(title="time to first token (median)", xlabel="ms", xscale="log")
    report.plain_log_ticks(ax2.xaxis)
    report.categories(ax2, list(KINDS))
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3, axis="x")
    report.legend_outside(ax2)
    report.save(fig, path)
