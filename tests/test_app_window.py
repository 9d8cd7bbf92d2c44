"""The chat window driving a real (tiny) Engine through the worker thread: streaming, stop, regenerate, edit,
strategy switches, plots and the block map."""

from __future__ import annotations

import pytest
from PySide6.QtCore import Qt
from test_app_support import HANG_GUARD_MS, Catch, greedy, run_turn, send, worker_messages

from app.file_dialogs import SCREEN_SHARE
from app.main_window import MIN_SIZE
from engine.kv.base import BLOCK_OWN


def test_the_window_opens_within_the_screen_it_is_on(window):
    """1440 x 900 where the screen has room (tests/test_app_xvfb.py: 1600 x 1000); else 90% of its free area, never
    under the minimum size (the offscreen screen here is 800 x 800, a small laptop's scale)."""
    room = window.screen().availableGeometry()
    assert window.width() <= max(MIN_SIZE[0], int(room.width() * SCREEN_SHARE))
    assert window.height() <= int(room.height() * SCREEN_SHARE)
    assert (window.width(), window.height()) >= MIN_SIZE


def test_sending_a_message_streams_tokens_into_the_view(qtbot, window):
    turn = send(qtbot, window, "Hello there")

    assert not turn.errors
    done = turn.done[0]
    assert done.n_generated_tokens == 12 and done.finish_reason == "length"
    assert len(turn.tokens) >= 6  # the reply arrived piece by piece
    assert "".join(turn.tokens) == done.text
    assert window.chat.message_texts() == [("user", "Hello there"), ("assistant", done.text)]
    assert worker_messages(window) == window.chat.message_texts()


def test_enter_in_the_input_box_sends_and_the_button_turns_into_stop(qtbot, window):
    window.chat.input.setPlainText("Hi from the keyboard")

    with Catch(qtbot, window.client.signals.finished, timeout=120_000):
        qtbot.keyClick(window.chat.input, "\r")
        assert window.chat.send_button.text() == "Stop"
    qtbot.waitUntil(lambda: window.chat.send_button.text() == "Send", timeout=10_000)
    assert window.chat.messages[0].text == "Hi from the keyboard"


def test_stop_ends_a_long_reply_within_a_step_and_keeps_the_partial_text(qtbot, window):
    window.sampling_override = greedy(max_new_tokens=2000)

    def start_then_stop():
        window.send("Write a very long story")
        qtbot.waitUntil(lambda: len(window.chat.messages[-1].text) > 10, timeout=60_000)
        qtbot.mouseClick(window.chat.send_button, Qt.MouseButton.LeftButton)

    turn = run_turn(qtbot, window, start_then_stop)

    done = turn.done[0]
    assert done.finish_reason == "cancelled"
    assert 0 < done.n_generated_tokens < 2000
    assert window.chat.messages[-1].text == done.text
    assert worker_messages(window)[-1] == ("assistant", done.text)
    again = send(qtbot, window, "Still there?")  # the app keeps working
    assert again.done[0].finish_reason == "length"


def test_regenerate_reuses_the_prompt_prefix_from_the_cache(qtbot, window):
    first = send(qtbot, window, "Tell me about caches")
    prompt_tokens = first.done[0].n_prompt_tokens

    turn = run_turn(qtbot, window, window.chat.messages[-1].regenerate_button.click)

    prefill = [s for s in turn.steps if s.phase == "prefill"]
    assert prefill[0].prefix_hit_tokens >= 16  # whole blocks of the prompt were not recomputed
    assert turn.done[0].prefix_hit_tokens == prefill[0].prefix_hit_tokens
    assert turn.done[0].n_prompt_tokens == prompt_tokens
    assert [role for role, _ in window.chat.message_texts()] == ["user", "assistant"]
    assert worker_messages(window) == window.chat.message_texts()


def test_editing_the_last_user_message_resends_it_and_reuses_the_system_prompt_prefix(qtbot, window):
    send(qtbot, window, "What is a KV cache?")
    user = window.chat.messages[0]
    assert not user.edit_button.isHidden()
    user.start_editing()
    user.editor.setPlainText("What is a paged KV cache?")

    turn = run_turn(qtbot, window, user.resend_button.click)

    assert turn.done[0].prefix_hit_tokens >= 16
    assert window.chat.message_texts()[0] == ("user", "What is a paged KV cache?")
    assert worker_messages(window) == window.chat.message_texts()
    assert len(worker_messages(window)) == 2


def test_switching_strategy_between_turns_makes_the_next_turn_use_it(qtbot, window):
    first = send(qtbot, window, "First turn")
    assert {s.strategy for s in first.steps} == {"paged"}

    window.menus.strategies["contiguous"].trigger()
    second = send(qtbot, window, "Second turn")

    assert {s.strategy for s in second.steps} == {"contiguous"}
    assert second.done[0].strategy == "contiguous"
    assert window.settings.cache_strategy == "contiguous"
    assert "contiguous" in window.status.text("strategy")
    assert {run.strategy for run in window.metrics.log.runs} == {"paged", "contiguous"}


def test_a_strategy_chosen_during_a_reply_applies_from_the_next_turn(qtbot, window):
    def send_then_switch():
        window.send("A turn")
        window.menus.strategies["paged-int8"].trigger()

    during = run_turn(qtbot, window, send_then_switch)
    after = send(qtbot, window, "Another turn")

    assert {s.strategy for s in during.steps} == {"paged"}
    assert {s.strategy for s in after.steps} == {"paged-int8"}


def test_the_plots_receive_one_point_per_step_with_the_engines_figures(qtbot, window):
    turn = send(qtbot, window, "Plot me")
    window.metrics.refresh()

    rows = window.metrics.log.rows
    assert len(rows) == len(turn.steps)
    for row, step in zip(rows, turn.steps):
        assert row[:4] == (step.strategy, step.phase, step.pos, step.n_tokens)
        assert row[6:9] == (step.kv.bytes_allocated, step.kv.bytes_used, step.kv.bytes_theoretical)
    decode = [s for s in turn.steps if s.phase == "decode"]
    x, y = window.metrics.curve("paged", "decode")
    assert list(x) == [s.pos for s in decode]
    assert list(y) == pytest.approx([s.latency_ms for s in decode])
    x, _ = window.metrics.curve("paged", "allocated")
    assert len(x) == len(turn.steps)


def test_the_block_map_reflects_the_pool(qtbot, window):
    turn = send(qtbot, window, "Fill some blocks")
    qtbot.waitUntil(lambda: window.block_map.grid.states == turn.steps[-1].kv.block_states, timeout=HANG_GUARD_MS)

    states = window.block_map.grid.states
    kv = turn.steps[-1].kv
    assert window.block_map.showing_grid
    assert len(states) == kv.num_blocks
    assert states.count(BLOCK_OWN) == kv.num_blocks_used > 0
    assert f"{kv.num_blocks_used:,} used" in window.block_map.summary.text()

    window.menus.strategies["contiguous"].trigger()
    qtbot.waitUntil(lambda: not window.block_map.showing_grid, timeout=10_000)
    assert "has no blocks" in window.block_map.message.text()


def test_the_status_bar_shows_speed_first_token_time_context_and_kv_memory(qtbot, window):
    done = send(qtbot, window, "Status please").done[0]

    status = window.status
    assert status.text("model") == "tiny-random"
    assert status.text("device").startswith("cpu")
    assert status.text("speed") == f"{done.decode_tok_s:.1f} tok/s"
    assert status.text("ttft").startswith("first token")
    used = done.n_prompt_tokens + done.n_generated_tokens
    assert status.text("context").startswith(f"context {used:,} / {window.info.max_context:,}")
    assert status.text("kv").startswith("KV ") and "iB" in status.text("kv")
