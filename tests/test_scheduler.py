"""Continuous batching over one engine: batched greedy output equals one-at-a-time, chunked prefill, admission
by free blocks, preemption instead of failure, cancellation, prefix sharing, stop strings, no leaked block."""

from __future__ import annotations

import random
import threading

import pytest
from engine_helpers import greedy, one_torch_thread

from engine.chat import PromptTooLong
from engine.config import ConfigError
from engine.scheduler import Output, Scheduler, SchedulerConfig, StopStrings


@pytest.fixture(autouse=True)
def _one_thread():
    with one_torch_thread():
        yield


def prompts(n: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 2000) for _ in range(lengths[i % len(lengths)])] for i in range(n)]


class Collector:
    """Outputs per request, in arrival order."""

    def __init__(self):
        self.outputs: dict[int, list[Output]] = {}

    def sink(self, out: Output) -> None:
        self.outputs.setdefault(out.request_id, []).append(out)

    def tokens(self, rid: int) -> list[int]:
        return [o.token_id for o in self.outputs[rid] if o.token_id is not None]

    def final(self, rid: int) -> Output:
        return self.outputs[rid][-1]

    def done(self, rid: int) -> bool:
        return bool(self.outputs.get(rid)) and self.outputs[rid][-1].finished


def run_all(sched: Scheduler, prompt_list, params, stop=()) -> tuple[Collector, list[int]]:
    col = Collector()
    ids = [sched.submit(p, params, col.sink, stop) for p in prompt_list]
    while not all(col.done(i) for i in ids):
        sched.tick()
    return col, ids


def alone(engine_factory, prompt, params, **config):
    sched = Scheduler(engine_factory(**config))
    col, (rid,) = run_all(sched, [prompt], params)
    return col.tokens(rid)


def test_batched_greedy_outputs_equal_one_at_a_time(tiny_engine_factory):
    batch = prompts(6, [5, 40, 17, 90, 3, 33])
    sched = Scheduler(tiny_engine_factory(), SchedulerConfig(step_rows=8))
    col, ids = run_all(sched, batch, greedy(12))
    for rid, prompt in zip(ids, batch):
        assert col.tokens(rid) == alone(tiny_engine_factory, prompt, greedy(12))
        assert col.final(rid).finish_reason == "length"
        assert col.final(rid).n_generated_tokens == 12
    assert sched.stats().peak_running == 6


@pytest.mark.parametrize("cache", ["contiguous", "paged-int8"])
def test_other_caches_batch_the_same_way(tiny_engine_factory, cache):
    batch = prompts(4, [9, 50, 21, 70], seed=5)
    sched = Scheduler(tiny_engine_factory(cache=cache), SchedulerConfig(step_rows=8))
    col, ids = run_all(sched, batch, greedy(10))
    for rid, prompt in zip(ids, batch):
        assert col.tokens(rid) == alone(tiny_engine_factory, prompt, greedy(10), cache=cache)
    assert sched.stats().peak_running == 4 and sched.cache.stats().bytes_used == 0


def test_scheduler_output_equals_engine_generate(tiny_engine_factory):
    engine = tiny_engine_factory()
    conv = engine.new_conversation("You are terse.")
    from engine.chat import prompt_ids

    events = list(engine.generate(conv, "Hello there", greedy(10)))
    expected = [e.token_id for e in events if getattr(e, "token_id", None) is not None]
    ids = prompt_ids(engine.tokenizer, "You are terse.", conv.messages[:1])
    sched = Scheduler(tiny_engine_factory())
    col, (rid,) = run_all(sched, [ids], greedy(10))
    assert col.tokens(rid) == expected


def test_a_long_prompt_is_cut_into_pieces_and_does_not_stall_decoding(tiny_engine_factory):
    sched = Scheduler(tiny_engine_factory(), SchedulerConfig(step_rows=16, prefill_rows_while_decoding=16))
    col = Collector()
    short = sched.submit(prompts(1, [8])[0], greedy(60), col.sink)
    sched.tick()  # the short prompt is prefilled: it decodes from now on
    long_id = sched.submit(prompts(1, [600], seed=1)[0], greedy(4), col.sink)
    ticks_until_first_long_token = 0
    while not col.outputs.get(long_id):
        before = len(col.tokens(short))
        sched.tick()
        ticks_until_first_long_token += 1
        assert len(col.tokens(short)) == before + 1, "the decoding request got a token every tick"
    assert ticks_until_first_long_token == -(-600 // 16)  # one piece of 16 rows per tick


@pytest.mark.parametrize("kv_dtype, rows_while_decoding", [("float32", 4), ("float16", 4), ("int8", 16)])
def test_while_a_stream_decodes_a_float_cache_prefills_in_small_steps(tiny_engine_factory, kv_dtype,
                                                                      rows_while_decoding):
    """A running stream's gap grows by one small prefill step a tick; alone, a prompt takes full steps. A quantized
    cache keeps its pieces on multiples of step_rows (its blocks turn into codes at the step that fills them)."""
    engine = tiny_engine_factory(kv_dtype=kv_dtype)
    fed = []
    step = engine.step
    engine.step = lambda ids, feeds, **kw: fed.append(sum(map(len, feeds))) or step(ids, feeds, **kw)
    sched = Scheduler(engine, SchedulerConfig(step_rows=16, prefill_rows_while_decoding=4))
    col = Collector()
    first = sched.submit(prompts(1, [40])[0], greedy(30), col.sink)
    sched.tick(), sched.tick(), sched.tick()
    assert fed == [16, 16, 8] and len(col.tokens(first)) == 1  # prefilled: it decodes from now on
    later = sched.submit(prompts(1, [40], seed=2)[0], greedy(2), col.sink)
    fed.clear()
    while not col.outputs.get(later):
        sched.tick()
    assert fed[0::2] == [1] * len(fed[0::2])  # the running stream's token, every tick
    prefill = fed[1::2]
    assert sum(prefill) == 40 and max(prefill) == rows_while_decoding
    assert len(col.tokens(first)) == 1 + len(prefill)


def test_every_step_computes_at_most_step_rows_rows(tiny_engine_factory):
    """Rows = sequences x fed tokens, padding included: within the width where the kernels are batch-invariant."""
    engine = tiny_engine_factory()
    widths = []
    step = engine.step
    engine.step = lambda ids, feeds, **kw: widths.append(len(ids) * max(map(len, feeds))) or step(ids, feeds, **kw)
    sched = Scheduler(engine, SchedulerConfig(max_concurrency=20, step_rows=16))
    run_all(sched, prompts(20, [5, 40, 17, 3, 33]), greedy(6))
    assert max(widths) == 16 and sched.stats().peak_running == 20


def test_prompts_that_arrive_together_take_pieces_in_turn_and_share_steps_with_short_ones(tiny_engine_factory):
    engine = tiny_engine_factory()
    steps = []
    step = engine.step
    engine.step = lambda ids, feeds, **kw: steps.append([len(f) for f in feeds]) or step(ids, feeds, **kw)
    sched = Scheduler(engine, SchedulerConfig(step_rows=16))
    run_all(sched, prompts(3, [21, 40, 7]), greedy(1))  # pieces 16+5, 16+16+8, 7
    assert steps == [[16], [16], [7, 5], [16], [8]]  # round robin; the 7 and the 5 share a step


def test_a_running_stream_is_stalled_by_one_piece_per_tick_whatever_arrives(tiny_engine_factory):
    """Four prompts arriving while a stream decodes: every tick still gives that stream its token."""
    sched = Scheduler(tiny_engine_factory(), SchedulerConfig(step_rows=16))
    col = Collector()
    first = sched.submit(prompts(1, [8])[0], greedy(100), col.sink)  # outlasts the others' 4-row pieces
    sched.tick()
    later = [sched.submit(p, greedy(4), col.sink) for p in prompts(4, [40, 70, 33, 90], seed=4)]
    while not all(col.outputs.get(r) for r in later):
        before = len(col.tokens(first))
        sched.tick()
        assert len(col.tokens(first)) == before + 1


def test_a_prompts_pieces_end_on_multiples_of_step_rows_whatever_its_prefix_hit(tiny_engine_factory):
    """Absolute piece boundaries: a prompt is cut the same way alone, in a batch, or after a prefix-cache hit."""
    engine = tiny_engine_factory(block_size=8)
    fed = []
    step = engine.step
    engine.step = lambda ids, feeds, **kw: fed.extend(map(len, feeds)) or step(ids, feeds, **kw)
    sched = Scheduler(engine, SchedulerConfig(step_rows=16))
    system = prompts(1, [24])[0]
    run_all(sched, [system + [7] * 20], greedy(1))
    assert fed == [16, 16, 12]
    fed.clear()
    col, (rid,) = run_all(sched, [system + [9] * 20], greedy(1))  # 24 tokens cached: 3 blocks of 8
    assert col.final(rid).prefix_hit_tokens == 24 and fed == [8, 12]


def test_requests_wait_when_the_pool_is_full_and_all_finish(tiny_engine_factory):
    engine = tiny_engine_factory(max_context=128, pool_tokens=128)  # 8 blocks of 16
    sched = Scheduler(engine)
    batch = prompts(5, [60, 45, 70])
    col, ids = run_all(sched, batch, greedy(20))
    assert all(col.final(i).finish_reason == "length" for i in ids)
    assert sched.stats().peak_running < 5
    for rid, prompt in zip(ids, batch):
        assert col.tokens(rid) == alone(tiny_engine_factory, prompt, greedy(20), max_context=128, pool_tokens=128)
    assert engine.cache.pool.num_used == 0
    engine.cache.pool.check_invariants()


def test_a_full_pool_preempts_the_newest_request_instead_of_failing_one(tiny_engine_factory):
    engine = tiny_engine_factory(max_context=128, pool_tokens=128)
    sched = Scheduler(engine)
    batch = prompts(3, [20])  # 2 blocks each to start, up to 7 each by the end: they cannot all grow
    col, ids = run_all(sched, batch, greedy(90))
    assert sched.stats().num_preemptions >= 1
    assert [col.final(i).finish_reason for i in ids] == ["length"] * 3
    for rid, prompt in zip(ids, batch):
        assert col.tokens(rid) == alone(tiny_engine_factory, prompt, greedy(90), max_context=128, pool_tokens=128)
    assert engine.cache.pool.num_used == 0


def test_more_decoding_requests_than_step_rows_take_several_steps_and_survive_preemption(tiny_engine_factory):
    engine = tiny_engine_factory(max_context=128, pool_tokens=128)
    sched = Scheduler(engine, SchedulerConfig(step_rows=2))
    batch = prompts(6, [10, 14])  # 6 requests in decode steps of 2 rows; they cannot all grow to 50 tokens
    col, ids = run_all(sched, batch, greedy(40))
    assert sched.stats().num_preemptions >= 1
    for rid, prompt in zip(ids, batch):
        assert col.tokens(rid) == alone(tiny_engine_factory, prompt, greedy(40), max_context=128, pool_tokens=128)
    assert engine.cache.pool.num_used == 0


def test_cancel_releases_blocks_at_the_next_tick(tiny_engine_factory):
    engine = tiny_engine_factory()
    sched = Scheduler(engine)
    col = Collector()
    rid = sched.submit(prompts(1, [100])[0], greedy(50), col.sink)
    for _ in range(3):
        sched.tick()
    assert engine.cache.pool.num_used > 0
    sched.cancel(rid)
    sched.tick()
    assert col.final(rid).finish_reason == "cancelled"
    assert engine.cache.pool.num_used == 0
    assert sched.stats().num_running == 0


def test_a_waiting_request_can_be_cancelled(tiny_engine_factory):
    sched = Scheduler(tiny_engine_factory(), SchedulerConfig(max_concurrency=1))
    col = Collector()
    first = sched.submit(prompts(1, [10])[0], greedy(5), col.sink)
    second = sched.submit(prompts(1, [10], seed=2)[0], greedy(5), col.sink)
    sched.tick()
    assert sched.stats().num_waiting == 1
    sched.cancel(second)
    while not col.done(first):
        sched.tick()
    assert col.final(second).finish_reason == "cancelled" and col.tokens(second) == []


def test_same_system_prompt_shares_cached_blocks(tiny_engine_factory):
    sched = Scheduler(tiny_engine_factory())
    system = prompts(1, [64])[0]
    first, (a,) = run_all(sched, [system + [7, 8, 9]], greedy(3))
    second, (b,) = run_all(sched, [system + [10, 11]], greedy(3))  # the first one's blocks are cached now
    assert first.final(a).prefix_hit_tokens == 0
    assert second.final(b).prefix_hit_tokens == 64
    assert sched.stats().prefix_hits == 64


@pytest.mark.parametrize("cache, kv_dtype", [("paged", None), ("paged-int8", None), ("paged", "int4")])
def test_requests_arriving_together_compute_their_common_prefix_once(tiny_engine_factory, cache, kv_dtype):
    """Four requests with one 40-token system prompt, submitted at once: the first computes its full blocks, the
    others wait the ticks that takes and share them (an int4 pool shares a block only once it holds codes, 128
    tokens later, so there the four compute their own); every reply is the one its request gets alone."""
    engine = tiny_engine_factory(cache=cache, kv_dtype=kv_dtype)
    rows = []
    step = engine.step
    engine.step = lambda ids, feeds, **kw: rows.append(sum(map(len, feeds))) or step(ids, feeds, **kw)
    system = prompts(1, [40])[0]
    batch = [system + suffix for suffix in prompts(4, [5, 9, 3, 12], seed=3)]
    col, ids = run_all(Scheduler(engine), batch, greedy(4))
    shared = 0 if kv_dtype == "int4" else 32  # two full blocks of 16
    assert [col.final(i).prefix_hit_tokens for i in ids] == [0] + [shared] * 3
    assert sum(rows) == sum(len(p) + 3 for p in batch) - 3 * shared
    for rid, prompt in zip(ids, batch):
        assert col.tokens(rid) == alone(tiny_engine_factory, prompt, greedy(4), cache=cache, kv_dtype=kv_dtype)


def test_a_request_waiting_for_its_prefix_keeps_its_place_and_lets_others_in(tiny_engine_factory):
    sched = Scheduler(tiny_engine_factory())
    col = Collector()
    system = prompts(1, [80])[0]
    first = sched.submit(system + [7, 8], greedy(3), col.sink)
    sched.tick()  # its first piece: 16 of the 80 shared tokens computed
    second = sched.submit(system + [9], greedy(3), col.sink)
    other = sched.submit(prompts(1, [20], seed=5)[0], greedy(3), col.sink)
    sched.tick()
    assert [r.id for r in sched.waiting] == [second] and other in [r.id for r in sched.running]
    while not all(col.done(i) for i in (first, second, other)):
        sched.tick()
    assert col.final(second).prefix_hit_tokens == 80
    assert col.tokens(second) == alone(tiny_engine_factory, system + [9], greedy(3))


def test_max_concurrency_is_respected(tiny_engine_factory):
    sched = Scheduler(tiny_engine_factory(), SchedulerConfig(max_concurrency=2))
    run_all(sched, prompts(5, [10]), greedy(4))
    assert sched.stats().peak_running == 2


def test_stop_strings_cut_the_text_and_hold_back_partial_matches():
    stops = StopStrings(("END", "##"))
    assert stops.feed("hello E") == ("hello ", False)
    assert stops.feed("N") == ("", False)
    assert stops.feed("X more #") == ("ENX more ", False)
    assert stops.feed("# tail") == ("", True)
    assert StopStrings(("x",)).feed("abxcd") == ("ab", True)
    plain = StopStrings(())
    assert plain.feed("anything") == ("anything", False) and plain.flush() == ""


def test_random_cancellations_leak_no_block(tiny_engine_factory):
    engine = tiny_engine_factory(max_context=256, pool_tokens=256)
    sched = Scheduler(engine, SchedulerConfig(max_concurrency=6, step_rows=8))
    rng = random.Random(3)
    col = Collector()
    live: list[int] = []
    for i in range(120):
        if rng.random() < 0.5:
            live.append(sched.submit(prompts(1, [rng.randrange(1, 80)], seed=i)[0], greedy(rng.randrange(1, 30)),
                                     col.sink))
        if live and rng.random() < 0.3:
            sched.cancel(live.pop(rng.randrange(len(live))))
        sched.tick()
        engine.cache.pool.check_invariants()
    while any(not col.done(r) for r in col.outputs) or sched.stats().num_waiting or sched.stats().num_running:
        sched.tick()
    assert engine.cache.pool.num_used == 0
    assert sched.running == [] and not sched.waiting


def test_the_thread_serves_submissions_from_other_threads(tiny_engine_factory):
    sched = Scheduler(tiny_engine_factory())
    sched.start()
    try:
        finished = threading.Event()
        col = Collector()

        def sink(out):
            col.sink(out)
            if out.finished:
                finished.set()

        rid = sched.submit(prompts(1, [12])[0], greedy(6), sink)
        assert finished.wait(60)
        assert len(col.tokens(rid)) == 6
        assert col.outputs[rid][0].ttft_s is not None and col.outputs[rid][1].itl_s is not None
    finally:
        sched.close()


def test_bad_input_is_refused_with_a_clear_error(tiny_engine_factory):
    sched = Scheduler(tiny_engine_factory(max_context=64, pool_tokens=64))
    with pytest.raises(PromptTooLong, match="context holds 64"):
        sched.submit(list(range(3, 67)), greedy(1), lambda o: None)
    with pytest.raises(PromptTooLong):
        sched.submit([], greedy(1), lambda o: None)
    with pytest.raises(ConfigError, match="keeps keys and values"):
        Scheduler(tiny_engine_factory(cache="none"))
    with pytest.raises(ConfigError, match="less than one context"):
        Scheduler(tiny_engine_factory(pool_tokens=64))
    with pytest.raises(ConfigError):
        SchedulerConfig(max_concurrency=0)


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16"])
def test_while_a_stream_decodes_a_new_prompt_rides_in_its_step_one_token_a_tick(tiny_engine_factory, kv_dtype):
    """One prefill row a tick (the default while others decode, float caches) joins the decode step: one forward a
    tick, no step of its own, and the new request's tokens are those it gets alone. Only the rows that sample (the
    stream's token, the prompt's last) go through the head."""
    heads_seen = []

    def fresh():
        engine = tiny_engine_factory(kv_dtype=kv_dtype)
        feeds_seen = []
        step = engine.step

        def recording_step(ids, feeds, **kw):
            feeds_seen.append([len(f) for f in feeds])
            logits = step(ids, feeds, **kw)
            heads_seen.append(len(logits))
            return logits
        engine.step = recording_step
        return Scheduler(engine, SchedulerConfig(step_rows=16)), feeds_seen

    alone, _ = fresh()
    col, (alone_id,) = run_all(alone, prompts(1, [40], seed=2), greedy(6))
    sched, fed = fresh()
    col2 = Collector()
    first = sched.submit(prompts(1, [40])[0], greedy(60), col2.sink)
    while not col2.outputs.get(first):
        sched.tick()
    later = sched.submit(prompts(1, [40], seed=2)[0], greedy(6), col2.sink)
    fed.clear()
    ticks = 0
    while not col2.outputs.get(later):
        sched.tick()
        ticks += 1
    assert fed == [[1, 1]] * ticks  # one forward a tick: the stream's token and one prompt token
    assert ticks == 40
    assert heads_seen[-ticks:] == [1] * (ticks - 1) + [2]  # the prompt's row samples at its last token only
    while not col2.done(later):
        sched.tick()
    assert col2.tokens(later) == col.tokens(alone_id)


def test_a_quantized_cache_recomputes_a_preempted_reply_a_token_a_step_after_the_prompts_pieces():
    """A quantized cache turns a block into codes in the step that fills it, read by every row of that step, so a
    reply recomputed after a preemption goes as it was decoded; a float cache's pieces run on to step_rows."""
    from types import SimpleNamespace

    req = SimpleNamespace(prompt=list(range(69)), tokens=list(range(75)), num_computed=64)  # 69 prompt + 6 reply
    assert Scheduler._next_piece(req, 16) == list(range(64, 75))
    assert Scheduler._next_piece(req, 16, one_reply_token=True) == list(range(64, 69))
    req.num_computed = 69
    assert Scheduler._next_piece(req, 16, one_reply_token=True) == [69]
    req.num_computed = 32
    assert Scheduler._next_piece(req, 16, one_reply_token=True) == list(range(32, 48))
