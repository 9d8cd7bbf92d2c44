"""EngineClient: the GUI thread's handle on the EngineWorker. It owns the QThread and sends queued requests.

Every method returns at once; results arrive through `client.signals` (see app.worker.WorkerSignals).
"""

from __future__ import annotations

from PySide6.QtCore import QObject, QThread, Signal

from app.worker import EngineWorker


class ChatRequests:
    """The chat requests every backend client sends the same way: a numbered, queued signal each (the numbers let
    Stop cancel everything asked for so far), and the conversation changes. The class using it declares the
    signals _generate, _regenerate, _edit, _new_conversation, _open_conversation, _set_system_prompt and owns
    _requests and worker."""

    def generate(self, text: str, params) -> int:
        self._requests += 1
        self._generate.emit(self._requests, text, params)
        return self._requests

    def regenerate(self, params) -> int:
        self._requests += 1
        self._regenerate.emit(self._requests, params)
        return self._requests

    def edit_and_resend(self, text: str, params, index: int | None = None) -> int:
        """Replace the user message at `index` (None: the last) with `text`, drop what follows, and answer it."""
        self._requests += 1
        self._edit.emit(self._requests, -1 if index is None else index, text, params)
        return self._requests

    def stop(self) -> None:
        """Cancel every reply asked for so far; takes effect within one step (remote: the stream is closed, so
        the server frees its blocks)."""
        self.worker.stop(self._requests)

    def new_conversation(self, system_prompt: str | None) -> None:
        self._new_conversation.emit(system_prompt)

    def open_conversation(self, conv) -> None:
        self._open_conversation.emit(conv)

    def set_system_prompt(self, system_prompt: str | None) -> None:
        self._set_system_prompt.emit(system_prompt)


class EngineClient(QObject, ChatRequests):
    _load = Signal(object)
    _use_engine = Signal(object)
    _generate = Signal(int, str, object)
    _regenerate = Signal(int, object)
    _edit = Signal(int, int, str, object)
    _set_cache = Signal(str, int)
    _set_prefix_reuse = Signal(bool)
    _set_weights = Signal(str)
    _set_kv_budget = Signal(object)
    _set_kv_dtype = Signal(object)
    _compare = Signal(int, object)
    _new_conversation = Signal(object)
    _open_conversation = Signal(object)
    _set_system_prompt = Signal(object)

    def __init__(self, cache: str = "paged", block_size: int = 16, system_prompt: str | None = None,
                 parent: QObject | None = None):
        super().__init__(parent)
        self._requests = 0
        self.worker = EngineWorker(cache=cache, block_size=block_size, system_prompt=system_prompt)
        self.signals = self.worker.signals
        self.thread = QThread()
        self.thread.setObjectName("EngineWorker")
        self.worker.moveToThread(self.thread)
        self._connect()
        self.thread.start()

    def _connect(self) -> None:
        w = self.worker
        pairs = ((self._load, w.load), (self._use_engine, w.use_engine), (self._generate, w.generate),
                 (self._regenerate, w.regenerate), (self._edit, w.edit_and_resend), (self._set_cache, w.set_cache),
                 (self._set_prefix_reuse, w.set_prefix_reuse), (self._set_kv_budget, w.set_kv_budget),
                 (self._set_kv_dtype, w.set_kv_dtype),
                 (self._compare, w.compare),
                 (self._set_weights, w.set_weights),
                 (self._new_conversation, w.new_conversation), (self._open_conversation, w.open_conversation),
                 (self._set_system_prompt, w.set_system_prompt))
        for signal, slot in pairs:
            signal.connect(slot)

    # --- requests ---------------------------------------------------------------------------------------------------
    def load(self, model: str | None) -> None:
        self._load.emit(model)

    def use_engine(self, engine) -> None:
        """Adopt an Engine that is already loaded (tests, embedding)."""
        self._use_engine.emit(engine)

    def set_cache(self, strategy: str, block_size: int) -> None:
        """Applied between turns: a generation in progress finishes with the old strategy."""
        self._set_cache.emit(strategy, block_size)

    def set_prefix_reuse(self, on: bool) -> None:
        """Applied between turns, like a change of strategy."""
        self._set_prefix_reuse.emit(on)

    def set_weights(self, fmt: str) -> None:
        """The weight format: the model is loaded again in it (between turns); the conversation stays."""
        self._set_weights.emit(fmt)

    def set_kv_budget(self, mib: float | None) -> None:
        """The most the paged pool grows to (None: one context); applied between turns, as a new cache."""
        self._set_kv_budget.emit(mib)

    def set_kv_dtype(self, name: str | None) -> None:
        """The KV precision (engine.config.KV_DTYPES); applied between turns, as a new cache."""
        self._set_kv_dtype.emit(name)

    def compare(self, configs) -> int:
        """Replay the conversation under each engine.replay.ReplayConfig; Stop (stop()) ends it like a reply."""
        self._requests += 1
        self._compare.emit(self._requests, list(configs))
        return self._requests

    def shutdown(self) -> None:
        """Cancel, let the worker's current step finish, stop the thread and wait for it."""
        if not self.thread.isRunning():
            return
        self.worker.close(self._requests)
        self.thread.quit()
        self.thread.wait()
        self.worker.release()  # the thread is gone: safe to touch the engine from here

    @property
    def running(self) -> bool:
        return self.thread.isRunning()
