"""The input box counts the message's tokens with the model's tokenizer and, before sending a message that would
fill more than half of the context left, says so once (and which old turns would leave the model's view); a second
Enter sends it (issue 20 part 3), on the tiny random model and its real tokenizer."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtTest import QTest
from test_app_support import HANG_GUARD_MS, run_turn, send


def test_the_input_shows_the_messages_token_count(window, qtbot):
    window.chat.input.setPlainText("Hello there, how are you?")
    qtbot.waitUntil(lambda: window.chat.token_count.isVisibleTo(window.chat), timeout=HANG_GUARD_MS)
    tokens = window.chat.count_tokens("Hello there, how are you?")
    assert 5 <= tokens <= 12 and window.chat.token_count.text() == f"{tokens:,} tokens"
    window.chat.input.clear()
    qtbot.waitUntil(lambda: not window.chat.token_count.isVisibleTo(window.chat), timeout=HANG_GUARD_MS)


def test_a_message_over_half_the_context_left_is_sent_by_a_second_enter(window, qtbot):
    send(qtbot, window, "Hello")
    text = "word " * 600
    window.chat.input.setPlainText(text)

    QTest.keyClick(window.chat.input, Qt.Key.Key_Return)

    assert not window.generating and window.chat.input.toPlainText() == text  # not sent yet
    warning = window.chat.token_count.text()
    left = window.info.max_context - window.status.context_used
    assert warning.startswith(f"This message is {window.chat.count_tokens(text):,} tokens") and f"{left:,}" in warning
    assert "Press Enter again" in warning
    run_turn(qtbot, window, lambda: QTest.keyClick(window.chat.input, Qt.Key.Key_Return))
    assert window.snapshot["messages"][-2]["content"] == text.strip()


def test_the_warning_names_the_turns_that_would_leave_as_the_engine_drops_them(window, qtbot):
    send(qtbot, window, "Hello")
    words = 700
    while not window._turns_that_would_leave("word " * words):
        words += 10
    text = "word " * words
    assert window._turns_that_would_leave(text) == ["Hello"]
    assert '(from "Hello") would leave' in window.send_warning(text, window.chat.count_tokens(text))

    send(qtbot, window, text)

    assert window.snapshot["context_start"] == 2  # the engine dropped exactly that turn
