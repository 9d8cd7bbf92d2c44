"""The OpenAI wire format: request models (pydantic, validated), response and error bodies.

Every field of a request is honoured, refused with a 400 that names it, or (a few that change nothing in the
output: `user`, `metadata`, ...) accepted and ignored; a field this server does not know is refused, as OpenAI
refuses it. Ranges are checked here, at the edge, never deep in the engine: a request that passes these models
cannot make the engine raise.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.chat import Message
from engine.config import SamplingParams

MAX_N = 16  # choices per request
MAX_TOP_LOGPROBS = 20
MAX_SEED = 2**64 - 1  # what a torch.Generator takes
IGNORED = frozenset({"user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
                     "parallel_tool_calls"})  # no effect on the reply


class ProtocolError(ValueError):
    """A request that is well-formed JSON but cannot be served as asked (-> 400)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


def refuse(param: str, what: str) -> ProtocolError:
    return ProtocolError(f"`{param}` is not supported by this server: {what}", param, "unsupported_parameter")


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # `name` and the like: no effect on the prompt
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


class SamplingRequest(BaseModel):
    """The fields chat and text completions share. None (JSON null) means the default, as in OpenAI's API."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int | None = Field(default=None, ge=1, le=MAX_N)
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = Field(default=None)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    # vLLM's extra sampling fields
    top_k: int | None = Field(default=None, ge=-1)  # -1 or 0: off
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)

    def check_supported(self) -> None:
        """Refuse every field not declared by the model (a typo, or a feature this server lacks)."""
        for name in self.model_extra or {}:
            if name not in IGNORED:
                raise ProtocolError(f"Unrecognized request argument supplied: {name}", name, "unknown_parameter")
        if isinstance(self.stop, list) and len(self.stop) > 16:
            raise ProtocolError("stop: at most 16 stop strings", "stop")
        for key, bias in (self.logit_bias or {}).items():
            if not key.isdigit() or not -100 <= bias <= 100:
                raise ProtocolError("logit_bias maps token ids (as strings) to biases in [-100, 100], got "
                                    f"{key[:20]!r}: {bias}", "logit_bias")

    def logprobs_k(self) -> int | None:
        """None: no log-probabilities; k: the chosen token's and the k most likely tokens' at each position."""
        return None

    @property
    def choices(self) -> int:
        return self.n or 1

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def sampling(self, max_new_tokens: int) -> list[SamplingParams]:
        """One SamplingParams per choice. OpenAI semantics by default (temperature 1, no top-k, no repetition
        penalty); temperature 0 is greedy; choice i is seeded with seed + i, so choices differ and repeat."""
        base = dict(temperature=1.0 if self.temperature is None else self.temperature,
                    top_k=max(self.top_k or 0, 0), top_p=1.0 if self.top_p is None else self.top_p,
                    repetition_penalty=self.repetition_penalty or 1.0, max_new_tokens=max_new_tokens)
        seeds = [None if self.seed is None else (self.seed + i) % (MAX_SEED + 1) for i in range(self.choices)]
        return [SamplingParams(**base, seed=s) for s in seeds]

    def logit_bias_ids(self, vocab_size: int) -> dict[int, float]:
        bias = {int(k): v for k, v in (self.logit_bias or {}).items()}
        wrong = [k for k in bias if k >= vocab_size]
        if wrong:
            raise ProtocolError(f"logit_bias: token id {wrong[0]} is outside the vocabulary (0..{vocab_size - 1})",
                                "logit_bias")
        return bias


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: dict | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    functions: list | None = None
    function_call: str | dict | None = None
    modalities: list[str] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        kind = (self.response_format or {}).get("type", "text")
        if kind != "text":
            raise refuse("response_format", f"only {{\"type\": \"text\"}}; {kind!r} output is not constrained here")
        if self.tools or self.functions:
            raise refuse("tools" if self.tools else "functions", "no tool or function calling")
        for name in ("tool_choice", "function_call"):
            if getattr(self, name) not in (None, "none"):
                raise refuse(name, "no tool or function calling")
        if self.modalities not in (None, ["text"]):
            raise refuse("modalities", "text only")
        if self.top_logprobs is not None and not self.logprobs:
            raise ProtocolError("top_logprobs needs `logprobs: true`", "top_logprobs")

    def logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

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


class CompletionRequest(SamplingRequest):
    """/v1/completions: one prompt (text, or token ids) in, text out."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise refuse("suffix", "no insertion (fill-in-the-middle)")
        if self.best_of not in (None, self.choices):
            raise refuse("best_of", "only best_of equal to n (no server-side ranking)")
        if self.echo and self.logprobs is not None:
            raise refuse("echo", "echo with logprobs would need the prompt's log-probabilities")

    def logprobs_k(self) -> int | None:
        return self.logprobs

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise ProtocolError("one prompt per request (send a batch as separate requests)", "prompt")
            p = p[0]
        if not p:
            raise ProtocolError("prompt must not be empty", "prompt")
        return p

    def requested_tokens(self) -> int:
        return self.max_tokens or 16  # OpenAI's default for text completions


# ---- responses -----------------------------------------------------------------------------------------------------
def completion_id(prefix: str = "chatcmpl") -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def chat_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None) -> dict:
    return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
            "finish_reason": finish_reason}


def completion(cid: str, model: str, choices: list[dict], prompt_tokens: int, completion_tokens: int,
               obj: str = "chat.completion") -> dict:
    return {"id": cid, "object": obj, "created": int(time.time()), "model": model, "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens)}


def chunk(cid: str, model: str, choice: dict, with_usage: bool = False, obj: str = "chat.completion.chunk") -> dict:
    body = {"id": cid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice]}
    if with_usage:
        body["usage"] = None  # OpenAI: null on every chunk but the last when usage is asked for
    return body


def chat_delta(index: int, delta: dict, finish_reason: str | None = None, logprobs: dict | None = None) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def text_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def usage_chunk(cid: str, model: str, prompt_tokens: int, completion_tokens: int,
                obj: str = "chat.completion.chunk") -> dict:
    return {"id": cid, "object": obj, "created": int(time.time()), "model": model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens)}


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def model_card(model: str, created: int, max_context: int) -> dict:
    return {"id": model, "object": "model", "created": created, "owned_by": "kvscope", "max_model_len": max_context}


def models_list(model: str, created: int, max_context: int) -> dict:
    return {"object": "list", "data": [model_card(model, created, max_context)]}
