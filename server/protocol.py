"""The OpenAI chat-completions wire format: request models (pydantic, validated), response and error bodies."""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.chat import Message
from engine.config import SamplingParams


class ProtocolError(ValueError):
    """A request that is well-formed JSON but cannot be served as asked (-> 400)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise ProtocolError(f"only text content is supported, got a {part.type!r} part", "messages")
        return "".join(part.text for part in self.content)


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown OpenAI fields (user, n=1, ...) are accepted and ignored
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling(self, max_new_tokens: int) -> SamplingParams:
        """OpenAI semantics: no top-k, no repetition penalty; temperature 0 is greedy."""
        return SamplingParams(temperature=self.temperature, top_k=0, top_p=self.top_p, repetition_penalty=1.0,
                              max_new_tokens=max_new_tokens, seed=self.seed)

    def requested_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def conversation(self) -> tuple[str | None, list[Message]]:
        """-> (system prompt, user/assistant messages). System messages must come first."""
        system: list[str] = []
        messages: list[Message] = []
        for m in self.messages:
            if m.role in ("system", "developer"):
                if messages:
                    raise ProtocolError("system messages must come before the conversation", "messages")
                system.append(m.text())
            else:
                messages.append(Message(m.role, m.text()))
        if not messages:
            raise ProtocolError("messages must contain at least one user or assistant message", "messages")
        return ("\n\n".join(system) if system else None), messages


def completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion(cid: str, model: str, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int
               ) -> dict:
    return {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": finish_reason}],
            "usage": usage(prompt_tokens, completion_tokens)}


def chunk(cid: str, model: str, delta: dict, finish_reason: str | None = None, with_usage: bool = False) -> dict:
    body = {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}
    if with_usage:
        body["usage"] = None  # OpenAI: null on every chunk but the last when usage is asked for
    return body


def usage_chunk(cid: str, model: str, prompt_tokens: int, completion_tokens: int) -> dict:
    return {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [], "usage": usage(prompt_tokens, completion_tokens)}


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def models_list(model: str, created: int, max_context: int) -> dict:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created, "owned_by": "kvscope",
                                        "max_model_len": max_context}]}
