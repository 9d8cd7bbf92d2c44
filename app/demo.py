"""The scripted run behind `main.py gui --demo PROMPT... --screenshot FILE.png`: send each prompt as one turn,
wait for every reply, save a picture of the whole window, exit."""

from __future__ import annotations

import sys

from PySide6.QtCore import QEventLoop, QObject, QTimer

DEMO_TIMEOUT_MS = 30 * 60 * 1000
SETTLE_MS = 400  # let the plots' timer draw the last points before the screenshot


class DemoRunner(QObject):
    def __init__(self, window, prompts: list[str], screenshot: str | None):
        super().__init__(window)
        self.window, self.prompts, self.screenshot = window, list(prompts), screenshot
        self.loop = QEventLoop()
        signals = window.client.signals
        signals.loaded.connect(self._on_loaded)
        signals.finished.connect(self._on_finished)
        signals.error.connect(self._on_error)
        self._started = False

    def run(self) -> int:
        QTimer.singleShot(DEMO_TIMEOUT_MS, self, lambda: self._fail("the demo did not finish in time"))
        if self.window.info is not None:
            QTimer.singleShot(0, self, self._next)
        return self.loop.exec()

    def _on_loaded(self, info) -> None:
        if not self._started:
            self._next()

    def _next(self) -> None:
        self._started = True
        if self.prompts:
            self.window.send(self.prompts.pop(0))
        else:
            QTimer.singleShot(SETTLE_MS, self, self._finish)

    def _on_finished(self, done) -> None:
        print(f"[{done.strategy}] {done.text}\n", flush=True)
        self._next()

    def _on_error(self, message: str) -> None:
        self._fail(message)

    def _finish(self) -> None:
        self.window.metrics.refresh()
        if self.screenshot:
            if not self.window.grab().save(self.screenshot):
                self._fail(f"could not write {self.screenshot}")
                return
            print(f"screenshot saved to {self.screenshot}", flush=True)
        self.loop.exit(0)

    def _fail(self, message: str) -> None:
        if self.loop.isRunning():
            print(f"demo failed: {message}", file=sys.stderr, flush=True)
            self.loop.exit(1)


def run_demo(window, prompts: list[str], screenshot: str | None = None) -> int:
    """Drive a shown MainWindow through the prompts; returns the exit code (0 when every reply arrived)."""
    code = DemoRunner(window, prompts, screenshot).run()
    window.close()
    return code
