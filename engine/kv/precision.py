"""The precision the exact caches (contiguous, paged) store keys and values in, apart from their layout.

float32, bfloat16 or float16 (the int8 pool is its own strategy, paged-int8). `auto` is the fastest of them for
the compiled attention on this machine, measured once over a synthetic cache and remembered like the weights'
choice; each of them meets the quality bound (tests/test_kv_precision.py: mean KL <= 0.0005 nats against a
float32 cache on real English). Without the compiled kernels, or on another device, `auto` keeps the
activations' dtype on the CPU and float16 elsewhere.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from engine import kernels
from engine.config import KV_DTYPES
from engine.machine import cpu_model
from engine.weights.convert import _read_choices, _write_choices

AUTO_KEY = "kv precision"


def resolve(kv_dtype: str | None, device: torch.device, activations: torch.dtype,
            cache_dir: Path | None) -> torch.dtype:
    """The storage dtype for a setting: None keeps the activations' dtype; auto measures (see above)."""
    if kv_dtype is None:
        return activations
    if kv_dtype != "auto":
        return getattr(torch, kv_dtype)
    if device.type != "cpu":
        return torch.float16
    if kernels.ops() is None or activations != torch.float32:
        return activations
    key = f"{AUTO_KEY}|{cpu_model()}|torch {torch.__version__}|threads {torch.get_num_threads()}|{kernels.TAG}"
    remembered = _read_choices(cache_dir)
    if key not in remembered:
        timings = measure_attention()
        remembered[key] = {"choice": min(timings, key=timings.get), "attention_us": timings}
        _write_choices(cache_dir, remembered)
    return getattr(torch, remembered[key]["choice"])


def measure_attention(tokens: int = 2048, heads: int = 4, head_dim: int = 64, layers: int = 8,
                      repeats: int = 5) -> dict[str, float]:
    """Median microseconds of one decode step's attention over `layers` caches of `tokens` tokens per precision
    (several layers, so the keys come from memory rather than from the processor's caches)."""
    from engine.kv.attention import KeyMap, attend

    q = torch.randn(1, heads * 3, 1, head_dim)
    keys = KeyMap.one_store_each([tokens], [tokens - 1], [1], torch.device("cpu"))
    timings = {}
    for name in KV_DTYPES[1:]:
        dtype = getattr(torch, name)
        stores = [(torch.randn(heads, tokens, head_dim).to(dtype), torch.randn(heads, tokens, head_dim).to(dtype))
                  for _ in range(layers)]
        samples = []
        for i in range(repeats + 1):
            start = time.perf_counter()
            for k, v in stores:
                attend(q, [k], [v], keys)
            if i:
                samples.append(time.perf_counter() - start)
        timings[name] = round(sorted(samples)[len(samples) // 2] * 1e6, 1)
    return timings
