"""The window around the turns: files, failures that change nothing, responsiveness, closing mid-reply, the
scripted demo, and the real default model."""

from __future__ import annotations

import threading

import pytest
from test_app_support import (
    HANG_GUARD_MS,
    TURN_TIMEOUT_MS,
    Catch,
    StepProbe,
    dispose,
    greedy,
    make_settings,
    open_window,
    send,
    worker_messages,
)

from app.demo import run_demo
from app.dialogs import about_html
from app.main_window import MainWindow
from engine.kv.base import BLOCK_OWN


def test_save_then_open_restores_the_conversation_exactly(qtbot, window, tmp_path):
    send(qtbot, window, "First question")
    send(qtbot, window, "Second question")
    saved = dict(window.snapshot)
    path = str(tmp_path / "chat.json")
    assert window.actions_.save_file(path)

    with Catch(qtbot, window.client.signals.conversation, timeout=10_000):
        window.new_chat()
    assert window.chat.messages == [] and worker_messages(window) == []
    with Catch(qtbot, window.client.signals.conversation, timeout=10_000):
        assert window.actions_.open_file(path)

    assert window.snapshot == saved
    assert window.chat.message_texts() == worker_messages(window)
    assert len(window.chat.messages) == 4
    assert send(qtbot, window, "Third question").done[0].n_prompt_tokens > 0  # and the chat goes on


def test_opening_a_corrupt_file_shows_an_error_and_changes_nothing(qtbot, window, tmp_path):
    send(qtbot, window, "Keep me")
    before_view, before_worker = window.chat.message_texts(), dict(window.snapshot)
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "something-else"}')

    assert not window.actions_.open_file(str(bad))
    qtbot.wait(200)

    assert "is not a kvscope conversation" in window.chat.error_text
    assert window.chat.message_texts() == before_view and window.snapshot == before_worker


@pytest.mark.parametrize("model, reason", [("/no/such/model.gguf", "no such file or folder"),
                                           ("{tmp}", "config.json is missing")])
def test_a_bad_model_path_shows_an_error_and_keeps_the_model_and_the_conversation(qtbot, window, tmp_path,
                                                                                   model, reason):
    send(qtbot, window, "Keep me too")
    before = window.chat.message_texts()

    with Catch(qtbot, window.client.signals.error, timeout=60_000):
        window.load_model(model.format(tmp=tmp_path))

    assert reason in window.chat.error_text
    assert window.info.model_name == "tiny-random" and window.chat.input.isEnabled()
    assert window.chat.message_texts() == before
    assert window.settings.model_path is None
    assert send(qtbot, window, "Still works?").done[0].finish_reason == "length"


def test_a_failed_generation_shows_an_error_and_keeps_the_conversation(qtbot, window):
    send(qtbot, window, "A short question")
    before = window.chat.message_texts()
    too_long = "word " * 1500  # more than the tiny model's 1,024-token context

    turn = send(qtbot, window, too_long, expect_error=True)

    assert turn.errors and "Generation failed" in window.chat.error_text
    assert window.chat.message_texts() == before == worker_messages(window)
    assert window.chat.input.toPlainText() == too_long  # given back to shorten
    assert not window.generating and window.chat.send_button.text() == "Send"


def test_a_new_chat_clears_the_view_and_releases_the_blocks(qtbot, window):
    send(qtbot, window, "Fill the pool")

    with Catch(qtbot, window.client.signals.stats, timeout=10_000) as stats:
        window.menus.new_chat.trigger()

    assert window.chat.messages == []
    assert stats.args[0].block_states.count(BLOCK_OWN) == 0
    qtbot.waitUntil(lambda: window.block_map.grid.states.count(BLOCK_OWN) == 0, timeout=HANG_GUARD_MS)


def test_the_window_stays_responsive_during_a_long_generation(qtbot, window):
    """What makes it true, counted rather than timed: every step of the engine runs on the worker thread, never on
    the GUI thread, and while each step is under way the GUI thread processes a timer tick (one tick per step)."""
    window.sampling_override = greedy(400)
    probe = StepProbe(window.client.worker.engine.model)
    try:
        turn = send(qtbot, window, "Tell me everything about caches. " * 20)  # a long prefill, then 399 steps
    finally:
        probe.remove()

    assert turn.done[0].n_generated_tokens == 400 and len(turn.steps) == 400
    assert len(probe.threads) == 400 and threading.get_ident() not in probe.threads
    assert len(set(probe.threads)) == 1  # the worker's thread, every time
    assert probe.missed == 0 and probe.ticks_in_steps == 400
    assert window.chat.messages[-1].text == turn.done[0].text  # and the view kept every token


def test_closing_during_generation_cancels_and_stops_the_thread_cleanly(qtbot, qtlog, tmp_path, tiny_engine_factory):
    window = open_window(qtbot, make_settings(tmp_path), tiny_engine_factory(), max_new_tokens=5000)
    try:
        window.send("A very long answer please")
        qtbot.waitUntil(lambda: len(window.chat.messages[-1].text) > 10, timeout=60_000)

        window.close()

        assert not window.client.thread.isRunning()
    finally:
        dispose(window)
    assert not [r for r in qtlog.records if "QThread" in r.message]


def test_the_scripted_demo_sends_each_prompt_and_saves_a_screenshot(qtbot, window, tmp_path):
    shot = tmp_path / "demo.png"

    code = run_demo(window, ["Hello", "And again"], str(shot))

    assert code == 0
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [role for role, _ in window.chat.message_texts()] == ["user", "assistant"] * 2
    assert not window.client.thread.isRunning()


@pytest.mark.default_model
def test_a_turn_on_the_default_model_fills_in_its_numbers(qtbot, tmp_path, default_engine):
    window = open_window(qtbot, make_settings(tmp_path), default_engine, max_new_tokens=6)
    try:
        done = send(qtbot, window, "What is 2 + 2?").done[0]
        window.metrics.refresh()

        assert done.n_generated_tokens == 6 and done.text.strip()
        assert window.chat.messages[-1].text == done.text
        formula = "2 × 4 B/element × 30 layers × 3 KV heads × 64 head_dim = 46,080 bytes/token"
        assert formula in window.metrics.figures_text and formula in about_html(window.info)
        assert "3× smaller than multi-head" in window.metrics.figures_text
        assert window.block_map.showing_grid
        qtbot.waitUntil(lambda: window.block_map.grid.states.count(BLOCK_OWN) > 0, timeout=HANG_GUARD_MS)
        assert len(window.metrics.log.rows) == done.n_generated_tokens  # one prefill step + five decode steps
    finally:
        dispose(window)


def test_loading_a_model_shows_progress_and_then_the_model(qtbot, tmp_path, tiny_model_folder):
    """A real load on the worker thread (config, safetensors, tokenizer) of the tiny model's folder; the default
    model's own load is the session's (conftest's default_weights, tests/test_loader.py)."""
    settings = make_settings(tmp_path)
    settings.model_path = str(tiny_model_folder)
    window = MainWindow(settings=settings)
    try:
        assert window.loading and not window.status.progress.isHidden()
        assert not window.chat.input.isEnabled()
        qtbot.waitUntil(lambda: window.info is not None, timeout=TURN_TIMEOUT_MS)

        assert window.info.model_name == "tiny-random" and window.info.num_kv_heads == 2
        assert window.status.progress.isHidden() and window.chat.input.isEnabled()
        assert window.status.text("model") == window.info.model_name
    finally:
        dispose(window)
