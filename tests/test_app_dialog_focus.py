"""Every dialog gives the focus back: after any of the app's dialogs closes (cancelled here), the input has the
focus and the window's shortcuts work without a click (Ctrl+N starts a new chat). The file dialogs have their own
test in tests/test_app_file_dialogs.py."""

from __future__ import annotations

import pytest
from PySide6.QtCore import Qt, QTimer
from PySide6.QtTest import QTest
from PySide6.QtWidgets import QApplication, QDialog, QMessageBox
from test_app_support import HANG_GUARD_MS, send


def cancel_the_dialog_when_it_opens(seen: list) -> None:
    """Cancel the modal dialog as soon as it shows (whatever happens, it closes: a dialog left open hangs)."""
    def cancel():
        dialog = QApplication.activeModalWidget()
        if not isinstance(dialog, (QDialog, QMessageBox)):
            QTimer.singleShot(100, cancel)
            return
        seen.append(dialog.windowTitle())
        dialog.reject()

    QTimer.singleShot(100, cancel)


DIALOGS = {  # what opens it, from the window
    "sampling": lambda w: w.menus.sampling.trigger(),
    "system prompt": lambda w: w.menus.system_prompt.trigger(),
    "KV budget": lambda w: w.menus.kv_budget.trigger(),
    "max draft tokens": lambda w: w.menus.max_draft_tokens.trigger(),
    "backend": lambda w: w.menus.backend.trigger(),
    "about": lambda w: w.menus.about.trigger(),
    "open model": lambda w: w.menus.open_model.trigger(),
    "compare": lambda w: w.compare.replay_action.trigger(),
    "rename": lambda w: w.conversation_list.rename_button.click(),
    "delete": lambda w: w.conversation_list.delete_button.click(),
}


@pytest.mark.parametrize("name", DIALOGS)
def test_after_every_dialog_the_input_has_the_focus_and_shortcuts_work(qtbot, window, name):
    send(qtbot, window, "Something to keep")  # a saved conversation, selected in the sidebar
    window.activateWindow()
    window.chat.input.setPlainText("draft")
    seen: list[str] = []
    cancel_the_dialog_when_it_opens(seen)

    DIALOGS[name](window)

    qtbot.waitUntil(lambda: bool(seen), timeout=HANG_GUARD_MS)
    qtbot.waitUntil(lambda: QApplication.focusWidget() is window.chat.input, timeout=HANG_GUARD_MS)
    QTest.keyClick(window.chat.input, Qt.Key.Key_N, Qt.KeyboardModifier.ControlModifier)  # File → New chat
    assert window.chat.messages == [] and window.chat.input.toPlainText() == "draft"
    assert len(window.conversations.store.entries()) == 1  # cancelled: nothing deleted
