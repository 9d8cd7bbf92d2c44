"""A KV cache from a layout and a precision: the one place that maps the two to a cache class."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import cache_preset
from engine.kv import quant
from engine.kv.base import KVCache
from engine.kv.contiguous import ContiguousCache
from engine.kv.contiguous_quant import ContiguousQuantCache
from engine.kv.paged import PagedCache
from engine.kv.paged_quant import PagedQuantCache
from engine.kv.recompute import RecomputeCache


@dataclass(frozen=True)
class CacheShape:
    """What every cache of one model shares: its shapes, device, activations and context."""
    model_config: object
    activation_dtype: torch.dtype
    device: torch.device
    max_context: int
    residual: int | None = None  # a quantized cache's newest tokens in full precision (None: the codec's)
    sink: int | None = None  # and its first tokens


def new_cache(strategy: str, precision: str, shape: CacheShape, block_size: int = 16,
              pool_tokens: int | None = None, budget_bytes: int | None = None) -> KVCache:
    """A layout (none, contiguous, paged, or a preset) over a precision (a float dtype's name, int8 or int4).
    `none` holds nothing and computes in the activations' dtype; a quantized cache keeps its full-precision
    rows in the activations' dtype too."""
    layout, fixed = cache_preset(strategy)  # a preset name fixes the precision, a layout takes the one given
    precision = fixed or precision
    codec = quant.CODECS.get(precision)
    dtype = shape.activation_dtype if layout == "none" or codec else getattr(torch, precision)
    args = (shape.model_config, dtype, shape.device, shape.max_context)
    if layout == "none":
        return RecomputeCache(*args)
    full_precision = {"residual": shape.residual, "sink": shape.sink}
    if layout == "contiguous":
        return ContiguousQuantCache(*args, codec=codec, **full_precision) if codec else ContiguousCache(*args)
    if layout != "paged":
        raise ValueError(f"unknown cache layout {layout!r}: expected none, contiguous, paged or paged-int8")
    sizes = {"block_size": block_size, "pool_tokens": pool_tokens, "budget_bytes": budget_bytes}
    return PagedQuantCache(*args, codec=codec, **full_precision, **sizes) if codec else PagedCache(*args, **sizes)
