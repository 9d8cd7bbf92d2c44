"""Conversation files: atomic save (temp file in the same folder, flush, fsync, os.replace) and validated open.

Format versions (`"format": "kvscope-conversation"`):
  1  system prompt, context start, and each message's role and text;
  2  the same, and each reply's figures — what its footer shows — under "reply": prompt and generated tokens,
     time to first token, tokens/s, prefix reused, strategy, why it ended ("cancelled" is the stopped tag) and
     the speculative-decoding counts.
  3  the same, and what the conversation list keeps: its "title", each reply's "footer" as shown (with the
     weights and KV precision it ran under), each reply's generated "token_ids" (so a
     Compare replays the exact tokens), the step log's rows ("steps", app.step_log's columns: the plots) and the
     last Compare result ("compare", engine.replay_result's saved form). Every one of them is optional.
  4  the same, and what the step log needs to follow edits and the block map: "turn_steps" (for each user message,
     the index of the first step row of its turn, null where not known), "pools" (the block map's state after a
     turn's last step: app.pool_snapshot records, each with the "step" row it follows) and "branches" (the
     versions an edit kept, app.branches: [{"at": index of the edited user message, "alternatives": [null for
     the version shown (the messages above), or {"messages", "steps", "turn_steps", "pools", "branches"} from
     that message on]}]). Every one of them is optional.
Files of versions 1, 2 and 3 still open (their replies have no figures, or no steps; version 3's turn starts are
read from its steps where each turn's prefill shows where it began).
A file that is not a kvscope conversation, or whose figures are malformed, raises StorageError with a message fit
for the user; nothing else changes, so the caller can show the message and carry on.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from app.branches import Fork, Tail
from engine.chat import FORMAT_NAME, Conversation, ConversationFormatError
from engine.events import DoneEvent

MAX_FILE_BYTES = 64 * 1024 * 1024
VERSION = 4
VERSIONS = (1, 2, 3, 4)
MAX_BRANCH_DEPTH = 100  # versions inside versions: deeper than this is not a file kvscope wrote
MAX_TITLE = 200
FINISH_REASONS = ("stop", "length", "cancelled", "budget")  # budget: the turn reached the KV budget
# a reply's figures: the DoneEvent fields its footer shows, and their kinds (int counts, float figures)
REPLY_FIELDS = {"n_prompt_tokens": int, "n_generated_tokens": int, "ttft_ms": float, "decode_tok_s": float,
                "finish_reason": str, "strategy": str, "prefix_hit_tokens": int, "n_decode_steps": int,
                "n_decode_forwards": int, "n_drafted": int, "n_accepted": int}
REQUIRED = ("n_prompt_tokens", "n_generated_tokens", "ttft_ms", "decode_tok_s", "finish_reason", "strategy",
            "prefix_hit_tokens")


@dataclass
class SavedChat:
    """An opened file: the conversation, and for each of its messages the reply's figures (None: none saved)."""

    conversation: Conversation
    replies: list[dict | None] = field(default_factory=list)
    title: str = ""
    steps: list[tuple] = field(default_factory=list)  # the step log's rows (app.step_log.CSV_COLUMNS)
    compare: dict | None = None  # a CompareResult's saved form
    footers: list[str] = field(default_factory=list)  # per message, the footer as shown ("": none saved)
    turn_steps: list[int | None] = field(default_factory=list)  # per user message, its turn's first step row
    pools: dict[int, dict] = field(default_factory=dict)  # step row -> the block map's state after it
    forks: dict[int, Fork] = field(default_factory=dict)  # the versions edits kept (app.branches)

    def done_event(self, index: int) -> DoneEvent | None:
        """The saved reply as the DoneEvent its footer was made from (text: the message's)."""
        reply = self.replies[index]
        return None if reply is None else DoneEvent(self.conversation.messages[index].content, **reply)


def reply_record(done) -> dict:
    """What a finished reply's footer shows, as a JSON-ready record."""
    return {name: kind(getattr(done, name)) for name, kind in REPLY_FIELDS.items() if hasattr(done, name)}


class StorageError(ValueError):
    """A conversation could not be saved or opened; the message says why."""


def save_conversation(path: str | Path, data: dict | Conversation, replies: list[dict | None] | None = None,
                      extras: dict | None = None) -> None:
    """Write the conversation (a Conversation or its to_dict(), whose messages may carry "token_ids") with each
    reply's figures (replies[i] for message i, from reply_record) and the extras (title, steps, compare, footers,
    turn_steps, pools, forks) in the current format, so the file is either old or new, never half."""
    path = Path(path)
    if isinstance(data, Conversation):
        data = conversation_dict(data)
    extras = extras or {}
    record = with_replies(data, replies or [], extras.get("footers") or [])
    record.update({k: v for k, v in extras.items() if k in ("title", "steps", "compare") and v is not None})
    record.update(_log_record(extras.get("turn_steps"), extras.get("pools"), extras.get("forks")))
    try:
        text = json.dumps(record, ensure_ascii=False, indent=2, allow_nan=False)
    except ValueError as e:
        raise StorageError(f"Could not save to {path}: {e}") from None
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


def conversation_dict(conv: Conversation) -> dict:
    """to_dict() with each generated reply's token ids (what a Compare replays)."""
    data = conv.to_dict()
    for record, message in zip(data["messages"], conv.messages):
        if message.token_ids:
            record["token_ids"] = list(message.token_ids)
    return data


def with_replies(data: dict, replies: list[dict | None], footers: list[str] | None = None) -> dict:
    """The conversation dict in the current version, each assistant message with its reply's figures (and the
    footer as shown)."""
    messages = [dict(m) for m in data.get("messages", [])]
    for message, reply in zip(messages, replies):
        if reply is not None and message.get("role") == "assistant":
            message["reply"] = dict(reply)
    for message, footer in zip(messages, footers or []):
        if footer and message.get("role") == "assistant":
            message["footer"] = footer
    return {**data, "version": VERSION, "messages": messages}


def open_conversation(path: str | Path) -> Conversation:
    """Read and validate a conversation file (any version)."""
    return open_chat(path).conversation


def open_chat(path: str | Path) -> SavedChat:
    """Read and validate a conversation file and the figures of its replies."""
    path = Path(path)
    data = _read_json(path)
    try:
        replies = _replies(data)
        conv = Conversation.from_dict(_as_version_1(data))
        _apply_token_ids(conv, data["messages"])
        steps = _steps(data)
        return SavedChat(conv, replies, _title(data), steps, _compare(data), _footers(data["messages"]),
                         _turn_steps(data, conv.messages, steps), _pools(data, steps),
                         _forks(data, [m.role for m in conv.messages], 0, 0))
    except ConversationFormatError as e:
        raise StorageError(f"{path.name} is not a kvscope conversation: {e}") from None


def _apply_token_ids(conv: Conversation, messages: list) -> None:
    for index, (message, record) in enumerate(zip(conv.messages, messages)):
        ids = record.get("token_ids")
        if ids is None:
            continue
        if message.role != "assistant" or not isinstance(ids, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 2**31 for i in ids):
            raise ConversationFormatError(f"message {index}'s token_ids must be a list of token ids on a reply")
        message.token_ids = tuple(ids)


def _footers(messages: list) -> list[str]:
    footers = [m.get("footer", "") for m in messages]
    if not all(isinstance(f, str) for f in footers):
        raise ConversationFormatError("a reply's footer must be a string")
    return footers


def _title(data: dict) -> str:
    title = data.get("title", "")
    if not isinstance(title, str):
        raise ConversationFormatError("title must be a string")
    return title[:MAX_TITLE]


def _steps(data: dict) -> list[tuple]:
    from app.step_log import SavedStep

    steps = data.get("steps", [])
    if not isinstance(steps, list):
        raise ConversationFormatError("steps must be a list of step rows")
    try:
        for row in steps:
            SavedStep.from_row(row)
    except ValueError as e:
        raise ConversationFormatError(f"its step log is malformed ({e})") from None
    return [tuple(row) for row in steps]


def _compare(data: dict) -> dict | None:
    from engine.replay_result import CompareResult

    compare = data.get("compare")
    if compare is None:
        return None
    try:
        CompareResult.from_dict(compare)
    except (ValueError, KeyError, TypeError) as e:
        raise ConversationFormatError(f"its Compare result is malformed ({e!r})") from None
    return compare


# --- version 4: turn starts, block-map snapshots and the versions edits kept ---------------------------------------
def _log_record(turn_steps, pools, forks) -> dict:
    """The step log's companions and the branches as saved (empty ones left out)."""
    record = {}
    if turn_steps and any(s is not None for s in turn_steps):
        record["turn_steps"] = list(turn_steps)
    if pools:
        record["pools"] = [{"step": row, **pools[row]} for row in sorted(pools)]
    if forks:
        record["branches"] = [{"at": at, "alternatives": [None if t is None else _tail_record(t)
                                                          for t in fork.alternatives]}
                              for at, fork in sorted(forks.items())]
    return record


def _tail_record(tail: Tail) -> dict:
    return {"messages": tail.messages, "steps": [list(row) for row in tail.steps],
            **_log_record(tail.turn_steps, tail.pools, tail.forks)}


def first_turn_steps(steps: list[tuple], num_turns: int) -> list[int | None]:
    """Where each turn begins in a log saved without turn starts (version 3): at each run of prefill rows, when
    there is one per turn; else not known."""
    starts = [i for i, row in enumerate(steps) if row[1] == "prefill" and (i == 0 or steps[i - 1][1] != "prefill")]
    return starts if len(starts) == num_turns else [None] * num_turns


def _turn_steps(data: dict, messages: list, steps: list[tuple]) -> list[int | None]:
    num_turns = sum(1 for m in messages if m.role == "user")
    raw = data.get("turn_steps")
    if raw is None:
        return first_turn_steps(steps, num_turns)
    known = [s for s in raw if s is not None] if isinstance(raw, list) else []
    if not isinstance(raw, list) or len(raw) != num_turns or not all(
            isinstance(s, int) and not isinstance(s, bool) and 0 <= s <= len(steps) for s in known) \
            or known != sorted(known) or raw[len(raw) - len(known):] != known:
        raise ConversationFormatError("turn_steps must give, for each user message in order, the step row its turn "
                                      "begins at (null, first, where not known)")
    return list(raw)


def _pools(data: dict, steps: list[tuple]) -> dict[int, dict]:
    from app.pool_snapshot import SavedPool

    raw = data.get("pools", [])
    if not isinstance(raw, list):
        raise ConversationFormatError("pools must be a list of block-map snapshots")
    pools = {}
    for record in raw:
        step = record.get("step") if isinstance(record, dict) else None
        if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step < len(steps):
            raise ConversationFormatError("a block-map snapshot must name the step row it follows")
        try:
            SavedPool.from_record(record)
        except ValueError as e:
            raise ConversationFormatError(str(e)) from None
        pools[step] = {k: v for k, v in record.items() if k != "step"}
    return pools


def _forks(data: dict, roles: list[str], first: int, depth: int) -> dict[int, Fork]:
    """The branch points of these messages (roles[0] is message `first`'s), each at one of their user messages."""
    raw = data.get("branches", [])
    if not isinstance(raw, list) or depth > MAX_BRANCH_DEPTH:
        raise ConversationFormatError("branches must be a list of branch points, nested at most "
                                      f"{MAX_BRANCH_DEPTH} deep")
    forks: dict[int, Fork] = {}
    for point in raw:
        at = point.get("at") if isinstance(point, dict) else None
        if not isinstance(at, int) or isinstance(at, bool) or not first <= at < first + len(roles) \
                or roles[at - first] != "user" or at in forks or set(point) != {"at", "alternatives"}:
            raise ConversationFormatError(f"a branch point at {at!r} is not at a user message of its messages")
        versions = point["alternatives"]
        if not isinstance(versions, list) or len(versions) < 2 or sum(v is None for v in versions) != 1:
            raise ConversationFormatError(f"the branch point at message {at} needs two or more alternatives, one "
                                          "of them null (the one shown)")
        forks[at] = Fork([None if v is None else _tail(v, at, depth + 1) for v in versions])
    return forks


def _tail(data, at: int, depth: int) -> Tail:
    """A kept version of message `at` and what followed it, checked as a conversation's messages are."""
    if not isinstance(data, dict) or not isinstance(data.get("messages"), list) or not data["messages"] \
            or set(data) - {"messages", "steps", "turn_steps", "pools", "branches"}:
        raise ConversationFormatError(f"an alternative at message {at} must be an object with its messages")
    as_file = {"format": FORMAT_NAME, "version": VERSION, "messages": data["messages"]}
    replies = _replies(as_file)
    conv = Conversation.from_dict(_as_version_1(as_file))
    _apply_token_ids(conv, data["messages"])
    if conv.messages[0].role != "user":
        raise ConversationFormatError(f"an alternative at message {at} must begin with the user's message")
    messages = with_replies(conversation_dict(conv), replies, _footers(data["messages"]))["messages"]
    steps = _steps(data)
    return Tail(messages, steps, _turn_steps(data, conv.messages, steps), _pools(data, steps),
                _forks(data, [m.role for m in conv.messages[1:]], at + 1, depth))


def _read_json(path: Path):
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
    return data


def _as_version_1(data):
    """Versions 2 and 3 less the replies' figures and token ids are version 1, which engine.chat reads."""
    if not isinstance(data, dict) or data.get("version") not in VERSIONS[1:] or not isinstance(data.get("messages"),
                                                                                                 list):
        return data
    messages = [{k: v for k, v in m.items() if k not in ("reply", "token_ids", "footer")} if isinstance(m, dict) else m
                for m in data["messages"]]
    return {**data, "version": 1, "messages": messages}


def _replies(data) -> list[dict | None]:
    if not isinstance(data, dict) or data.get("version") not in VERSIONS:
        return []  # Conversation.from_dict says what is wrong
    messages = data.get("messages") if isinstance(data.get("messages"), list) else []
    return [_reply(i, m.get("reply"), m.get("role")) if isinstance(m, dict) else None for i, m in enumerate(messages)]


def _reply(index: int, reply, role) -> dict | None:
    if reply is None:
        return None
    where = f"message {index}'s reply figures"
    if role != "assistant" or not isinstance(reply, dict):
        raise ConversationFormatError(f"{where} must be an object on an assistant message")
    missing = [name for name in REQUIRED if name not in reply]
    unknown = sorted(set(reply) - set(REPLY_FIELDS))
    if missing or unknown:
        raise ConversationFormatError(f"{where} lack {', '.join(missing)}" if missing else
                                      f"{where} have unknown fields {', '.join(unknown)}")
    for name, value in reply.items():
        _check_field(where, name, value)
    return {name: REPLY_FIELDS[name](value) for name, value in reply.items()}


def _check_field(where: str, name: str, value) -> None:
    kind = REPLY_FIELDS[name]
    if kind is str:
        ok = isinstance(value, str) and (name != "finish_reason" or value in FINISH_REASONS)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
    else:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
    if not ok:
        raise ConversationFormatError(f"{where}: {name} {value!r} is not a valid value")


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
