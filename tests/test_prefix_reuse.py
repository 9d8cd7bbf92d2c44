"""Prefix reuse is its own switch, apart from paging: with it on, every caching strategy keeps a conversation's
cache between turns and computes only what changed; with it off, every turn prefills the whole history again.
Either way the replies are the same tokens."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import greedy, run_turn

from engine.bench import branches, turns
from engine.config import ConfigError, EngineConfig
from engine.kv.paged import common_prefix_length

SYSTEM = "You are a terse assistant."
CACHING = ["contiguous", "paged", "paged-int8"]


def three_turns(engine, messages=("What is a cache?", "And a block?", "Why page it?")):
    conv = engine.new_conversation(SYSTEM)
    return conv, [run_turn(engine, conv, m, greedy(8)) for m in messages]


# ---- the switch ---------------------------------------------------------------------------------------------


def test_prefix_reuse_is_on_by_default_and_must_be_a_bool():
    assert EngineConfig().prefix_reuse is True
    with pytest.raises(ConfigError, match="prefix_reuse must be True or False"):
        EngineConfig(prefix_reuse="off")


@pytest.mark.parametrize("strategy", ["none", *CACHING])
def test_the_engine_gives_its_cache_the_switch_and_keeps_it_across_a_strategy_change(tiny_engine_factory,
                                                                                      strategy):
    engine = tiny_engine_factory("paged", prefix_reuse=False)
    assert engine.cache.prefix_reuse is False
    engine.set_cache(strategy)
    assert engine.cache.prefix_reuse is False and engine.config.prefix_reuse is False
    engine.set_prefix_reuse(True)
    assert engine.cache.prefix_reuse is True and engine.config.prefix_reuse is True


@pytest.mark.parametrize("command", ["chat", "gui", "bench"])
def test_every_command_takes_prefix_reuse_on_or_off(command):
    from main import build_parser

    parser = build_parser()
    assert parser.parse_args([command, "--prefix-reuse", "off"]).prefix_reuse == "off"
    assert parser.parse_args([command, "--prefix-reuse", "on"]).prefix_reuse == "on"
    with pytest.raises(SystemExit):
        parser.parse_args([command, "--prefix-reuse", "maybe"])


# ---- with reuse: each strategy computes only the new tokens -------------------------------------------------


@pytest.mark.parametrize("strategy", CACHING)
def test_with_reuse_a_later_turn_prefills_only_what_follows_the_held_history(tiny_engine_factory, strategy):
    engine = tiny_engine_factory(strategy, 16)
    _, (first, second, third) = three_turns(engine)
    for before, turn in ((first, second), (second, third)):
        hit = turn.done.prefix_hit_tokens
        assert hit >= before.done.n_prompt_tokens  # the whole previous prompt, and most of its reply, is kept
        assert sum(ev.n_tokens for ev in turn.prefill) == turn.done.n_prompt_tokens - hit


@pytest.mark.parametrize("strategy", CACHING)
def test_reuse_changes_no_token_of_any_reply(tiny_engine_factory, strategy):
    _, with_reuse = three_turns(tiny_engine_factory(strategy, 16))
    _, without = three_turns(tiny_engine_factory(strategy, 16, prefix_reuse=False))
    assert [t.tokens for t in with_reuse] == [t.tokens for t in without]


def test_contiguous_regenerate_keeps_all_but_the_last_prompt_token_in_the_same_reservation(tiny_engine_factory):
    engine = tiny_engine_factory("contiguous")
    conv = engine.new_conversation(SYSTEM)
    first = run_turn(engine, conv, "Tell me a fact.", greedy(10))
    reservation = engine.cache.reservations[conv.seq_id]
    again = run_turn(engine, conv, None, greedy(10))
    assert engine.cache.reservations[conv.seq_id] is reservation  # no new reservation, no copy
    assert again.done.prefix_hit_tokens == first.done.n_prompt_tokens - 1
    assert [ev.n_tokens for ev in again.prefill] == [1]
    assert again.tokens == first.tokens


def test_contiguous_edit_keeps_the_longest_common_prefix_and_cuts_the_rest(tiny_engine_factory, tokenizer):
    engine = tiny_engine_factory("contiguous")
    conv = engine.new_conversation(SYSTEM)
    run_turn(engine, conv, "What is the capital of France?", greedy(8))
    held = list(engine.cache.reservations[conv.seq_id].tokens)
    conv.messages[-2:] = []  # what the app's edit-and-resend does
    edited = run_turn(engine, conv, "What is the capital of Spain?", greedy(8))
    new_prompt = edited.done.n_prompt_tokens
    reservation = engine.cache.reservations[conv.seq_id]
    assert edited.done.prefix_hit_tokens == common_prefix_length(held, reservation.tokens) > 0
    assert edited.prefill[0].n_tokens == new_prompt - edited.done.prefix_hit_tokens
    assert reservation.length == len(reservation.tokens) == new_prompt + 8 - 1  # the last token is never fed


def test_contiguous_starts_a_new_reservation_when_the_held_one_is_too_small(tiny_engine_factory):
    engine = tiny_engine_factory("contiguous")
    cache = engine.cache
    cache.prepare(1, list(range(10, 30)), reserve_tokens=24)
    engine.step([1], [list(range(10, 30))])
    assert cache.prepare(1, list(range(10, 60))) == 0  # 50 tokens do not fit 24: a new, full reservation
    assert cache.reservations[1].capacity == engine.max_context


# ---- without reuse: every turn prefills the whole history ---------------------------------------------------


@pytest.mark.parametrize("strategy", CACHING)
def test_without_reuse_every_turn_prefills_its_whole_prompt(tiny_engine_factory, strategy):
    engine = tiny_engine_factory(strategy, 16, prefix_reuse=False)
    conv, turns_ = three_turns(engine)
    for turn in turns_:
        assert turn.done.prefix_hit_tokens == 0
        assert sum(ev.n_tokens for ev in turn.prefill) == turn.done.n_prompt_tokens
    assert engine.cache.tokens_held(conv.seq_id) == turns_[-1].done.n_prompt_tokens + 8 - 1


@pytest.mark.parametrize("strategy", ["paged", "paged-int8"])
def test_without_reuse_paged_neither_keeps_a_sequence_nor_matches_the_prefix_cache(tiny_engine_factory, strategy):
    engine = tiny_engine_factory(strategy, 8, prefix_reuse=False)
    pool = engine.cache.pool
    conv, _ = three_turns(engine)
    own = len(engine.cache.seqs[conv.seq_id].blocks)
    assert pool.num_used == own  # earlier turns' blocks were released, not leaked
    other = engine.new_conversation(SYSTEM)  # same system prompt: its blocks are cached, but not matched
    assert run_turn(engine, other, "What is a cache?", greedy(4)).done.prefix_hit_tokens == 0


def test_switching_reuse_on_between_turns_reuses_from_the_next_turn(tiny_engine_factory):
    engine = tiny_engine_factory("contiguous", prefix_reuse=False)
    conv = engine.new_conversation(SYSTEM)
    first = run_turn(engine, conv, "Hi.", greedy(4))
    engine.set_prefix_reuse(True)
    second = run_turn(engine, conv, "Again.", greedy(4))
    assert second.done.prefix_hit_tokens >= first.done.n_prompt_tokens


# ---- the benchmarks that separate reuse from paging ---------------------------------------------------------


class TinyBench:
    """The benchmarks' context on the tiny engine: the real tokenizer and real English text."""

    def __init__(self, engine):
        from engine.bench.common import BenchContext

        self.ctx = BenchContext(engine, None, True)


def test_turns_benchmark_separates_reuse_from_paging(tiny_engine_factory):
    r = turns.run(TinyBench(tiny_engine_factory("paged")).ctx, quick=True)
    assert set(r["series"]) == set(turns.SERIES)
    off, on = r["series"]["contiguous, no reuse"], r["series"]["contiguous, reuse"]
    shared = r["series"]["paged, prefix cache across conversations"]
    paged = r["series"]["paged, reuse"]
    assert all(t["prefix_hit_tokens"] == 0 for t in off)
    for series in (on, paged, shared):
        assert all(t["prefix_hit_tokens"] > 0 for t in series[1:])
    assert [t["prompt_tokens"] for t in on] == [t["prompt_tokens"] for t in off] == \
        [t["prompt_tokens"] for t in paged]
    # reuse computes the new tokens only: far fewer prefilled tokens than a full re-prefill
    computed = {name: sum(t["prompt_tokens"] - t["prefix_hit_tokens"] for t in s) for name, s in r["series"].items()}
    assert computed["contiguous, reuse"] * 2 < computed["contiguous, no reuse"]
    assert computed["paged, reuse"] == computed["contiguous, reuse"]


def test_branches_benchmark_shares_blocks_where_contiguous_copies(tiny_engine_factory):
    r = branches.run(TinyBench(tiny_engine_factory("paged")).ctx, quick=True)
    cont, paged = r["contiguous"], r["paged"]
    assert cont["branches"] == paged["branches"] == r["conversations"] * (1 + r["branches_per_conversation"])
    # the same tokens are live in both; paged holds the shared prefix once
    assert cont["live_tokens"] == paged["live_tokens"]
    assert paged["bytes_used"] * 2 < cont["bytes_used"]
    assert paged["shared_blocks"] > 0 and cont["shared_blocks"] == 0
    # both fork and keep the exact common prefix: the same tokens are computed; contiguous copies its parent's
    # tokens, paged at most the partly filled block of each fork (copy-on-write)
    assert cont["prefill_tokens"] == paged["prefill_tokens"]
    forks = len(paged["turns"]) - 1
    assert cont["copied_tokens"] > cont["live_tokens"] // 2 and paged["copied_tokens"] <= 15 * forks

# ---- fork: a branch of a conversation ------------------------------------------------------------------------


def continue_with(engine, seq_id: int, prompt: list[int]) -> torch.Tensor:
    held = engine.cache.prepare(seq_id, prompt)
    return engine.step([seq_id], [prompt[held:]])[0]  # logits of the last prompt token


@pytest.mark.parametrize("strategy", ["contiguous", "paged"])
def test_a_forked_branch_continues_exactly_like_a_fresh_sequence_and_leaves_its_parent_alone(tiny_engine_factory,
                                                                                             strategy):
    engine = tiny_engine_factory(strategy, 16)
    parent, branch = list(range(10, 60)), list(range(10, 45)) + [7, 8, 9]  # the branch diverges at token 35
    continue_with(engine, 1, parent)
    engine.cache.fork(1, 2)
    assert engine.cache.tokens_held(2) == len(parent)

    got = continue_with(engine, 2, branch)
    assert engine.cache.tokens_held(2) == len(branch) and engine.cache.tokens_held(1) == len(parent)
    fresh = tiny_engine_factory(strategy, 16)
    torch.testing.assert_close(got, continue_with(fresh, 9, branch), rtol=1e-4, atol=1e-5)
    # the parent's keys and values are untouched: its next token is what it was
    torch.testing.assert_close(engine.step([1], [[5]])[0], fresh_step(tiny_engine_factory(strategy, 16), parent),
                               rtol=1e-4, atol=1e-5)


def fresh_step(engine, prompt: list[int]) -> torch.Tensor:
    continue_with(engine, 1, prompt)
    return engine.step([1], [[5]])[0]


def test_a_paged_fork_shares_full_blocks_and_copies_only_the_partly_filled_one(tiny_engine_factory):
    engine = tiny_engine_factory("paged", 16)
    cache, pool = engine.cache, engine.cache.pool
    continue_with(engine, 1, list(range(10, 60)))  # 50 tokens: 3 full blocks and one of 2
    used = pool.num_used
    cache.fork(1, 2)
    assert pool.num_used == used and [pool.refcount(b) for b in cache.seqs[1].blocks] == [2, 2, 2, 2]

    continue_with(engine, 2, list(range(10, 50)) + [3])  # keeps 40 tokens: 2 full blocks and 8 of the third
    parent, child = cache.seqs[1].blocks, cache.seqs[2].blocks
    assert child[:2] == parent[:2]  # shared
    assert child[2] != parent[2] and len(child) == 3  # the block it writes into was copied first
    assert [pool.refcount(b) for b in parent] == [2, 2, 1, 1]
    pool.check_invariants()
    cache.release(1)
    cache.release(2)
    assert pool.num_used == 0
    pool.check_invariants()


@pytest.mark.parametrize("kv", ["int8", "int4"])
def test_a_quantized_pool_forks_its_blocks_and_copies_its_window(tiny_engine_factory, kv):
    engine = tiny_engine_factory("paged", 16, kv_dtype=kv, kv_residual=0)  # blocks hold codes once full
    prompt = list(range(10, 30))
    continue_with(engine, 1, prompt)  # one full (quantized) block and 4 tokens in the window
    engine.cache.fork(1, 2)
    assert engine.cache.seqs[2].blocks == engine.cache.seqs[1].blocks
    assert engine.cache.pool.refcount(engine.cache.seqs[1].blocks[0]) == 2
    assert torch.equal(engine.cache.state.seqs[2].window, engine.cache.state.seqs[1].window)
    branch = continue_with(engine, 2, prompt + [7] * 16)  # fills the shared partial block: copied on write
    parent = continue_with(engine, 1, prompt + [7] * 16)
    assert torch.equal(branch, parent)  # the same state continues the same way
    assert engine.cache.seqs[1].blocks[1] != engine.cache.seqs[2].blocks[1]
