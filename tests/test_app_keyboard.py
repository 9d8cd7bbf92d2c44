"""Keyboard and state (issue 20 part 6), on the tiny random model: Escape stops and the status bar says the reply
ended; Tab reaches every message action with a visible focus ring; Ctrl+Enter saves an edit; any user message can
be edited and the chat continues from it; focus and shortcuts come back after a dialog; speculation's state is
in the status bar; a progress bar stays visible with its message."""

from __future__ import annotations

from PySide6.QtCore import Qt, QTimer
from PySide6.QtTest import QTest
from PySide6.QtWidgets import QApplication, QDialog
from test_app_support import HANG_GUARD_MS, TURN_TIMEOUT_MS, greedy, run_turn, send, worker_messages

from app.message_widget import TOKENS_PER_STEP_TIP
from engine.config import SpeculativeConfig


def activate(window, qtbot) -> None:
    window.activateWindow()
    qtbot.waitUntil(window.isActiveWindow, timeout=HANG_GUARD_MS)


def test_escape_stops_a_reply_and_the_status_bar_says_it_ended(window, qtbot):
    activate(window, qtbot)
    window.sampling_override = greedy(5000)

    def start_then_escape():
        window.send("Tell me everything.")
        qtbot.waitUntil(lambda: len(window.chat.messages[-1].text) > 0, timeout=TURN_TIMEOUT_MS)
        QTest.keyClick(window.chat.input, Qt.Key.Key_Escape)

    turn = run_turn(qtbot, window, start_then_escape)

    assert turn.done[0].finish_reason == "cancelled" and turn.done[0].n_generated_tokens < 5000
    assert window.status.currentMessage() == "Stopped: the reply so far is kept"
    assert "stopped" in window.chat.messages[-1].footer.text()


def test_escape_without_a_reply_changes_nothing(window, qtbot):
    activate(window, qtbot)
    QTest.keyClick(window.chat.input, Qt.Key.Key_Escape)
    assert window.status.currentMessage() == "" and not window.generating


def test_tab_reaches_every_message_action_with_a_visible_focus_ring(window, qtbot):
    activate(window, qtbot)
    send(qtbot, window, "Hello")
    user, reply = window.chat.messages
    user.copy_button.setFocus()
    chain = [QApplication.focusWidget()]
    for _ in range(3):
        QTest.keyClick(QApplication.focusWidget(), Qt.Key.Key_Tab)
        chain.append(QApplication.focusWidget())

    assert chain[:2] == [user.copy_button, user.edit_button]
    assert reply.copy_button in chain[2:] or reply.regenerate_button in chain[2:]
    unfocused = reply.regenerate_button.grab().toImage()
    reply.regenerate_button.setFocus()
    assert reply.regenerate_button.grab().toImage() != unfocused  # the ring is drawn


def test_ctrl_enter_saves_an_edit(window, qtbot):
    activate(window, qtbot)
    send(qtbot, window, "Hello")
    user = window.chat.messages[0]
    user.start_editing()
    user.editor.setPlainText("Goodbye")

    run_turn(qtbot, window, lambda: QTest.keyClick(user.editor, Qt.Key.Key_Return, Qt.KeyboardModifier.ControlModifier))

    assert worker_messages(window)[0] == ("user", "Goodbye") and len(worker_messages(window)) == 2


def test_any_user_message_can_be_edited_and_the_chat_continues_from_it(window, qtbot):
    send(qtbot, window, "First question")
    send(qtbot, window, "Second question")
    first = window.chat.messages[0]
    assert first.edit_button.isVisibleTo(first)  # not only the last user message

    run_turn(qtbot, window, lambda: window.edit_and_resend("A better first question", 0))

    assert [role for role, _ in worker_messages(window)] == ["user", "assistant"]
    assert worker_messages(window)[0][1] == "A better first question"
    assert [m.text for m in window.chat.messages][:1] == ["A better first question"]
    assert len(window.chat.messages) == 2
    assert len(window.metrics._turn_marks) == 1  # the two old turns' points left the plots


def test_focus_and_shortcuts_come_back_after_a_dialog(window, qtbot):
    send(qtbot, window, "Hello")
    activate(window, qtbot)
    window.chat.input.setPlainText("draft")

    def close_the_dialog():
        dialog = QApplication.activeModalWidget()
        assert isinstance(dialog, QDialog)
        dialog.reject()

    QTimer.singleShot(200, close_the_dialog)
    window.actions_.edit_sampling()

    qtbot.waitUntil(lambda: QApplication.focusWidget() is window.chat.input, timeout=HANG_GUARD_MS)
    QTest.keyClick(window.chat.input, Qt.Key.Key_N, Qt.KeyboardModifier.ControlModifier)  # File → New chat
    assert window.chat.messages == [] and window.chat.input.toPlainText() == "draft"  # the window's, not the text's


def test_speculation_is_named_in_the_status_bar_while_it_is_on(window):
    window.status.set_speculation(SpeculativeConfig("lookup", 8))
    label = window.status.labels["speculation"]
    assert window.status.text("speculation") == "speculative: lookup ≤ 8" and "8 drafted tokens" in label.toolTip()
    window.status.set_speculation(SpeculativeConfig())
    assert label.isHidden()


def test_tokens_per_step_is_explained_where_it_is_shown(window, qtbot):
    send(qtbot, window, "Hello")
    reply = window.chat.messages[-1]
    reply.set_footer("12 tokens · 1.50 tokens per decode step · 40% of drafts accepted")
    assert reply.footer.toolTip() == TOKENS_PER_STEP_TIP


def test_a_progress_bar_stays_visible_beside_its_message(window):
    window.status.show_progress("Loading the weights as int8…", -1)
    window.status.showMessage("Cache: paged", 100)  # a message shown meanwhile...
    window.status.show_progress("Loading the weights as int8…", 0.5)
    assert not window.status.progress.isHidden() and window.status.progress_message.startswith("Loading")
    window.status.hide_progress()
    assert window.status.progress.isHidden() and window.status.progress_message == ""
