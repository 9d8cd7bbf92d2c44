"""The file dialogs (Open / Save conversation, exports, choose model): Qt's own dialog, where the platform has no
native one, opens wide enough that name, size, type and date all show, starts in the folder last used, and gives
the focus back to the input when it closes, however it closes."""

from __future__ import annotations

import pytest
from PySide6.QtCore import Qt, QTimer
from PySide6.QtTest import QTest
from PySide6.QtWidgets import QApplication, QFileDialog, QLineEdit, QTreeView
from test_app_support import HANG_GUARD_MS, send

from app.file_dialogs import SIZE, make_file_dialog

NAMES = ("a conversation with a rather long name about paged attention.json", "chat.json", "notes.json")


def shown_dialog(qtbot, folder, mode="save") -> tuple[QFileDialog, QTreeView]:
    for i, name in enumerate(NAMES):
        (folder / name).write_text("{}" * 10 ** i)
    dialog = make_file_dialog(None, "Save", str(folder), "kvscope conversation (*.json);;All files (*)", mode)
    qtbot.addWidget(dialog)
    dialog.show()
    view = dialog.findChild(QTreeView)
    qtbot.waitUntil(lambda: view.model().rowCount(view.rootIndex()) >= len(NAMES), timeout=HANG_GUARD_MS)
    QTest.qWait(100)
    return dialog, view


@pytest.mark.parametrize("mode", ["save", "open"])
def test_size_type_and_date_columns_show_whole_and_name_takes_the_rest(qtbot, tmp_path, mode):
    dialog, view = shown_dialog(qtbot, tmp_path, mode)
    header = view.header()

    for column in (1, 2, 3):  # Size, Type, Date Modified: no cell and no title cut
        assert header.sectionSize(column) >= max(view.sizeHintForColumn(column), header.sectionSizeHint(column))
    widths = [header.sectionSize(c) for c in range(header.count())]
    assert sum(widths) <= view.viewport().width()  # every column inside the view: none past its right edge
    assert widths[0] >= 200  # and the name keeps room to be read
    screen = dialog.screen().availableGeometry().size()
    assert dialog.width() >= min(SIZE.width(), int(screen.width() * 0.9))
    dialog.grab().save(str(tmp_path / f"{mode}-dialog.png"))


def test_a_folder_dialog_fits_its_columns_too(qtbot, tmp_path):
    (tmp_path / "models").mkdir()
    dialog = make_file_dialog(None, "Choose a folder", str(tmp_path), mode="folder")
    qtbot.addWidget(dialog)
    dialog.show()
    view = dialog.findChild(QTreeView)
    qtbot.waitUntil(lambda: view.model().rowCount(view.rootIndex()) >= 1, timeout=HANG_GUARD_MS)

    header = view.header()
    assert header.sectionSize(3) >= view.sizeHintForColumn(3)
    assert dialog.fileMode() == QFileDialog.FileMode.Directory


def close_the_file_dialog(choose=None):
    """As soon as the file dialog is open: choose this path in it, as a user does (None: cancel it). Whatever
    happens, the dialog closes (a modal dialog left open would hang the test)."""
    def close():
        dialog = QApplication.activeModalWidget()
        if not isinstance(dialog, QFileDialog):
            QTimer.singleShot(100, close)  # not open yet
            return
        close.started_in = dialog.directory().absolutePath()
        try:
            if choose is not None:  # go to its folder, type its name, press Save
                dialog.setDirectory(str(choose.parent))
                dialog.findChild(QLineEdit, "fileNameEdit").setText(choose.name)
                dialog.accept()
        finally:
            if dialog.isVisible():
                dialog.reject()

    QTimer.singleShot(100, close)
    return close


@pytest.mark.parametrize("menu", ["open", "save", "export_png", "export_csv", "model_gguf", "model_folder"])
def test_every_file_dialog_gives_the_focus_back_to_the_input(qtbot, window, menu):
    window.activateWindow()
    window.chat.input.setPlainText("draft")
    close_the_file_dialog()

    getattr(window.menus, menu).trigger()

    qtbot.waitUntil(lambda: QApplication.focusWidget() is window.chat.input, timeout=HANG_GUARD_MS)
    QTest.keyClick(window.chat.input, Qt.Key.Key_N, Qt.KeyboardModifier.ControlModifier)  # File → New chat works
    assert window.chat.input.toPlainText() == "draft"


def test_the_next_dialog_starts_in_the_folder_last_used(qtbot, window, tmp_path):
    send(qtbot, window, "Save me")
    folder = tmp_path / "saved here"
    folder.mkdir()
    close_the_file_dialog(folder / "chat.json")
    window.menus.save.trigger()
    qtbot.waitUntil(lambda: (folder / "chat.json").exists(), timeout=HANG_GUARD_MS)

    opened = close_the_file_dialog()
    window.menus.open.trigger()

    qtbot.waitUntil(lambda: hasattr(opened, "started_in"), timeout=HANG_GUARD_MS)
    assert opened.started_in == str(folder) and window.settings.last_folder == str(folder)
