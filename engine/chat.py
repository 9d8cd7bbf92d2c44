"""Conversation: system prompt and turns, the chat template, and trimming at the context limit."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

FORMAT_NAME = "kvscope-conversation"
FORMAT_VERSION = 1
ROLES = ("user", "assistant")

_seq_ids = itertools.count(1)


class ConversationFormatError(ValueError):
    """A conversation file or dictionary is not one this program wrote."""


class PromptTooLong(ValueError):
    """Even the newest message alone does not fit in the context."""


@dataclass
class Message:
    role: str
    content: str
    token_ids: tuple[int, ...] | None = field(default=None, compare=False, repr=False)  # as generated


@dataclass
class Conversation:
    system_prompt: str | None = None
    messages: list[Message] = field(default_factory=list)
    context_start: int = 0  # messages before this index were trimmed from the model's view
    seq_id: int = field(default_factory=lambda: next(_seq_ids))

    def add(self, role: str, content: str, token_ids: tuple[int, ...] | None = None) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.messages.append(Message(role, content, token_ids))

    def snapshot(self) -> tuple:
        return (self.system_prompt, [Message(m.role, m.content, m.token_ids) for m in self.messages],
                self.context_start)

    def restore(self, snapshot: tuple) -> None:
        self.system_prompt, self.messages, self.context_start = snapshot[0], list(snapshot[1]), snapshot[2]

    def visible_messages(self) -> list[Message]:
        return self.messages[self.context_start:]

    def to_dict(self) -> dict:
        return {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "system_prompt": self.system_prompt,
            "context_start": self.context_start,
            "messages": [{"role": m.role, "content": m.content} for m in self.messages],
        }

    @classmethod
    def from_dict(cls, data: object) -> Conversation:
        if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
            raise ConversationFormatError("not a kvscope conversation (missing \"format\": \"kvscope-conversation\")")
        if data.get("version") != FORMAT_VERSION:
            raise ConversationFormatError(f"unsupported conversation version {data.get('version')!r}")
        system = data.get("system_prompt")
        if system is not None and not isinstance(system, str):
            raise ConversationFormatError("system_prompt must be a string or null")
        raw = data.get("messages")
        if not isinstance(raw, list):
            raise ConversationFormatError("messages must be a list")
        messages = [_message_from_dict(i, m) for i, m in enumerate(raw)]
        start = data.get("context_start", 0)
        if not isinstance(start, int) or not 0 <= start <= len(messages):
            raise ConversationFormatError(f"context_start {start!r} is out of range")
        return cls(system_prompt=system, messages=messages, context_start=start)


def _message_from_dict(index: int, m: object) -> Message:
    if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
        raise ConversationFormatError(f"message {index} must have a role in {ROLES} and a string content")
    return Message(m["role"], m["content"])


def prompt_ids(tokenizer, system_prompt: str | None, messages: list[Message]) -> list[int]:
    """Token ids of the chat template applied to the messages, ready for the assistant's reply.

    A reply keeps the token ids the model generated: re-tokenizing its text can split it differently, which
    would make the next turn's prompt diverge from what the KV cache holds in the middle of the history.
    """
    text = render_chat(tokenizer, system_prompt, messages)
    ids, cursor = [], 0
    for m in messages:
        if m.role != "assistant" or not m.token_ids or tokenizer.decode(list(m.token_ids)) != m.content:
            continue
        found = text.find(m.content, cursor) if m.content else -1
        if found < 0:
            continue
        ids += _encode(tokenizer, text[cursor:found]) + list(m.token_ids)
        cursor = found + len(m.content)
    return ids + _encode(tokenizer, text[cursor:])


def render_chat(tokenizer, system_prompt: str | None, messages: list[Message]) -> str:
    """The chat template's text, ready for the assistant's reply. A template without a system role (Gemma 2's
    raises "System role not supported") gets the system prompt folded into the first user message, followed by a
    blank line, as Gemma 3's own template folds it."""
    chat = [{"role": m.role, "content": m.content} for m in messages]
    if system_prompt and system_role_supported(tokenizer):
        chat.insert(0, {"role": "system", "content": system_prompt})
    elif system_prompt:
        chat = fold_system_prompt(system_prompt, chat)
    return tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)


def fold_system_prompt(system_prompt: str, chat: list[dict]) -> list[dict]:
    first_user = next((i for i, m in enumerate(chat) if m["role"] == "user"), None)
    if first_user is None:
        return [{"role": "user", "content": system_prompt}, *chat]
    folded = dict(chat[first_user], content=f"{system_prompt}\n\n{chat[first_user]['content']}")
    return [*chat[:first_user], folded, *chat[first_user + 1:]]


_SYSTEM_ROLE: dict[str, bool] = {}  # chat template text -> does it accept a system message


def system_role_supported(tokenizer) -> bool:
    """Whether the tokenizer's chat template accepts a system message (asked once per template)."""
    template = str(getattr(tokenizer, "chat_template", None))
    if template not in _SYSTEM_ROLE:
        probe = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
        try:
            tokenizer.apply_chat_template(probe, add_generation_prompt=True, tokenize=False)
            _SYSTEM_ROLE[template] = True
        except Exception as e:  # noqa: BLE001 - jinja's TemplateError or a template's raise_exception
            if "system" not in str(e).lower():
                raise
            _SYSTEM_ROLE[template] = False
    return _SYSTEM_ROLE[template]


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False) if text else []


def fit_to_context(tokenizer, conv: Conversation, limit: int, reserve: int) -> tuple[list[int], int, int]:
    """Prompt ids that leave `reserve` tokens free, dropping the oldest turns.

    Returns (ids, messages dropped, tokens dropped). The window only ever moves forward
    (conv.context_start), so later turns keep a stable prefix.
    """
    dropped, untrimmed = 0, None
    while True:
        ids = prompt_ids(tokenizer, conv.system_prompt, conv.visible_messages())
        untrimmed = untrimmed or len(ids)
        if len(ids) + reserve <= limit:
            return ids, dropped, untrimmed - len(ids)
        if len(conv.visible_messages()) <= 1:
            raise PromptTooLong(
                f"the message needs {len(ids)} tokens with the system prompt, but the context holds {limit} "
                f"and {reserve} are kept for the reply; shorten it or raise the context limit"
            )
        step = _turn_length(conv.visible_messages())
        conv.context_start += step
        dropped += step


def _turn_length(messages: list[Message]) -> int:
    """Drop a user message together with the assistant reply that follows it."""
    if len(messages) >= 3 and messages[0].role == "user" and messages[1].role == "assistant":
        return 2
    return 1
