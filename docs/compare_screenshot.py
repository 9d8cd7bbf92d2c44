"""Make docs/compare.png: three greedy turns on the default model, then Compare → Replay under contiguous, paged
and paged with a bfloat16 KV cache; the Compare window is saved as a PNG (and its table printed).

    QT_QPA_PLATFORM=offscreen .venv/bin/python docs/compare_screenshot.py docs/compare.png

Conversations are saved under a temporary folder, never the user's."""

from __future__ import annotations

import faulthandler
import signal
import sys
import tempfile
import time

from PySide6.QtCore import QSettings
from PySide6.QtTest import QTest
from PySide6.QtWidgets import QApplication

from app.main_window import MainWindow
from app.settings import AppSettings
from app.style import apply_theme
from engine.config import EngineConfig, SamplingParams
from engine.engine import Engine
from engine.replay import ReplayConfig

QUESTIONS = ("What is a KV cache, in two sentences?", "How does a paged KV cache differ from a contiguous one?",
             "Which one should a chat app use?")


def wait(condition, seconds: float = 2400) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit("timed out")
        QTest.qWait(50)


def main(path: str) -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # kill -USR1 <pid>: where every thread is
    app = QApplication([])
    apply_theme(app)
    folder = tempfile.mkdtemp(prefix="kvscope-shot-")
    settings = AppSettings(QSettings(f"{folder}/kvscope.ini", QSettings.Format.IniFormat))
    engine = Engine.load(None, EngineConfig(cache="paged", kv_dtype="float32"))
    window = MainWindow(settings=settings, engine=engine)
    window.sampling_override = SamplingParams(temperature=0, max_new_tokens=32)
    window.show()
    wait(lambda: window.info is not None and bool(window.snapshot))
    for question in QUESTIONS:
        before = len(window.snapshot["messages"])
        window.send(question)
        wait(lambda n=before + 2: not window.generating and len(window.snapshot["messages"]) == n)
    kv = window.info.kv_dtype or "float32"
    window.compare.run([ReplayConfig("contiguous", kv, window.info.weight_format),
                        ReplayConfig("paged", kv, window.info.weight_format),
                        ReplayConfig("paged", "bfloat16", window.info.weight_format)])
    wait(lambda: not window.compare.running)
    view = window.compare.view
    view.resize(1200, 900)
    QTest.qWait(500)
    view.export_png_to(path)
    for row in view.table_text():
        print(" | ".join(cell.replace("\n", " ") for cell in row))
    window.close()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "docs/compare.png")
