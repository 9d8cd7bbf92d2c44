"""A guard against reference-counting bugs in PySide6 6.12.0.

In PySide6 6.12.0 every `SignalInstance.emit()` returns `True` without taking a reference to it, and every call
of a Python slot from a Qt signal (a QTimer's timeout into a method, say) releases one reference too many to the
slot's result, `None`. Each emit or timer tick (ours, pyqtgraph's, the worker's thousands per reply) leaves
`True` or `None` a reference short; after some thousands CPython aborts ("bool_dealloc" / "none_dealloc") or
crashes at random later. PySide6 6.11.3 has neither bug; the real fix is to avoid 6.12.0 in the dependency pins.

Until then, on 6.12.0 with CPython before 3.12 (3.12 made these objects immortal, so lost references do no
harm), None, True and False get a reserve of 2**40 references once: no program runs that many slots.
"""

from __future__ import annotations

import ctypes
import platform
import sys

import PySide6

BUGGY_VERSIONS = ("6.12.0",)
RESERVE = 1 << 40


def needs_guard() -> bool:
    return (PySide6.__version__ in BUGGY_VERSIONS and sys.version_info < (3, 12)
            and platform.python_implementation() == "CPython")


def install_refcount_guard() -> bool:
    """Give None, True and False their reserve once; returns whether the guard is in place."""
    if not needs_guard():
        return False
    for singleton in (None, True, False):
        if sys.getrefcount(singleton) < RESERVE // 2:  # not given yet (idempotent)
            refcount = ctypes.c_ssize_t.from_address(id(singleton))  # ob_refcnt: the first field of a PyObject
            refcount.value += RESERVE
    return True
