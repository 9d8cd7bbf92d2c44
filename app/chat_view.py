"""The conversation: a scrolling list of messages, an error banner, and the input box with Send / Stop.

The list follows the latest message (a new one, and a reply as it streams) until the user scrolls up; then a
"jump to latest" button floats over the list until they are back at the bottom. Messages sit in a centred column
no wider than READABLE_CHARS characters, so lines stay readable when the side panel is hidden.
"""

from __future__ import annotations

from collections.abc import Callable

from PySide6.QtCore import QEvent, Qt, QTimer, Signal
from PySide6.QtGui import QKeySequence, QShortcut
from PySide6.QtWidgets import (
    QFrame,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QScrollArea,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from app.message_widget import MessageWidget

COUNT_DELAY_MS = 250  # the token count follows the typing, a quarter second behind
MAX_INPUT_LINES = 8
SEND_HINTS = ("Send a message  (Enter to send, Shift+Enter for a new line)", "Send a message  (Shift+Enter: new line)",
              "Send a message")
READABLE_CHARS = 100  # the longest line of a message, in average characters of the message font
FOLLOW_SLACK = 24  # pixels from the bottom that still count as "at the latest message"
SAMPLE_TEXT = "The quick brown fox jumps over the lazy dog, then reads a KV cache: 0123456789. "


def readable_width(font_metrics) -> int:
    """Pixels of READABLE_CHARS characters of ordinary text in this font."""
    return round(font_metrics.horizontalAdvance(SAMPLE_TEXT) * READABLE_CHARS / len(SAMPLE_TEXT))


class ChatInput(QPlainTextEdit):
    """Enter sends, Shift+Enter starts a new line; grows with its text up to MAX_INPUT_LINES."""

    submitted = Signal()

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("chatInput")
        self.setTabChangesFocus(True)
        self.set_hint(*SEND_HINTS)
        self.document().contentsChanged.connect(self._fit_height)
        self._fit_height()

    def keyPressEvent(self, event) -> None:  # noqa: N802 (Qt override)
        enter = event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter)
        if enter and not event.modifiers() & Qt.KeyboardModifier.ShiftModifier:
            self.submitted.emit()
            return
        super().keyPressEvent(event)

    def set_hint(self, *hints: str) -> None:
        """The placeholder: the first of these that fits the box on one line (the last one elided if none does)."""
        self._hints = hints
        self._fit_hint()

    def resizeEvent(self, event) -> None:  # noqa: N802 (Qt override)
        super().resizeEvent(event)
        self._fit_hint()

    def _fit_hint(self) -> None:
        metrics, width = self.fontMetrics(), self.viewport().width() - 2 * int(self.document().documentMargin()) - 4
        fitting = [hint for hint in self._hints if metrics.horizontalAdvance(hint) <= width]
        text = fitting[0] if fitting else metrics.elidedText(self._hints[-1], Qt.TextElideMode.ElideRight, width)
        if text != self.placeholderText():
            self.setPlaceholderText(text)

    def _fit_height(self) -> None:
        line = self.fontMetrics().lineSpacing()
        lines = min(max(self.document().lineCount(), 1), MAX_INPUT_LINES)
        margins = self.contentsMargins()
        self.setFixedHeight(lines * line + 2 * int(self.document().documentMargin()) + margins.top()
                            + margins.bottom() + 8)


class ChatView(QWidget):
    """Shows the messages; asks (through signals) for sends, stops, regenerations and edits."""

    send_requested = Signal(str)
    stop_requested = Signal()
    regenerate_requested = Signal()
    edit_requested = Signal(str, int)  # the new text, and the index of the user message edited
    branch_requested = Signal(int, int)  # the index of an edited user message, and its version to show (from 0)

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.messages: list[MessageWidget] = []
        self.branch_positions: dict[int, tuple[int, int]] = {}  # message index -> (version shown, versions)
        self._generating = False
        self.count_tokens: Callable[[str], int] | None = None  # the model's count of a message (set on load)
        self.send_warning: Callable[[str, int], str] | None = None  # (text, tokens) -> a warning, or ""
        self._warned_text: str | None = None  # a warned message is sent by a second Enter
        self.following = True  # the list keeps the latest message in view
        self.setMinimumWidth(340)
        self._build()
        self._refresh_actions()

    # --- messages ----------------------------------------------------------------------------------------------
    def add_message(self, role: str, text: str) -> MessageWidget:
        widget = MessageWidget(role, text, self._list)
        widget.regenerate_clicked.connect(self.regenerate_requested.emit)
        widget.edit_submitted.connect(lambda text, w=widget: self.edit_requested.emit(text, self.messages.index(w)))
        widget.branch_stepped.connect(lambda step, w=widget: self._step_branch(self.messages.index(w), step))
        row = QWidget(self.column)  # a widget, not a bare layout: see remove_last
        layout = QHBoxLayout(row)
        layout.setContentsMargins(0, 0, 0, 0)
        if role == "user":
            layout.addStretch(1)
        layout.addWidget(widget, 6)
        self._list_layout.insertWidget(self._list_layout.count() - 1, row)
        self.messages.append(widget)
        self._placeholder.hide()
        self._refresh_actions()
        self.follow_latest()
        return widget

    def remove_last(self) -> None:
        if not self.messages:
            return
        # The row is a QObject, so Qt tells PySide when it is gone. A bare row layout taken out of the list left
        # PySide wrappers of its spacer and widget items behind; once Qt reused their addresses, a new message's
        # widgets came back as those stale wrappers (a crash after some 30 new chats).
        row = self.messages.pop().parentWidget()
        self._list_layout.removeWidget(row)
        row.hide()
        row.deleteLater()
        self._placeholder.setVisible(not self.messages)
        self._refresh_actions()

    def clear(self) -> None:
        self.keep_first(0)

    def keep_first(self, count: int) -> None:
        """Remove the messages after the first `count`."""
        while len(self.messages) > count:
            self.remove_last()

    def set_branch_positions(self, positions: dict[int, tuple[int, int]]) -> None:
        """The "‹ shown/count ›" switchers: on these messages (by index), and on no other."""
        self.branch_positions = dict(positions)
        for i, message in enumerate(self.messages):
            message.set_branch(self.branch_positions.get(i))

    def _step_branch(self, index: int, step: int) -> None:
        shown, count = self.branch_positions.get(index, (1, 1))
        if 1 <= shown + step <= count and not self._generating:
            self.branch_requested.emit(index, shown + step - 1)

    def set_messages(self, messages: list[tuple[str, str]]) -> None:
        self.clear()
        for role, text in messages:
            self.add_message(role, text)

    def keep_messages(self, messages: list[tuple[str, str]]) -> None:
        """Show these messages, keeping the widgets (and their footers) of the leading ones that are unchanged:
        only what differs from the end is removed and added again."""
        shown, same = self.message_texts(), 0
        while same < min(len(messages), len(shown)) and shown[same] == messages[same]:
            same += 1
        while len(self.messages) > same:
            self.remove_last()
        for role, text in messages[same:]:
            self.add_message(role, text)

    def message_texts(self) -> list[tuple[str, str]]:
        return [(m.role, m.text) for m in self.messages]

    def append_to_last(self, piece: str) -> None:
        """Streaming text; the list follows it as it grows unless the user has scrolled up."""
        if self.messages and self.messages[-1].role == "assistant":
            self.messages[-1].append_text(piece)

    # --- state ----------------------------------------------------------------------------------------------------
    def set_generating(self, generating: bool) -> None:
        self._generating = generating
        self.stop_shortcut.setEnabled(generating)  # Escape stops a reply; otherwise it is the editor's to cancel
        self.send_button.setText("Stop" if generating else "Send")
        self.send_button.setProperty("stop", generating)
        self.send_button.style().unpolish(self.send_button)
        self.send_button.style().polish(self.send_button)
        self._refresh_actions()

    @property
    def generating(self) -> bool:
        return self._generating

    def set_input_enabled(self, enabled: bool, reason: str = "") -> None:
        self.input.setEnabled(enabled)
        self.send_button.setEnabled(enabled or self._generating)
        self.input.set_hint(*((reason,) if reason else SEND_HINTS))

    def show_error(self, message: str) -> None:
        self._error_label.setText(message)
        self._error_banner.show()

    def clear_error(self) -> None:
        self._error_banner.hide()

    @property
    def error_text(self) -> str:
        return self._error_label.text() if self._error_banner.isVisibleTo(self) else ""

    def follow_latest(self) -> None:
        """Show the latest message now and keep it in view as the list grows (Send, a new reply, the jump button)."""
        self.following = True
        bar = self.scroll.verticalScrollBar()
        bar.setValue(bar.maximum())
        self._update_jump_button()

    scroll_to_bottom = follow_latest

    @property
    def at_bottom(self) -> bool:
        bar = self.scroll.verticalScrollBar()
        return bar.value() >= bar.maximum() - FOLLOW_SLACK

    # --- internals ---------------------------------------------------------------------------------------------
    def _build(self) -> None:
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(0)
        self.scroll = QScrollArea(self, widgetResizable=True, objectName="chatScroll")
        self.scroll.setFrameShape(QFrame.Shape.NoFrame)
        self.scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)  # messages wrap instead
        self._list = QWidget(objectName="chatList")
        centre = QHBoxLayout(self._list)
        centre.setContentsMargins(0, 0, 0, 0)
        self.column = QWidget(self._list, objectName="chatColumn")
        centre.addStretch(1)
        centre.addWidget(self.column, 1000)  # as wide as the view, up to its maximum; then centred
        centre.addStretch(1)
        self._list_layout = QVBoxLayout(self.column)
        self._list_layout.setContentsMargins(24, 16, 24, 16)
        self._list_layout.setSpacing(12)
        self._list_layout.addStretch(1)
        margins = self._list_layout.contentsMargins()
        self.column.setMaximumWidth(readable_width(self.fontMetrics()) + 32 + margins.left() + margins.right())
        self.scroll.setWidget(self._list)
        layout.addWidget(self.scroll, 1)
        hint = "Start a conversation.\nThe side panel shows what the KV cache does, token by token."
        self._placeholder = QLabel(hint, self.column, objectName="placeholder", wordWrap=True,
                                   alignment=Qt.AlignmentFlag.AlignCenter)
        self._list_layout.insertWidget(0, self._placeholder)
        self._build_jump_button()
        self.stop_shortcut = QShortcut(QKeySequence("Escape"), self, self.stop_requested.emit,
                                       context=Qt.ShortcutContext.WindowShortcut)
        self.stop_shortcut.setEnabled(False)
        layout.addWidget(self._build_error_banner())
        layout.addWidget(self._build_input_row())

    def _build_error_banner(self) -> QFrame:
        self._error_banner = QFrame(self, objectName="errorBanner")
        row = QHBoxLayout(self._error_banner)
        row.setContentsMargins(12, 6, 6, 6)
        self._error_label = QLabel(self._error_banner, wordWrap=True, objectName="errorLabel")
        self._error_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        close = QToolButton(self._error_banner, text="Dismiss", objectName="messageAction")
        close.clicked.connect(self.clear_error)
        row.addWidget(self._error_label, 1)
        row.addWidget(close)
        self._error_banner.hide()
        return self._error_banner

    def _build_input_row(self) -> QFrame:
        frame = QFrame(self, objectName="inputFrame")
        column = QVBoxLayout(frame)
        column.setContentsMargins(16, 10, 16, 8)
        column.setSpacing(4)
        row = QHBoxLayout()
        self.input = ChatInput(frame)
        self.input.submitted.connect(self._submit)
        self.send_button = QPushButton("Send", frame, objectName="sendButton")
        self.send_button.setMinimumWidth(84)
        self.send_button.clicked.connect(self._send_or_stop)
        row.addWidget(self.input, 1)
        row.addWidget(self.send_button, 0, Qt.AlignmentFlag.AlignBottom)
        column.addLayout(row)
        self.token_count = QLabel("", frame, objectName="muted", wordWrap=True)  # "12 tokens", or the warning
        self.token_count.hide()
        column.addWidget(self.token_count)
        self._count_timer = QTimer(self, singleShot=True, interval=COUNT_DELAY_MS)
        self._count_timer.timeout.connect(self.update_token_count)
        self.input.document().contentsChanged.connect(self._count_timer.start)
        return frame

    def update_token_count(self) -> int | None:
        """Show the message's token count under the input (nothing while the model is unknown)."""
        text = self.input.toPlainText()
        if self.count_tokens is None or not text.strip():
            self.token_count.hide()
            return None
        tokens = self.count_tokens(text)
        if self._warned_text != text:
            self._warned_text = None
            self.token_count.setText(f"{tokens:,} tokens")
        self.token_count.show()
        return tokens

    def _warning(self, text: str) -> str:
        tokens = self.update_token_count()
        if tokens is None or self.send_warning is None or self._warned_text == text:
            return ""
        return self.send_warning(text, tokens)

    def _send_or_stop(self) -> None:
        if self._generating:
            self.stop_requested.emit()
        else:
            self._submit()

    def _submit(self) -> None:
        text = self.input.toPlainText().strip()
        if not text or self._generating or not self.input.isEnabled():
            return
        warning = self._warning(self.input.toPlainText())
        if warning:  # said once; a second Enter (or Send) sends it
            self._warned_text = self.input.toPlainText()
            self.token_count.setText(warning)
            return
        self._warned_text = None
        self.input.clear()
        self.send_requested.emit(text)

    def _refresh_actions(self) -> None:
        idle = not self._generating
        for i, message in enumerate(self.messages):
            last = i == len(self.messages) - 1
            message.set_actions(edit=idle and message.role == "user",  # any: a new version of it, the old one kept
                                regenerate=idle and last and message.role == "assistant")
            message.branch_box.setEnabled(idle)  # another version is shown between replies, not during one

    # --- following the latest message ---------------------------------------------------------------------------
    def _build_jump_button(self) -> None:
        self.jump_button = QToolButton(self.scroll, text="↓  Jump to latest", objectName="jumpToLatest",
                                       toolTip="Scroll to the latest message and follow it")
        self.jump_button.setCursor(Qt.CursorShape.PointingHandCursor)
        self.jump_button.clicked.connect(self.follow_latest)
        self.jump_button.hide()
        bar = self.scroll.verticalScrollBar()
        bar.rangeChanged.connect(self._on_range_changed)
        bar.valueChanged.connect(self._on_scrolled)
        self.scroll.installEventFilter(self)

    def _on_range_changed(self, _minimum: int, maximum: int) -> None:
        """The list grew or shrank (a new message, streamed text, a narrower view): keep following."""
        if self.following:
            self.scroll.verticalScrollBar().setValue(maximum)
        self._update_jump_button()

    def _on_scrolled(self, _value: int) -> None:
        self.following = self.at_bottom
        self._update_jump_button()

    def _update_jump_button(self) -> None:
        show = not self.following and not self.at_bottom
        if show:
            self.jump_button.adjustSize()
            area = self.scroll.viewport().geometry()
            self.jump_button.move(area.center().x() - self.jump_button.width() // 2,
                                  area.bottom() - self.jump_button.height() - 12)
            self.jump_button.raise_()
        self.jump_button.setVisible(show)

    def eventFilter(self, watched, event) -> bool:  # noqa: N802 (Qt override)
        if watched is self.scroll and event.type() == QEvent.Type.Resize:
            self._update_jump_button()
        return super().eventFilter(watched, event)
