"""Prometheus metrics for /metrics: vLLM's names where the meaning is the same (under `kvscope:`), plus the
block pool's own figures.

Counters and gauges are read from the scheduler's latest published stats at scrape time (no engine call, no
lock held across a forward). The histograms are observed on the engine thread as the scheduler emits each output
(an observer), so a request whose client went away is counted too.

`request_success_total` is labelled `finished_reason` as vLLM's: `stop`, `length`, `abort` (cancelled: the client
went away or stopped it, or the server shut down) and `error` (failed). Per-request histograms, vLLM's names:
`e2e_request_latency_seconds`, `request_queue_time_seconds` (submitted -> first admitted),
`request_prompt_tokens`, `request_generation_tokens`, and `time_per_output_token_seconds` (every gap between two
tokens of a request, the same observations as `inter_token_latency_seconds`, as in vLLM where it is the older
name). Each choice of an `n > 1` request is a request here.
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
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)  # vLLM's, for e2e and queue time
FINISHED_REASONS = {"stop": "stop", "length": "length", "cancelled": "abort", "error": "error"}  # ours -> vLLM's


def one_two_five_buckets(limit: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to limit (vLLM's token-count buckets)."""
    out, exp = [], 0
    while True:
        for m in (1, 2, 5):
            value = m * 10**exp
            if value > limit:
                return tuple(out)
            out.append(float(value))
        exp += 1


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
        ):
            yield self._family(CounterMetricFamily, name, doc, value)
        finished = dict.fromkeys(FINISHED_REASONS.values(), 0)
        for reason, count in s.finished_by_reason:
            finished[FINISHED_REASONS.get(reason, reason)] += count
        family = CounterMetricFamily(PREFIX + "request_success", "Requests finished, by finished_reason (stop, "
                                     "length, abort = cancelled, error = failed).",
                                     labels=["model_name", "finished_reason"])
        for reason, count in finished.items():
            family.add_metric([self.model, reason], count)
        yield family

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
    """Observes every output of the scheduler (registered as its observer) into the histograms."""

    def __init__(self, scheduler: Scheduler, model: str, max_context: int = 8192):
        self.model = model
        self.registry = CollectorRegistry()
        tokens = one_two_five_buckets(max_context)
        self.ttft = self._histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = self._histogram("inter_token_latency_seconds", "Time between two tokens of a request.",
                                   ITL_BUCKETS)
        self.tpot = self._histogram("time_per_output_token_seconds", "Time per output token (every gap between "
                                    "two tokens of a request; vLLM's older name for the inter-token latency).",
                                    ITL_BUCKETS)
        self.e2e = self._histogram("e2e_request_latency_seconds", "Seconds from a request's arrival to its end.",
                                   REQUEST_BUCKETS)
        self.queue = self._histogram("request_queue_time_seconds", "Seconds a request waited before it was first "
                                     "admitted to the running batch.", REQUEST_BUCKETS)
        self.prompt = self._histogram("request_prompt_tokens", "Prompt tokens per finished request.", tokens)
        self.generation = self._histogram("request_generation_tokens", "Generated tokens per finished request.",
                                          tokens)
        self.registry.register(_SchedulerCollector(scheduler, model))
        scheduler.add_observer(self.observe)

    def _histogram(self, name: str, doc: str, buckets) -> Histogram:
        return Histogram(PREFIX + name, doc, ["model_name"], buckets=buckets, registry=self.registry
                         ).labels(self.model)

    def observe(self, out: Output) -> None:
        for histogram, value in ((self.ttft, out.ttft_s), (self.itl, out.itl_s), (self.tpot, out.itl_s)):
            if value is not None:
                histogram.observe(value)
        if out.finished and out.e2e_s is not None:
            self.e2e.observe(out.e2e_s)
            self.queue.observe(out.queue_s or 0.0)
            self.prompt.observe(out.n_prompt_tokens)
            self.generation.observe(out.n_generated_tokens)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
