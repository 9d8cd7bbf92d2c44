"""Branches, the block map's saved state, the file dialogs and focus in a real X window (Xvfb, Qt's xcb plugin):
two turns, an edit of the first message, "‹" clicked to show the first version again, rename, a second chat
deleted, the first reopened (its versions, its plots, its block map as saved, captioned), the Save dialog's
columns whole, and the focus back on the input after each of the app's fourteen dialogs, the file dialogs among
them (Ctrl+N works without a click).

Skipped, with the reason, where Xvfb is not installed (see tests/test_app_xvfb.py)."""

from __future__ import annotations

from test_app_xvfb import needs_xvfb, run_scenario, x_display  # noqa: F401 (x_display: the fixture)

SCENARIO = r'''
import json, sys, time
from PySide6.QtCore import QSettings, Qt, QTimer
from PySide6.QtTest import QTest
from PySide6.QtWidgets import QApplication, QFileDialog, QTreeView

from app.file_dialogs import make_file_dialog
from app.main_window import MainWindow
from app.settings import AppSettings
from app.style import apply_theme
from engine.config import EngineConfig, SamplingParams
from engine.engine import Engine

app = QApplication([])
apply_theme(app)
folder, model, shots = sys.argv[1], sys.argv[2], sys.argv[3]
settings = AppSettings(QSettings(folder + "/kvscope.ini", QSettings.Format.IniFormat))
engine = Engine.load(model, EngineConfig(cache="paged", weights="float32"))
window = MainWindow(settings=settings, engine=engine)
window.sampling_override = SamplingParams(temperature=0, max_new_tokens=10, stop_token_ids=(10**9,))
window.show()
report = {"platform": app.platformName()}


def wait(condition, seconds=300):
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit("timed out")
        QTest.qWait(20)


def worker_caught_up():
    """The worker's conversation (reported after the reply's end) holds what the chat shows."""
    messages, in_chat = window.snapshot.get("messages", []), window.chat.messages
    return len(messages) == len(in_chat) > 0 and messages[-1]["content"] == in_chat[-1].text


def turn(start):
    start()
    wait(lambda: not window.generating and worker_caught_up())
    QTest.qWait(100)


def shown():
    return [(m.role, m.text, m.footer.text()) for m in window.chat.messages]


def focus_after(open_dialog):
    """Open a dialog, close it as soon as it shows; then: is the input focused, and does Ctrl+N start a new chat?"""
    def close():
        dialog = QApplication.activeModalWidget()
        if dialog is None:
            return QTimer.singleShot(100, close)
        dialog.reject()
    window.chat.input.setPlainText("draft")
    QTimer.singleShot(100, close)
    open_dialog()
    wait(lambda: QApplication.focusWidget() is window.chat.input, 30)
    QTest.keyClick(window.chat.input, Qt.Key.Key_N, Qt.KeyboardModifier.ControlModifier)
    return window.chat.input.toPlainText() == "draft" and window.chat.messages == []


wait(lambda: window.info is not None and bool(window.snapshot))
turn(lambda: window.send("What is a KV cache?"))
turn(lambda: window.send("And a paged one?"))
first_version, first_rows = shown(), list(window.metrics.log.rows)
turn(lambda: window.edit_and_resend("What is attention?", 0))
second_version = shown()
report["after_edit"] = window.chat.messages[0].branch_text
QTest.mouseClick(window.chat.messages[0].previous_button, Qt.MouseButton.LeftButton)  # "‹"
QTest.qWait(300)
report["after_click"] = window.chat.messages[0].branch_text
report["first_version_back"] = shown() == first_version and window.metrics.log.rows == first_rows
window.grab().save(shots + "/switched.png")
first_id = window.conversations.current
window.conversations.rename(first_id, "Caches, two versions")
window.new_chat()
turn(lambda: window.send("A chat to delete"))
report["deleted"] = window.conversations.delete(window.conversations.current)
report["rows_after_delete"] = len(window.metrics.log.rows)
window.conversations.open(first_id)
QTest.qWait(500)
report["reopened_branch"] = window.chat.messages[0].branch_text
report["reopened_rows"] = window.metrics.log.rows == first_rows
report["block_map_saved"] = window.block_map.saved and window.block_map.caption.isVisible()
report["caption"] = window.block_map.caption.text()
report["saved_states"] = window.block_map.grid.states.hex()
report["titles"] = [window.conversations.widget.list.item(i).text().splitlines()[0]
                    for i in range(window.conversations.widget.list.count())]
window.grab().save(shots + "/reopened.png")

dialog = make_file_dialog(window, "Save", folder, "kvscope conversation (*.json);;All files (*)", "save")
dialog.show()
view = dialog.findChild(QTreeView)
wait(lambda: view.model().rowCount(view.rootIndex()) >= 1, 30)
QTest.qWait(300)
header = view.header()
report["dialog_width"] = dialog.width()
report["columns_whole"] = all(header.sectionSize(c) >= view.sizeHintForColumn(c) for c in (1, 2, 3))
report["columns_inside"] = sum(header.sectionSize(c) for c in range(4)) <= view.viewport().width()
dialog.grab().save(shots + "/save-dialog.png")
dialog.reject()
QTest.qWait(200)
window.activateWindow()
QTest.qWait(200)
menus, sidebar = window.menus, window.conversation_list
dialogs = {"sampling": menus.sampling.trigger, "system prompt": menus.system_prompt.trigger,
           "KV budget": menus.kv_budget.trigger, "max draft tokens": menus.max_draft_tokens.trigger,
           "backend": menus.backend.trigger, "about": menus.about.trigger, "open model": menus.open_model.trigger,
           "compare": window.compare.replay_action.trigger, "rename": sidebar.rename_button.click,
           "delete": sidebar.delete_button.click, "open": menus.open.trigger, "save": menus.save.trigger,
           "export PNG": menus.export_png.trigger, "choose GGUF": menus.model_gguf.trigger}
report["focus"] = {}
for name, open_dialog in dialogs.items():
    window.conversations.open(first_id)  # selected in the sidebar (Rename, Delete)
    QTest.qWait(100)
    report["focus"][name] = focus_after(open_dialog)
print(json.dumps(report))
window.close()
'''


@needs_xvfb
def test_branches_block_map_history_dialogs_and_focus_on_a_real_x_server(x_display, tmp_path,  # noqa: F811
                                                                          tiny_model_folder):
    report = run_scenario(x_display, tmp_path, SCENARIO, str(tmp_path), str(tiny_model_folder), str(tmp_path))
    assert report["platform"] == "xcb"
    assert report["after_edit"] == "2/2" and report["after_click"] == "1/2" and report["first_version_back"]
    assert report["deleted"] and report["rows_after_delete"] == 0
    assert report["reopened_branch"] == "1/2" and report["reopened_rows"]
    assert report["block_map_saved"] and "Saved state" in report["caption"] and report["saved_states"]
    assert report["titles"] == ["Caches, two versions"]
    assert report["dialog_width"] >= 900 and report["columns_whole"] and report["columns_inside"]
    assert report["focus"] == {name: True for name in report["focus"]} and len(report["focus"]) == 14
    for shot in ("switched.png", "reopened.png", "save-dialog.png"):
        assert (tmp_path / shot).read_bytes()[:4] == b"\x89PNG"
