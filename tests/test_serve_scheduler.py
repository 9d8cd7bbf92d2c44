"""The scheduler's side of the server's parameters: n choices of one prompt prefilled once and sharing its blocks
(the paged pool's fork), log-probabilities from the model's logits, a logits adjustment before sampling, finish
reasons counted apart, queue and end-to-end times on the last output, observers that see every output."""

from __future__ import annotations

import math

import pytest
import torch
from engine_helpers import greedy, one_torch_thread

from engine.config import SamplingParams
from engine.scheduler import Output, Scheduler, SchedulerConfig


@pytest.fixture(autouse=True)
def _one_thread():
    with one_torch_thread():
        yield


class Collector:
    def __init__(self):
        self.outputs: dict[int, list[Output]] = {}

    def sink(self, out: Output) -> None:
        self.outputs.setdefault(out.request_id, []).append(out)

    def tokens(self, rid: int) -> list[int]:
        return [o.token_id for o in self.outputs.get(rid, []) if o.token_id is not None]

    def final(self, rid: int) -> Output:
        return self.outputs[rid][-1]

    def done(self, rid: int) -> bool:
        return bool(self.outputs.get(rid)) and self.outputs[rid][-1].finished


def run(sched: Scheduler, ids: list[int], col: Collector) -> None:
    while not all(col.done(i) for i in ids):
        sched.tick()


def prefill(sched: Scheduler, ids: list[int], col: Collector) -> None:
    """Tick until the group's prompt is prefilled (in pieces of step_rows rows) and its first tokens are out."""
    while not col.outputs.get(ids[0]):
        sched.tick()


def prompt(n: int) -> list[int]:
    return [3 + (7 * i) % 1900 for i in range(n)]


def sampled(max_new_tokens: int, seed: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, top_k=0, top_p=1.0, repetition_penalty=1.0,
                          max_new_tokens=max_new_tokens, seed=seed, stop_token_ids=(-1,))


# ---- n choices -----------------------------------------------------------------------------------------------------
def test_four_choices_of_a_block_aligned_prompt_hold_its_blocks_once(tiny_engine_factory):
    engine = tiny_engine_factory(block_size=16)
    sched, col = Scheduler(engine), Collector()
    ids = sched.submit_group(prompt(32), [greedy(3)] * 4, col.sink)
    prefill(sched, ids, col)  # the prompt is prefilled once; the four choices sample their first token from its logits
    assert all(len(col.tokens(i)) == 1 for i in ids)
    assert engine.cache.pool.num_used == 2  # 32 tokens = 2 blocks, shared by 4 sequences: counted once
    assert sched.stats().prompt_tokens == 32
    run(sched, ids, col)
    assert len({tuple(col.tokens(i)) for i in ids}) == 1  # greedy: four equal choices
    assert engine.cache.pool.num_used == 0
    engine.cache.pool.check_invariants()


def test_four_choices_count_the_prompts_kv_once_in_the_published_metrics(tiny_engine_factory):
    from app.backends.metrics_parser import server_kv
    from server.metrics import ServerMetrics

    published = {}
    for n in (1, 4):
        engine = tiny_engine_factory(block_size=16)
        sched, col = Scheduler(engine), Collector()
        metrics = ServerMetrics(sched, "tiny")
        ids = sched.submit_group(prompt(32), [greedy(3)] * n, col.sink)
        prefill(sched, ids, col)  # prefilled once, every choice holding the prompt's 2 blocks
        published[n] = server_kv(metrics.exposition().decode())
        run(sched, ids, col)
    one, four = published[1], published[4]
    assert four.blocks_used == one.blocks_used == 2
    assert four.bytes_used == one.bytes_used > 0
    assert four.bytes_theoretical == 4 * one.bytes_theoretical  # the formula counts every choice's tokens: held once
    assert four.prompt_tokens == one.prompt_tokens == 32


def test_an_unaligned_prompt_shares_its_full_blocks_and_copies_only_the_last_partial_one(tiny_engine_factory):
    engine = tiny_engine_factory(block_size=16)
    sched, col = Scheduler(engine), Collector()
    ids = sched.submit_group(prompt(40), [greedy(2)] * 4, col.sink)  # 2 full blocks + 8 tokens
    prefill(sched, ids, col)
    assert engine.cache.pool.num_used == 2 + 4  # the full blocks once, the partial block once per choice
    run(sched, ids, col)
    engine.cache.pool.check_invariants()


def test_choices_equal_the_same_request_run_alone(tiny_engine_factory):
    sched, col = Scheduler(tiny_engine_factory()), Collector()
    ids = sched.submit_group(prompt(45), [sampled(8, seed=s) for s in (1, 2, 3)], col.sink)
    run(sched, ids, col)
    for rid, seed in zip(ids, (1, 2, 3)):
        single, c = Scheduler(tiny_engine_factory()), Collector()
        (one,) = [single.submit(prompt(45), sampled(8, seed=seed), c.sink)]
        run(single, [one], c)
        assert col.tokens(rid) == c.tokens(one)
    assert len({tuple(col.tokens(i)) for i in ids}) > 1  # different seeds, different choices


@pytest.mark.parametrize("cache", ["contiguous", "paged-int8"])
def test_other_caches_serve_n_choices_too(tiny_engine_factory, cache):
    engine = tiny_engine_factory(cache=cache)
    sched, col = Scheduler(engine), Collector()
    ids = sched.submit_group(prompt(20), [greedy(4)] * 3, col.sink)
    run(sched, ids, col)
    assert len({tuple(col.tokens(i)) for i in ids}) == 1 and len(col.tokens(ids[0])) == 4
    assert engine.cache.stats().bytes_used == 0


def test_a_full_batch_queues_the_other_choices_as_requests_of_their_own(tiny_engine_factory):
    engine = tiny_engine_factory()
    sched, col = Scheduler(engine, SchedulerConfig(max_concurrency=2)), Collector()
    ids = sched.submit_group(prompt(20), [greedy(4)] * 4, col.sink)
    run(sched, ids, col)
    assert len({tuple(col.tokens(i)) for i in ids}) == 1 and sched.stats().peak_running <= 2
    assert engine.cache.pool.num_used == 0


def test_cancelling_a_group_before_its_prefill_ends_every_choice(tiny_engine_factory):
    engine = tiny_engine_factory()
    sched, col = Scheduler(engine), Collector()
    ids = sched.submit_group(prompt(30), [greedy(4)] * 3, col.sink)
    sched.cancel(ids[1])  # a choice not yet forked
    sched.cancel(ids[0])
    run(sched, ids, col)
    assert [col.final(i).finish_reason for i in ids] == ["cancelled"] * 3
    assert engine.cache.pool.num_used == 0


def test_one_choice_cancelled_after_the_fork_leaves_the_others_running(tiny_engine_factory):
    engine = tiny_engine_factory()
    sched, col = Scheduler(engine), Collector()
    ids = sched.submit_group(prompt(30), [greedy(6)] * 3, col.sink)
    prefill(sched, ids, col)
    sched.cancel(ids[1])
    run(sched, ids, col)
    assert [col.final(i).finish_reason for i in ids] == ["length", "cancelled", "length"]
    assert engine.cache.pool.num_used == 0


# ---- log-probabilities and the logits adjustment -------------------------------------------------------------------
def test_logprobs_are_the_models_log_softmax_at_the_chosen_token(tiny_engine_factory):
    sched, col = Scheduler(tiny_engine_factory()), Collector()
    rid = sched.submit(prompt(10), greedy(4), col.sink, logprobs=3)
    run(sched, [rid], col)
    for out in (o for o in col.outputs[rid] if o.token_id is not None):
        assert len(out.top_logprobs) == 3
        (best_id, best), *_ = out.top_logprobs
        assert best_id == out.token_id and math.isclose(best, out.logprob)  # greedy picks the most likely
        assert [lp for _, lp in out.top_logprobs] == sorted((lp for _, lp in out.top_logprobs), reverse=True)
        assert out.logprob <= 0


def test_without_logprobs_asked_outputs_carry_none(tiny_engine_factory):
    sched, col = Scheduler(tiny_engine_factory()), Collector()
    rid = sched.submit(prompt(10), greedy(2), col.sink)
    run(sched, [rid], col)
    assert all(o.logprob is None and o.top_logprobs == () for o in col.outputs[rid])


def test_the_adjustment_steers_sampling_and_sees_the_generated_tokens(tiny_engine_factory):
    seen: list[list[int]] = []

    def force_token_7(logits: torch.Tensor, generated: list[int]) -> torch.Tensor:
        seen.append(list(generated))
        out = torch.full_like(logits, -1e9)
        out[7] = 0.0
        return out

    sched, col = Scheduler(tiny_engine_factory()), Collector()
    rid = sched.submit(prompt(10), greedy(3), col.sink, adjust=force_token_7, logprobs=0)
    run(sched, [rid], col)
    assert col.tokens(rid) == [7, 7, 7]
    assert seen == [[], [7], [7, 7]]
    assert all(o.logprob > -1e8 for o in col.outputs[rid])  # the log-probabilities are the model's, not adjusted


# ---- what the server's metrics read --------------------------------------------------------------------------------
def test_finish_reasons_are_counted_apart_and_the_last_output_carries_its_times(tiny_engine_factory):
    sched, col = Scheduler(tiny_engine_factory()), Collector()
    observed: list[Output] = []
    sched.add_observer(observed.append)
    done = sched.submit(prompt(10), greedy(2), col.sink)
    cancelled = sched.submit(prompt(12), greedy(50), col.sink)
    sched.tick()
    sched.cancel(cancelled)
    run(sched, [done, cancelled], col)
    assert dict(sched.stats().finished_by_reason) == {"length": 1, "cancelled": 1}
    last = col.final(done)
    assert last.e2e_s >= last.queue_s >= 0
    delivered = [o for outs in col.outputs.values() for o in outs]
    assert len(observed) == len(delivered) and set(observed) == set(delivered)  # each output seen, once


def test_an_observer_that_raises_stops_nothing(tiny_engine_factory):
    sched, col = Scheduler(tiny_engine_factory()), Collector()
    sched.add_observer(lambda out: 1 / 0)
    rid = sched.submit(prompt(10), greedy(3), col.sink)
    run(sched, [rid], col)
    assert len(col.tokens(rid)) == 3


# ---- the handoff to the server's event loop ------------------------------------------------------------------------
def test_the_handoff_runs_at_the_end_of_each_tick_that_sent_outputs_and_only_then(tiny_engine_factory):
    sched, col = Scheduler(tiny_engine_factory(), SchedulerConfig(step_rows=8)), Collector()
    events: list[str] = []
    sched.set_handoff(lambda: events.append("handoff"))
    sched.add_observer(lambda out: events.append("output"))
    rid = sched.submit(prompt(40), greedy(4), col.sink)  # prefilled in five pieces: four ticks send nothing
    ticks = 0
    while not col.done(rid):
        before = len(events)
        sched.tick()
        ticks += 1
        tick = events[before:]
        assert tick == [] or (tick[-1] == "handoff" and tick.count("handoff") == 1 and "output" in tick)
    assert events.count("handoff") == 4 and ticks == 8  # a tick per token, the last one's with its finish
    sched.set_handoff(None)
    rid = sched.submit(prompt(10), greedy(2), col.sink)
    run(sched, [rid], col)
    assert events.count("handoff") == 4
