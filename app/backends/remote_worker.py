"""The remote backend's two workers: the chat (RemoteWorker) and the /metrics poller (MetricsPoller), each on
its own QThread, both reporting through RemoteSignals. See app.backends.remote for the picture."""

from __future__ import annotations

import time
from contextlib import closing

from PySide6.QtCore import QObject, QTimer, Slot

from app.backends import http
from app.backends.metrics_parser import ServerKV
from app.backends.remote_info import STRATEGY, RemoteInfo, RemoteSignals
from app.worker import keep_until
from engine.chat import Conversation
from engine.events import DoneEvent, StepEvent
from engine.kv.base import KVStats

POLL_MS = 1000


def kv_stats(kv: ServerKV | None, tokens: int = 0) -> KVStats:
    """The server's byte and block figures where published; 0 (drawn as a gap, never a value) otherwise."""
    def whole(value):
        return int(value) if value is not None else 0

    kv = kv or ServerKV()
    return KVStats(STRATEGY, tokens, whole(kv.bytes_allocated), whole(kv.bytes_used), whole(kv.bytes_theoretical),
                   0.0, num_blocks=whole(kv.blocks_total), num_blocks_used=whole(kv.blocks_used),
                   num_blocks_free=whole(kv.blocks_free), num_blocks_cached=whole(kv.blocks_cached))


class RemoteWorker(QObject):
    def __init__(self, url: str, api_key: str | None, model: str | None, system_prompt: str | None,
                 signals: RemoteSignals):
        super().__init__()
        self.url, self.api_key, self.model = url, api_key, model
        self.signals = signals
        self.conv = Conversation(system_prompt=system_prompt)
        self.client = None  # made on the worker thread
        self.latest_kv: ServerKV | None = None  # set from the poller thread (a direct connection): read as is
        self._cancel_upto = 0
        self._context = 0  # tokens of the conversation after the last reply, as the server counted them

    def stop(self, upto: int) -> None:
        self._cancel_upto = max(self._cancel_upto, upto)

    @Slot(object)
    def set_server_kv(self, kv) -> None:
        self.latest_kv = kv

    @Slot(object)
    def load(self, _model=None) -> None:
        self.client = self.client or http.make_client()
        try:
            models = http.list_models(self.client, self.url, self.api_key)
            if not models:
                raise http.RemoteError(f"The server at {self.url} serves no model.")
            chosen = next((m for m in models if m.id == self.model), models[0])
        except http.RemoteError as e:
            self.signals.error.emit(str(e))
            return
        self.model = chosen.id
        self.signals.loaded.emit(RemoteInfo(chosen.id, http.base_url(self.url), chosen.max_context or 0))
        self.signals.conversation.emit(self.conv.to_dict())

    @Slot(int, str, object)
    def generate(self, request: int, text: str, params) -> None:
        snapshot = self.conv.snapshot()
        self.conv.add("user", text)
        self._run(request, params, snapshot)

    @Slot(int, object)
    def regenerate(self, request: int, params) -> None:
        snapshot = self.conv.snapshot()
        if self.conv.messages and self.conv.messages[-1].role == "assistant":
            self.conv.messages.pop()
        self._run(request, params, snapshot)

    @Slot(int, int, str, object)
    def edit_and_resend(self, request: int, index: int, text: str, params) -> None:
        """Replace the user message at `index` (-1: the last) with `text`, dropping what follows it."""
        snapshot = self.conv.snapshot()
        try:
            keep_until(self.conv, index)
        except ValueError as e:
            self.signals.error.emit(f"Could not edit: {e}")
            self.signals.conversation.emit(self.conv.to_dict())
            return
        self.conv.add("user", text)
        self._run(request, params, snapshot)

    @Slot(str, int)
    def set_cache(self, _strategy: str, _block_size: int) -> None:
        """The server chooses its own cache: nothing to do here."""

    @Slot(object)
    def new_conversation(self, system_prompt) -> None:
        self.conv, self._context = Conversation(system_prompt=system_prompt), 0
        self.signals.conversation.emit(self.conv.to_dict())

    @Slot(object)
    def open_conversation(self, conv) -> None:
        self.conv, self._context = conv, 0
        self.signals.conversation.emit(self.conv.to_dict())

    @Slot(object)
    def set_system_prompt(self, system_prompt) -> None:
        self.conv.system_prompt = system_prompt
        self.signals.conversation.emit(self.conv.to_dict())

    # --- one reply -------------------------------------------------------------------------------------------------
    def _run(self, request: int, params, snapshot: tuple) -> None:
        try:
            if not self.conv.messages or self.conv.messages[-1].role != "user":
                raise http.RemoteError("Nothing to answer: the conversation has no user message at its end.")
            self._reply(request, params)
        except (http.RemoteError, ValueError) as e:
            self.conv.restore(snapshot)
            self.signals.error.emit(str(e))
        except Exception as e:  # noqa: BLE001 - a worker never takes the app down; the conversation is kept
            self.conv.restore(snapshot)
            self.signals.error.emit(f"The request to the server failed: {e}")
        self.signals.conversation.emit(self.conv.to_dict())

    def _body(self, params) -> dict:
        system = [{"role": "system", "content": self.conv.system_prompt}] if self.conv.system_prompt else []
        body = {"model": self.model, "messages": system + [{"role": m.role, "content": m.content}
                                                           for m in self.conv.messages],
                "max_tokens": params.max_new_tokens, "temperature": params.temperature, "top_p": params.top_p}
        if params.seed is not None:
            body["seed"] = params.seed
        return body

    def _reply(self, request: int, params) -> None:
        self.client = self.client or http.make_client()
        start = last = time.perf_counter()
        parts, gaps, ttft, end = [], [], None, None
        events = http.stream_chat(self.client, self.url, self.api_key, self._body(params),
                                  lambda: request <= self._cancel_upto)
        with closing(events):  # leaving early (Stop) closes the connection: the server frees the request
            for event in events:
                if isinstance(event, http.StreamEnd):
                    end = event
                    break
                ms = (event.at - last) * 1000
                if ttft is None:
                    ttft = ms
                else:
                    gaps.append(ms)
                last = event.at
                parts.append(event.text)
                self._emit_step(len(parts), ms, event.text, first=len(parts) == 1)
        self._finish(end, "".join(parts), ttft or (time.perf_counter() - start) * 1000, gaps)

    def _emit_step(self, n: int, ms: float, text: str, first: bool) -> None:
        pos = self._context + n - 1
        event = StepEvent("prefill" if first else "decode", pos, 1, ms, kv_stats(self.latest_kv, pos + 1), 0,
                          STRATEGY, None, text)
        self.signals.token.emit(text)
        self.signals.step.emit(event)

    def _finish(self, end: http.StreamEnd, text: str, ttft_ms: float, gaps: list[float]) -> None:
        self.conv.add("assistant", text)
        n_prompt = end.prompt_tokens or 0
        n_generated = end.completion_tokens if end.completion_tokens is not None else len(gaps) + bool(text)
        self._context = n_prompt + n_generated
        tok_s = len(gaps) / (sum(gaps) / 1000) if gaps and sum(gaps) else 0.0
        self.signals.finished.emit(DoneEvent(text, n_prompt, n_generated, ttft_ms, tok_s, end.finish_reason,
                                             STRATEGY, end.cached_tokens or 0))

    def release(self) -> None:
        if self.client is not None:
            self.client.close()


class MetricsPoller(QObject):
    """Polls the server's /metrics every POLL_MS on its own thread: a slow server never delays the chat."""

    def __init__(self, url: str, api_key: str | None, signals: RemoteSignals):
        super().__init__()
        self.url, self.api_key, self.signals = url, api_key, signals
        self.client = None
        self.timer = None

    @Slot()
    def start(self) -> None:
        self.client = http.make_client()
        self.timer = QTimer(self, interval=POLL_MS)
        self.timer.timeout.connect(self.poll)
        self.timer.start()
        self.poll()

    @Slot()
    def poll(self) -> None:
        self.signals.server_kv.emit(http.fetch_server_kv(self.client, self.url, self.api_key))

    @Slot()
    def stop(self) -> None:
        if self.timer is not None:  # stopped and deleted on its own thread (Qt timers cannot be stopped elsewhere)
            self.timer.stop()
            self.timer.deleteLater()
            self.timer = None
        if self.client is not None:
            self.client.close()
