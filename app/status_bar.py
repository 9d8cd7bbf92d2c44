"""The status bar: model, device, cache strategy, speed and first-token time of the reply (live while it streams,
then the finished reply's), context used, KV memory now. A new conversation resets them."""

from __future__ import annotations

from dataclasses import dataclass

from PySide6.QtWidgets import QLabel, QProgressBar, QStatusBar, QWidget

from app.model_info import ModelInfo
from app.style import human_bytes, strategy_color


@dataclass
class LiveReply:
    """The reply streaming now, from its step events: the same sums DoneEvent reports at the end."""

    prefill_ms: float = 0.0
    first_token: bool = False
    decode_ms: float = 0.0
    decode_tokens: int = 0

    def add(self, event) -> None:
        if event.phase == "prefill":
            self.prefill_ms += event.latency_ms
            self.first_token = self.first_token or event.token_id is not None
        else:
            self.decode_ms += event.latency_ms
            self.decode_tokens += event.n_produced

    @property
    def tok_s(self) -> float | None:
        return self.decode_tokens / (self.decode_ms / 1000) if self.decode_ms else None


class StatusBar(QStatusBar):
    FIELDS = ("model", "device", "strategy", "speculation", "speed", "ttft", "context", "kv")

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setSizeGripEnabled(False)
        self.labels: dict[str, QLabel] = {}
        self.progress = QProgressBar(self, minimumWidth=160, maximumWidth=220, textVisible=False)
        self.progress.hide()
        self.progress_text = QLabel("", self, objectName="status_progress")  # beside the bar: a temporary
        self.progress_text.hide()  # message would hide the bar (QStatusBar hides its normal widgets meanwhile)
        self.addWidget(self.progress)
        self.addWidget(self.progress_text)
        for name in self.FIELDS:
            label = QLabel("", self)
            label.setObjectName("statusStrong" if name in ("model", "strategy") else f"status_{name}")
            self.labels[name] = label
            self.addPermanentWidget(label)
        self.max_context = 0
        self.context_used = 0  # tokens of the context in use, as last shown
        self.live: LiveReply | None = None
        self.set_model(None)

    def text(self, name: str) -> str:
        return self.labels[name].text()

    def set_model(self, info: ModelInfo | None) -> None:
        if info is None:
            self._set(model="no model", device="", strategy="", speed="– tok/s", ttft="first token –",
                      context="context –", kv="KV –")
            return
        self.max_context = info.max_context
        color = strategy_color(info.cache_strategy)
        block = f" · {info.block_size}" if info.cache_strategy.startswith("paged") else ""
        precision = f" · {info.kv_dtype_text}" if getattr(info, "kv_dtype_text", "") else ""
        self._set(model=info.model_name, device=f"{info.device} · {info.weights_text}",
                  strategy=f'<span style="color:{color};">■</span> {info.cache_strategy}{block}{precision}')

    def set_speculation(self, config) -> None:
        """Speculative decoding's state (a SpeculativeConfig): named while it is on, hidden while it is off."""
        on = getattr(config, "enabled", False)
        self._set(speculation=f"speculative: {config.mode} ≤ {config.max_draft_tokens}" if on else "")
        self.labels["speculation"].setToolTip(
            f"speculative decoding ({config.mode}): up to {config.max_draft_tokens} drafted tokens checked in one "
            "forward per step; the reply is the same, faster when it repeats the context" if on else "")

    def set_idle(self, message: str = "") -> None:
        """After a stop: nothing is streaming any more; the message says how it ended."""
        self.live = None
        if message:
            self.showMessage(message, 4000)
        else:
            self.clearMessage()

    def start_reply(self) -> None:
        """A reply begins: the last reply's figures give way to this one's, filled in as its steps arrive."""
        self.live = LiveReply()
        self._set(speed="… tok/s", ttft="first token …")

    def add_step(self, event) -> None:
        """A step of the streaming reply: counted now, its first-token time shown as soon as it is known, its speed
        by show_live (the window calls it a few times a second). Set at every token, the speed's label and the
        bar's fitting took ~0.8 ms of the GUI thread a token, time the engine's threads lost a core for."""
        if self.live is None:
            return
        had_first = self.live.first_token
        self.live.add(event)
        if self.live.first_token and not had_first:
            self.show_live()

    def show_live(self) -> None:
        """The streaming reply's figures so far: its first-token time and its running speed."""
        if self.live is None:
            return
        if self.live.first_token:
            self._set(ttft=f"first token {self.live.prefill_ms:,.0f} ms")
        if self.live.tok_s is not None:
            self._set(speed=f"{self.live.tok_s:.1f} tok/s")

    def set_done(self, done) -> None:
        self.live = None
        self._set(speed=f"{done.decode_tok_s:.1f} tok/s", ttft=f"first token {done.ttft_ms:,.0f} ms")

    def new_conversation(self) -> None:
        """Nothing said yet: no speed, no first token, an empty context."""
        self.live = None
        self._set(speed="– tok/s", ttft="first token –")
        self.set_context(0)

    def set_context(self, used: int) -> None:
        self.context_used = used
        limit = max(self.max_context, 1)
        self._set(context=f"context {used:,} / {self.max_context:,} ({used / limit:.1%})")

    def set_kv(self, kv) -> None:
        self._set(kv=f"KV {human_bytes(kv.bytes_allocated)}")

    def show_progress(self, message: str, fraction: float) -> None:
        """A bar (busy when fraction < 0) and its message, side by side, until hide_progress."""
        self.clearMessage()  # a temporary message would hide the bar
        self.progress.show()
        if fraction < 0:
            self.progress.setRange(0, 0)  # busy indicator
        else:
            self.progress.setRange(0, 100)
            self.progress.setValue(int(fraction * 100))
        self.progress_text.setText(message)
        self.progress_text.show()

    @property
    def progress_message(self) -> str:
        return self.progress_text.text() if self.progress.isVisibleTo(self) else ""

    def hide_progress(self) -> None:
        self.progress.hide()
        self.progress_text.hide()

    def _set(self, **texts: str) -> None:
        for name, text in texts.items():
            self.labels[name].setText(text)
            self.labels[name].setVisible(bool(text))
