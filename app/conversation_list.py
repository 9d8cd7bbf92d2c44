"""The conversations sidebar: saved conversations newest first, a search box, New, Rename and Delete; and the
controller that keeps the open conversation saved and opens another one with its chat, plots and figures.

Saving is automatic: after every change the worker reports while no reply is streaming (a finished turn, a
failed one put back, a system prompt), the open conversation is written to its file (app.conversation_store)
with the reply footers' figures, the step log (the plots) and the last Compare result. A new chat gets its
file with its first message.
"""

from __future__ import annotations

import time
from pathlib import Path

from PySide6.QtCore import QEvent, QObject, QSettings, QSize, Qt, Signal, Slot
from PySide6.QtWidgets import (
    QHBoxLayout,
    QInputDialog,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QMessageBox,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from app import storage
from app.branch_controller import add_records, turn_steps
from app.conversation_store import ConversationStore, Entry, default_folder, title_from

MIN_WIDTH = 180  # narrower than this beside the other panes' minimums, the sidebar folds away
OPEN_WIDTH = 210  # the sidebar's width when it opens again
ID_ROLE = Qt.ItemDataRole.UserRole


def folder_for(settings) -> Path:
    """Beside an ini settings file (tests, portable setups), else in the user data directory."""
    q = getattr(settings, "q", None)
    if isinstance(q, QSettings) and q.format() == QSettings.Format.IniFormat:
        return Path(q.fileName()).resolve().parent / "conversations"
    return default_folder()


def when(seconds: float) -> str:
    """'14:05' today, '3 Dec' this year, '3 Dec 2025' before."""
    then, now = time.localtime(seconds), time.localtime()
    if then[:3] == now[:3]:
        return time.strftime("%H:%M", then)
    return time.strftime("%-d %b" if then.tm_year == now.tm_year else "%-d %b %Y", then)


class ConversationList(QWidget):
    """The sidebar widget. It only shows entries and asks; the Conversations controller does the work."""

    open_requested = Signal(str)
    new_requested = Signal()
    rename_requested = Signal(str)
    delete_requested = Signal(str)
    search_changed = Signal(str)
    conversation_reported = Signal(object)  # the worker's conversation dict, relayed (see relay)

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent, objectName="conversationList")
        self.search = QLineEdit(self, placeholderText="Search conversations", clearButtonEnabled=True)
        self.new_button = QPushButton("New chat", self, toolTip="Start a new conversation (Ctrl+N)")
        self.list = QListWidget(self)
        self.list.setWordWrap(True)
        self.list.setTextElideMode(Qt.TextElideMode.ElideRight)
        self.rename_button = QPushButton("Rename", self, toolTip="Rename the selected conversation (F2)")
        self.delete_button = QPushButton("Delete", self, toolTip="Delete the selected conversation's file (Del)")
        buttons = QHBoxLayout()
        buttons.setContentsMargins(0, 0, 0, 0)
        buttons.addWidget(self.rename_button)
        buttons.addWidget(self.delete_button)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(6, 6, 6, 6)
        for widget in (self.new_button, self.search, self.list):
            layout.addWidget(widget)
        layout.addLayout(buttons)
        self.new_button.clicked.connect(self.new_requested)
        self.search.textChanged.connect(self.search_changed)
        self.list.itemActivated.connect(lambda item: self.open_requested.emit(item.data(ID_ROLE)))
        self.list.itemClicked.connect(lambda item: self.open_requested.emit(item.data(ID_ROLE)))
        self.list.currentItemChanged.connect(lambda *_: self._enable_buttons())
        self.rename_button.clicked.connect(lambda: self._ask(self.rename_requested))
        self.delete_button.clicked.connect(lambda: self._ask(self.delete_requested))
        self._enable_buttons()

    def minimumSizeHint(self) -> QSize:  # noqa: N802 (Qt override)
        """No minimum width: the sidebar folds away (SidebarFit) rather than widening the window's minimum."""
        return QSize(0, super().minimumSizeHint().height())

    def keyPressEvent(self, event) -> None:  # noqa: N802 (Qt override)
        if event.key() == Qt.Key.Key_F2:
            self._ask(self.rename_requested)
        elif event.key() == Qt.Key.Key_Delete and not self.search.hasFocus():
            self._ask(self.delete_requested)
        else:
            super().keyPressEvent(event)

    def set_entries(self, entries: list[Entry], current: str | None) -> None:
        self.list.blockSignals(True)
        self.list.clear()
        for entry in entries:
            detail = entry.error or f"{entry.num_messages} messages · {when(entry.updated)}"
            item = QListWidgetItem(f"{entry.title}\n{detail}")
            item.setData(ID_ROLE, entry.id)
            item.setToolTip(entry.error or entry.title)
            if entry.error:
                item.setForeground(Qt.GlobalColor.gray)
            self.list.addItem(item)
            if entry.id == current:
                self.list.setCurrentItem(item)
        self.list.blockSignals(False)
        self._enable_buttons()

    @Slot(object)
    def relay(self, data) -> None:
        """The worker's report, received by this widget: the connection goes with it when the window closes."""
        self.conversation_reported.emit(data)

    def ids(self) -> list[str]:
        return [self.list.item(i).data(ID_ROLE) for i in range(self.list.count())]

    def selected_id(self) -> str | None:
        item = self.list.currentItem()
        return item.data(ID_ROLE) if item is not None else None

    def _ask(self, signal) -> None:
        chosen = self.selected_id()
        if chosen is not None:
            signal.emit(chosen)

    def _enable_buttons(self) -> None:
        chosen = self.list.currentItem() is not None
        self.rename_button.setEnabled(chosen)
        self.delete_button.setEnabled(chosen)


class SidebarFit(QObject):
    """Folds the sidebar away (the splitter's first pane, collapsible) when the window is too narrow for it
    beside the chat's and the side panel's minimum widths, and opens it again when the room comes back; dragging
    the splitter's handle opens it at any width."""

    def __init__(self, window, splitter):
        super().__init__(window)
        self.window, self.splitter = window, splitter
        self.folded = False
        splitter.setCollapsible(0, True)
        window.installEventFilter(self)

    def needed_width(self) -> int:
        """The sidebar's minimum beside the other panes' minimums, the handles and the window's margins."""
        panes = [self.splitter.widget(i) for i in range(1, self.splitter.count())]
        others = sum(max(pane.minimumWidth(), pane.minimumSizeHint().width()) for pane in panes if pane.isVisible())
        return MIN_WIDTH + others + self.splitter.count() * self.splitter.handleWidth() + 16

    def eventFilter(self, watched, event) -> bool:  # noqa: N802 (Qt override)
        if watched is self.window and event.type() == QEvent.Type.Resize:
            self.fit(event.size().width())
        return False

    def fit(self, width: int) -> None:
        sizes = self.splitter.sizes()
        if width < self.needed_width() and sizes[0] > 0:
            self.folded = True
            self.splitter.setSizes([0, sizes[1] + sizes[0] // 2, sizes[2] + sizes[0] - sizes[0] // 2])
        elif width >= self.needed_width() and self.folded and sizes[0] == 0:
            self.folded = False
            self.splitter.setSizes([OPEN_WIDTH, max(sizes[1] - OPEN_WIDTH // 2, 1), max(sizes[2] - OPEN_WIDTH // 2,
                                                                                        1)])


class Conversations:
    """Keeps the window's conversation saved, and switches between saved ones."""

    def __init__(self, window, widget: ConversationList | None = None, store: ConversationStore | None = None):
        self.window = window
        self.store = store or ConversationStore(folder_for(window.settings))
        self.current: str | None = None  # the open conversation's id (None: a new chat not saved yet)
        self.title: str | None = None  # its title as saved or renamed (None: from its first message)
        self.compare: dict | None = None  # its last Compare result, saved form
        self._saved: tuple | None = None  # what was last saved or opened: the same again is not written
        self.widget = widget or ConversationList(window)
        self.fit = SidebarFit(window, window.splitter) if self.widget.parent() is window.splitter else None
        w = self.widget
        w.new_requested.connect(window.new_chat)
        w.open_requested.connect(self.open)
        w.rename_requested.connect(self.ask_rename)
        w.delete_requested.connect(self.ask_delete)
        w.search_changed.connect(lambda _text: self.refresh())
        window.client.signals.conversation.connect(w.relay)
        w.conversation_reported.connect(self._on_conversation)
        self.refresh()

    # --- what the window tells it ---------------------------------------------------------------------------------
    def new_chat_started(self) -> None:
        """The window started a new chat: the next save creates a new file."""
        self.current, self.title, self.compare = None, None, None
        self.refresh()

    def set_compare(self, result: dict | None) -> None:
        self.compare = result
        self.save()

    def _on_conversation(self, data: dict) -> None:
        if not self.window.generating and data.get("messages"):
            self.save(data)

    # --- actions --------------------------------------------------------------------------------------------------
    def save(self, data: dict | None = None) -> bool:
        w = self.window
        data = data if data is not None else w.snapshot
        if not data.get("messages"):
            return False
        if self.current is None:
            self.current = self.store.new_id()
        replies, extras = record_of(w, data)
        signature = (self.current, repr(data), repr(replies), self.title, len(w.metrics.log.rows), id(self.compare),
                     w.branching.revision, len(w.metrics.log.pools))
        if signature == self._saved:
            return True
        try:
            self.store.save(self.current, data, replies, self.title or "", compare=self.compare, **extras)
        except storage.StorageError as e:
            w.chat.show_error(f"The conversation could not be saved: {e}")
            return False
        self._saved = signature
        self.refresh()
        return True

    def open(self, conversation_id: str) -> bool:
        w = self.window
        if conversation_id == self.current:
            return True
        if w.generating or w.loading:
            w.status.showMessage("Wait for the reply (or Stop it) before opening another conversation", 5000)
            self.refresh()
            return False
        try:
            saved = self.store.open(conversation_id)
        except storage.StorageError as e:
            w.chat.show_error(str(e))
            self.refresh()
            return False
        show_saved(w, saved)
        title = saved.title or title_from([{"role": m.role, "content": m.content} for m in saved.conversation.messages])
        w.status.showMessage(f"Opened “{title}”", 4000)
        self.current, self.title, self.compare = conversation_id, saved.title or None, saved.compare
        self._saved = (conversation_id, repr(storage.conversation_dict(saved.conversation)), repr(saved.replies),
                       self.title, len(w.metrics.log.rows), id(self.compare), w.branching.revision,
                       len(w.metrics.log.pools))
        if hasattr(w, "compare"):
            w.compare.show_saved(saved.compare)
        self.refresh()
        return True

    def ask_rename(self, conversation_id: str) -> None:
        entry = next((e for e in self.store.entries() if e.id == conversation_id), None)
        title, ok = QInputDialog.getText(self.window, "Rename conversation", "Title:",
                                         text=entry.title if entry else "")
        self.window.restore_focus()
        if ok:
            self.rename(conversation_id, title)

    def rename(self, conversation_id: str, title: str) -> bool:
        try:
            self.store.rename(conversation_id, title)
        except storage.StorageError as e:
            self.window.chat.show_error(str(e))
            return False
        if conversation_id == self.current:
            self.title = " ".join(title.split())
        self.refresh()
        return True

    def ask_delete(self, conversation_id: str) -> None:
        entry = next((e for e in self.store.entries() if e.id == conversation_id), None)
        answer = QMessageBox.question(self.window, "Delete conversation",
                                      f"Delete “{entry.title if entry else conversation_id}”? Its file is removed.")
        self.window.restore_focus()
        if answer == QMessageBox.StandardButton.Yes:
            self.delete(conversation_id)

    def delete(self, conversation_id: str) -> bool:
        if conversation_id == self.current and (self.window.generating or self.window.loading):
            self.window.status.showMessage("Stop the reply before deleting this conversation", 5000)
            return False
        try:
            self.store.delete(conversation_id)
        except storage.StorageError as e:
            self.window.chat.show_error(str(e))
            return False
        if conversation_id == self.current:
            self.window.new_chat()  # the open conversation is gone: start afresh
        self.refresh()
        return True

    def refresh(self) -> None:
        self.widget.set_entries(self.store.entries(self.widget.search.text()), self.current)


def record_of(window, data: dict) -> tuple[list[dict | None], dict]:
    """What is saved with the worker's conversation dict: each reply's figures, and the extras (footers as shown,
    the step log with its turn starts and block-map states, the versions edits kept)."""
    n = len(data["messages"])
    messages = window.chat.messages[:n]
    replies = [getattr(m, "reply", None) for m in messages]
    footers = [m.footer.text() if m.role == "assistant" else "" for m in messages]
    log = window.metrics.log
    num_turns = sum(1 for m in data["messages"] if m.get("role") == "user")
    return replies, {"footers": footers, "steps": log.rows, "turn_steps": turn_steps(window, num_turns),
                     "pools": log.pools, "forks": window.branching.forks}


def show_saved(window, saved: storage.SavedChat) -> None:
    """The window shows a saved conversation: chat with footers, plots from its steps, its last figures, its block
    map as saved, its versions; the worker gets the conversation (its next turn prefills the history)."""
    w = window
    conv = saved.conversation
    w.chat.clear()
    records = storage.with_replies(storage.conversation_dict(conv), saved.replies, saved.footers)["messages"]
    last_done = add_records(w, records)
    w.chat.clear_error()
    w.metrics.clear()
    w.metrics.new_conversation()
    w.metrics.add_saved(saved.steps, saved.turn_steps, saved.pools)
    if last_done is not None:
        w.metrics.turn_finished(last_done)
    w.branching.reset(saved.forks)
    w.show_saved_pools()
    w.show_last_reply(last_done)
    w.snapshot = storage.conversation_dict(conv)  # what the worker holds from now on
    w.client.open_conversation(conv)
