"""Helpers shared by the app tests (no tests here): temporary settings, a window on a real engine, turns."""

from __future__ import annotations

import gc
import threading
import time

import shiboken6
from PySide6.QtCore import QCoreApplication, QEvent, QObject, QSettings, QTimer

from app.main_window import MainWindow
from app.settings import AppSettings
from engine.config import SamplingParams

NEVER_STOP = (10**9,)  # a token id no model emits: replies run to max_new_tokens
LONG_SYSTEM_PROMPT = (
    "You are kvscope's test assistant. You answer briefly and precisely. You never invent facts, you show code "
    "in fenced blocks, and you keep every answer under one hundred words unless asked for more detail."
)
TURN_TIMEOUT_MS = 120_000
HANG_GUARD_S = 60  # how long a helper waits for the other thread before calling it a hang (never a timing bound)
HANG_GUARD_MS = HANG_GUARD_S * 1000  # qtbot's waits: pytest-qt's default of 5 s is a timing bound on a loaded machine


def make_settings(tmp_path) -> AppSettings:
    """Settings in an ini file under tmp_path: never the user's real preferences."""
    settings = AppSettings(QSettings(str(tmp_path / "kvscope-test.ini"), QSettings.Format.IniFormat))
    settings.system_prompt = LONG_SYSTEM_PROMPT
    return settings


def greedy(max_new_tokens: int = 12) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, stop_token_ids=NEVER_STOP)


def open_window(qtbot, settings: AppSettings, engine, max_new_tokens: int = 12, show: bool = True) -> MainWindow:
    """show=False: never painted (loops that open and close many windows skip the first paint, ~0.1 s)."""
    window = MainWindow(settings=settings, engine=engine)  # the caller disposes of it (see dispose)
    window.sampling_override = greedy(max_new_tokens)
    if show:
        window.show()
    qtbot.waitUntil(lambda: window.info is not None and bool(window.snapshot), timeout=TURN_TIMEOUT_MS)
    return window


def dispose(window) -> None:
    """Close the window, destroy it and collect its garbage now, while no worker thread runs.

    Left to qtbot's deleteLater and to the garbage collector, an old window would be destroyed at some random
    moment of a later test, while that test's worker thread is emitting: a needless source of flakiness.
    """
    if not shiboken6.isValid(window):
        return
    window.close()
    window.deleteLater()
    QCoreApplication.sendPostedEvents(None, QEvent.Type.DeferredDelete.value)
    gc.collect()


class Recorder(QObject):
    """Collects what the worker reports during one turn (a QObject, so every report arrives on this thread).

    The turn has ended when the conversation is reported after its DoneEvent or its error: the worker always
    reports them in that order.
    """

    def __init__(self, window):
        super().__init__()
        self.signals = window.client.signals
        self.steps, self.tokens, self.done, self.errors = [], [], [], []
        self.ended = False
        self._pairs = ((self.signals.step, self._on_step), (self.signals.token, self._on_token),
                       (self.signals.finished, self._on_finished), (self.signals.error, self._on_error),
                       (self.signals.conversation, self._on_conversation))
        for signal, slot in self._pairs:
            signal.connect(slot)

    def _on_step(self, event) -> None:
        self.steps.append(event)

    def _on_token(self, text: str) -> None:
        self.tokens.append(text)

    def _on_finished(self, done) -> None:
        self.done.append(done)

    def _on_error(self, message: str) -> None:
        self.errors.append(message)

    def _on_conversation(self, _data) -> None:
        self.ended = self.ended or bool(self.done or self.errors)

    def close(self) -> None:
        for signal, slot in self._pairs:
            signal.disconnect(slot)


class Catch(QObject):
    """`with Catch(qtbot, signal) as caught: ...` waits, after the block, for one emission of a worker signal.

    A QObject receiver, so the emission from the worker thread is queued to this one (pytest-qt's waitSignal
    connects a plain callable, which is fine for signals of this thread but not for the worker's).
    """

    def __init__(self, qtbot, signal, timeout: int = TURN_TIMEOUT_MS):
        super().__init__()
        self.qtbot, self.signal, self.timeout = qtbot, signal, timeout
        self.args: list | None = None

    def _on_signal(self, *args) -> None:
        if self.args is None:
            self.args = list(args)

    def __enter__(self) -> Catch:
        self.signal.connect(self._on_signal)
        return self

    def __exit__(self, kind, value, traceback) -> None:
        try:
            if kind is None:
                self.qtbot.waitUntil(lambda: self.args is not None, timeout=self.timeout)
        finally:
            self.signal.disconnect(self._on_signal)


def run_turn(qtbot, window, start, timeout: int = TURN_TIMEOUT_MS, expect_error: bool = False) -> Recorder:
    """Call start() (send, regenerate, edit...) and wait until the turn has ended and the window is idle."""
    recorder = Recorder(window)
    try:
        start()
        qtbot.waitUntil(lambda: recorder.ended and not window.generating, timeout=timeout)
    finally:
        recorder.close()
    assert expect_error or not recorder.errors, f"the worker reported: {recorder.errors}"
    assert expect_error or len(recorder.done) == 1
    return recorder


def send(qtbot, window, text: str, timeout: int = TURN_TIMEOUT_MS, expect_error: bool = False) -> Recorder:
    return run_turn(qtbot, window, lambda: window.send(text), timeout, expect_error)


def worker_messages(window) -> list[tuple[str, str]]:
    return [(m["role"], m["content"]) for m in window.snapshot["messages"]]


class StepProbe(QObject):
    """Watches every forward of an engine's model: records the thread it runs on, and holds it until the GUI
    thread's timer has ticked once. So each step proves that the GUI thread processed an event while the step was
    under way (a tick per step, whatever the machine's load); a step run on the GUI thread would never see its
    tick and would be counted as missed after HANG_GUARD_S."""

    def __init__(self, model, interval_ms: int = 1):
        super().__init__()
        self.threads: list[int] = []
        self.ticks_in_steps = self.missed = 0
        self._ticked = threading.Event()
        self._timer = QTimer(self, interval=interval_ms)
        self._timer.timeout.connect(self._ticked.set)
        self._timer.start()
        self._hook = model.register_forward_pre_hook(self._in_step)

    def _in_step(self, _module, _args) -> None:  # on the thread that runs the step
        self.threads.append(threading.get_ident())
        self._ticked.clear()
        if not self.missed and self._ticked.wait(HANG_GUARD_S):
            self.ticks_in_steps += 1
        else:
            self.missed += 1

    def remove(self) -> None:
        self._hook.remove()
        self._timer.stop()


class CloseGate:
    """Holds the worker thread at a chosen point (a prefill step, a decode step, a model load) until the GUI thread
    has begun closing the window, so that the close lands exactly there. hold() runs on the worker thread; it
    reads the worker's closing flag, which the window sets first thing when it shuts the worker down."""

    def __init__(self, window):
        self.worker = window.client.worker
        self.reached = threading.Event()
        self.closed_inside = 0
        self.armed = True

    def hold(self) -> None:
        if not self.armed:
            return
        self.armed = False
        self.reached.set()
        deadline = time.monotonic() + HANG_GUARD_S
        while not self.worker._closing and time.monotonic() < deadline:
            time.sleep(0.0005)
        self.closed_inside += self.worker._closing
