"""What the app shows about the loaded model: a plain frozen record built on the worker thread.

The KV bytes per token that Help → About and the side panel show both come from `kv_bytes(info)`: the active
strategy's bytes per stored element (the model's dtype; paged-int8's 1 byte plus its float16 scales), read from
the storage the strategy allocates when the record is built.

A model with sliding-window layers (Gemma 2/3) whose cache holds only their window grows by the global layers' bytes
per token; the sliding layers add at most their window's bytes (`KVBytes.bytes_at`): the formula is per layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
SCALED = {"paged-int8": "int8 + float16 scales"}  # strategies whose elements carry scales beside them


@dataclass(frozen=True)
class ModelInfo:
    model_name: str
    device: str
    dtype_name: str
    max_context: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    cache_strategy: str
    block_size: int
    kv_bytes_per_element: float = 0.0  # the active strategy's, scales included; 0: the dtype's
    prefix_reuse: bool = True  # the cache is kept between turns
    weight_format: str = "float32"  # how the projections are stored (int4, int8, bfloat16, float32)
    weights_bytes: int = 0  # the weights as they sit in memory
    weights_file_bytes: int = 0  # the file(s) they were read from (0: not read from a file)
    weights_report: str = ""  # a GGUF's tensors: 'kept as int4: 12 (Q4_K 12); ...' (engine.weights_report)
    kv_dtype: str = ""  # the precision the active cache stores K/V in (float32 ... int4; "" for 'none')
    kv_dtype_setting: str = ""  # what Settings → KV precision asked for ("auto" or a precision; "": not set)
    precision_bytes: tuple[tuple[str, float], ...] = ()  # (precision, KV bytes per token, scales included)
    kv_bytes_per_block: int = 0  # one block of the active paged pool, exactly (0: the strategy has no blocks)
    sliding_layers: int = 0  # layers that attend to a window of the last tokens only (Gemma 2/3; 0: none)
    sliding_window: int = 0  # their window, in tokens
    window_rows: int = 0  # the cache holds only a ring of this many rows for them per sequence (0: every token)
    window_bytes_per_element: float = 0.0  # what the ring stores an element in (the cache's float dtype)
    # count_prompt(system prompt, [(role, text), ...]) -> the prompt's tokens under the model's chat template
    count_prompt: Callable[[str | None, list[tuple[str, str]]], int] | None = field(default=None, compare=False,
                                                                                     repr=False)

    @classmethod
    def from_engine(cls, engine) -> ModelInfo:
        mc = engine.model_config
        return cls(
            model_name=engine.model_name, device=str(engine.device), dtype_name=engine.dtype_name,
            max_context=engine.max_context, num_layers=mc.num_layers, num_heads=mc.num_heads,
            num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim, cache_strategy=engine.cache_strategy,
            block_size=engine.block_size, kv_bytes_per_element=strategy_bytes_per_element(engine),
            prefix_reuse=engine.config.prefix_reuse, weight_format=engine.weight_format,
            weights_bytes=engine.weights_resident_bytes, weights_file_bytes=engine.weights_file_bytes,
            weights_report=getattr(engine, "weights_report", ""),
            kv_dtype=active_precision(engine), kv_dtype_setting=engine.config.kv_dtype or "",
            precision_bytes=precision_bytes_per_token(engine),
            kv_bytes_per_block=int(engine.cache.bytes_per_block()) if hasattr(engine.cache, "bytes_per_block") else 0,
            count_prompt=prompt_counter(engine.tokenizer), **sliding_fields(engine),
        )

    @property
    def window_only(self) -> bool:
        return bool(self.window_rows)

    @property
    def held_layers(self) -> int:
        """Layers that hold every token of the context: all but the sliding ones whose cache holds the window."""
        return self.num_layers - self.sliding_layers if self.window_only else self.num_layers

    @property
    def sliding_text(self) -> str:
        """'5 of 6 layers slide with a window of 512 tokens and hold only it (528 rows a sequence)', or ''."""
        if not self.sliding_layers:
            return ""
        slide = (f"{self.sliding_layers} of {self.num_layers} layers slide with a window of {self.sliding_window:,} "
                 "tokens")
        if self.window_only:
            return f"{slide} and hold only it ({self.window_rows:,} rows a sequence)"
        if self.cache_strategy == "none":
            return f"{slide}; none keeps no keys or values"
        return f"{slide}; the cache holds every token of them (the window is no shorter than the context)"

    @property
    def kv_dtype_text(self) -> str:
        """'auto → bfloat16', 'int8', or '' when no cache is kept."""
        if not self.kv_dtype:
            return ""
        asked = self.kv_dtype_setting
        return f"{asked} → {self.kv_dtype}" if asked and asked != self.kv_dtype else self.kv_dtype

    @property
    def weights_text(self) -> str:
        """'int4 weights, 105 MiB' (and the file's size when it came from one): MiB, as everywhere in the app."""
        text = f"{self.weight_format} weights, {self.weights_bytes / 2**20:,.0f} MiB"
        text += f" (file {self.weights_file_bytes / 2**20:,.0f} MiB)" if self.weights_file_bytes else ""
        return text + (f"; GGUF tensors {self.weights_report}" if self.weights_report else "")

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES.get(self.dtype_name, 4)

    def bytes_per_token(self, bytes_per_element: float | None = None) -> float:
        """The article's formula: 2 (K and V) x bytes/element x layers x KV heads x head_dim, for the layers that
        hold every token (a window-only cache's sliding layers add a bounded amount, `KVBytes.bytes_at`)."""
        bpe = self.dtype_bytes if bytes_per_element is None else bytes_per_element
        return 2 * bpe * self.held_layers * self.num_kv_heads * self.head_dim

    def window_bytes_per_token(self) -> float:
        """Bytes a window-only cache's sliding layers hold per token of their window (0: none such)."""
        if not self.window_only:
            return 0.0
        return 2 * self.window_bytes_per_element * self.sliding_layers * self.num_kv_heads * self.head_dim

    def formula(self, bytes_per_element: float | None = None) -> str:
        bpe = self.dtype_bytes if bytes_per_element is None else bytes_per_element
        bpe_text = f"{bpe:g}"
        total = self.bytes_per_token(bpe)
        return (f"2 × {bpe_text} B/element × {self.held_layers} layers × {self.num_kv_heads} KV heads × "
                f"{self.head_dim} head_dim = {total:,.0f} bytes/token")

    @property
    def gqa_ratio(self) -> float:
        return self.num_heads / self.num_kv_heads


def strategy_bytes_per_element(engine) -> float:
    """Bytes one stored K or V element costs under the engine's strategy: a paged pool's bytes per block (int8
    data and its scales) over the elements a block holds; otherwise the cache's element size."""
    cache = engine.cache
    mc = getattr(cache, "store_config", engine.model_config)  # the layers a block holds (not the sliding ones)
    if not hasattr(cache, "bytes_per_block") or not mc.num_layers:
        return float(cache.bytes_per_element)
    elements = cache.block_size * 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim
    return cache.bytes_per_block() / elements


def sliding_fields(engine) -> dict:
    """ModelInfo's sliding-window fields: which layers slide, and what the engine's cache holds of them."""
    mc, held = engine.model_config, getattr(engine.cache, "sliding", None)
    fields = {"sliding_layers": sum(mc.sliding_layers), "sliding_window": mc.sliding_window}
    if held is not None and engine.cache.keeps_kv:
        fields.update(window_rows=held.slots, window_bytes_per_element=float(engine.cache.dtype.itemsize))
    return fields


def prompt_counter(tokenizer) -> Callable[[str | None, list[tuple[str, str]]], int]:
    """Counts a prompt's tokens as the engine builds it (engine.chat.prompt_ids): safe on the GUI thread, since
    a fast tokenizer is."""
    from engine.chat import Message, prompt_ids

    def count(system_prompt: str | None, messages: list[tuple[str, str]]) -> int:
        return len(prompt_ids(tokenizer, system_prompt, [Message(role, text) for role, text in messages]))

    return count


def active_precision(engine) -> str:
    """The precision the engine's cache stores keys and values in ('' for 'none', which stores none)."""
    strategy = engine.cache_strategy
    if strategy == "none":
        return ""
    if strategy == "paged-int8":
        return "int8"
    return getattr(engine, "kv_dtype_name", engine.dtype_name)


def precision_bytes_per_token(engine) -> tuple[tuple[str, float], ...]:
    """KV bytes per token under every concrete precision, scales included (engine.kv.precision's formula; the
    float formats by their element size where the engine offers no such formula), for the layers that hold every
    token (a window-only cache's sliding layers are apart: ModelInfo.window_bytes_per_token)."""
    from engine.config import KV_DTYPES
    from engine.kv import precision

    mc, block_size = getattr(engine.cache, "store_config", engine.model_config), engine.block_size  # held whole
    formula = getattr(precision, "bytes_per_token", None)
    names = getattr(precision, "PRECISIONS", None) or tuple(n for n in KV_DTYPES if n != "auto")
    rows = []
    for name in names:
        if formula is not None:
            rows.append((name, float(formula(mc, name, block_size))))
        elif name in DTYPE_BYTES:
            rows.append((name, float(mc.kv_bytes_per_token(DTYPE_BYTES[name]))))
    return tuple(rows)


@dataclass(frozen=True)
class KVBytes:
    """The formula filled in for the active strategy: the one source of About and the side panel."""

    strategy: str
    bytes_per_element: float
    bytes_per_token: float
    formula: str  # "2 × 4 B/element × 30 layers × 3 KV heads × 64 head_dim = 46,080 bytes/token"
    holds_kv: bool  # False for 'none': the formula is then what a cache would need
    window_bytes_per_token: float = 0.0  # a window-only cache's sliding layers, per token of their window
    window: int = 0

    def bytes_at(self, context: int) -> float:
        """Per layer: the global layers hold the context, the sliding ones at most their window."""
        return self.bytes_per_token * context + self.window_bytes_per_token * min(context, self.window)


def kv_outgrows_weights_at(info: ModelInfo) -> int | None:
    """The context length at which the KV cache (the active strategy's bytes per token) holds more bytes than
    the weights; None when nothing is held ('none') or the weights are unknown."""
    kv = kv_bytes(info)
    if not kv.holds_kv or not info.weights_bytes:
        return None
    within = kv.bytes_per_token + kv.window_bytes_per_token  # per token while the context is within the window
    if info.weights_bytes // within < kv.window or not kv.window:
        return int(info.weights_bytes // within) + 1
    if not kv.bytes_per_token:  # every layer slides: the cache never passes its windows' bytes
        return None
    return int((info.weights_bytes - kv.window_bytes_per_token * kv.window) // kv.bytes_per_token) + 1


def kv_bytes(info: ModelInfo) -> KVBytes:
    strategy = info.cache_strategy
    holds_kv = strategy != "none"
    bpe = info.kv_bytes_per_element if holds_kv and info.kv_bytes_per_element else info.dtype_bytes
    what = f" ({SCALED[strategy]})" if strategy in SCALED else ""
    total = info.bytes_per_token(bpe)
    layers = f"{info.held_layers} global layers" if info.window_only else f"{info.num_layers} layers"
    formula = (f"2 × {bpe:.4g} B/element{what} × {layers} × {info.num_kv_heads} KV heads × "
               f"{info.head_dim} head_dim = {total:,.0f} bytes/token")
    window = info.window_bytes_per_token() if holds_kv else 0.0
    if window:
        formula += (f", plus 2 × {info.window_bytes_per_element:g} B/element × {info.sliding_layers} sliding layers × "
                    f"{info.num_kv_heads} KV heads × {info.head_dim} head_dim × min(context, {info.sliding_window:,}) "
                    f"= at most {window * info.sliding_window:,.0f} bytes")
    return KVBytes(strategy, bpe, total, formula, holds_kv, window, info.sliding_window if window else 0)
