"""EngineWorker: the Engine on its own QThread, driven by queued requests and reporting through signals.

Superqt-style: the signals live in a composed WorkerSignals object, every exception becomes an `error` signal
(a worker never takes the app down, and the conversation is kept as it was), and a stop flag is checked
between steps. Requests carry an increasing id so that Stop cancels exactly the generations asked so far.
The Conversation belongs to this thread; the GUI only ever sees copies (`conversation` emits to_dict()).
"""

from __future__ import annotations

from PySide6.QtCore import QObject, Signal, Slot

from app.model_info import ModelInfo
from app.storage import conversation_dict
from engine.chat import Conversation
from engine.config import EngineConfig
from engine.events import DoneEvent, StepEvent, TrimEvent


def keep_until(conv: Conversation, index: int) -> None:
    """Drop the user message at `index` (-1: the last user message, with the reply after it) and all after it."""
    messages = conv.messages
    if index < 0:
        index = max((i for i, m in enumerate(messages) if m.role == "user"), default=len(messages))
    if not 0 <= index < len(messages) or messages[index].role != "user":
        raise ValueError(f"message {index} is not a user message of this conversation")
    del messages[index:]
    conv.context_start = min(conv.context_start, index)


def advice(error: Exception) -> str:
    """What the user can do about a failed turn, where the engine's message names only the cause."""
    if type(error).__name__ == "KVCacheFull":  # engine.kv.base.KVCacheFull, not imported here: torch loads late
        return (". In the app: raise the KV budget (Settings → KV budget), start a new chat (File → New chat), or "
                "send a shorter message")
    return ""


class WorkerSignals(QObject):
    loaded = Signal(object)  # ModelInfo, after a load or a change of cache strategy
    progress = Signal(str, float)  # message, fraction in [0, 1] or -1 when unknown
    step = Signal(object)  # StepEvent
    token = Signal(str)  # text a step added to the reply
    trim = Signal(object)  # TrimEvent
    finished = Signal(object)  # DoneEvent: the turn is over (also when cancelled)
    error = Signal(str)  # something failed; the engine and the conversation are as before
    stats = Signal(object)  # KVStats after a change made without generating
    conversation = Signal(object)  # storage.conversation_dict() after every change (a plain dict, not a QVariantMap)
    compare_step = Signal(object)  # app.compare_job.CompareStep: one replayed step of a Compare
    compare_done = Signal(object)  # engine.replay_result.CompareResult: the Compare is over (also when stopped)


class EngineWorker(QObject):
    def __init__(self, engine=None, cache: str = "paged", block_size: int = 16, system_prompt: str | None = None):
        super().__init__()
        self.signals = WorkerSignals()
        self.engine = engine
        self.conv = Conversation(system_prompt=system_prompt)
        self._cache, self._block_size = cache, block_size
        self._prefix_reuse = True  # keep the conversation's cache between turns (Settings)
        self._weights = "auto"  # the weight format (Settings)
        self._model: str | None = None  # what load() last loaded (None: the default model)
        self._kv_budget: float | None = None  # MiB the paged pool may grow to (Settings; None: one context)
        self._kv_dtype: str | None = None  # the KV precision (Settings; None: the engine's own)
        self._cancel_upto = 0  # generation requests with an id <= this are cancelled
        self._closing = False

    # --- called directly from the GUI thread (thread-safe) -----------------------------------------------------
    def stop(self, upto: int) -> None:
        self._cancel_upto = max(self._cancel_upto, upto)
        if self.engine is not None:
            self.engine.cancel()

    def close(self, upto: int) -> None:
        self._closing = True
        self.stop(upto)

    def release(self) -> None:
        """After the thread has stopped: give the conversation's cache blocks back to the engine."""
        if self.engine is not None:
            self.engine.forget(self.conv)

    # --- slots, run on the worker thread ---------------------------------------------------------------------------
    @Slot(object)
    def load(self, model: str | None) -> None:
        if self._closing:
            return
        from engine.engine import Engine  # imported here: loading torch happens off the GUI thread

        try:
            config = EngineConfig(cache=self._cache, block_size=self._block_size, prefix_reuse=self._prefix_reuse,
                                  kv_budget_mib=self._kv_budget, weights=self._weights,
                                  kv_dtype=self._kv_dtype)
            engine = Engine.load(model, config, progress=self._progress)
        except Exception as e:  # noqa: BLE001 - every failure is reported; the old model stays loaded
            self.signals.error.emit(f"Could not load the model {model or '(default)'}: {e}")
            return
        self._model = model
        self.use_engine(engine)

    @Slot(str)
    def set_weights(self, fmt: str) -> None:
        """Load the model again in `fmt`; the conversation stays and its next turn prefills into the new cache.
        An engine handed over ready-made (tests, embedding) converts its weights in place instead."""
        self._weights = fmt
        if self.engine is None or self.engine.config.weights == fmt:
            return
        if self._model is not None or self.engine.weights_file_bytes:
            self.load(self._model)
            return
        try:
            self.engine.set_weights(fmt)
        except Exception as e:  # noqa: BLE001 - reported; the engine keeps its weights
            self.signals.error.emit(f"Could not convert the weights to {fmt}: {e}")
            return
        self.signals.loaded.emit(ModelInfo.from_engine(self.engine))

    @Slot(object)
    def use_engine(self, engine) -> None:
        if self.engine is not None and self.engine is not engine:
            self.engine.forget(self.conv)
        self.engine = engine
        self._cache, self._block_size = engine.cache_strategy, engine.block_size
        engine.set_prefix_reuse(self._prefix_reuse)  # the window's setting decides, whoever built the engine
        if engine.config.kv_budget_mib != self._kv_budget:
            try:
                engine.set_kv_budget(self._kv_budget)
            except ValueError as e:  # too small for one block: the engine keeps its own budget
                self.signals.error.emit(f"Could not set the KV budget to {self._kv_budget} MiB: {e}")
        if self._kv_dtype is not None and engine.config.kv_dtype != self._kv_dtype:
            self._apply_kv_dtype(self._kv_dtype)
        self.signals.loaded.emit(ModelInfo.from_engine(engine))
        self._emit_state()

    @Slot(int, str, object)
    def generate(self, request: int, text: str, params) -> None:
        self._run(request, lambda: self.engine.generate(self.conv, text, params))

    @Slot(int, object)
    def regenerate(self, request: int, params) -> None:
        self._run(request, lambda: self.engine.generate(self.conv, None, params))

    @Slot(int, int, str, object)
    def edit_and_resend(self, request: int, index: int, text: str, params) -> None:
        """Replace the user message at `index` (-1: the last) with `text`, drop what follows it, and answer it:
        the history before it keeps its cache (prefix reuse), the rest is computed anew."""
        def events():
            keep_until(self.conv, index)
            old = self._branch_off()
            try:
                for event in self.engine.generate(self.conv, text, params):
                    if old is not None and isinstance(event, StepEvent):  # the new sequence holds its own blocks
                        self.engine.forget(old)
                        old = None
                    yield event
            finally:
                if old is not None:
                    self.engine.forget(old)

        self._run(request, events, self.conv.snapshot())

    def _branch_off(self) -> Conversation | None:
        """The window keeps the version an edit replaces (app.branches). Where the cache has a prefix cache (the
        paged pool), the edited conversation goes on in a fork of the sequence: it shares every block of the
        common history (the partly filled one is copied when it is rewritten), and the old sequence, forgotten
        once the new one holds its own blocks, leaves all of its blocks to the prefix cache whole, so showing the
        old version again finds them there while they are not evicted. Elsewhere (one buffer per sequence: a fork
        would copy it), or near the KV budget (the old sequence holds its blocks until the new one's first step),
        the sequence is cut back to the common history and goes on. Returns the old sequence's conversation, or
        None."""
        cache, held = self.engine.cache, self.engine.cache.tokens_held(self.conv.seq_id)
        room = -(-held // self.engine.block_size) + 1  # the old sequence's blocks stay held until the first step
        if not self.engine.cache_strategy.startswith("paged") or not cache.prefix_reuse or not held \
                or not cache.can_make_room(room):
            return None  # near the budget the fork's extra blocks could end the reply early: cut back instead
        old = self.conv
        self.conv = Conversation(old.system_prompt, old.messages, old.context_start)
        cache.fork(old.seq_id, self.conv.seq_id)
        return old

    @Slot(str, int)
    def set_cache(self, strategy: str, block_size: int) -> None:
        self._cache, self._block_size = strategy, block_size
        if self.engine is None or self._closing:
            return
        try:
            self.engine.set_cache(strategy, block_size)
        except Exception as e:  # noqa: BLE001
            self.signals.error.emit(f"Could not switch the cache to {strategy} (block size {block_size}): {e}")
            return
        self.signals.loaded.emit(ModelInfo.from_engine(self.engine))
        self._emit_state()

    @Slot(bool)
    def set_prefix_reuse(self, on: bool) -> None:
        """From the next turn: keep the conversation's cache between turns, or prefill the history every turn."""
        self._prefix_reuse = on
        if self.engine is not None and not self._closing:
            self.engine.set_prefix_reuse(on)
            self.signals.loaded.emit(ModelInfo.from_engine(self.engine))

    @Slot(object)
    def set_kv_budget(self, mib: float | None) -> None:
        """A new cache with this budget (None: one context's worth); the next turn prefills the history."""
        self._kv_budget = mib
        if self.engine is None or self._closing or self.engine.config.kv_budget_mib == mib:
            return
        try:
            self.engine.set_kv_budget(mib)
        except ValueError as e:
            self.signals.error.emit(f"Could not set the KV budget to {mib} MiB: {e}")
            return
        self.signals.loaded.emit(ModelInfo.from_engine(self.engine))
        self._emit_state()

    @Slot(object)
    def set_kv_dtype(self, name: str | None) -> None:
        """A new cache in this KV precision (None: the engine's own); the next turn prefills the history."""
        self._kv_dtype = name
        if self.engine is None or self._closing or name is None or self.engine.config.kv_dtype == name:
            return
        if self._apply_kv_dtype(name):
            self.signals.loaded.emit(ModelInfo.from_engine(self.engine))
            self._emit_state()

    def _apply_kv_dtype(self, name: str) -> bool:
        try:
            self.engine.set_kv_dtype(name)
        except Exception as e:  # noqa: BLE001 - reported; the engine keeps its cache
            self.signals.error.emit(f"Could not store the KV cache as {name}: {e}")
            return False
        return True

    @Slot(int, object)
    def compare(self, request: int, configs) -> None:
        """Replay the conversation's exact tokens under each ReplayConfig (app.compare_job); Stop ends it."""
        from app.compare_job import CompareJob, run_compare

        if not self._closing:
            run_compare(CompareJob(self.signals, self.engine, self.conv, lambda: request <= self._cancel_upto,
                                   self._model, self._progress), configs)

    @Slot(object)
    def new_conversation(self, system_prompt: str | None) -> None:
        self._replace_conversation(Conversation(system_prompt=system_prompt))

    @Slot(object)
    def open_conversation(self, conv: Conversation) -> None:
        self._replace_conversation(conv)

    @Slot(object)
    def set_system_prompt(self, system_prompt: str | None) -> None:
        self.conv.system_prompt = system_prompt
        self.signals.conversation.emit(conversation_dict(self.conv))

    # --- internals --------------------------------------------------------------------------------------------------
    def _progress(self, message: str, fraction: float | None) -> None:
        self.signals.progress.emit(message, -1.0 if fraction is None else float(fraction))

    def _replace_conversation(self, conv: Conversation) -> None:
        if self.engine is not None:
            self.engine.forget(self.conv)
        self.conv = conv
        self._emit_state()

    def _emit_state(self) -> None:
        if self.engine is not None:
            self.signals.stats.emit(self.engine.kv_stats(self.conv))
        self.signals.conversation.emit(conversation_dict(self.conv))

    def _run(self, request: int, events, snapshot: tuple | None = None) -> None:
        if self._closing:
            return
        if self.engine is None:
            self.signals.error.emit("No model is loaded yet: wait for loading to finish, or choose a model.")
            self.signals.conversation.emit(conversation_dict(self.conv))
            return
        try:
            for event in events():
                if request <= self._cancel_upto:
                    self.engine.cancel()
                self._emit(event)
        except Exception as e:  # noqa: BLE001 - reported; the engine restored the conversation
            if snapshot is not None:
                self.conv.restore(snapshot)
            self.signals.error.emit(f"Generation failed: {e}{advice(e)}")
            self.signals.stats.emit(self.engine.kv_stats(self.conv))  # the failed turn's blocks are gone: show it
        self.signals.conversation.emit(conversation_dict(self.conv))

    def _emit(self, event) -> None:
        if isinstance(event, StepEvent):
            if event.text:
                self.signals.token.emit(event.text)
            self.signals.step.emit(event)
        elif isinstance(event, TrimEvent):
            self.signals.trim.emit(event)
        elif isinstance(event, DoneEvent):
            self.signals.finished.emit(event)
