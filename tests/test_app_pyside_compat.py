"""The guard against PySide6 6.12.0 dropping references to True (emit) and None (slot results)."""

from __future__ import annotations

import sys

import pytest
from PySide6.QtCore import QObject, QTimer, Signal

from app.pyside_compat import RESERVE, install_refcount_guard, needs_guard


class Emitter(QObject):
    ping = Signal(object)


@pytest.mark.skipif(not needs_guard(), reason="this PySide6 / Python does not have the bug")
def test_many_emits_cannot_exhaust_the_references_to_true(qtbot):
    assert install_refcount_guard()
    assert install_refcount_guard()  # once only
    before = sys.getrefcount(True)
    emitter = Emitter()
    received = []
    emitter.ping.connect(received.append)

    for i in range(50_000):  # more than True's references in a fresh process with torch loaded
        emitter.ping.emit(i)

    assert len(received) == 50_000
    assert RESERVE // 2 < sys.getrefcount(True) <= before


class Counter(QObject):
    def __init__(self):
        super().__init__()
        self.ticks = 0

    def tick(self) -> None:
        self.ticks += 1


@pytest.mark.skipif(not needs_guard(), reason="this PySide6 / Python does not have the bug")
def test_many_timer_ticks_into_a_method_cannot_exhaust_the_references_to_none(qtbot):
    install_refcount_guard()
    counter = Counter()
    timer = QTimer(interval=0)
    timer.timeout.connect(counter.tick)
    timer.start()

    qtbot.waitUntil(lambda: counter.ticks >= 20_000, timeout=60_000)  # None has a few thousand references
    timer.stop()

    assert sys.getrefcount(None) > RESERVE // 2
