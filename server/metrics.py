"""Prometheus metrics for /metrics: vLLM's names where the meaning is the same (under `kvscope:`), plus the
block pool's own figures.

Counters and gauges are read from the scheduler's latest published stats at scrape time (no engine call, no
lock held across a forward); the two latency histograms are observed as outputs reach the HTTP layer.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine.scheduler import Output, Scheduler

PREFIX = "kvscope:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)


class _SchedulerCollector:
    def __init__(self, scheduler: Scheduler, model: str):
        self.scheduler, self.model = scheduler, model

    def collect(self):
        s = self.scheduler.stats()
        yield from self._counters(s)
        yield from self._gauges(s)

    def _family(self, cls, name: str, doc: str, value: float):
        family = cls(PREFIX + name, doc, labels=["model_name"])
        family.add_metric([self.model], value)
        return family

    def _counters(self, s):
        for name, doc, value in (
            ("prompt_tokens", "Prompt tokens of the requests served (once per request).", s.prompt_tokens),
            ("generation_tokens", "Tokens generated.", s.generation_tokens),
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_queries),
            ("prefix_cache_hits", "Prompt tokens the prefix cache held.", s.prefix_hits),
            ("num_preemptions", "Requests preempted (blocks released, recomputed later) when the pool was full.",
             s.num_preemptions),
            ("request_success", "Requests finished (any reason).", s.num_finished),
        ):
            yield self._family(CounterMetricFamily, name, doc, value)

    def _gauges(self, s):
        kv = s.kv
        yield self._family(GaugeMetricFamily, "num_requests_running", "Requests in the running batch.",
                           s.num_running)
        yield self._family(GaugeMetricFamily, "num_requests_waiting", "Requests queued for admission.",
                           s.num_waiting)
        if kv is None:
            return
        capacity = getattr(kv, "num_blocks_budget", 0) or kv.num_blocks  # a growing pool: its budget
        usage = (kv.num_blocks_used / capacity if capacity
                 else kv.bytes_used / kv.bytes_allocated if kv.bytes_allocated else 0.0)
        for name, doc, value in (
            ("kv_cache_usage_perc", "KV-cache usage: 1 means 100 percent of the pool in use.", usage),
            ("kv_blocks_total", "Blocks the pool may hold.", capacity),
            ("kv_blocks_allocated", "Blocks the pool holds now (a pool that grows holds fewer than its total).",
             kv.num_blocks),
            ("kv_blocks_used", "Blocks held by running requests.", kv.num_blocks_used),
            ("kv_blocks_free", "Blocks on the free list.", kv.num_blocks_free),
            ("kv_blocks_cached", "Unreferenced blocks kept for the prefix cache (evictable).", kv.num_blocks_cached),
            ("kv_block_size", "Tokens per block.", kv.block_size),
            ("kv_cache_bytes_allocated", "Bytes of KV storage reserved.", kv.bytes_allocated),
            ("kv_cache_bytes_used", "Bytes of KV storage holding live tokens (whole blocks).", kv.bytes_used),
            ("kv_cache_bytes_theoretical", "The formula's bytes for the tokens held.", kv.bytes_theoretical),
        ):
            yield self._family(GaugeMetricFamily, name, doc, value)


class ServerMetrics:
    def __init__(self, scheduler: Scheduler, model: str):
        self.model = model
        self.registry = CollectorRegistry()
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token.", ["model_name"],
                              buckets=TTFT_BUCKETS, registry=self.registry).labels(model)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between two tokens of a request.",
                             ["model_name"], buckets=ITL_BUCKETS, registry=self.registry).labels(model)
        self.registry.register(_SchedulerCollector(scheduler, model))

    def observe(self, out: Output) -> None:
        if out.ttft_s is not None:
            self.ttft.observe(out.ttft_s)
        if out.itl_s is not None:
            self.itl.observe(out.itl_s)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
