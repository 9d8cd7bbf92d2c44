"""Soak, on the tiny random model: a 100-turn chat under every strategy (long enough to be trimmed at the context
limit again and again) and 200 new-chat cycles in the window. After a warm-up, nothing grows: the blocks in use
return to their baseline and the others are free or cached, the live Python objects and the threads are as many
as before, and resident memory grows by at most 5%."""

from __future__ import annotations

import gc

import psutil
import pytest
from PySide6.QtCore import QCoreApplication, QEvent
from test_app_support import HANG_GUARD_MS, dispose, make_settings, open_window, send

from engine.config import CACHE_STRATEGIES, SamplingParams
from engine.events import DoneEvent

TURNS = 100
WARM_UP_TURNS = 20
CYCLES = 200
WARM_UP_CYCLES = 20
CONTEXT = 256  # tokens: the chat outgrows it after a dozen turns, so trimming runs on most turns
MAX_RSS_GROWTH = 0.05
SYSTEM = "You are a helpful assistant."
QUESTIONS = ("What is a KV cache?", "Why page it?", "And quantize it?", "How big is a block?", "Thanks!")


def reply(engine, conv, text: str) -> DoneEvent:
    params = SamplingParams(temperature=0.0, max_new_tokens=4, stop_token_ids=(10**9,))
    return [e for e in engine.generate(conv, text, params) if isinstance(e, DoneEvent)][0]


def live_objects() -> int:
    QCoreApplication.sendPostedEvents(None, QEvent.Type.DeferredDelete.value)  # widgets deleted later: now
    gc.collect()
    return len(gc.get_objects())


def process_figures() -> tuple[int, int, int]:
    """(live Python objects, operating-system threads, resident bytes)."""
    objects = live_objects()
    process = psutil.Process()
    return objects, process.num_threads(), process.memory_info().rss


def assert_flat(warm: tuple[int, int, int], end: tuple[int, int, int], repeats: int, what: str) -> None:
    """No object per repeat (a leak of one object a turn fails), no thread, at most 5% more resident memory."""
    assert end[0] - warm[0] < repeats, f"{end[0] - warm[0]} more live Python objects after {what}"
    assert end[1] <= warm[1], f"{end[1] - warm[1]} more threads after {what}"
    assert end[2] <= warm[2] * (1 + MAX_RSS_GROWTH), f"resident memory grew {end[2] / warm[2] - 1:.1%} in {what}"


def blocks(engine) -> tuple[int, int, int, int]:
    s = engine.kv_stats()
    return s.num_blocks_used, s.num_blocks_free, s.num_blocks_cached, s.num_blocks


@pytest.mark.parametrize("cache", CACHE_STRATEGIES)
def test_a_100_turn_chat_leaks_no_block_object_thread_or_memory(tiny_engine_factory, cache):
    engine = tiny_engine_factory(cache, 16, max_context=CONTEXT)
    used_before = blocks(engine)[0]
    warm_up = engine.new_conversation(SYSTEM)  # the same chat, shorter: caches, allocator, template
    for i in range(WARM_UP_TURNS):
        reply(engine, warm_up, QUESTIONS[i % len(QUESTIONS)])
    engine.forget(warm_up)
    del warm_up
    warm = process_figures()

    conv = engine.new_conversation(SYSTEM)
    for i in range(TURNS):
        done = reply(engine, conv, QUESTIONS[i % len(QUESTIONS)])
        assert done.n_prompt_tokens + done.n_generated_tokens <= CONTEXT
        used, free, cached, total = blocks(engine)
        assert used <= -(-CONTEXT // 16) and used + free + cached == total
    assert conv.context_start > TURNS  # trimmed at the context limit over and over
    engine.forget(conv)
    del conv, done

    used, free, cached, total = blocks(engine)
    assert used == used_before and free + cached == total
    assert_flat(warm, process_figures(), TURNS, f"{TURNS} turns")


def test_200_new_chat_cycles_in_the_window_return_to_the_same_state(qtbot, tmp_path, tiny_engine_factory):
    """Each cycle answers the same question in a new chat: after every cycle the pool is exactly as after the
    first (the same blocks used, free and cached), and after the warm-up nothing grows. View -> Clear plots ends
    each cycle: the plots keep every chat's curves until cleared, on purpose."""
    window = open_window(qtbot, make_settings(tmp_path), tiny_engine_factory("paged", 16), 2, show=False)
    try:
        run_cycles(qtbot, window)
    finally:
        dispose(window)


def run_cycles(qtbot, window) -> None:
    def cycle() -> tuple[int, int, int, int]:
        send(qtbot, window, "What is a KV cache?")
        window.new_chat()
        window.metrics.clear()  # the plots keep every chat's curves on purpose (~0.2 MB a chat) until cleared
        conversations = window.conversations  # the sidebar keeps every chat on purpose: delete the one just left
        for entry in conversations.store.entries():
            if entry.id != conversations.current:
                assert conversations.delete(entry.id)
        qtbot.waitUntil(lambda: not window.snapshot.get("messages"), timeout=HANG_GUARD_MS)
        return blocks(window.client.worker.engine)

    baseline = cycle()
    assert baseline[0] == 0
    for _ in range(WARM_UP_CYCLES - 1):
        assert cycle() == baseline
    warm = process_figures()
    for _ in range(CYCLES - WARM_UP_CYCLES):
        assert cycle() == baseline
    assert window.chat.messages == []
    assert_flat(warm, process_figures(), CYCLES - WARM_UP_CYCLES, f"{CYCLES} new-chat cycles")
