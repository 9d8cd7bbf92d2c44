"""The server's outer guards, so that no request gets a plain-text answer or a dropped connection:
- `Guard` (ASGI middleware): a body larger than the limit -> 413 JSON (by its Content-Length before anything is
  read, or while it is read when chunked); headers over 16 KiB -> 431 JSON; any exception a route did not
  handle -> an OpenAI-shaped 500 JSON, and the connection stays open for the client's next request
  (Starlette's own handler answers, then re-raises, and uvicorn closes the connection).
- `RequireKey` (ASGI middleware): the API key, `Authorization: Bearer <key>` with the scheme in any case.
- `JSONErrorH11Protocol` (uvicorn's h11 protocol): a request HTTP itself rejects (malformed, or headers beyond
  h11's 16 KiB buffer) gets a JSON 400 / 431 instead of uvicorn's plain text; that connection closes, as HTTP
  requires after a request that cannot be framed.
"""

from __future__ import annotations

import json
import logging
import secrets

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from server.protocol import error_body

DEFAULT_MAX_BODY_BYTES = 4 * 2**20
MAX_HEADER_BYTES = 16 * 1024  # h11's buffer for an incomplete request head: the same limit, whatever the reads
log = logging.getLogger("kvscope.server")


class BodyTooLarge(Exception):
    pass


def json_bytes(obj: dict) -> bytes:
    return json.dumps(obj).encode()  # ASCII: valid whatever the strings hold


async def send_json(send, status: int, obj: dict, close: bool = False) -> None:
    body = json_bytes(obj)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def too_large_body(limit: int) -> dict:
    return error_body(f"The request body is larger than this server's limit of {limit:,} bytes.",
                      param=None, code="request_too_large")


def too_large_headers() -> dict:
    return error_body(f"The request's headers are larger than this server accepts ({MAX_HEADER_BYTES:,} bytes).",
                      code="request_header_fields_too_large")


class Guard:
    def __init__(self, app, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES):
        self.app, self.max_body_bytes = app, max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_body_bytes
        if sum(len(k) + len(v) + 4 for k, v in scope.get("headers", ())) > MAX_HEADER_BYTES:
            await send_json(send, 431, too_large_headers(), close=True)
            return
        if self._declared_length(scope) > limit:
            await send_json(send, 413, too_large_body(limit), close=True)
            return
        started, received = False, 0

        async def counting_receive():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > limit:
                raise BodyTooLarge
            return message

        async def watching_send(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, watching_send)
        except BodyTooLarge:
            if not started:
                await send_json(send, 413, too_large_body(limit), close=True)
        except Exception as e:  # noqa: BLE001 - the last line of defence: log it, answer in JSON
            log.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            if not started:
                await send_json(send, 500, error_body(f"internal server error: {type(e).__name__}",
                                                      "server_error"))

    @staticmethod
    def _declared_length(scope) -> int:
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    return int(value)
                except ValueError:
                    return 0
        return 0


class RequireKey:
    """Every path but the open ones needs `Authorization: Bearer <key>`; the scheme in any case (RFC 7235)."""

    def __init__(self, app, api_key: str, open_paths: tuple[str, ...] = ()):
        self.app, self.key, self.open_paths = app, api_key.encode(), open_paths

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths and not self._allowed(scope):
            await send_json(send, 401, error_body("Incorrect or missing API key: send `Authorization: Bearer "
                                                  "<key>`.", code="invalid_api_key"))
            return
        await self.app(scope, receive, send)

    def _allowed(self, scope) -> bool:
        given = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), b"")
        scheme, _, token = given.strip().partition(b" ")
        return scheme.lower() == b"bearer" and secrets.compare_digest(token.strip(), self.key)


class JSONErrorH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with JSON bodies for the requests HTTP parsing rejects."""

    def send_400_response(self, msg: str) -> None:
        oversized = len(self.conn.trailing_data[0]) > self.conn._max_incomplete_event_size  # noqa: SLF001
        status = 431 if oversized else 400
        body = json_bytes(too_large_headers() if oversized else
                          error_body(f"{msg} The request could not be parsed as HTTP/1.1.",
                                     code="invalid_http_request"))
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        try:
            for event in (h11.Response(status_code=status, headers=headers), h11.Data(data=body),
                          h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
        except h11.LocalProtocolError:  # h11 cannot answer on this connection any more
            pass
        self.transport.close()
