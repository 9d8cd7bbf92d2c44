"""The scripted run behind `main.py gui --demo PROMPT... --screenshot FILE.png`: send each prompt as one turn,
wait for every reply, save a picture of the whole window, exit."""

from __future__ import annotations

import sys

from PySide6.QtCore import QEventLoop, QObject, QTimer

DEMO_TIMEOUT_MS = 30 * 60 * 1000
SETTLE_MS = 400
DEMO_SIZE = (1440, 900)  # let the plots' timer draw the last points before the screenshot


class DemoRunner(QObject):
    def __init__(self, window, prompts: list[str], screenshot: str | None):
        super().__init__(window)
        self.window, self.prompts, self.screenshot = window, list(prompts), screenshot
        self.loop = QEventLoop()
        signals = window.client.signals
        signals.finished.connect(self._on_finished)
        signals.error.connect(self._on_error)
        self._wait_for_model = QTimer(self, interval=100)
        self._wait_for_model.timeout.connect(self._start_when_loaded)

    def run(self) -> int:
        QTimer.singleShot(DEMO_TIMEOUT_MS, self, lambda: self._fail("the demo did not finish in time"))
        self._wait_for_model.start()
        return self.loop.exec()

    def _start_when_loaded(self) -> None:
        if self.window.info is not None and not self.window.loading:
            self._wait_for_model.stop()
            self._next()

    def _next(self) -> None:
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
    window.resize(*DEMO_SIZE)  # the same picture whatever size the window was saved at
    window.splitter.setSizes([210, DEMO_SIZE[0] - 660 - 210, 660])  # conversations, chat, side panel
    code = DemoRunner(window, prompts, screenshot).run()
    window.close()
    return code
