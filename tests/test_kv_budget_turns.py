"""A turn at the KV budget (issue 20 part 5), on the tiny random model: the reply keeps what it generated (as Stop
does) and says why it ended; the sequence holds exactly its own blocks; earlier replies are untouched; the next
turn drops the oldest turns to make room, like the context limit, and says so; a message the budget cannot hold
at all is refused with what the user can do, and nothing is lost."""

from __future__ import annotations

import pytest

from engine.chat import PromptTooLong
from engine.config import SamplingParams
from engine.events import DoneEvent, TrimEvent
from engine.kv.base import BLOCK_OWN

BUDGET_BLOCKS = 16
NEVER_STOP = (10**9,)
SYSTEM = "You are a helpful assistant."


def budget_engine(tiny_engine_factory, blocks: int = BUDGET_BLOCKS, cache: str = "paged"):
    probe = tiny_engine_factory(cache=cache, block_size=16)
    mib = blocks * probe.cache.bytes_per_block() / 2**20
    return tiny_engine_factory(cache=cache, block_size=16, kv_budget_mib=mib)


def turn(engine, conv, text: str, max_new_tokens: int) -> tuple[DoneEvent, list[TrimEvent]]:
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, stop_token_ids=NEVER_STOP)
    events = list(engine.generate(conv, text, params))
    return events[-1], [e for e in events if isinstance(e, TrimEvent)]


def own_blocks(engine, conv) -> int:
    return engine.kv_stats(conv).block_states.count(BLOCK_OWN)


def assert_holds_exactly_its_own_blocks(engine, conv) -> None:
    kv = engine.kv_stats(conv)
    held = engine.cache.tokens_held(conv.seq_id)
    assert kv.num_blocks_used == own_blocks(engine, conv) == -(-held // kv.block_size)
    assert kv.num_blocks_used + kv.num_blocks_cached + kv.num_blocks_free == kv.num_blocks <= kv.num_blocks_budget


@pytest.mark.parametrize("cache", ["paged"])
def test_a_reply_that_reaches_the_budget_keeps_what_it_generated(tiny_engine_factory, cache):
    engine = budget_engine(tiny_engine_factory, cache=cache)
    conv = engine.new_conversation(SYSTEM)

    done, _ = turn(engine, conv, "Tell me a long story.", max_new_tokens=1000)

    assert done.finish_reason == "budget"
    assert 0 < done.n_generated_tokens < 1000
    assert conv.messages[-1].role == "assistant" and conv.messages[-1].content == done.text
    assert len(conv.messages[-1].token_ids) == done.n_generated_tokens
    assert done.n_prompt_tokens + done.n_generated_tokens > (BUDGET_BLOCKS - 1) * 16  # it filled the budget
    assert_holds_exactly_its_own_blocks(engine, conv)


def test_the_next_turn_drops_the_oldest_turns_to_make_room_and_never_touches_earlier_replies(tiny_engine_factory):
    engine = budget_engine(tiny_engine_factory)
    conv = engine.new_conversation(SYSTEM)
    first, _ = turn(engine, conv, "Hello.", max_new_tokens=40)
    second, _ = turn(engine, conv, "Tell me a long story.", max_new_tokens=1000)
    assert first.finish_reason == "length" and second.finish_reason == "budget"
    kept = [(m.role, m.content, m.token_ids) for m in conv.messages]

    third, trims = turn(engine, conv, "And then?", max_new_tokens=20)

    assert third.finish_reason == "length"
    assert len(trims) == 1 and trims[0].reason == "budget" and trims[0].dropped_messages >= 2
    assert trims[0].context_limit == BUDGET_BLOCKS * 16
    assert [(m.role, m.content, m.token_ids) for m in conv.messages[:4]] == kept  # the replies are all still there
    assert conv.context_start == trims[0].dropped_messages  # only the model's view moved on
    assert_holds_exactly_its_own_blocks(engine, conv)


def test_a_message_the_budget_cannot_hold_is_refused_saying_what_to_do_and_nothing_is_lost(tiny_engine_factory):
    engine = budget_engine(tiny_engine_factory, blocks=4)
    conv = engine.new_conversation(SYSTEM)
    turn(engine, conv, "Hi.", max_new_tokens=8)
    before = (conv.snapshot(), engine.cache.tokens_held(conv.seq_id))

    with pytest.raises(PromptTooLong, match=r"KV budget .* holds 64 tokens .*raise the KV budget"):
        turn(engine, conv, "word " * 200, max_new_tokens=8)

    assert (conv.snapshot(), engine.cache.tokens_held(conv.seq_id)) == before
    assert_holds_exactly_its_own_blocks(engine, conv)


def test_fifty_turns_under_a_small_budget_lose_no_reply_and_no_block(tiny_engine_factory):
    engine = budget_engine(tiny_engine_factory, blocks=6)  # 96 tokens: trimmed most turns, full every tenth
    conv = engine.new_conversation(SYSTEM)
    reasons = set()
    for i in range(50):
        done, _ = turn(engine, conv, f"Question {i}?", max_new_tokens=200 if i % 10 == 9 else 3)
        reasons.add(done.finish_reason)
        assert conv.messages[-1].role == "assistant" and conv.messages[-1].content == done.text
        assert done.n_generated_tokens > 0
        assert_holds_exactly_its_own_blocks(engine, conv)
    assert len(conv.messages) == 100  # every question and every reply is kept, though the model sees only the last
    assert reasons == {"length", "budget"}
    engine.forget(conv)
    kv = engine.kv_stats()
    assert kv.num_blocks_used == 0 and kv.num_blocks_free + kv.num_blocks_cached == kv.num_blocks
