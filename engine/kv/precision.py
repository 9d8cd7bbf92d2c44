"""The precision a cache (contiguous or paged) stores keys and values in, apart from its layout.

float32, bfloat16, float16, int8 or int4 (engine/kv/quant.py; 'paged-int8' names paged + int8). `auto` is the
fastest (the smallest among those within 15% of it), for the compiled attention on this machine, of the float
precisions (they meet the quality bound of mean KL <= 0.0005 nats against a float32 cache on real English,
tests/test_kv_precision.py, and stay exact across layouts, batches and chunkings; int8 meets the bound but is not
exact, int4 meets neither), measured once over synthetic caches and remembered like the weights' choice. Without
the compiled kernels, or on another device, `auto` keeps the activations' dtype on the CPU and float16 elsewhere.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from engine import kernels
from engine.machine import cpu_model
from engine.weights.convert import _read_choices, _write_choices

AUTO_KEY = "kv precision"
PRECISIONS = ("float32", "bfloat16", "float16", "int8", "int4")  # what a cache can store keys and values as
QUANTIZED = ("int8", "int4")
# auto's candidates: within the quality bound AND exact. int8 meets the bound (mean KL 0.0002) but a quantized
# cache quantizes a block inside the step that fills it, so its bits depend on how a prompt was cut into
# steps (a batch, a server's prefill budget): choose it explicitly. int4 is also outside the bound.
AUTO_CANDIDATES = ("float32", "bfloat16", "float16")
CONTIGUOUS_GROUP = 32  # tokens per quantization group of a contiguous cache (a paged pool's group is its block)
FLOAT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
SCALE_BYTES = 2  # quantization scales and minimums are float16
TIE = 1.15  # candidates within this factor of the fastest count as equally fast: the smaller one wins


def bytes_per_element(precision: str, group_tokens: int, head_dim: int) -> float:
    """Average bytes per stored element of K and V, scales included.

    int8: symmetric codes; keys one float16 scale per channel per group of tokens, values one per token and head.
    int4: asymmetric codes (two per byte); keys an 8-bit scale and minimum per channel per group (KIVI's
    per-channel keys) under two float16 super scales per group and head (quant.py), values a float16 scale and
    minimum per token and head."""
    if precision in FLOAT_BYTES:
        return float(FLOAT_BYTES[precision])
    if precision not in QUANTIZED:
        raise ValueError(f"unknown KV precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    if precision == "int8":
        keys, values = 1.0 + SCALE_BYTES / group_tokens, 1.0 + SCALE_BYTES / head_dim
    else:
        keys = 0.5 + (2 + 2 * SCALE_BYTES / head_dim) / group_tokens
        values = 0.5 + 2 * SCALE_BYTES / head_dim
    return (keys + values) / 2


def bytes_per_token(model_config, precision: str, block_size: int = CONTIGUOUS_GROUP) -> float:
    """The article's formula, 2 x bytes/element x layers x KV heads x head_dim, with the precision's bytes per
    element including its scales (block_size: the quantization group of keys, a paged pool's block)."""
    return model_config.kv_bytes_per_token(bytes_per_element(precision, block_size, model_config.head_dim))


def resolve(kv_dtype: str | None, device: torch.device, activations: torch.dtype,
            cache_dir: Path | None) -> str:
    """The precision name for a setting: None keeps the activations' dtype; auto measures (see above)."""
    if kv_dtype is None:
        return str(activations).removeprefix("torch.")
    if kv_dtype != "auto":
        return kv_dtype
    if device.type != "cpu":
        return "float16"
    if kernels.ops() is None or activations != torch.float32:
        return str(activations).removeprefix("torch.")
    key = f"{AUTO_KEY}|{cpu_model()}|torch {torch.__version__}|threads {torch.get_num_threads()}|{kernels.TAG}"
    remembered = _read_choices(cache_dir)
    if key not in remembered:
        timings = measure_attention()
        remembered[key] = {"choice": fastest_or_smallest(timings), "attention_us": timings}
        _write_choices(cache_dir, remembered)
    return remembered[key]["choice"]


def fastest_or_smallest(timings: dict[str, float]) -> str:
    """As the weights' auto: among the candidates within TIE of the fastest, the one with the fewest bytes (a
    local app's memory is the user's; a cache that reads fewer bytes is also the one that grows less)."""
    best = min(timings.values())
    near = [name for name in timings if timings[name] <= best * TIE]
    return min(near, key=lambda name: (FLOAT_BYTES.get(name, 0), timings[name]))


def measure_attention(tokens: int = 2048, heads: int = 4, head_dim: int = 64, stream_bytes: int = 128 * 2**20,
                      repeats: int = 5) -> dict[str, float]:
    """Microseconds of one decode step's attention over synthetic caches of `tokens` tokens, per candidate of
    `auto`: as many layers as make the float32 keys and values exceed the processor's caches (stream_bytes), so
    they come from memory as a real model's do; the candidates take turns, and each keeps its fastest pass (other
    work on a shared machine only ever adds time)."""
    layers = max(1, -(-stream_bytes // (2 * heads * tokens * head_dim * 4)))
    runners = {name: _attention_runner(name, tokens, heads, head_dim, layers) for name in AUTO_CANDIDATES}
    samples: dict[str, list[float]] = {name: [] for name in runners}
    for i in range(repeats + 1):
        for name, run in runners.items():
            start = time.perf_counter()
            run()
            if i:
                samples[name].append(time.perf_counter() - start)
    return {name: round(min(times) * 1e6, 1) for name, times in samples.items()}


def _attention_runner(name: str, tokens: int, heads: int, head_dim: int, layers: int):
    """A callable attending one query row per layer over a synthetic cache of `tokens` tokens in precision `name`."""
    from engine.kv.attention import KeyMap, attend
    from engine.kv.quant import CODECS
    from engine.kv.quantized import WINDOW_DTYPE

    q = torch.randn(1, heads * 3, 1, head_dim)
    if name not in CODECS:
        keys = KeyMap.one_store_each([tokens], [tokens - 1], [1], torch.device("cpu"))
        dtype = getattr(torch, name)
        stores = [(torch.randn(heads, tokens, head_dim).to(dtype), torch.randn(heads, tokens, head_dim).to(dtype))
                  for _ in range(layers)]
        return lambda: [attend(q, [k], [v], keys) for k, v in stores]
    codec, bs = CODECS[name], CONTIGUOUS_GROUP
    blocks = -(-tokens // bs)
    keys = KeyMap.build([list(range(blocks))], torch.zeros(blocks, dtype=torch.int32),
                        torch.arange(blocks, dtype=torch.int32) * bs, bs, [tokens - 1], [1], torch.device("cpu"))
    stores = [[t[0].random_(0, 15) if t.dtype != torch.float16 else t[0].uniform_(0.01, 0.02)
               for t in codec.storage(1, heads, blocks, bs, head_dim, "cpu")] for _ in range(layers)]
    window = torch.randn(2, heads, bs, head_dim).to(WINDOW_DTYPE[name] or torch.float32)  # no residual, no sink
    ops, upto = kernels.ops(), torch.zeros(1, dtype=torch.int32)
    where = (keys.table, keys.block_store, keys.block_start, bs, keys.q_pos, upto, 0, 0, codec.bits)
    return lambda: [ops.attention_quant(q, *[[t] for t in s], [window[0]], [window[1]], *where) for s in stores]
