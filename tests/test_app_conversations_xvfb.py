"""Conversations and Compare in a real X window (Xvfb, Qt's xcb plugin), as users on a Linux desktop run them:
three turns, a Compare under contiguous and paged (one series each over the same positions, 100% greedy
agreement), a new chat with empty plots, and switching back to the first conversation with its plots.

Skipped, with the reason, where Xvfb is not installed (see tests/test_app_xvfb.py)."""

from __future__ import annotations

from test_app_xvfb import needs_xvfb, run_scenario, x_display  # noqa: F401 (x_display: the fixture)

SCENARIO = r'''
import json, sys, time
from PySide6.QtCore import QSettings
from PySide6.QtTest import QTest
from PySide6.QtWidgets import QApplication

from app.main_window import MainWindow
from app.settings import AppSettings
from engine.config import EngineConfig, SamplingParams
from engine.engine import Engine
from engine.replay import ReplayConfig

app = QApplication([])
folder, model, shot = sys.argv[1], sys.argv[2], sys.argv[3]
settings = AppSettings(QSettings(folder + "/kvscope.ini", QSettings.Format.IniFormat))
engine = Engine.load(model, EngineConfig(cache="paged", weights="float32"))
window = MainWindow(settings=settings, engine=engine)
window.sampling_override = SamplingParams(temperature=0, max_new_tokens=10, stop_token_ids=(10**9,))
window.show()


def wait(condition, seconds=300):
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit("timed out")
        QTest.qWait(20)


wait(lambda: window.info is not None and bool(window.snapshot))
for question in ("What is a KV cache?", "And a paged one?", "Which is faster?"):
    window.send(question)
    wait(lambda: not window.generating and len(window.snapshot.get("messages", [])) == len(window.chat.messages)
         and window.snapshot["messages"][-1]["content"] == window.chat.messages[-1].text)
first_id, first_rows = window.conversations.current, len(window.metrics.log.rows)
window.compare.run([ReplayConfig("contiguous"), ReplayConfig("paged")])
wait(lambda: not window.compare.running)
view = window.compare.view
QTest.qWait(300)
view.grab().save(shot)
table = view.table_text()
x = [list(map(float, view.series(i)[0])) for i in range(2)]
window.new_chat()
QTest.qWait(200)
empty = len(window.metrics.log.rows)
window.conversations.open(first_id)
QTest.qWait(200)
print(json.dumps({"platform": app.platformName(), "agreement": table[1][-1], "same_positions": x[0] == x[1],
                  "num_positions": len(x[0]), "rows_after_new_chat": empty, "first_rows": first_rows,
                  "rows_after_reopen": len(window.metrics.log.rows), "listed": len(window.conversations.widget.ids())}))
window.close()
'''


@needs_xvfb
def test_conversations_and_compare_on_a_real_x_server(x_display, tmp_path, tiny_model_folder):  # noqa: F811
    shot = tmp_path / "compare.png"
    report = run_scenario(x_display, tmp_path, SCENARIO, str(tmp_path), str(tiny_model_folder), str(shot))
    assert report["platform"] == "xcb"
    assert report["same_positions"] and report["num_positions"] == 3 * 10
    assert report["agreement"] == f"100% of {3 * 11}"
    assert report["rows_after_new_chat"] == 0
    assert report["rows_after_reopen"] == report["first_rows"] > 0
    assert report["listed"] == 1
    assert shot.read_bytes()[:4] == b"\x89PNG"
