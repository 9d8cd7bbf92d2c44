"""Keeps the status bar readable at any window width, without deciding the window's minimum width.

A QStatusBar is as wide as all its labels together, so a long model name alone could forbid half a 1920-pixel
screen, and a temporary message gets whatever width the labels leave: it is cut off mid-word. Here every label
may shrink to nothing, and after each resize, text change or message the labels that do not fit whole are folded
away (width 0), least important first; while a message is shown, labels step aside until the message fits.
Strategy, context and KV fold last; whatever folds is in the bar's tooltip, so nothing is lost at 900 pixels.
"""

from __future__ import annotations

from PySide6.QtCore import QEvent, QObject
from PySide6.QtGui import QTextDocumentFragment
from PySide6.QtWidgets import QLabel, QStatusBar

# most important first; labels not named here fold before these
PRIORITY = ("strategy", "context", "kv", "model", "speculation", "speed", "ttft", "device")
SPACING = 14  # between permanent widgets, and around the message
UNLIMITED = 16_777_215  # QWIDGETSIZE_MAX


class StatusFit(QObject):
    def __init__(self, bar: QStatusBar, labels: dict[str, QLabel]):
        super().__init__(bar)
        self.bar = bar
        order = [name for name in PRIORITY if name in labels]
        self.labels = [labels[name] for name in order] + [label for name, label in labels.items()
                                                          if name not in PRIORITY]
        for label in self.labels:
            label.setMinimumWidth(1)  # the text no longer sets the bar's minimum width; fit() folds it instead
        self.folded: set[QLabel] = set()
        bar.installEventFilter(self)
        bar.messageChanged.connect(lambda _message: self.fit())
        self.fit()

    def eventFilter(self, watched, event) -> bool:  # noqa: N802 (Qt override)
        if watched is self.bar and event.type() in (QEvent.Type.Resize, QEvent.Type.LayoutRequest):
            self.fit()
        return False

    def message_width(self) -> int:
        message = self.bar.currentMessage()
        return self.bar.fontMetrics().horizontalAdvance(message) + 2 * SPACING if message else 0

    def fit(self) -> None:
        room = self.bar.width() - self.message_width() - SPACING
        for label in self.labels:
            wanted = label.sizeHint().width() + SPACING if label.isVisibleTo(self.bar) else 0
            fits = wanted <= room
            room -= wanted if fits else 0
            self._fold(label, not fits)
        self._explain_folded()

    def _explain_folded(self) -> None:
        """The folded labels' text as the bar's tooltip (plain text: the strategy's colour swatch is HTML)."""
        texts = [QTextDocumentFragment.fromHtml(label.text()).toPlainText() for label in self.labels
                 if label in self.folded and label.isVisibleTo(self.bar) and label.text()]
        self.bar.setToolTip("\n".join(texts))

    def _fold(self, label: QLabel, folded: bool) -> None:
        if folded == (label in self.folded):
            return
        if folded:
            self.folded.add(label)
            label.setMaximumWidth(0)
        else:
            self.folded.discard(label)
            label.setMaximumWidth(UNLIMITED)

    @property
    def shown(self) -> list[QLabel]:
        """The labels shown whole now (visible and not folded)."""
        return [label for label in self.labels if label.isVisibleTo(self.bar) and label not in self.folded]
