"""Small dialogs: sampling parameters, system prompt, and the About text."""

from __future__ import annotations

import math
from html import escape

from PySide6.QtWidgets import (
    QDialog,
    QDialogButtonBox,
    QDoubleSpinBox,
    QFormLayout,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from app.model_info import ModelInfo, kv_bytes
from app.style import default_system_prompt, human_bytes
from engine.config import SamplingParams


def _double(minimum: float, maximum: float, step: float, value: float, decimals: int = 2) -> QDoubleSpinBox:
    box = QDoubleSpinBox(minimum=minimum, maximum=maximum, singleStep=step, decimals=decimals)
    box.setValue(value)
    return box


def _int(minimum: int, maximum: int, value: int) -> QSpinBox:
    box = QSpinBox(minimum=minimum, maximum=maximum)
    box.setValue(value)
    return box


class SamplingDialog(QDialog):
    def __init__(self, params: SamplingParams, parent: QWidget | None = None):
        super().__init__(parent)
        self.setWindowTitle("Sampling")
        form = QFormLayout(self)
        self.temperature = _double(0.0, 2.0, 0.05, params.temperature)
        self.top_k = _int(0, 1000, params.top_k)
        self.top_p = _double(0.01, 1.0, 0.01, params.top_p)
        self.repetition_penalty = _double(0.5, 2.0, 0.01, params.repetition_penalty)
        self.max_new_tokens = _int(1, 32768, params.max_new_tokens)
        self.seed = _int(-1, 2**31 - 1, -1 if params.seed is None else params.seed)
        self.seed.setSpecialValueText("random")
        form.addRow("Temperature (0 = greedy)", self.temperature)
        form.addRow("Top-k (0 = off)", self.top_k)
        form.addRow("Top-p", self.top_p)
        form.addRow("Repetition penalty", self.repetition_penalty)
        form.addRow("Max new tokens", self.max_new_tokens)
        form.addRow("Seed", self.seed)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        form.addRow(buttons)

    def params(self) -> SamplingParams:
        seed = self.seed.value()
        return SamplingParams(
            temperature=self.temperature.value(), top_k=self.top_k.value(), top_p=self.top_p.value(),
            repetition_penalty=self.repetition_penalty.value(), max_new_tokens=self.max_new_tokens.value(),
            seed=None if seed < 0 else seed,
        )


class DraftTokensDialog(QDialog):
    """The most tokens speculative decoding drafts per step (it adapts below that to the acceptance rate)."""

    def __init__(self, value: int, parent: QWidget | None = None):
        super().__init__(parent)
        self.setWindowTitle("Speculative decoding")
        form = QFormLayout(self)
        form.addRow(QLabel("Draft at most this many tokens per step; fewer while drafts are being rejected.", self))
        self.spin = _int(1, 64, value)
        form.addRow("Max draft tokens", self.spin)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        form.addRow(buttons)

    def value(self) -> int:
        return self.spin.value()


SHORT_QUESTION = "Could you explain briefly what a KV cache holds, and why it grows with the conversation?"
SHORT_REPLY_TOKENS = 32


def minimum_budget(info: ModelInfo | None, system_prompt: str | None) -> tuple[float, str] | None:
    """The smallest budget (MiB, rounded up to the dialog's 0.01) that holds the system prompt and one short turn
    under the active paged pool, and why; None when the strategy has no block pool to budget."""
    if info is None or not info.kv_bytes_per_block or info.count_prompt is None:
        return None
    prompt = info.count_prompt(system_prompt or None, [("user", SHORT_QUESTION)])
    # the engine keeps a quarter of the budget free for the reply (Engine._fit_prompt)
    tokens = max(prompt + SHORT_REPLY_TOKENS, -(-prompt * 4 // 3))
    blocks = -(-tokens // info.block_size)
    mib = math.ceil(blocks * info.kv_bytes_per_block / 2**20 * 100) / 100
    stored = f", {info.kv_dtype}" if info.kv_dtype else ""
    why = (f"the system prompt with a short question ({prompt:,} tokens) and a {SHORT_REPLY_TOKENS}-token reply "
           f"need {blocks} blocks of {info.block_size} tokens ({info.cache_strategy}{stored}: "
           f"{human_bytes(info.kv_bytes_per_block)} a block)")
    return mib, why


class KVBudgetDialog(QDialog):
    """The most a paged KV pool grows to, in MiB (0: one context's worth, the default). minimum: (MiB, why) from
    minimum_budget: a smaller budget is refused, saying what to choose instead."""

    def __init__(self, value: float | None, parent: QWidget | None = None,
                 minimum: tuple[float, str] | None = None):
        super().__init__(parent)
        self.setWindowTitle("KV budget")
        self.minimum = minimum
        form = QFormLayout(self)
        form.addRow(QLabel("The paged pool starts small and grows with the conversation, up to this budget.\n"
                           "Past it, cached blocks are evicted, a reply ends where the budget does (its text\n"
                           "kept), and the next turn drops the oldest turns from the model's view to fit.", self))
        self.spin = _double(0.0, 1 << 20, 16.0, value or 0.0, decimals=2)
        self.spin.setSpecialValueText("one context (default)")
        self.spin.setSuffix(" MiB")
        form.addRow("KV budget", self.spin)
        if minimum is not None:
            form.addRow(QLabel(f"At least {minimum[0]:g} MiB: {minimum[1]}.", self, objectName="muted",
                               wordWrap=True))
        self.problem = QLabel("", self, wordWrap=True)
        self.problem.setStyleSheet("color: #f28b82;")
        self.problem.hide()
        form.addRow(self.problem)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        form.addRow(buttons)

    def value(self) -> float | None:
        return self.spin.value() or None

    def accept(self) -> None:
        value = self.value()
        if value is not None and self.minimum is not None and value < self.minimum[0]:
            self.problem.setText(f"{value:g} MiB cannot hold one turn: {self.minimum[1]}. Choose "
                                 f"{self.minimum[0]:g} MiB or more, or 0 for one context's worth.")
            self.problem.show()
            return
        super().accept()


class SystemPromptDialog(QDialog):
    def __init__(self, prompt: str, parent: QWidget | None = None):
        super().__init__(parent)
        self.setWindowTitle("System prompt")
        self.resize(560, 320)
        layout = QVBoxLayout(self)
        layout.addWidget(QLabel("Applies to the current chat from its next turn, and to new chats.", self))
        self.editor = QPlainTextEdit(prompt, self, objectName="messageEditor")
        layout.addWidget(self.editor)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel)
        self.reset_button = QPushButton("Reset to default", self)
        self.reset_button.clicked.connect(lambda: self.editor.setPlainText(default_system_prompt()))
        buttons.addButton(self.reset_button, QDialogButtonBox.ButtonRole.ResetRole)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        layout.addWidget(buttons)

    def prompt(self) -> str:
        return self.editor.toPlainText().strip()


def about_html(info: ModelInfo | None) -> str:
    head = ("<h3>kvscope</h3><p>A local LLM chat that shows, live, what the KV cache is doing.</p>")
    if info is None:
        return head + "<p>No model is loaded yet.</p>"
    kv = kv_bytes(info)  # the same figures as the side panel's
    blocks = f", block size {info.block_size}" if info.cache_strategy.startswith("paged") else ""
    reuse = "kept between turns (prefix reuse)" if info.prefix_reuse else "prefilled again every turn"
    full = f"{human_bytes(kv.bytes_at(info.max_context))}"
    held = (f"A full {info.max_context:,}-token context needs {full}." if kv.holds_kv else
            f"'none' holds nothing: every step recomputes the context. A cache would need this "
            f"({full} for a full {info.max_context:,}-token context).")
    return head + (
        f"<p><b>Model:</b> {escape(info.model_name)}<br><b>Device:</b> {escape(info.device)} "
        f"({escape(info.dtype_name)} activations)<br><b>Weights:</b> {escape(info.weights_text)}<br>"
        f"<b>Context:</b> {info.max_context:,} tokens<br>"
        f"<b>Cache:</b> {escape(info.cache_strategy)}{blocks}; the history is {reuse}</p>"
        f"<p><b>KV bytes per token</b> = 2 × bytes/element × layers × KV heads × head_dim<br>"
        f"= {escape(kv.formula)} ({human_bytes(kv.bytes_per_token)})<br>{escape(held)}"
        + (f"<br>{escape(info.sliding_text)}." if info.sliding_text else "") + "</p>"
    )
