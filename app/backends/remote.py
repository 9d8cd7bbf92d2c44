"""RemoteClient: the window's backend for an OpenAI-compatible server (kvscope serve, vLLM, llama.cpp server).

It answers the same requests as the local EngineClient and reports through the same WorkerSignals (plus
`server_kv`), so the window does not care which one it talks to:

    GUI thread: RemoteClient --queued signals--> RemoteWorker (QThread "RemoteWorker": httpx, streaming chat)
                             --start/stop------> MetricsPoller (QThread "MetricsPoller": GET /metrics each second)

The conversation lives on the worker thread. A request that fails (unreachable, an error status, the server
dying mid-stream) leaves it exactly as it was and reports an error. Step events carry the inter-token arrival
times (latency plot) and, for the memory plot, byte figures only where the server publishes them (kvscope does;
vLLM and llama.cpp do not, and their points are left out rather than drawn as zero).
"""

from __future__ import annotations

from PySide6.QtCore import QObject, Qt, QThread, Signal

from app.backends.remote_info import RemoteInfo, RemoteSignals
from app.backends.remote_worker import MetricsPoller, RemoteWorker
from app.engine_client import ChatRequests

__all__ = ["RemoteClient", "RemoteInfo"]


class RemoteClient(QObject, ChatRequests):
    kind = "remote"
    _load = Signal(object)
    _generate = Signal(int, str, object)
    _regenerate = Signal(int, object)
    _edit = Signal(int, int, str, object)
    _set_cache = Signal(str, int)
    _new_conversation = Signal(object)
    _open_conversation = Signal(object)
    _set_system_prompt = Signal(object)
    _start_polling = Signal()
    _stop_polling = Signal()

    def __init__(self, url: str, api_key: str | None = None, model: str | None = None,
                 system_prompt: str | None = None, parent: QObject | None = None):
        super().__init__(parent)
        self.url = url
        self._requests = 0
        self.signals = RemoteSignals()
        self.worker = RemoteWorker(url, api_key, model, system_prompt, self.signals)
        self.poller = MetricsPoller(url, api_key, self.signals)
        self.thread, self.poll_thread = QThread(), QThread()
        self.thread.setObjectName("RemoteWorker")
        self.poll_thread.setObjectName("MetricsPoller")
        self.worker.moveToThread(self.thread)
        self.poller.moveToThread(self.poll_thread)
        self._connect()
        self.thread.start()
        self.poll_thread.start()
        self._start_polling.emit()

    def _connect(self) -> None:
        w = self.worker
        pairs = ((self._load, w.load), (self._generate, w.generate), (self._regenerate, w.regenerate),
                 (self._edit, w.edit_and_resend), (self._set_cache, w.set_cache),
                 (self._new_conversation, w.new_conversation), (self._open_conversation, w.open_conversation),
                 (self._set_system_prompt, w.set_system_prompt), (self._start_polling, self.poller.start),
                 (self._stop_polling, self.poller.stop))
        for signal, slot in pairs:
            signal.connect(slot)
        # direct: the worker reads the latest figures while it streams (a plain attribute swap, no queued call)
        self.signals.server_kv.connect(w.set_server_kv, Qt.ConnectionType.DirectConnection)

    # --- the EngineClient interface -----------------------------------------------------------------------------
    def load(self, _model=None) -> None:
        """Ask the server for its models; `loaded` reports the one chosen (or `error` why none could be)."""
        self._load.emit(None)

    def use_engine(self, _engine) -> None:
        raise TypeError("a remote backend runs no local engine")

    def set_cache(self, strategy: str, block_size: int) -> None:
        self._set_cache.emit(strategy, block_size)

    def set_prefix_reuse(self, _on: bool) -> None:
        """The server decides what it keeps between requests: nothing to send."""

    def set_kv_budget(self, _mib: float | None) -> None:
        """The server sizes its own pool: nothing to send."""

    def set_weights(self, _fmt: str) -> None:
        """The server holds its own weights (its --weights): nothing to send."""

    def set_kv_dtype(self, _name: str | None) -> None:
        """The server keeps its own KV precision (its --kv-dtype): nothing to send."""

    def shutdown(self) -> None:
        """Stop the reply in progress, stop polling, and wait for both threads."""
        if not self.thread.isRunning():
            return
        self.worker.stop(self._requests)
        self._stop_polling.emit()
        for thread in (self.thread, self.poll_thread):
            thread.quit()
            thread.wait()
        self.worker.release()

    @property
    def running(self) -> bool:
        return self.thread.isRunning()
