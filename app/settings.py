"""Preferences kept with QSettings. Tests pass their own QSettings (an ini file in a temporary folder)."""

from __future__ import annotations

from PySide6.QtCore import QByteArray, QSettings

from app.style import default_system_prompt
from engine.config import (
    BLOCK_SIZES,
    CACHE_STRATEGIES,
    KV_DTYPES,
    WEIGHT_FORMATS,
    SamplingParams,
    SpeculativeConfig,
)

ORGANIZATION = "kvscope"
APPLICATION = "kvscope"
MENU_BLOCK_SIZES = tuple(b for b in BLOCK_SIZES if b >= 8)
BACKENDS = ("local", "remote")
SPECULATIVE_MENU_MODES = ("off", "lookup")  # the draft-model mode needs a second loaded model: not offered yet
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "repetition_penalty", "max_new_tokens", "seed")


class AppSettings:
    def __init__(self, qsettings: QSettings | None = None):
        self.q = qsettings if qsettings is not None else QSettings(ORGANIZATION, APPLICATION)

    # --- typed access -----------------------------------------------------------------------------------------------
    def _get(self, key: str, default, kind):
        value = self.q.value(key, default)
        try:
            if kind is bool and isinstance(value, str):
                return value.lower() in ("true", "1", "yes")
            return kind(value)
        except (TypeError, ValueError):
            return default

    @property
    def cache_strategy(self) -> str:
        value = self._get("engine/cache", "paged", str)
        return value if value in CACHE_STRATEGIES else "paged"

    @cache_strategy.setter
    def cache_strategy(self, value: str) -> None:
        self.q.setValue("engine/cache", value)

    @property
    def block_size(self) -> int:
        value = self._get("engine/block_size", 16, int)
        return value if value in MENU_BLOCK_SIZES else 16

    @block_size.setter
    def block_size(self, value: int) -> None:
        self.q.setValue("engine/block_size", int(value))

    @property
    def weights(self) -> str:
        """The weight format (auto: the fastest measured on this machine that meets the quality bounds)."""
        value = self._get("engine/weights", "auto", str)
        return value if value in WEIGHT_FORMATS else "auto"

    @weights.setter
    def weights(self, value: str) -> None:
        self.q.setValue("engine/weights", value)

    @property
    def kv_dtype(self) -> str:
        """The KV precision (Settings → KV precision; auto: the fastest measured here within the quality bound)."""
        value = self._get("engine/kv_dtype", "auto", str)
        return value if value in KV_DTYPES else "auto"

    @kv_dtype.setter
    def kv_dtype(self, value: str) -> None:
        self.q.setValue("engine/kv_dtype", value if value in KV_DTYPES else "auto")

    @property
    def prefix_reuse(self) -> bool:
        """Keep the conversation's KV cache between turns and reuse the common prefix (on by default)."""
        return self._get("engine/prefix_reuse", True, bool)

    @prefix_reuse.setter
    def prefix_reuse(self, value: bool) -> None:
        self.q.setValue("engine/prefix_reuse", bool(value))

    @property
    def kv_budget_mib(self) -> float | None:
        """The most a paged KV pool grows to, in MiB; None (stored as 0): one context's worth."""
        value = self._get("engine/kv_budget_mib", 0.0, float)
        return value if value > 0 else None

    @kv_budget_mib.setter
    def kv_budget_mib(self, value: float | None) -> None:
        self.q.setValue("engine/kv_budget_mib", float(value or 0.0))

    @property
    def model_path(self) -> str | None:
        return self._get("engine/model", "", str) or None

    @model_path.setter
    def model_path(self, value: str | None) -> None:
        self.q.setValue("engine/model", value or "")

    @property
    def last_folder(self) -> str:
        """Where the last conversation or export was opened or saved: the file dialogs start there."""
        return self._get("files/last_folder", "", str)

    @last_folder.setter
    def last_folder(self, value: str) -> None:
        self.q.setValue("files/last_folder", value or "")

    # --- backend: the local engine, or an OpenAI-compatible server -------------------------------------------------
    @property
    def backend(self) -> str:
        value = self._get("backend/kind", "local", str)
        return value if value in BACKENDS else "local"

    @backend.setter
    def backend(self, value: str) -> None:
        self.q.setValue("backend/kind", value if value in BACKENDS else "local")

    @property
    def server_url(self) -> str:
        return self._get("backend/url", "http://127.0.0.1:8000", str)

    @server_url.setter
    def server_url(self, value: str) -> None:
        self.q.setValue("backend/url", value)

    @property
    def server_api_key(self) -> str | None:
        return self._get("backend/api_key", "", str) or None  # kept in the settings file as typed, not encrypted

    @server_api_key.setter
    def server_api_key(self, value: str | None) -> None:
        self.q.setValue("backend/api_key", value or "")

    @property
    def server_model(self) -> str | None:
        return self._get("backend/model", "", str) or None

    @server_model.setter
    def server_model(self, value: str | None) -> None:
        self.q.setValue("backend/model", value or "")

    @property
    def system_prompt(self) -> str:
        return self._get("chat/system_prompt", default_system_prompt(), str)

    @system_prompt.setter
    def system_prompt(self, value: str) -> None:
        self.q.setValue("chat/system_prompt", value)

    @property
    def show_side_panel(self) -> bool:
        return self._get("view/side_panel", True, bool)

    @show_side_panel.setter
    def show_side_panel(self, value: bool) -> None:
        self.q.setValue("view/side_panel", bool(value))

    # --- speculative decoding: off or prompt lookup, and the most draft tokens per step -------------------------
    @property
    def speculative_mode(self) -> str:
        value = self._get("speculative/mode", "off", str)
        return value if value in SPECULATIVE_MENU_MODES else "off"

    @speculative_mode.setter
    def speculative_mode(self, value: str) -> None:
        self.q.setValue("speculative/mode", value if value in SPECULATIVE_MENU_MODES else "off")

    @property
    def max_draft_tokens(self) -> int:
        value = self._get("speculative/max_draft_tokens", SpeculativeConfig().max_draft_tokens, int)
        return value if 1 <= value <= 64 else SpeculativeConfig().max_draft_tokens

    @max_draft_tokens.setter
    def max_draft_tokens(self, value: int) -> None:
        self.q.setValue("speculative/max_draft_tokens", int(value))

    @property
    def speculative(self) -> SpeculativeConfig:
        return SpeculativeConfig(self.speculative_mode, self.max_draft_tokens)

    @property
    def sampling(self) -> SamplingParams:
        defaults = SamplingParams()
        values = {}
        for name in SAMPLING_FIELDS:
            default = getattr(defaults, name)
            kind = int if name in ("top_k", "max_new_tokens", "seed") else float
            raw = self.q.value(f"sampling/{name}", default)
            values[name] = None if raw in (None, "", "none") else self._get(f"sampling/{name}", default, kind)
        try:
            return SamplingParams(**values, speculative=self.speculative)
        except ValueError:
            return SamplingParams(speculative=self.speculative)

    @sampling.setter
    def sampling(self, params: SamplingParams) -> None:
        for name in SAMPLING_FIELDS:
            value = getattr(params, name)
            self.q.setValue(f"sampling/{name}", "" if value is None else value)

    def window_state(self) -> tuple[QByteArray | None, QByteArray | None]:
        return self.q.value("window/geometry"), self.q.value("window/splitter")

    def save_window_state(self, geometry: QByteArray, splitter: QByteArray) -> None:
        self.q.setValue("window/geometry", geometry)
        self.q.setValue("window/splitter", splitter)

    def sync(self) -> None:
        self.q.sync()
