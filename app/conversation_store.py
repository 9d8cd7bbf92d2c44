"""The conversation list's files: one conversation per file in the user data directory, each written atomically
(app.storage), listed newest first, searched by text, renamed and deleted. No Qt widgets here.

A conversation gets its file when it is first saved (a new chat that is never used leaves nothing behind). Its id
is the file's name without ".json": the creation time and a random suffix, so names never collide and sort by age.
A file that cannot be read is listed as unreadable (with the reason) instead of being hidden or deleted.
"""

from __future__ import annotations

import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from app import storage

SUFFIX = ".json"
UNTITLED = "New chat"
TITLE_CHARS = 60


@dataclass(frozen=True)
class Entry:
    """What the sidebar shows of one conversation file."""

    id: str
    title: str
    updated: float  # the file's modification time (seconds since the epoch)
    num_messages: int
    text: str  # the title, system prompt and messages, lower-cased: what a search looks in
    error: str = ""  # why the file could not be read ("": it could)


def default_folder() -> Path:
    """<user data directory>/conversations (QStandardPaths' AppDataLocation: ~/.local/share/kvscope on Linux)."""
    from PySide6.QtCore import QStandardPaths

    base = QStandardPaths.writableLocation(QStandardPaths.StandardLocation.AppDataLocation)
    return Path(base or Path.home() / ".kvscope") / "conversations"


def title_from(messages: list[dict]) -> str:
    """The first user message's first line, shortened: the title a conversation has until it is renamed."""
    for message in messages:
        if message.get("role") == "user" and message.get("content", "").strip():
            line = message["content"].strip().splitlines()[0]
            return line if len(line) <= TITLE_CHARS else line[:TITLE_CHARS - 1].rstrip() + "…"
    return UNTITLED


class ConversationStore:
    def __init__(self, folder: str | Path | None = None):
        self.folder = Path(folder) if folder is not None else default_folder()
        self._cache: dict[str, tuple[float, Entry]] = {}  # id -> (mtime, entry): files are read again on change

    def new_id(self) -> str:
        return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)

    def path(self, conversation_id: str) -> Path:
        if not conversation_id or "/" in conversation_id or "\\" in conversation_id or conversation_id[0] == ".":
            raise storage.StorageError(f"{conversation_id!r} is not a conversation id")
        return self.folder / f"{conversation_id}{SUFFIX}"

    def save(self, conversation_id: str, data: dict, replies: list[dict | None], title: str | None = None,
             steps: list[tuple] | None = None, compare: dict | None = None, footers: list[str] | None = None,
             **log) -> None:
        """Write the conversation's file (created on first save). title None: keep the saved one, else the
        first user message's. log: turn_steps, pools and forks (app.storage's version 4)."""
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise storage.StorageError(f"Could not create {self.folder}: {e.strerror or e}") from None
        if title is None:
            title = self._saved_title(conversation_id) or title_from(data.get("messages", []))
        storage.save_conversation(self.path(conversation_id), data, replies,
                                  {"title": title, "steps": [list(row) for row in steps or []], "compare": compare,
                                   "footers": footers, **log})

    def open(self, conversation_id: str) -> storage.SavedChat:
        return storage.open_chat(self.path(conversation_id))

    def exists(self, conversation_id: str) -> bool:
        return self.path(conversation_id).is_file()

    def rename(self, conversation_id: str, title: str) -> None:
        title = " ".join(title.split())[:storage.MAX_TITLE]
        if not title:
            raise storage.StorageError("A conversation needs a title: type at least one character")
        saved = self.open(conversation_id)
        data = storage.conversation_dict(saved.conversation)
        storage.save_conversation(self.path(conversation_id), data, saved.replies,
                                  {"title": title, "steps": [list(r) for r in saved.steps], "compare": saved.compare,
                                   "footers": saved.footers, "turn_steps": saved.turn_steps, "pools": saved.pools,
                                   "forks": saved.forks})

    def delete(self, conversation_id: str) -> None:
        try:
            os.unlink(self.path(conversation_id))
        except FileNotFoundError:
            pass
        except OSError as e:
            raise storage.StorageError(f"Could not delete {self.path(conversation_id)}: {e.strerror or e}") from None
        self._cache.pop(conversation_id, None)

    def entries(self, search: str = "") -> list[Entry]:
        """Every conversation, most recently updated first; with search, those whose title or text holds it
        (case-insensitive; every word of the search, in any order)."""
        words = search.lower().split()
        found = [entry for entry in self._all() if all(word in entry.text for word in words)]
        return sorted(found, key=lambda e: (e.updated, e.id), reverse=True)

    # --- internals ------------------------------------------------------------------------------------------------
    def _all(self) -> list[Entry]:
        if not self.folder.is_dir():
            return []
        seen = {}
        for path in self.folder.glob(f"*{SUFFIX}"):
            if path.name.startswith("."):
                continue  # a temporary file of a save under way
            try:
                mtime = path.stat().st_mtime
            except OSError:
                continue  # deleted meanwhile
            cached = self._cache.get(path.stem)
            seen[path.stem] = cached if cached and cached[0] == mtime else (mtime, self._read(path, mtime))
        self._cache = seen
        return [entry for _, entry in seen.values()]

    def _read(self, path: Path, mtime: float) -> Entry:
        try:
            saved = storage.open_chat(path)
        except storage.StorageError as e:
            return Entry(path.stem, path.name, mtime, 0, path.name.lower(), str(e))
        conv = saved.conversation
        title = saved.title or title_from([{"role": m.role, "content": m.content} for m in conv.messages])
        text = "\n".join([title, conv.system_prompt or ""] + [m.content for m in conv.messages]).lower()
        return Entry(path.stem, title, mtime, len(conv.messages), text)

    def _saved_title(self, conversation_id: str) -> str:
        if not self.exists(conversation_id):
            return ""
        try:
            return self.open(conversation_id).title
        except storage.StorageError:
            return ""
