"""The HTTP layer: FastAPI routes over the scheduler. The event loop never runs a forward: the scheduler's
thread does, and hands each output to the loop with call_soon_threadsafe.

Routes: GET /health, GET /v1/models, POST /v1/chat/completions (streaming SSE or not), GET /metrics.
With an API key, every route but /health needs `Authorization: Bearer <key>`. Errors are OpenAI-style JSON.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.chat import PromptTooLong, prompt_ids
from engine.config import ConfigError
from engine.scheduler import Output, Scheduler
from server import protocol
from server.metrics import CONTENT_TYPE, ServerMetrics
from server.protocol import ChatCompletionRequest, ProtocolError

DISCONNECT_POLL_S = 0.25


def error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
          code: str | None = None) -> JSONResponse:
    return JSONResponse(protocol.error_body(message, kind, param, code), status_code=status)


class CancellingStream(StreamingResponse):
    """A stream that cancels its request however the response ends, even when the client is gone before the
    first byte (then the body generator never starts, and its own `finally` never runs)."""

    def __init__(self, content, on_close, **kwargs):
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


class ChatService:
    """One chat-completion request at a time per call; many calls run concurrently on the event loop."""

    def __init__(self, scheduler: Scheduler, model: str):
        self.scheduler, self.model = scheduler, model
        self.metrics = ServerMetrics(scheduler, model)
        self.created = int(time.time())

    def encode(self, body: ChatCompletionRequest) -> list[int]:
        system, messages = body.conversation()
        with self.scheduler.tokenizer_lock:
            return prompt_ids(self.scheduler.engine.tokenizer, system, messages)

    async def submit(self, body: ChatCompletionRequest) -> tuple[int, list[int], asyncio.Queue]:
        ids = await asyncio.to_thread(self.encode, body)
        limit = self.scheduler.engine.max_context
        room = limit - len(ids)
        if room < 1:
            raise PromptTooLong(f"This model's maximum context length is {limit} tokens. However, your messages "
                                f"resulted in {len(ids)} tokens.")
        max_new = min(body.requested_tokens() or room, room)
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()

        def sink(out: Output) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, out)

        rid = self.scheduler.submit(ids, body.sampling(max_new), sink, body.stop_strings())
        return rid, ids, queue

    async def next_output(self, queue: asyncio.Queue) -> Output:
        out = await queue.get()
        self.metrics.observe(out)
        return out


def create_app(scheduler: Scheduler, model: str, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="kvscope", docs_url=None, redoc_url=None, openapi_url=None)
    service = ChatService(scheduler, model)
    app.state.service = service
    _install_error_handlers(app)
    _install_auth(app, api_key)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict:
        return protocol.models_list(model, service.created, scheduler.engine.max_context)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(service.metrics.exposition(), media_type=CONTENT_TYPE)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        if body.model != model:
            return error(404, f"The model `{body.model}` does not exist.", param="model", code="model_not_found")
        try:
            rid, ids, queue = await service.submit(body)
        except PromptTooLong as e:
            return error(400, str(e), param="messages", code="context_length_exceeded")
        except (ProtocolError, ConfigError) as e:
            return error(400, str(e), param=getattr(e, "param", None), code=getattr(e, "code", None))
        if body.stream:
            return CancellingStream(_stream(service, body, rid, len(ids), queue), lambda: scheduler.cancel(rid),
                                    media_type="text/event-stream",
                                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await _complete(service, request, rid, len(ids), queue)

    return app


async def _complete(service: ChatService, request: Request, rid: int, n_prompt: int, queue) -> Response:
    cid, parts = protocol.completion_id(), []
    try:
        while True:
            try:
                out = await asyncio.wait_for(service.next_output(queue), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return Response(status_code=499)
                continue
            parts.append(out.text)
            if out.finished:
                break
    finally:
        service.scheduler.cancel(rid)  # a no-op once finished; releases the blocks if the client went away
    if out.finish_reason in ("error", "cancelled"):
        return error(500, out.error or "the request was cancelled", kind="server_error")
    body = protocol.completion(cid, service.model, "".join(parts), out.finish_reason, n_prompt,
                               out.n_generated_tokens)
    return JSONResponse(body)


async def _stream(service: ChatService, body: ChatCompletionRequest, rid: int, n_prompt: int, queue
                  ) -> AsyncIterator[str]:
    cid, model, with_usage = protocol.completion_id(), service.model, body.include_usage()
    try:
        yield _sse(protocol.chunk(cid, model, {"role": "assistant", "content": ""}, with_usage=with_usage))
        while True:
            out = await service.next_output(queue)
            if out.finish_reason in ("error", "cancelled"):
                yield _sse(protocol.error_body(out.error or "the request was cancelled", "server_error"))
                return
            if out.text:
                yield _sse(protocol.chunk(cid, model, {"content": out.text}, with_usage=with_usage))
            if out.finished:
                yield _sse(protocol.chunk(cid, model, {}, out.finish_reason, with_usage=with_usage))
                if with_usage:
                    yield _sse(protocol.usage_chunk(cid, model, n_prompt, out.n_generated_tokens))
                yield "data: [DONE]\n\n"
                return
    finally:
        service.scheduler.cancel(rid)  # the client disconnected (or we are done): blocks go back at once


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "json_invalid" or not where:
            return error(400, f"The request body is not a valid JSON object: {first.get('msg', '')}",
                         code="invalid_json")
        param = ".".join(where) or None
        message = f"{param}: {first.get('msg', 'invalid value')}" if param else first.get("msg", "invalid request")
        return error(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error(exc.status_code, str(exc.detail), kind=kind)


def _install_auth(app: FastAPI, api_key: str | None) -> None:
    if not api_key:
        return
    expected = f"Bearer {api_key}".encode()

    @app.middleware("http")
    async def require_key(request: Request, call_next):
        if request.url.path != "/health":
            given = request.headers.get("authorization", "").encode()
            if not secrets.compare_digest(given, expected):
                return error(401, "Incorrect or missing API key: send `Authorization: Bearer <key>`.",
                             code="invalid_api_key")
        return await call_next(request)
