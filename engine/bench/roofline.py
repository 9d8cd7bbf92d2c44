"""The decode roofline: the bytes one decode step must read, and how fast this machine can read them.

A decode step multiplies one token's activations by every weight matrix and reads every key and value held,
so on a CPU it is bound by memory bandwidth: latency >= (weight bytes + KV bytes at the context) / bandwidth.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Bandwidth:
    single_thread_gbs: float
    all_threads_gbs: float
    threads: int
    buffer_mb: int


def weight_bytes(model: nn.Module) -> int:
    """Bytes of weights one decode step reads: each parameter once (a tied lm_head is counted once), in the
    format the model holds them (kvscope's models say so themselves: int4 codes, scales and minimums).

    An untied embedding table is looked up for one token only, so it contributes one row.
    """
    if hasattr(model, "decode_weight_bytes"):
        return model.decode_weight_bytes
    total = sum(p.numel() * p.element_size() for p in model.parameters())  # shared tensors appear once
    embed, head = _embedding_and_head(model)
    if embed is not None and head is not None and embed.data_ptr() != head.data_ptr():
        total -= (embed.shape[0] - 1) * embed.shape[1] * embed.element_size()
    return total


def _embedding_and_head(model: nn.Module) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    get_in = getattr(model, "get_input_embeddings", None)
    embed = get_in().weight if get_in else getattr(getattr(model, "embed_tokens", None), "weight", None)
    head = getattr(getattr(model, "lm_head", None), "weight", None)
    return embed, head


def step_bytes(weights: int, kv_bytes_per_token: float, context: int) -> int:
    """Bytes a decode step at `context` tokens reads: the weights plus the keys and values of the context."""
    return int(weights + kv_bytes_per_token * context)


def lower_bound_ms(num_bytes: int, bandwidth_gbs: float) -> float:
    return num_bytes / (bandwidth_gbs * 1e9) * 1000


def measure_bandwidth(buffer_mb: int = 512, repeats: int = 5) -> Bandwidth:
    """Memory read bandwidth: the best of several full sums of a buffer far larger than the caches."""
    x = torch.ones(buffer_mb * 2**20 // 4, dtype=torch.float32)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = _best_read_gbs(x, repeats)
    finally:
        torch.set_num_threads(threads)
    return Bandwidth(single, _best_read_gbs(x, repeats), threads, buffer_mb)


def _best_read_gbs(x: torch.Tensor, repeats: int) -> float:
    x.sum()  # warm up: page the buffer in, start the thread pool
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.nbytes / best / 1e9
