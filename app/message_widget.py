"""One chat message: a role header with actions (and, on an edited user message, the "‹ 1/2 ›" switcher between
its versions), the rendered text, and an inline editor."""

from __future__ import annotations

import time

from PySide6.QtCore import Qt, QTimer, QUrl, Signal
from PySide6.QtGui import QGuiApplication, QKeySequence, QShortcut
from PySide6.QtWidgets import (
    QFrame,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QSizePolicy,
    QTextBrowser,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from app.markdown_render import render_markdown, render_plain

RENDER_INTERVAL_MS = 60  # a streaming reply is re-rendered at most this often...
RENDER_BUDGET = 0.2  # ...and rendering takes at most this share of the time while it streams (long replies)


def speculation_footer(done) -> list[str]:
    """The footer's speculative-decoding part of a reply: tokens per decode step and drafts accepted (or nothing)."""
    if not getattr(done, "n_drafted", 0):
        return []
    return [f"{done.tokens_per_step:.2f} tokens per decode step", f"{done.acceptance_rate:.0%} of drafts accepted"]


TOKENS_PER_STEP_TIP = ("tokens per decode step: how many tokens each forward of the model produced on average. "
                       "Plain decoding makes 1; speculative decoding drafts tokens and keeps the ones the model "
                       "agrees with, so a step can make several (the reply is the same either way)")
FOCUS_RING = "QToolButton:focus { border: 2px solid #8ab4f8; border-radius: 4px; }"


class MessageBrowser(QTextBrowser):
    """Read-only rich text that grows to fit its content and never loads anything: no links, no images."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setOpenExternalLinks(False)
        self.setOpenLinks(False)
        self.setFrameShape(QFrame.Shape.NoFrame)
        self.setTabChangesFocus(True)  # Tab moves on to the message's actions, never stops inside the text
        self.setVerticalScrollBarPolicy(self.verticalScrollBarPolicy().ScrollBarAlwaysOff)
        self.setHorizontalScrollBarPolicy(self.horizontalScrollBarPolicy().ScrollBarAlwaysOff)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.document().setDocumentMargin(2)
        self.document().documentLayout().documentSizeChanged.connect(self._fit_height)

    def loadResource(self, kind: int, url: QUrl):  # noqa: N802 (Qt override)
        return None  # nothing is ever fetched, local or remote

    def resizeEvent(self, event) -> None:  # noqa: N802
        super().resizeEvent(event)
        self._fit_height()

    def _fit_height(self, *_args) -> None:
        margins = self.contentsMargins()
        height = int(self.document().size().height() + 0.99) + margins.top() + margins.bottom()
        if height != self.height():
            self.setFixedHeight(max(height, 20))


class MessageWidget(QFrame):
    """A user or assistant message. The chat view decides which actions are offered."""

    regenerate_clicked = Signal()
    edit_submitted = Signal(str)
    branch_stepped = Signal(int)  # -1: the previous version of this message, +1: the next

    def __init__(self, role: str, text: str = "", parent: QWidget | None = None):
        super().__init__(parent)
        self.role = role
        self._text = text
        self.setObjectName("userBubble" if role == "user" else "assistantBubble")
        self._render_timer = QTimer(self, singleShot=True, interval=RENDER_INTERVAL_MS)
        self._render_timer.timeout.connect(self._render)
        self._build()
        self._render()

    # --- public ---------------------------------------------------------------------------------------------
    @property
    def text(self) -> str:
        return self._text

    def set_text(self, text: str) -> None:
        self._text = text
        self._render_timer.stop()
        self._render()

    def append_text(self, piece: str) -> None:
        """Streaming: the text grows now, the rendering follows within RENDER_INTERVAL_MS."""
        self._text += piece
        if not self._render_timer.isActive():
            self._render_timer.start()

    def flush(self) -> None:
        if self._render_timer.isActive():
            self._render_timer.stop()
            self._render()

    def set_footer(self, text: str) -> None:
        self.footer.setText(text)
        self.footer.setVisible(bool(text))
        self.footer.setToolTip(TOKENS_PER_STEP_TIP if "tokens per decode step" in text else "")

    @property
    def editing(self) -> bool:
        return not self.edit_box.isHidden()

    def set_actions(self, *, edit: bool, regenerate: bool) -> None:
        self.edit_button.setVisible(edit and self.role == "user")
        self.regenerate_button.setVisible(regenerate and self.role == "assistant")

    def set_branch(self, position: tuple[int, int] | None) -> None:
        """Show "‹ shown/count ›" (both from 1) for a message with versions; None hides it."""
        self.branch_box.setVisible(position is not None)
        if position is None:
            return
        shown, count = position
        self.branch_label.setText(f"{shown}/{count}")
        self.branch_label.setToolTip(f"Version {shown} of {count} of this message: each edit keeps the versions "
                                     "before it, with their replies")
        self.previous_button.setEnabled(shown > 1)
        self.next_button.setEnabled(shown < count)

    @property
    def branch_text(self) -> str:
        return self.branch_label.text() if not self.branch_box.isHidden() else ""

    def copy_to_clipboard(self) -> None:
        QGuiApplication.clipboard().setText(self._text)

    def start_editing(self) -> None:
        self.editor.setPlainText(self._text)
        self.browser.hide()
        self.edit_box.show()
        self.editor.setFocus()

    def cancel_editing(self) -> None:
        self.edit_box.hide()
        self.browser.show()
        if self.edit_button.isVisible():
            self.edit_button.setFocus(Qt.FocusReason.OtherFocusReason)

    # --- building ----------------------------------------------------------------------------------------------
    def _build(self) -> None:
        layout = QVBoxLayout(self)
        layout.setContentsMargins(12, 8, 12, 8)
        layout.setSpacing(4)
        layout.addLayout(self._build_header())
        self.browser = MessageBrowser(self)
        layout.addWidget(self.browser)
        self.edit_box = self._build_editor()
        layout.addWidget(self.edit_box)
        self.footer = QLabel(self, objectName="messageFooter", wordWrap=True)  # wraps: never widens the chat
        self.footer.hide()
        layout.addWidget(self.footer)

    def _build_header(self) -> QHBoxLayout:
        header = QHBoxLayout()
        header.setSpacing(2)
        name = "You" if self.role == "user" else "Assistant"
        header.addWidget(QLabel(name, self, objectName="roleLabel"))
        header.addStretch(1)
        header.addWidget(self._build_branch_switcher())
        self.copy_button = self._tool_button("Copy", "Copy this message", self.copy_to_clipboard)
        self.edit_button = self._tool_button("Edit", "Edit this message and send it again", self.start_editing)
        self.regenerate_button = self._tool_button("Regenerate", "Generate this reply again",
                                                   self.regenerate_clicked.emit)
        for button in (self.copy_button, self.edit_button, self.regenerate_button):
            header.addWidget(button)
        self.set_actions(edit=False, regenerate=False)
        return header

    def _build_branch_switcher(self) -> QWidget:
        self.branch_box = QWidget(self)
        row = QHBoxLayout(self.branch_box)
        row.setContentsMargins(0, 0, 6, 0)
        row.setSpacing(0)
        self.previous_button = self._tool_button("‹", "Show the previous version of this message and its replies",
                                                 lambda: self.branch_stepped.emit(-1))
        self.branch_label = QLabel("", self.branch_box, objectName="branchPosition")
        self.next_button = self._tool_button("›", "Show the next version of this message and its replies",
                                             lambda: self.branch_stepped.emit(1))
        for widget in (self.previous_button, self.branch_label, self.next_button):
            row.addWidget(widget)
        self.branch_box.hide()
        return self.branch_box

    def _tool_button(self, text: str, tip: str, slot) -> QToolButton:
        button = QToolButton(self, text=text, toolTip=tip, objectName="messageAction")
        button.setFocusPolicy(Qt.FocusPolicy.StrongFocus)  # reached with Tab, with a visible ring
        button.setStyleSheet(FOCUS_RING)
        button.clicked.connect(slot)
        return button

    def _build_editor(self) -> QWidget:
        box = QWidget(self)
        layout = QVBoxLayout(box)
        layout.setContentsMargins(0, 0, 0, 0)
        self.editor = QPlainTextEdit(box, objectName="messageEditor")
        self.editor.setMinimumHeight(80)
        layout.addWidget(self.editor)
        buttons = QHBoxLayout()
        buttons.addStretch(1)
        cancel = QPushButton("Cancel", box)
        cancel.clicked.connect(self.cancel_editing)
        self.resend_button = QPushButton("Save && send", box, objectName="primaryButton")
        self.resend_button.clicked.connect(self._submit_edit)
        self.resend_button.setToolTip("Save the edit and send it (Ctrl+Enter); Escape cancels")
        for keys in ("Ctrl+Return", "Ctrl+Enter"):
            QShortcut(QKeySequence(keys), self.editor, self._submit_edit, context=Qt.ShortcutContext.WidgetShortcut)
        QShortcut(QKeySequence("Escape"), self.editor, self.cancel_editing, context=Qt.ShortcutContext.WidgetShortcut)
        buttons.addWidget(cancel)
        buttons.addWidget(self.resend_button)
        layout.addLayout(buttons)
        box.hide()
        return box

    def _submit_edit(self) -> None:
        text = self.editor.toPlainText().strip()
        if text:
            self.cancel_editing()
            self.edit_submitted.emit(text)

    def _render(self) -> None:
        start = time.perf_counter()
        html = render_plain(self._text) if self.role == "user" else render_markdown(self._text)
        self.browser.setHtml(html)
        elapsed_ms = (time.perf_counter() - start) * 1000
        self._render_timer.setInterval(max(RENDER_INTERVAL_MS, int(elapsed_ms / RENDER_BUDGET)))
