"""Continuous batching: many requests over one Engine and its KV cache, advanced together step by step.

No HTTP here (the server is a thin layer over this). One thread owns the engine: `start()` runs `tick()` in a
loop on it; any other thread only calls `submit`, `cancel` and `stats`, which are thread-safe.

A request's tokens are its prompt followed by what it generated; the cache holds the first `num_computed` of
them. Every forward the scheduler runs computes at most `step_rows` rows (sequences x fed tokens, padding
included): the engine's batch-invariant width (engine.weights.linear.DECODE_ROWS), up to which a projection gives
each row the bits it gives that row alone, and attention sums each row in position order whatever the chunking.
So a token's keys, values and logits never depend on what else ran in its step or how its prompt was cut, and a
greedy request gives the same tokens concurrent or alone, after a prefix-cache hit or not, recomputed after a
preemption or not (by construction; tests/test_serve_greedy.py checks it on the real default model). A tick:
- every request with exactly one token left (decoding) advances in one batched `engine.step` (more than
  `step_rows` of them: several steps), with the prefilling requests that join it (below);
- then at most one prefill step: requests still prefilling advance by a piece that ends at the next multiple of
  `step_rows` (absolute positions, so the pieces of a prompt are the same whatever else runs), round robin (the
  one served least recently first), several in one step while their padded rows fit. A new prompt delays the
  running streams by one such step per token, never by its whole length; prompts that arrive together finish
  their prefill together (their short last pieces share steps) instead of the first one decoding while the
  others' pieces stall it. While some request decodes, a float KV cache's prefill step takes at most
  `prefill_rows_while_decoding` rows, its pieces ending at multiples of that: a running stream's gap grows by a
  small step instead of a full one (a prefill row costs what a decode row does, so a full step is several
  one-row steps), at the cost of the new prompt's time to first token. With one row (the default), the
  prefilling requests instead take one prompt token each in the decode step's free rows: no forward of their
  own, so a tick reads the weights once (measured with `bench serve --quick`, 4 clients: p99 inter-token
  11.3 against 16.0 ms with a 4-row step, the median first token 106 against 221 ms). Only the rows that sample
  (a decoding request's, a prompt's last) go through the head (`logits_for`). Any cut gives a float
  cache the same bits (tests/test_serve_greedy.py); a quantized one turns blocks into codes at the step that
  fills them, so its pieces stay on multiples of `step_rows`.
When a request has computed all its tokens, the last logits sample its next token.

Admission (paged caches): the oldest waiting request joins when the blocks it still needs for its tokens and one
more, added to what the running requests still need the same way, fit the free and cached blocks; the prefix
cache serves its leading blocks (same system prompt -> shared blocks). When a step still finds the pool full,
the most recently admitted request is preempted: its blocks are released (its full blocks stay cached), and it
waits at the head of the queue to be recomputed, so a running request is never failed for lack of blocks. A
cancelled request releases its blocks at the next tick boundary (the step in flight cannot be interrupted).

Several choices of one prompt (`submit_group`, OpenAI's `n`): only the first request of the group is queued and
prefilled; when its prompt is computed, the others fork its cache (the paged pool shares every block, one more
reference each, and the partly filled last block is copied before a choice writes into it), and every choice
samples its first token from the same logits. The prompt's KV is held once. A cache without `fork`
(paged-int8), or a full batch, queues the other choices as requests of their own (the prefix cache still serves
the prompt's full blocks). Until the fork the choices share a fate: the first one's cancellation or failure ends
them all.

Observers (`add_observer`) see every output on the engine thread, including those of requests whose consumer went
away: that is where the server counts finished requests and observes latencies.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.chat import PromptTooLong
from engine.config import ConfigError, SamplingParams
from engine.detokenizer import IncrementalDetokenizer
from engine.kv.base import KVCacheFull, KVStats
from engine.kv.precision import QUANTIZED
from engine.sampler import Sampler
from engine.weights.linear import DECODE_ROWS

LogitsAdjust = Callable  # (logits [V], generated token ids) -> logits [V]: penalties, biases, masks


@dataclass
class SchedulerConfig:
    max_concurrency: int = 16  # running requests at most; the rest wait
    step_rows: int = DECODE_ROWS  # rows one forward computes at most (see the module docstring)
    prefill_rows_while_decoding: int = 1  # prompt rows a tick while others decode (float KV; 1: inside their step)

    def __post_init__(self):
        for name in ("max_concurrency", "step_rows", "prefill_rows_while_decoding"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class Output:
    """What one request produced in one tick: a token (text may be "" inside a multi-byte character) or its end."""

    request_id: int
    text: str = ""
    token_id: int | None = None
    finish_reason: str | None = None  # "stop", "length", "cancelled" or "error"
    error: str | None = None
    n_prompt_tokens: int = 0
    n_generated_tokens: int = 0
    prefix_hit_tokens: int = 0
    ttft_s: float | None = None  # on the first token: seconds since the request was submitted
    itl_s: float | None = None  # on later tokens: seconds since the previous token
    logprob: float | None = None  # of token_id, from the model's raw logits (when the request asked for them)
    top_logprobs: tuple[tuple[int, float], ...] = ()  # the most likely tokens at this position, best first
    e2e_s: float | None = None  # on the last output: seconds since the request was submitted
    queue_s: float | None = None  # on the last output: seconds it waited before it was first admitted

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class SchedulerStats:
    num_running: int = 0
    num_waiting: int = 0
    kv: KVStats | None = None
    prompt_tokens: int = 0  # cumulative, counted once per request
    generation_tokens: int = 0
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache (on every admission)
    prefix_hits: int = 0  # of which the cache held
    num_preemptions: int = 0
    num_finished: int = 0
    num_steps: int = 0
    peak_running: int = 0
    finished_by_reason: tuple[tuple[str, int], ...] = ()  # (finish_reason, requests), sorted


class StopStrings:
    """Holds back text that may be the start of a stop string; cuts the reply at the first stop string."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """-> (text safe to emit, whether a stop string was met)."""
        buf = self.pending + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.pending = ""
            return buf[:min(hits)], True
        keep = max((n for s in self.stops for n in range(1, len(s)) if buf.endswith(s[:n])), default=0)
        self.pending = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep], False

    def flush(self) -> str:
        text, self.pending = self.pending, ""
        return text


@dataclass
class Request:
    id: int
    prompt: list[int]
    params: SamplingParams
    sink: Callable[[Output], None]
    sampler: Sampler
    detok: IncrementalDetokenizer
    stops: StopStrings
    stop_ids: frozenset[int]
    tokens: list[int] = field(default_factory=list)  # prompt + generated
    num_computed: int = 0  # leading tokens whose keys and values the cache holds
    prefix_hit: int = 0
    submitted: float = 0.0
    turn: int = 0  # its place in the prefill round robin: taken at admission and again after each piece
    admitted_at: float | None = None  # the first admission (or fork): the end of its queue time
    last_token_at: float | None = None
    counted: bool = False  # prompt tokens counted in the stats
    finished: bool = False
    logprobs: int | None = None  # None: none asked; k: the chosen token's and the k most likely tokens'
    adjust: LogitsAdjust | None = None
    followers: list[Request] = field(default_factory=list)  # the group's other choices, forked after prefill

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - len(self.prompt)

    @property
    def remaining(self) -> int:
        return len(self.tokens) - self.num_computed


def pool_capacity_blocks(cache) -> int | None:
    """The most blocks a paged cache's pool may hold (a growing pool: its budget); None for other caches."""
    layout = getattr(cache, "layout", None)
    if layout is not None:
        return layout.max_blocks
    pool = getattr(cache, "pool", None)
    return None if pool is None else pool.num_blocks


def can_allocate(cache, n: int) -> bool:
    """Whether n more blocks can be had: free, cached (evictable) or, for a growing pool, still to grow."""
    if hasattr(cache, "can_make_room"):
        return cache.can_make_room(n)
    return cache.pool.can_allocate(n)


class Scheduler:
    def __init__(self, engine, config: SchedulerConfig | None = None):
        if not engine.cache.keeps_kv:
            raise ConfigError("serving needs a cache that keeps keys and values (contiguous, paged, paged-int8)")
        self.engine = engine
        self.cache = engine.cache
        self.config = config or SchedulerConfig()
        self._check_pool_holds_a_context()
        self.tokenizer_lock = threading.Lock()  # the tokenizer is shared with the thread that encodes prompts
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._ids = itertools.count(1)
        self._lock = threading.Condition()
        self._inbox: list[Request] = []
        self._cancels: set[int] = set()
        self._counts = dict(prompt_tokens=0, generation_tokens=0, prefix_queries=0, prefix_hits=0,
                            num_preemptions=0, num_finished=0, num_steps=0, peak_running=0)
        self._finished_by_reason: Counter[str] = Counter()
        self._observers: list[Callable[[Output], None]] = []
        self._stats = SchedulerStats()
        self._turns = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._handoff: Callable[[], None] | None = None
        self._emitted = False  # whether this tick has sent an output
        self._publish_stats()

    def _check_pool_holds_a_context(self) -> None:
        blocks = pool_capacity_blocks(self.cache)
        if blocks is not None and blocks * self.cache.block_size < self.engine.max_context:
            raise ConfigError(f"the block pool holds {blocks * self.cache.block_size} tokens, less than one "
                              f"context ({self.engine.max_context}): one long request could never run")

    # ---- any thread
    def submit(self, prompt: list[int], params: SamplingParams, sink: Callable[[Output], None],
               stop: tuple[str, ...] = (), logprobs: int | None = None, adjust: LogitsAdjust | None = None) -> int:
        """Queue a request; its outputs go to sink(output) on the engine thread. Raises PromptTooLong.
        logprobs=k: each token's output carries its log-probability and the k most likely tokens'; adjust:
        applied to the logits before sampling (not to the log-probabilities, which are the model's own)."""
        return self.submit_group(prompt, [params], sink, stop, logprobs, adjust)[0]

    def submit_group(self, prompt: list[int], params: list[SamplingParams], sink: Callable[[Output], None],
                     stop: tuple[str, ...] = (), logprobs: int | None = None, adjust: LogitsAdjust | None = None
                     ) -> list[int]:
        """len(params) choices of one prompt, prefilled once (see the module docstring); -> their ids."""
        limit = self.engine.max_context
        if not prompt or len(prompt) >= limit:
            raise PromptTooLong(f"the prompt has {len(prompt)} tokens; the context holds {limit} "
                                f"(at least one must be left for the reply)")
        if not params:
            raise ValueError("a group needs at least one choice")
        leader, *followers = [self._new_request(prompt, p, sink, stop, logprobs, adjust) for p in params]
        leader.followers = followers
        with self._lock:
            self._inbox.append(leader)
            self._lock.notify()
        return [leader.id] + [f.id for f in followers]

    def _new_request(self, prompt, params, sink, stop, logprobs, adjust) -> Request:
        e = self.engine
        return Request(next(self._ids), list(prompt), params, sink, Sampler(params, e.device),
                       IncrementalDetokenizer(e.tokenizer), StopStrings(tuple(stop)),
                       frozenset(params.stop_token_ids or e.stop_token_ids), list(prompt),
                       submitted=time.perf_counter(), logprobs=logprobs, adjust=adjust)

    def add_observer(self, observer: Callable[[Output], None]) -> None:
        """observer(output) for every output of every request, on the engine thread, before its sink."""
        self._observers.append(observer)

    def cancel(self, request_id: int) -> None:
        """Stop a request and release its blocks at the next tick boundary (no-op when it has finished)."""
        with self._lock:
            self._cancels.add(request_id)
            self._lock.notify()

    def set_handoff(self, handoff: Callable[[], None] | None) -> None:
        """handoff() runs on the engine thread at the end of each tick that sent outputs, before the next step: a
        consumer on another thread (the server's event loop) can take them there (see server.app.LoopHandoff)."""
        self._handoff = handoff

    def stats(self) -> SchedulerStats:
        return self._stats

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="kvscope-scheduler", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the engine thread; requests still queued or running end as cancelled."""
        with self._lock:
            self._stopping = True
            self._lock.notify()
        if self._thread is not None:
            self._thread.join()
        self._drain_inbox()
        for req in list(self.running) + list(self.waiting):
            self._finish(req, "cancelled")
        self._publish_stats()

    # ---- the engine thread
    def _loop(self) -> None:
        while not self._stopping:
            if not self.tick():
                with self._lock:
                    if not self._inbox and not self._cancels and not self._stopping:
                        self._lock.wait(timeout=0.5)

    def tick(self) -> bool:
        """Take new requests and cancellations, admit, run one tick of steps. Returns whether anything ran."""
        self._drain_inbox()
        self._admit()
        ran = bool(self.running)
        decoding = [r for r in self.running if r.remaining == 1]
        rows = self.config.step_rows
        joining = self._joining(decoding)
        decoding += joining
        for i in range(0, len(decoding), rows):
            group = [r for r in decoding[i:i + rows] if r in self.running]  # an earlier group may have preempted one
            if group:
                self._run_step(group, [r.tokens[r.num_computed:r.num_computed + 1] for r in group])
        batch, feeds = self._prefill_batch(skip=joining)
        if batch:
            self._run_step(batch, feeds)
        self._publish_stats()
        emitted, self._emitted = self._emitted, False
        if emitted and self._handoff is not None:
            self._handoff()
        return ran

    def _drain_inbox(self) -> None:
        with self._lock:
            new, self._inbox = self._inbox, []
            cancels, self._cancels = self._cancels, set()
        self.waiting.extend(new)
        if not cancels:
            return
        for leader in (*self.running, *self.waiting):
            for f in [f for f in leader.followers if f.id in cancels]:
                leader.followers.remove(f)
                self._finish(f, "cancelled")
        for req in [r for r in (*self.running, *self.waiting) if r.id in cancels]:
            self._finish(req, "cancelled")

    def _admit(self) -> None:
        """The oldest waiting requests, in order, while they fit; one whose prefix a running request is computing
        waits at its place for those blocks, the ones after it go on."""
        later = []
        while self.waiting and len(self.running) < self.config.max_concurrency:
            req = self.waiting[0]
            if self._computing_its_prefix(req):
                later.append(self.waiting.popleft())
                continue
            hit = self.cache.prepare(req.id, req.tokens)
            if not self._fits(req, hit):
                self.cache.release(req.id)
                break
            self.waiting.popleft()
            req.num_computed = req.prefix_hit = hit
            req.turn = next(self._turns)
            req.admitted_at = req.admitted_at or time.perf_counter()
            self._count_admission(req, hit)
            self.running.append(req)
        self.waiting.extendleft(reversed(later))

    def _computing_its_prefix(self, req: Request) -> bool:
        """Whether a running request is still computing full blocks that begin this request's tokens (a system
        prompt that requests arriving together share): admitted once they are computed, it takes them from the
        prefix cache instead of computing them a second time, in the same ticks."""
        if not self.cache.shares_computed_blocks:
            return False
        bs = self.cache.block_size
        shareable = (len(req.tokens) - 1) // bs * bs  # the cache leaves a request at least one token to compute
        for r in self.running:
            block_end = (r.num_computed // bs + 1) * bs  # the end of the first full block r has still to compute
            if block_end <= min(shareable, len(r.tokens)) and r.tokens[:block_end] == req.tokens[:block_end]:
                return True
        return False

    def _fits(self, req: Request, hit: int) -> bool:
        pool = getattr(self.cache, "pool", None)
        if pool is None or not self.running:
            return True  # alone, a request always fits: the pool holds a whole context
        bs = pool.block_size

        def outstanding(r: Request, held: int) -> int:  # blocks still to allocate for its tokens and one more
            return -(-(len(r.tokens) + 1) // bs) - -(-held // bs)

        needed = outstanding(req, hit) + sum(outstanding(r, r.num_computed) for r in self.running)
        return can_allocate(self.cache, needed)

    def _count_admission(self, req: Request, hit: int) -> None:
        c = self._counts
        c["prefix_queries"] += len(req.tokens)
        c["prefix_hits"] += hit
        if not req.counted:
            req.counted = True
            c["prompt_tokens"] += len(req.prompt)
        c["peak_running"] = max(c["peak_running"], len(self.running) + 1)

    def _joining(self, decoding: list[Request]) -> list[Request]:
        """Prefilling requests that take one prompt token each in the decode step's free rows (least recently
        served first): while a float cache's streams decode with one prefill row a tick, it costs a row of the step
        they run anyway rather than a step of its own (a quantized cache's pieces stay on multiples of step_rows)."""
        if not decoding or self._prefill_rows() != 1:
            return []
        free = -len(decoding) % self.config.step_rows
        joining = sorted((r for r in self.running if r.remaining > 1), key=lambda r: r.turn)[:free]
        for req in joining:
            req.turn = next(self._turns)
        return joining

    def _prefill_batch(self, skip: list[Request]) -> tuple[list[Request], list[list[int]]]:
        """Round robin: the next piece of the prefilling request served least recently, then those of the next
        ones while the padded rows (requests x widest piece) still fit one step; `skip`: those that advanced in
        the decode step."""
        batch, feeds, width, rows, skipped = [], [], 0, self._prefill_rows(), {r.id for r in skip}
        prefilling = sorted((r for r in self.running if r.remaining > 1 and r.id not in skipped), key=lambda r: r.turn)
        for req in prefilling:
            piece = self._next_piece(req, rows, one_reply_token=self.cache.quantization_group > 0)
            if batch and (len(batch) + 1) * max(width, len(piece)) > rows:
                continue
            width = max(width, len(piece))
            req.turn = next(self._turns)
            batch.append(req)
            feeds.append(piece)
        return batch, feeds

    def _prefill_rows(self) -> int:
        """The rows of this tick's prefill step: fewer while another request decodes, where any cut gives the same
        bits (a float KV cache; see the module docstring)."""
        c = self.config
        if any(r.remaining == 1 for r in self.running) and self.engine.kv_dtype_name not in QUANTIZED:
            return min(c.prefill_rows_while_decoding, c.step_rows)
        return c.step_rows

    @staticmethod
    def _next_piece(req: Request, rows: int, one_reply_token: bool = False) -> list[int]:
        """The tokens from num_computed up to the next multiple of rows (or the last token). one_reply_token: a reply
        recomputed after a preemption goes as it was decoded, a token a step, after the prompt's own pieces. A
        quantized cache turns a block into codes in the step that fills it, and every row of that step reads them:
        a piece that filled a block with reply tokens gave rows that had read the block in full precision, one
        token a step, other bits (a greedy stream took another token at a near tie)."""
        start = req.num_computed
        end = (start // rows + 1) * rows
        if one_reply_token:
            end = start + 1 if start >= len(req.prompt) else min(end, len(req.prompt))
        return req.tokens[start:end]

    def _run_step(self, batch: list[Request], feeds: list[list[int]]) -> None:
        while batch:
            ending = [i for i, (r, f) in enumerate(zip(batch, feeds)) if r.remaining == len(f)]  # they sample
            try:
                logits = self.engine.step([r.id for r in batch], feeds, logits_for=ending)  # [len(ending), V]
            except KVCacheFull as e:
                if len(self.running) <= 1:
                    for req in batch:
                        self._finish(req, "error", f"the KV cache cannot hold this request: {e}")
                    return
                victim = self.running[-1]
                self._preempt(victim)
                kept = [i for i, r in enumerate(batch) if r is not victim]
                batch, feeds = [batch[i] for i in kept], [feeds[i] for i in kept]
                continue
            except Exception as e:  # noqa: BLE001 - the batch fails, the engine and the other requests go on
                for req in batch:
                    self._finish(req, "error", f"generation failed: {e}")
                return
            self._counts["num_steps"] += 1
            self._after_step(batch, feeds, dict(zip(ending, logits)))
            return

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.cache.release(req.id)
        req.num_computed = 0
        self.waiting.appendleft(req)
        self._counts["num_preemptions"] += 1

    def _after_step(self, batch: list[Request], feeds: list[list[int]], logits: dict) -> None:
        """logits: {position in batch: [V]} for the requests whose prompt or token this step completed."""
        with self.tokenizer_lock:
            for i, (req, feed) in enumerate(zip(batch, feeds)):
                req.num_computed += len(feed)
                if req.remaining == 0:
                    followers, req.followers = req.followers, []
                    room = self.config.max_concurrency - len(self.running)
                    forked = [k < room and self._fork(req, f) for k, f in enumerate(followers)]  # before req ends
                    self._accept(req, *self._sample(req, logits[i]))
                    for f, ok in zip(followers, forked):
                        self._start_follower(f, ok, logits[i])

    def _sample(self, req: Request, row) -> tuple[int, dict]:
        """row: [V] logits -> (token, the log-probability fields of its output)."""
        adjusted = row if req.adjust is None else req.adjust(row, req.tokens[len(req.prompt):])
        token = req.sampler(adjusted, req.tokens)
        return token, ({} if req.logprobs is None else token_logprobs(row, token, req.logprobs))

    # ---- the other choices of a group
    def _fork(self, leader: Request, f: Request) -> bool:
        """Whether f now holds the leader's prompt by sharing its blocks (a batch with room, a cache that forks)."""
        if not hasattr(self.cache, "fork"):
            return False
        try:
            self.cache.fork(leader.id, f.id)
        except (NotImplementedError, KVCacheFull):
            self.cache.release(f.id)
            return False
        return True

    def _start_follower(self, f: Request, forked: bool, row) -> None:
        f.counted, f.admitted_at = True, time.perf_counter()  # the prompt is the leader's: counted once
        self._accept(f, *self._sample(f, row))
        if f.finished:
            return
        if forked:
            try:  # copy-on-write of the shared partial block, before f writes its first token into it
                f.num_computed = self.cache.prepare(f.id, f.tokens)
                self.running.append(f)
                return
            except KVCacheFull:
                self.cache.release(f.id)
        f.num_computed = 0
        self.waiting.appendleft(f)  # recomputed when admitted; the prefix cache serves the prompt's full blocks

    def _accept(self, req: Request, token: int, logprob: dict | None = None) -> None:
        """logprob: the token's log-probability fields, on its output (a stop token has no output of its own)."""
        now = time.perf_counter()
        timing = dict(ttft_s=now - req.submitted) if req.last_token_at is None else dict(itl_s=now - req.last_token_at)
        req.last_token_at = now
        if token in req.stop_ids:
            self._finish(req, "stop", text=req.stops.feed(req.detok.flush())[0] + req.stops.flush(), **timing)
            return
        req.tokens.append(token)
        self._counts["generation_tokens"] += 1
        text, stopped = req.stops.feed(req.detok.add(token))
        fields = dict(token_id=token, **timing, **(logprob or {}))
        if stopped:
            self._finish(req, "stop", text=text, **fields)
        elif req.num_generated >= req.params.max_new_tokens or len(req.tokens) >= self.engine.max_context:
            self._finish(req, "length", text=text + req.stops.feed(req.detok.flush())[0] + req.stops.flush(),
                         **fields)
        else:
            self._emit(req, self._output(req, text=text, **fields))

    def _finish(self, req: Request, reason: str, error: str | None = None, **fields) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.cache.release(req.id)
        req.finished = True
        self._counts["num_finished"] += 1
        self._finished_by_reason[reason] += 1
        now = time.perf_counter()
        queued = (req.admitted_at or now) - req.submitted
        self._emit(req, self._output(req, finish_reason=reason, error=error, e2e_s=now - req.submitted,
                                     queue_s=queued, **fields))
        followers, req.followers = req.followers, []
        for f in followers:  # never forked: they end as the first choice did
            self._finish(f, reason, error)

    def _emit(self, req: Request, output: Output) -> None:
        for observe in self._observers:
            with contextlib.suppress(Exception):  # an observer never stops a request
                observe(output)
        self._emitted = True
        try:
            req.sink(output)
        except Exception:  # noqa: BLE001 - a consumer that went away cancels its request, nothing else
            if not output.finished:
                self.cancel(req.id)

    def _output(self, req: Request, **fields) -> Output:
        return Output(req.id, n_prompt_tokens=len(req.prompt), n_generated_tokens=req.num_generated,
                      prefix_hit_tokens=req.prefix_hit, **fields)

    def _publish_stats(self) -> None:
        self._stats = SchedulerStats(len(self.running), len(self.waiting), self.cache.stats(), **self._counts,
                                     finished_by_reason=tuple(sorted(self._finished_by_reason.items())))


def token_logprobs(logits, token: int, k: int) -> dict:
    """logits: [V] -> the output fields: the chosen token's log-probability and the k most likely tokens'."""
    logp = logits.float().log_softmax(-1)
    fields = {"logprob": float(logp[token])}
    if k:
        values, ids = logp.topk(min(k, logp.numel()))
        fields["top_logprobs"] = tuple(zip(ids.tolist(), values.tolist()))
    return fields
