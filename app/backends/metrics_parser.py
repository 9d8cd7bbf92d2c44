"""Reading a server's Prometheus /metrics: kvscope's, vLLM's and llama.cpp server's names, one record out.

What a server does not publish stays None (shown as unavailable), never a made-up zero. No Qt here.

Names read (summed over label sets, e.g. several models or engines):
- kvscope:  kv_cache_usage_perc, num_requests_running / waiting, prefix_cache_queries / hits (_total),
            prompt_tokens / generation_tokens (_total), kv_blocks_* and kv_cache_bytes_*;
- vLLM:     vllm:kv_cache_usage_perc (older releases: vllm:gpu_cache_usage_perc), vllm:num_requests_running /
            waiting, vllm:prefix_cache_queries_total / hits_total (older: vllm:gpu_prefix_cache_queries/hits),
            vllm:prompt_tokens_total, vllm:generation_tokens_total;
- llama.cpp: llamacpp:kv_cache_usage_ratio, llamacpp:kv_cache_tokens (older builds), llamacpp:requests_processing /
            requests_deferred, llamacpp:prompt_tokens_total (tokens it computed: cached ones excluded),
            llamacpp:prompt_tokens_cached_total (prompt tokens reused from its cache: the prefix-cache hits, of
            computed + cached queried), llamacpp:tokens_predicted_total, llamacpp:n_tokens_max (the longest
            sequence it has held, prompt + generation).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)(?:\s+\S+)?$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')

# record field -> names, first found wins (a server publishes one spelling)
NAMES: dict[str, tuple[str, ...]] = {
    "kv_usage": ("kvscope:kv_cache_usage_perc", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",
                 "llamacpp:kv_cache_usage_ratio"),
    "running": ("kvscope:num_requests_running", "vllm:num_requests_running", "llamacpp:requests_processing"),
    "waiting": ("kvscope:num_requests_waiting", "vllm:num_requests_waiting", "llamacpp:requests_deferred"),
    "prefix_queries": ("kvscope:prefix_cache_queries_total", "vllm:prefix_cache_queries_total",
                       "vllm:gpu_prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries"),
    "prefix_hits": ("kvscope:prefix_cache_hits_total", "vllm:prefix_cache_hits_total",
                    "vllm:gpu_prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits",
                    "llamacpp:prompt_tokens_cached_total"),
    "prompt_tokens": ("kvscope:prompt_tokens_total", "vllm:prompt_tokens_total", "llamacpp:prompt_tokens_total"),
    "generation_tokens": ("kvscope:generation_tokens_total", "vllm:generation_tokens_total",
                          "llamacpp:tokens_predicted_total"),
    "kv_tokens": ("llamacpp:kv_cache_tokens",),
    "longest_sequence": ("llamacpp:n_tokens_max",),
    "blocks_total": ("kvscope:kv_blocks_total",),
    "blocks_used": ("kvscope:kv_blocks_used",),
    "blocks_free": ("kvscope:kv_blocks_free",),
    "blocks_cached": ("kvscope:kv_blocks_cached",),
    "bytes_allocated": ("kvscope:kv_cache_bytes_allocated",),
    "bytes_used": ("kvscope:kv_cache_bytes_used",),
    "bytes_theoretical": ("kvscope:kv_cache_bytes_theoretical",),
}
FLAVOURS = (("kvscope:", "kvscope"), ("vllm:", "vLLM"), ("llamacpp:", "llama.cpp"))


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict
    value: float


@dataclass(frozen=True)
class ServerKV:
    """A server's KV-cache figures; None means the server does not publish it."""

    flavour: str | None = None  # "kvscope", "vLLM", "llama.cpp" or None (no known metric)
    kv_usage: float | None = None  # fraction in [0, 1]
    running: float | None = None
    waiting: float | None = None
    prefix_queries: float | None = None
    prefix_hits: float | None = None
    prompt_tokens: float | None = None
    generation_tokens: float | None = None
    kv_tokens: float | None = None  # tokens the KV cache holds now
    longest_sequence: float | None = None  # the longest sequence (prompt + generation) the server has held
    blocks_total: float | None = None
    blocks_used: float | None = None
    blocks_free: float | None = None
    blocks_cached: float | None = None
    bytes_allocated: float | None = None
    bytes_used: float | None = None
    bytes_theoretical: float | None = None
    reachable: bool = True  # False: the server did not answer at all (every figure then unknown)

    @property
    def prefix_hit_rate(self) -> float | None:
        if self.prefix_hits is None or not self.prefix_queries:
            return None
        return self.prefix_hits / self.prefix_queries


def parse_exposition(text: str) -> list[Sample]:
    """Samples of a Prometheus text exposition (comments skipped; a malformed line is skipped, not fatal)."""
    samples = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        try:
            value = float(m["value"])
        except ValueError:
            continue
        labels = {k: _unescape(v) for k, v in _LABEL.findall(m["labels"] or "")}
        samples.append(Sample(m["name"], labels, value))
    return samples


def _unescape(value: str) -> str:
    return value.replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\")


def server_kv(text: str) -> ServerKV:
    """The KV figures a /metrics text publishes, whichever server wrote it."""
    totals: dict[str, float] = {}
    counts: dict[str, int] = {}
    for s in parse_exposition(text):
        if math.isfinite(s.value):
            totals[s.name] = totals.get(s.name, 0.0) + s.value
            counts[s.name] = counts.get(s.name, 0) + 1
    for name in NAMES["kv_usage"]:  # a fraction: several series (engines, models) average, they do not add
        if name in totals:
            totals[name] /= counts[name]
    fields = {field: next((totals[n] for n in names if n in totals), None) for field, names in NAMES.items()}
    if "llamacpp:prompt_tokens_cached_total" in totals:  # llama.cpp counts computed and reused prompt tokens apart
        fields["prefix_queries"] = totals.get("llamacpp:prompt_tokens_total", 0.0) + fields["prefix_hits"]
    flavour = next((label for prefix, label in FLAVOURS if any(n.startswith(prefix) for n in totals)), None)
    return ServerKV(flavour, **fields)
