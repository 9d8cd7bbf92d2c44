"""Conversation files: atomic save (temp file in the same folder, flush, fsync, os.replace) and validated open.

A file that is not a kvscope conversation raises StorageError with a message fit for the user; nothing else
changes, so the caller can show the message and carry on.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path

from engine.chat import Conversation, ConversationFormatError

MAX_FILE_BYTES = 64 * 1024 * 1024


class StorageError(ValueError):
    """A conversation could not be saved or opened; the message says why."""


def save_conversation(path: str | Path, data: dict | Conversation) -> None:
    """Write the conversation (a Conversation or its to_dict()) so the file is either old or new, never half."""
    path = Path(path)
    if isinstance(data, Conversation):
        data = data.to_dict()
    text = json.dumps(data, ensure_ascii=False, indent=2)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:
        raise StorageError(f"Could not save to {path}: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, UnicodeEncodeError) as e:
        _remove_quietly(tmp)
        raise StorageError(f"Could not save to {path}: {getattr(e, 'strerror', None) or e}") from None
    _fsync_dir(path.parent)


def open_conversation(path: str | Path) -> Conversation:
    """Read and validate a conversation file."""
    path = Path(path)
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            raise StorageError(f"{path.name} is too large to be a conversation ({path.stat().st_size:,} bytes)")
        raw = path.read_text(encoding="utf-8")
    except OSError as e:
        raise StorageError(f"Could not open {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise StorageError(f"{path.name} is not a kvscope conversation: it is not UTF-8 text") from None
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as e:
        raise StorageError(f"{path.name} is not a kvscope conversation: invalid JSON ({e.msg}, line {e.lineno})") \
            from None
    except RecursionError:
        raise StorageError(f"{path.name} is not a kvscope conversation: its JSON is nested too deeply") from None
    except ValueError as e:  # a number of more digits than Python converts to an int
        raise StorageError(f"{path.name} is not a kvscope conversation: {e}") from None
    if not _is_unicode(data):
        raise StorageError(f"{path.name} is not a kvscope conversation: its text holds an unpaired surrogate (a "
                           "\\ud800-\\udfff escape), which is not Unicode")
    try:
        return Conversation.from_dict(data)
    except ConversationFormatError as e:
        raise StorageError(f"{path.name} is not a kvscope conversation: {e}") from None


def _is_unicode(data) -> bool:
    """Whether the data can be written back as UTF-8 (JSON escapes can decode to lone surrogates)."""
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _remove_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def _fsync_dir(folder: Path) -> None:
    """Make the rename itself durable where the platform allows it."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
