"""The HTTP layer: FastAPI routes over the scheduler. The event loop never runs a forward: the scheduler's
thread does, hands each output to the loop with call_soon_threadsafe, and after a tick waits (up to 2 ms) until the
loop has sent them before it starts the next step (LoopHandoff).

Routes: GET /health, GET /v1/models, GET /v1/models/{id}, POST /v1/chat/completions, POST /v1/completions
(streamed as server-sent events or not), GET /metrics. With an API key, every route but /health needs
`Authorization: Bearer <key>` (the scheme in any case). Errors are OpenAI-style JSON, whatever the request.

A request body is read here, not by FastAPI: its JSON is checked for lone UTF-16 surrogates (`"\\ud800"` parses
to a str that no tokenizer or UTF-8 encoder takes) and refused with a 400 naming the field, then validated by
the pydantic models of `server.protocol`, then refused if it names a field this server does not honour.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.chat import PromptTooLong, prompt_ids
from engine.config import ConfigError
from engine.scheduler import Output, Scheduler
from server import protocol
from server.limits import DEFAULT_MAX_BODY_BYTES, Guard, RequireKey
from server.metrics import CONTENT_TYPE, ServerMetrics
from server.protocol import ChatCompletionRequest, CompletionRequest, ProtocolError, SamplingRequest
from server.sampling import LogitsAdjust, TokenText, chat_logprobs, text_logprobs

DISCONNECT_POLL_S = 0.25
FAILED = ("error", "cancelled")


class JSONError(JSONResponse):
    def render(self, content) -> bytes:
        return json.dumps(content).encode()  # ASCII escapes: valid JSON whatever a message quotes


def error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
          code: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONError(protocol.error_body(message, kind, param, code), status_code=status, headers=headers)


class CancellingStream(StreamingResponse):
    """A stream that cancels its requests however the response ends, even when the client is gone before the
    first byte (then the body generator never starts, and its own `finally` never runs)."""

    def __init__(self, content, on_close, **kwargs):
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


# ---- reading a request ---------------------------------------------------------------------------------------------
def surrogate_path(obj) -> str | None:
    """The dotted path (`messages.0.content`) of the first string or key holding a lone surrogate, or None."""
    queue: deque = deque([((), obj)])
    while queue:
        path, value = queue.popleft()
        if isinstance(value, str) and not _encodable(value):
            return ".".join(path) or "body"
        if isinstance(value, dict):
            for key, item in value.items():
                name = key.encode("utf-8", "backslashreplace").decode("utf-8")
                if not _encodable(key):
                    return ".".join((*path, name))
                queue.append(((*path, name), item))
        elif isinstance(value, list):
            queue.extend(((*path, str(i)), item) for i, item in enumerate(value))
    return None


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def validation_error(exc: ValidationError | RequestValidationError) -> ProtocolError:
    first = exc.errors()[0] if exc.errors() else {}
    where = [str(p) for p in first.get("loc", ()) if p != "body" and _is_field(p)]
    param = ".".join(where) or None
    message = first.get("msg", "invalid value")
    return ProtocolError(f"{param}: {message}" if param else message, where[0] if where else None)


def _is_field(part) -> bool:
    """Field names and list indices of a pydantic error location, not the union members it tried (`str`,
    `list[str]`, `function-after[...]`)."""
    return isinstance(part, int) or (part.isidentifier() and part not in ("str", "int", "float", "bool", "list",
                                                                            "dict", "none"))


async def read_request(request: Request, cls: type[SamplingRequest]) -> SamplingRequest:
    raw = await request.body()
    try:
        obj = json.loads(raw)
    except RecursionError:
        raise ProtocolError("The request body is not a valid JSON object: nested too deeply",
                            code="invalid_json") from None
    except ValueError as e:  # UnicodeDecodeError included
        raise ProtocolError(f"The request body is not a valid JSON object: {e}", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise ProtocolError("The request body must be a JSON object", code="invalid_json")
    bad = surrogate_path(obj)
    if bad is not None:
        raise ProtocolError(f"{bad}: the text holds a lone UTF-16 surrogate, which is not Unicode text; send "
                            f"valid UTF-8 (this server refuses such text rather than change it)", bad,
                            "invalid_unicode")
    try:
        body = cls.model_validate(obj)
    except ValidationError as e:
        raise validation_error(e) from None
    body.check_supported()
    return body


# ---- the two completion formats ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Format:
    """What differs between chat completions and text completions."""

    chat: bool
    object: str
    chunk_object: str
    id_prefix: str
    prompt_param: str


CHAT = Format(True, "chat.completion", "chat.completion.chunk", "chatcmpl", "messages")
TEXT = Format(False, "text_completion", "text_completion", "cmpl", "prompt")


@dataclass
class Job:
    """One HTTP request's choices in the scheduler: request ids in choice order and the queue of their outputs."""

    fmt: Format
    body: SamplingRequest
    ids: list[int]
    n_prompt: int
    queue: asyncio.Queue
    echo: str = ""
    index: dict[int, int] = field(init=False)

    def __post_init__(self):
        self.index = {rid: i for i, rid in enumerate(self.ids)}

    @property
    def wants_logprobs(self) -> bool:
        return self.body.logprobs_k() is not None


HANDOFF_TIMEOUT_S = 0.002  # the longest the engine thread waits for the event loop after a tick's outputs


class LoopHandoff:
    """The scheduler's handoff (Scheduler.set_handoff) to an event loop: after a tick that sent outputs the engine
    thread waits, at most `timeout_s`, until the loop has run the callbacks that carry them and the streams they
    woke (each writes its chunk to its socket), and only then starts the next step. Without it the loop thread,
    woken while the step's threads held every core of a 2-core machine, waited for a core: a token went out up
    to a step late (serve on the model-167 Xeon, five A/B runs against the server without it: p99 gap at 4 clients
    10.1-11.1 -> 7.7-10.3 ms, one client's 7.4-8.3 -> 6.4-6.8; tokens/s 2% lower at 4 clients, the same at 1 and 16)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout_s: float = HANDOFF_TIMEOUT_S):
        self.loop, self.timeout_s = loop, timeout_s

    def __call__(self) -> None:
        taken = threading.Event()
        try:  # queued behind the outputs' callbacks; it queues the signal behind the streams they wake
            self.loop.call_soon_threadsafe(self.loop.call_soon, taken.set)
        except RuntimeError:  # the loop has closed (the server is stopping): nothing waits for it
            return
        taken.wait(self.timeout_s)


class ChatService:
    """Requests in, outputs out; many calls run concurrently on the event loop."""

    def __init__(self, scheduler: Scheduler, model: str):
        self.scheduler, self.model = scheduler, model
        engine = scheduler.engine
        self.metrics = ServerMetrics(scheduler, model, engine.max_context)
        self.text_of = TokenText(engine.tokenizer, scheduler.tokenizer_lock)
        self.vocab_size = engine.model_config.vocab_size
        self.created = int(time.time())
        self.handoff: LoopHandoff | None = None

    def encode(self, body: SamplingRequest) -> list[int]:
        if isinstance(body, ChatCompletionRequest):
            system, messages = body.conversation()
            with self.scheduler.tokenizer_lock:
                return prompt_ids(self.scheduler.engine.tokenizer, system, messages)
        prompt = body.single_prompt()
        if isinstance(prompt, list):
            if not all(0 <= t < self.vocab_size for t in prompt):
                raise ProtocolError(f"prompt: token ids must be in 0..{self.vocab_size - 1}", "prompt")
            return list(prompt)
        with self.scheduler.tokenizer_lock:
            ids = self.scheduler.engine.tokenizer.encode(prompt, add_special_tokens=True)
        if not ids:
            raise ProtocolError("prompt: the text encodes to no token", "prompt")
        return ids

    async def submit(self, fmt: Format, body: SamplingRequest) -> Job:
        ids = await asyncio.to_thread(self.encode, body)
        limit = self.scheduler.engine.max_context
        room = limit - len(ids)
        if room < 1:
            raise PromptTooLong(f"This model's maximum context length is {limit} tokens. However, your "
                                f"{fmt.prompt_param} resulted in {len(ids)} tokens.")
        max_new = min(body.requested_tokens() or room, room)
        adjust = LogitsAdjust.of(body, self.vocab_size)
        echo = await asyncio.to_thread(self._echo_text, body, ids)
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        self._hand_off_to(loop)

        def sink(out: Output) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, out)

        rids = self.scheduler.submit_group(ids, body.sampling(max_new), sink, body.stop_strings(),
                                           body.logprobs_k(), adjust)
        return Job(fmt, body, rids, len(ids), queue, echo)

    def _hand_off_to(self, loop: asyncio.AbstractEventLoop) -> None:
        """The engine thread hands each tick's outputs to the loop that serves the requests."""
        if self.handoff is None or self.handoff.loop is not loop:
            self.handoff = LoopHandoff(loop)
            self.scheduler.set_handoff(self.handoff)

    def _echo_text(self, body: SamplingRequest, ids: list[int]) -> str:
        if not getattr(body, "echo", False):
            return ""
        prompt = body.single_prompt()
        if isinstance(prompt, str):
            return prompt
        with self.scheduler.tokenizer_lock:
            return self.scheduler.engine.tokenizer.decode(ids, skip_special_tokens=False)

    def cancel(self, job: Job) -> None:
        for rid in job.ids:
            self.scheduler.cancel(rid)  # a no-op once finished; releases the blocks if the client went away

    def logprobs(self, job: Job, outputs: list[Output], offset: int = 0) -> dict | None:
        if not job.wants_logprobs:
            return None
        if job.fmt.chat:
            return chat_logprobs(outputs, self.text_of)
        return text_logprobs(outputs, self.text_of, offset)


# ---- the app -------------------------------------------------------------------------------------------------------
def create_app(scheduler: Scheduler, model: str, api_key: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    app = FastAPI(title="kvscope", docs_url=None, redoc_url=None, openapi_url=None)
    service = ChatService(scheduler, model)
    app.state.service = service
    _install_error_handlers(app)
    if api_key:
        app.add_middleware(RequireKey, api_key=api_key, open_paths=("/health",))
    app.add_middleware(Guard, max_body_bytes=max_body_bytes)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict:
        return protocol.models_list(model, service.created, scheduler.engine.max_context)

    @app.get("/v1/models/{model_id:path}")
    async def model_card(model_id: str) -> Response:
        if model_id != model:
            return error(404, f"The model `{model_id}` does not exist.", "not_found_error", "model",
                         "model_not_found")
        return JSONResponse(protocol.model_card(model, service.created, scheduler.engine.max_context))

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(service.metrics.exposition(), media_type=CONTENT_TYPE)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _serve(service, request, CHAT, ChatCompletionRequest)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _serve(service, request, TEXT, CompletionRequest)

    return app


async def _serve(service: ChatService, request: Request, fmt: Format, cls: type[SamplingRequest]) -> Response:
    try:
        body = await read_request(request, cls)
        if body.model != service.model:
            return error(404, f"The model `{body.model}` does not exist.", "not_found_error", "model",
                         "model_not_found")
        job = await service.submit(fmt, body)
    except PromptTooLong as e:
        return error(400, str(e), param=fmt.prompt_param, code="context_length_exceeded")
    except (ProtocolError, ConfigError) as e:
        return error(400, str(e), param=getattr(e, "param", None), code=getattr(e, "code", None))
    if body.stream:
        return CancellingStream(_stream(service, job), lambda: service.cancel(job), media_type="text/event-stream",
                                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await _complete(service, request, job)


async def _collect(request: Request, job: Job) -> dict[int, list[Output]] | None:
    """Every output of every choice, or None when the client went away first."""
    outputs: dict[int, list[Output]] = {rid: [] for rid in job.ids}
    left = set(job.ids)
    while left:
        try:
            out = await asyncio.wait_for(job.queue.get(), DISCONNECT_POLL_S)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                return None
            continue
        outputs[out.request_id].append(out)
        if out.finished:
            left.discard(out.request_id)
    return outputs


async def _complete(service: ChatService, request: Request, job: Job) -> Response:
    try:
        outputs = await _collect(request, job)
    finally:
        service.cancel(job)
    if outputs is None:
        return Response(status_code=499)
    finals = [outs[-1] for outs in outputs.values()]
    failed = next((o for o in finals if o.finish_reason in FAILED), None)
    if failed is not None:
        return error(500, failed.error or "the request was cancelled", kind="server_error")
    choices = []
    for i, rid in enumerate(job.ids):
        outs = outputs[rid]
        text = "".join(o.text for o in outs)
        logprobs = service.logprobs(job, outs, len(job.echo))
        build = protocol.chat_choice if job.fmt.chat else protocol.text_choice
        choices.append(build(i, job.echo + text, outs[-1].finish_reason, logprobs))
    generated = sum(o.n_generated_tokens for o in finals)
    return JSONResponse(protocol.completion(protocol.completion_id(job.fmt.id_prefix), service.model, choices,
                                            job.n_prompt, generated, job.fmt.object))


async def _stream(service: ChatService, job: Job) -> AsyncIterator[str]:
    fmt, model, with_usage = job.fmt, service.model, job.body.include_usage()
    cid = protocol.completion_id(fmt.id_prefix)
    offsets = [len(job.echo)] * len(job.ids)

    def chunk(i: int, text: str | None, finish: str | None = None, logprobs: dict | None = None,
              delta: dict | None = None) -> str:
        if fmt.chat:
            choice = protocol.chat_delta(i, delta if delta is not None else ({"content": text} if text is not None
                                                                              else {}), finish, logprobs)
        else:
            choice = protocol.text_choice(i, text or "", finish, logprobs)
        return _sse(protocol.chunk(cid, model, choice, with_usage, fmt.chunk_object))

    try:
        for i in range(len(job.ids)):
            if fmt.chat:
                yield chunk(i, None, delta={"role": "assistant", "content": ""})
            elif job.echo:
                yield chunk(i, job.echo)
        left, generated = set(job.ids), 0
        while left:
            out = await job.queue.get()
            if out.finish_reason in FAILED:
                yield _sse(protocol.error_body(out.error or "the request was cancelled", "server_error"))
                return
            i = job.index[out.request_id]
            logprobs = service.logprobs(job, [out], offsets[i]) if out.logprob is not None else None
            if out.text or logprobs:
                yield chunk(i, out.text, logprobs=logprobs)
                offsets[i] += len(out.text)
            if out.finished:
                yield chunk(i, None, out.finish_reason)
                left.discard(out.request_id)
                generated += out.n_generated_tokens
        if with_usage:
            yield _sse(protocol.usage_chunk(cid, model, job.n_prompt, generated, fmt.chunk_object))
        yield "data: [DONE]\n\n"
    finally:
        service.cancel(job)  # the client disconnected (or we are done): blocks go back at once


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        e = validation_error(exc)
        return error(400, str(e), param=e.param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error(exc.status_code, str(exc.detail), kind=kind, headers=getattr(exc, "headers", None))
