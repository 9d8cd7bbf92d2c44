"""Engine.generate over whole conversations: prefix reuse, regenerate, edit, cancel, trimming, errors, switching."""

from __future__ import annotations

import threading

import pytest

from engine.chat import Message, PromptTooLong, prompt_ids
from engine.config import SamplingParams
from engine.events import DoneEvent, StepEvent
from tests.engine_helpers import Turn, greedy, one_torch_thread, run_turn

STRATEGIES = ["none", "contiguous", "paged", "paged-int8"]
SYSTEM = "You are a terse test assistant."


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_torch_thread():
        yield


def common_prefix_length(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def messages_of(conv) -> list[tuple[str, str]]:
    return [(m.role, m.content) for m in conv.messages]


def spy_on_prompts(engine) -> list[list[int]]:
    """Record the token ids of every prompt the engine asks its cache to prepare."""
    seen: list[list[int]] = []
    prepare = engine.cache.prepare

    def recording(seq_id, token_ids, *args, **kwargs):
        seen.append(list(token_ids))
        return prepare(seq_id, token_ids, *args, **kwargs)

    engine.cache.prepare = recording
    return seen


# ---- the events of a turn -------------------------------------------------------------------------------


def test_a_turn_is_prefill_steps_then_one_decode_step_per_token_then_done(tiny_engine_factory):
    engine = tiny_engine_factory("paged")
    conv = engine.new_conversation(SYSTEM)
    turn = run_turn(engine, conv, "Hello", greedy(12))
    done = turn.done
    assert [ev.phase for ev in turn.steps] == ["prefill"] + ["decode"] * 11
    assert turn.prefill[0].pos == done.n_prompt_tokens - 1 and turn.prefill[0].n_tokens == done.n_prompt_tokens
    assert [ev.pos for ev in turn.decode] == list(range(done.n_prompt_tokens, done.n_prompt_tokens + 11))
    assert all(ev.n_tokens == 1 for ev in turn.decode)
    assert (done.n_generated_tokens, done.finish_reason, done.strategy) == (12, "length", "paged")
    assert "".join(ev.text for ev in turn.steps) == done.text
    assert messages_of(conv) == [("user", "Hello"), ("assistant", done.text)]


def test_a_stop_token_ends_the_reply_and_is_not_part_of_it(tiny_engine_factory):
    engine = tiny_engine_factory("paged")
    free = run_turn(engine, engine.new_conversation(), "Hello", greedy(12)).tokens
    stop = free[4]
    n_before = free.index(stop)
    params = SamplingParams(temperature=0, repetition_penalty=1.0, max_new_tokens=12, stop_token_ids=(stop,))
    turn = run_turn(engine, engine.new_conversation(), "Hello", params)
    assert turn.done.finish_reason == "stop"
    assert turn.tokens == free[: n_before + 1]  # the last step produced the stop token
    assert turn.done.n_generated_tokens == n_before


# ---- prefix reuse: second turn, regenerate, edit --------------------------------------------------------


@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_a_second_turn_prefills_only_its_new_tokens(tiny_engine_factory, tokenizer, block_size):
    engine = tiny_engine_factory("paged", block_size)
    conv = engine.new_conversation(SYSTEM)
    first = run_turn(engine, conv, "What is a cache?", greedy(10))
    first_prompt = prompt_ids(tokenizer, SYSTEM, conv.messages[:1])
    second = run_turn(engine, conv, "And a block?", greedy(10))
    hit = second.done.prefix_hit_tokens
    assert hit >= first.done.n_prompt_tokens == len(first_prompt)  # the whole first prompt is reused
    assert second.prefill[0].prefix_hit_tokens == hit
    assert second.prefill[0].n_tokens == second.done.n_prompt_tokens - hit
    assert sum(ev.n_tokens for ev in second.prefill) == second.done.n_prompt_tokens - hit


def test_regenerate_reuses_everything_but_the_last_prompt_token_and_replaces_the_reply(tiny_engine_factory):
    engine = tiny_engine_factory("paged", 16)
    conv = engine.new_conversation(SYSTEM)
    first = run_turn(engine, conv, "Tell me a fact.", greedy(10))
    again = run_turn(engine, conv, None, greedy(10))
    assert again.done.prefix_hit_tokens == again.done.n_prompt_tokens - 1 == first.done.n_prompt_tokens - 1
    assert [ev.n_tokens for ev in again.prefill] == [1]
    assert again.tokens == first.tokens  # greedy: the same reply again
    assert messages_of(conv) == [("user", "Tell me a fact."), ("assistant", again.done.text)]


@pytest.mark.parametrize("block_size", [1, 8, 16])
def test_regenerate_under_paged_int8_reuses_the_prefix(tiny_engine_factory, block_size):
    engine = tiny_engine_factory("paged-int8", block_size)
    conv = engine.new_conversation(SYSTEM)
    run_turn(engine, conv, "Tell me a fact.", greedy(20))
    again = run_turn(engine, conv, None, greedy(20))
    assert again.done.prefix_hit_tokens == again.done.n_prompt_tokens - 1
    assert again.done.n_generated_tokens == 20


def test_editing_the_last_user_message_reuses_the_common_prefix(tiny_engine_factory, tokenizer):
    engine = tiny_engine_factory("paged", 16)
    conv = engine.new_conversation(SYSTEM)
    run_turn(engine, conv, "What is the capital of France?", greedy(8))
    old_prompt = prompt_ids(tokenizer, SYSTEM, conv.messages[:1])
    conv.messages.pop()  # the reply
    conv.messages.pop()  # the message being edited (what the app's edit-and-resend does)
    edited = run_turn(engine, conv, "What is the capital of Spain?", greedy(8))
    new_prompt = prompt_ids(tokenizer, SYSTEM, [Message("user", "What is the capital of Spain?")])
    assert edited.done.prefix_hit_tokens == common_prefix_length(old_prompt, new_prompt) > 0
    assert edited.prefill[0].n_tokens == len(new_prompt) - edited.done.prefix_hit_tokens
    assert [m.role for m in conv.messages] == ["user", "assistant"]
    assert conv.messages[0].content == "What is the capital of Spain?"


def test_regenerate_with_no_user_message_is_an_error_that_changes_nothing(tiny_engine_factory):
    engine = tiny_engine_factory("paged")
    conv = engine.new_conversation(SYSTEM)
    with pytest.raises(ValueError, match="nothing to regenerate"):
        run_turn(engine, conv, None, greedy(4))
    assert conv.messages == []


def test_conversations_keep_their_own_cached_tokens_when_interleaved(tiny_engine_factory):
    engine = tiny_engine_factory("paged", 16)
    a, b = engine.new_conversation(SYSTEM), engine.new_conversation("Another system prompt, quite different.")
    run_turn(engine, a, "First question from A.", greedy(8))
    run_turn(engine, b, "First question from B.", greedy(8))
    a2 = run_turn(engine, a, "Second question from A.", greedy(8))
    assert a2.done.prefix_hit_tokens > a2.done.n_prompt_tokens // 2
    used = engine.kv_stats().num_blocks_used
    engine.forget(a)
    assert engine.kv_stats().num_blocks_used < used
    assert engine.cache.tokens_held(a.seq_id) == 0 < engine.cache.tokens_held(b.seq_id)


# ---- cancellation ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("cache", STRATEGIES)
def test_cancel_from_inside_the_event_loop_stops_after_the_current_step(tiny_engine_factory, cache):
    engine = tiny_engine_factory(cache)
    conv = engine.new_conversation(SYSTEM)
    events = []
    for ev in engine.generate(conv, "Count to one hundred.", greedy(50)):
        events.append(ev)
        if isinstance(ev, StepEvent) and ev.phase == "decode" and len(events) == 4:
            engine.cancel()
    turn = Turn(events)
    assert len(turn.decode) == 3  # no step ran after the cancel
    assert turn.done.finish_reason == "cancelled"
    assert turn.done.n_generated_tokens == 4  # the prefill's token and three decode steps' tokens
    assert messages_of(conv)[-1] == ("assistant", turn.done.text)


def test_cancel_from_another_thread_stops_a_generation_running_on_a_worker_thread(tiny_engine_factory):
    engine = tiny_engine_factory("paged")
    conv = engine.new_conversation(SYSTEM)
    events, paused, resume = [], threading.Event(), threading.Event()

    def worker():
        for ev in engine.generate(conv, "Count to one hundred.", greedy(50)):
            events.append(ev)
            if len(events) == 3:
                paused.set()
                resume.wait()

    thread = threading.Thread(target=worker)
    thread.start()
    assert paused.wait(timeout=60)
    engine.cancel()  # the GUI thread asks to stop while the worker is between two steps
    resume.set()
    thread.join(timeout=60)
    turn = Turn(events)
    assert len(turn.steps) == 3
    assert turn.done.finish_reason == "cancelled"


def test_a_stale_cancel_does_not_stop_the_next_turn(tiny_engine_factory):
    engine = tiny_engine_factory("paged")
    engine.cancel()
    turn = run_turn(engine, engine.new_conversation(), "Hello", greedy(6))
    assert (turn.done.finish_reason, turn.done.n_generated_tokens) == ("length", 6)


def test_the_turn_after_a_cancelled_one_runs_normally(tiny_engine_factory):
    engine = tiny_engine_factory("paged")
    conv = engine.new_conversation(SYSTEM)
    for ev in engine.generate(conv, "One", greedy(30)):
        if isinstance(ev, StepEvent):
            engine.cancel()
        if isinstance(ev, DoneEvent):
            assert ev.finish_reason == "cancelled"
    turn = run_turn(engine, conv, "Two", greedy(6))
    assert (turn.done.finish_reason, turn.done.n_generated_tokens) == ("length", 6)
    assert turn.done.prefix_hit_tokens > 0


# ---- the context limit ---------------------------------------------------------------------------------

LIMIT = 128


def chat_until_trimmed(engine, conv, turns: int = 8) -> list[Turn]:
    return [run_turn(engine, conv, f"Message number {i}, please answer briefly.", greedy(16))
            for i in range(turns)]


@pytest.mark.parametrize("cache", STRATEGIES)
def test_trimming_drops_the_oldest_turns_but_never_the_system_prompt(tiny_engine_factory, tokenizer, cache):
    engine = tiny_engine_factory(cache, 16, max_context=LIMIT)
    prompts = spy_on_prompts(engine)
    conv = engine.new_conversation(SYSTEM)
    turns = chat_until_trimmed(engine, conv)
    trims = [t for turn in turns for t in turn.trims]
    assert trims, "eight turns of ~35 tokens overflow a 128-token context"
    assert all(t.context_limit == LIMIT and t.dropped_messages >= 1 for t in trims)
    assert conv.context_start == sum(t.dropped_messages for t in trims)
    assert len(conv.messages) == 16  # trimming hides messages from the model; the conversation keeps them
    last_prompt = tokenizer.decode(prompts[-1])
    assert SYSTEM in last_prompt
    assert "Message number 0," not in last_prompt and "Message number 7," in last_prompt
    for turn in turns:
        assert all(ev.pos < LIMIT for ev in turn.steps)
        assert turn.done.n_prompt_tokens + turn.done.n_generated_tokens <= LIMIT


def test_a_trim_event_counts_the_tokens_it_dropped(tiny_engine_factory):
    engine = tiny_engine_factory("paged", 16, max_context=LIMIT)
    trims = [t for turn in chat_until_trimmed(engine, engine.new_conversation(SYSTEM)) for t in turn.trims]
    assert trims and all(t.dropped_tokens > 0 for t in trims)


@pytest.mark.parametrize("cache", STRATEGIES)
def test_generation_stops_at_the_context_limit(tiny_engine_factory, cache):
    engine = tiny_engine_factory(cache, 16, max_context=LIMIT)
    turn = run_turn(engine, engine.new_conversation(SYSTEM), "Write forever.", greedy(1000))
    assert turn.done.finish_reason == "length"
    assert turn.done.n_prompt_tokens + turn.done.n_generated_tokens == LIMIT
    assert max(ev.pos for ev in turn.steps) < LIMIT


def test_a_message_longer_than_the_context_is_refused_and_changes_nothing(tiny_engine_factory):
    engine = tiny_engine_factory("paged", 16, max_context=LIMIT)
    conv = engine.new_conversation(SYSTEM)
    run_turn(engine, conv, "Hi", greedy(4))
    before = conv.to_dict()
    with pytest.raises(PromptTooLong):
        run_turn(engine, conv, "word " * 400, greedy(4))
    assert conv.to_dict() == before


# ---- errors leave the engine usable and the conversation untouched -------------------------------------


@pytest.mark.parametrize("cache", ["paged", "paged-int8"])
def test_a_full_block_pool_ends_the_reply_keeping_it_and_the_earlier_turns(tiny_engine_factory, cache):
    engine = tiny_engine_factory(cache, 16, pool_tokens=64)
    conv = engine.new_conversation(SYSTEM)
    first = run_turn(engine, conv, "Hi", greedy(4))
    assert first.done.n_prompt_tokens + 4 < 64
    earlier = [m.content for m in conv.messages]
    long = run_turn(engine, conv, "Now write a very long answer.", greedy(200))
    assert long.done.finish_reason == "budget" and 0 < long.done.n_generated_tokens < 200  # kept, as a stop keeps it
    assert [m.content for m in conv.messages[:2]] == earlier
    assert conv.messages[-1].content == long.done.text
    assert engine.cache.tokens_held(conv.seq_id) <= 64
    retry = run_turn(engine, conv, "And a short one.", greedy(4))  # the oldest turns leave to make room
    assert retry.done.finish_reason == "length"


def test_an_error_in_the_model_restores_the_conversation_and_the_engine_recovers(tiny_engine_factory,
                                                                                 monkeypatch):
    engine = tiny_engine_factory("paged", 16)
    conv = engine.new_conversation(SYSTEM)
    run_turn(engine, conv, "Hi", greedy(4))
    before = conv.to_dict()
    forward = engine.model.forward
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("simulated device error")
        return forward(*args, **kwargs)

    monkeypatch.setattr(engine.model, "forward", failing)
    with pytest.raises(RuntimeError, match="simulated"):
        run_turn(engine, conv, "Go on", greedy(10))
    assert conv.to_dict() == before
    monkeypatch.undo()
    turn = run_turn(engine, conv, "Go on", greedy(10))
    assert turn.done.n_generated_tokens == 10


# ---- switching strategy between turns -------------------------------------------------------------------


def test_switching_strategy_between_turns_keeps_the_conversation_going(tiny_engine_factory):
    engine = tiny_engine_factory("paged", 16)
    reference = tiny_engine_factory("contiguous")
    conv = engine.new_conversation(SYSTEM)
    for i, (cache, block_size) in enumerate([("paged", 16), ("contiguous", None), ("none", None),
                                             ("paged", 64), ("paged-int8", 8), ("paged", 1)]):
        engine.set_cache(cache, block_size)
        assert engine.kv_stats().strategy == engine.cache_strategy == cache
        assert engine.kv_stats().bytes_used == 0
        history = [Message(m.role, m.content) for m in conv.messages]
        turn = run_turn(engine, conv, f"Turn {i}: say something.", greedy(8))
        assert turn.done.strategy == cache
        assert turn.done.prefix_hit_tokens == 0  # a new cache holds nothing yet
        if cache != "paged-int8":
            fresh = reference.new_conversation(SYSTEM)
            fresh.messages = history
            assert turn.tokens == run_turn(reference, fresh, f"Turn {i}: say something.", greedy(8)).tokens
    assert engine.block_size == 1 and engine.kv_stats().block_size == 1
    assert len(conv.messages) == 12


# ---- isolation between sequences that share blocks ------------------------------------------------------

LONG_SYSTEM = "You are a careful assistant. You answer in one short sentence and never use lists or tables."


def a_then_b_then_a(engine, with_b: bool) -> list[int]:
    """Conversation A's second reply, with or without conversation B sharing and rewriting A's blocks."""
    a = engine.new_conversation(LONG_SYSTEM)
    run_turn(engine, a, "Tell me about caches, please, in some detail.", greedy(8))
    if with_b:
        b = engine.new_conversation(LONG_SYSTEM)
        first = run_turn(engine, b, "Tell me about caches, please, in some detail.", greedy(8))
        assert first.done.prefix_hit_tokens >= 32  # B shares A's full prompt blocks
        b.messages.clear()
        edited = run_turn(engine, b, "Tell me about dogs, please.", greedy(8))  # diverges inside a shared block
        assert 0 < edited.done.prefix_hit_tokens < first.done.n_prompt_tokens
    return run_turn(engine, a, "And then?", greedy(16)).tokens


@pytest.mark.parametrize("cache", ["paged", "paged-int8"])
@pytest.mark.parametrize("block_size", [8, 16])
def test_a_sequence_rewriting_a_shared_block_never_changes_the_other_sequences_tokens(tiny_engine_factory,
                                                                                      cache, block_size):
    alone = a_then_b_then_a(tiny_engine_factory(cache, block_size), with_b=False)
    assert a_then_b_then_a(tiny_engine_factory(cache, block_size), with_b=True) == alone


@pytest.mark.parametrize("cache", ["paged", "paged-int8"])
def test_evicted_prefix_blocks_are_never_served_stale(tiny_engine_factory, cache):
    engine = tiny_engine_factory(cache, 16, pool_tokens=128)
    fresh = tiny_engine_factory(cache, 16, pool_tokens=128)
    expected = run_turn(fresh, fresh.new_conversation(LONG_SYSTEM), "Question one.", greedy(16)).tokens
    first = engine.new_conversation(LONG_SYSTEM)
    run_turn(engine, first, "Question one.", greedy(16))
    engine.forget(first)  # its full blocks stay cached for reuse...
    assert engine.kv_stats().num_blocks_cached > 0
    other = engine.new_conversation("A different system prompt that shares nothing with the first one at all.")
    run_turn(engine, other, "Something else entirely, and rather long, to fill the pool up.", greedy(40))
    engine.forget(other)  # ...until another conversation needs the room
    again = run_turn(engine, engine.new_conversation(LONG_SYSTEM), "Question one.", greedy(16))
    assert again.done.prefix_hit_tokens < 32  # not both of its full prompt blocks survived
    assert again.tokens == expected
