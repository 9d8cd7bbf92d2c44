"""Concurrent greedy requests give the tokens each gives alone, on the real default model as `serve` runs it.

By construction (engine/scheduler.py): every forward computes at most the engine's batch-invariant number of
rows and a prompt is cut into pieces at absolute multiples of it, so neither the batch, nor a prefix-cache hit,
nor a preemption changes a token's bits. Without that, a prompt prefilled in one step of 40 rows and the same
prompt in pieces of 16 give first-token logits that differ by several units (measured: up to 6.9).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
from engine_helpers import english_ids, greedy, one_torch_thread

from engine.chat import Message, prompt_ids
from engine.config import EngineConfig
from engine.engine import Engine
from engine.model import LlamaModel
from engine.scheduler import Output, Scheduler, SchedulerConfig

TOPICS = ("a lighthouse keeper", "a lost robot", "the first bakery on Mars", "a dragon who feared heights",
          "an old clockmaker", "a chess-playing cat")
NEW_TOKENS = 40


def serve_like_engine(default_weights, kv_dtype: str = "float16", block_size: int = 16, **config) -> Engine:
    """The default model as `serve` runs it here (its auto choices on this machine: int4 weights, float16 KV;
    every float KV precision is exact), paged in blocks of 16."""
    model = LlamaModel.from_hf_state_dict(default_weights.config, default_weights.state_dict)
    return Engine(model, default_weights.tokenizer, EngineConfig(cache="paged", block_size=block_size, weights="int4",
                                                                 kv_dtype=kv_dtype, **config), default_weights.name)


@pytest.fixture(scope="module")
def serve_engine(default_weights):
    with one_torch_thread():
        yield serve_like_engine(default_weights)


def story(engine: Engine, topic: str) -> list[int]:
    """A chat prompt of ~40 tokens; all share the template's leading block (prefix-cache hits)."""
    return prompt_ids(engine.tokenizer, None, [Message("user", f"Write a long story about {topic}.")])


class Streams:
    def __init__(self):
        self.outputs: dict[int, list[Output]] = {}

    def sink(self, out: Output) -> None:
        self.outputs.setdefault(out.request_id, []).append(out)

    def done(self, rid: int) -> bool:
        return bool(self.outputs.get(rid)) and self.outputs[rid][-1].finished

    def tokens(self, rid: int) -> list[int]:
        return [o.token_id for o in self.outputs[rid] if o.token_id is not None]


@dataclass(frozen=True)
class Arrival:
    prompt: list[int]
    new_tokens: int
    tick: int  # submitted at this tick
    cancel_after: int | None = None  # ticks after its submission; None: runs to its length


def random_workload(engine: Engine, seed: int, requests: int = 9) -> list[Arrival]:
    """Real English prompts, most of them behind one of three shared prefixes (a system prompt's, whose blocks
    are computed by whichever request comes first), arriving within eight ticks; one in six cancelled."""
    rng = random.Random(seed)
    text = english_ids(engine.tokenizer, 3000)
    prefixes = [text[a:a + rng.randint(20, 80)] for a in rng.sample(range(2800), 3)]
    return [Arrival(prompt=rng.choice([*prefixes, []]) + text[(b := rng.randint(0, 2800)):b + rng.randint(1, 80)],
                    new_tokens=rng.randint(1, 40), tick=rng.randint(0, 8),
                    cancel_after=rng.randint(1, 20) if rng.random() < 1 / 6 else None)
            for _ in range(requests)]


def run_workload(sched: Scheduler, workload: list[Arrival]) -> list[tuple[list[int], str]]:
    """Submit and cancel each arrival at its tick, tick until all have finished; -> (tokens, finish reason) each."""
    streams, ids, ticks = Streams(), {}, 0
    while len(ids) < len(workload) or not all(streams.done(r) for r in ids.values()):
        for i, a in enumerate(workload):
            if i not in ids and a.tick <= ticks:
                ids[i] = sched.submit(a.prompt, greedy(a.new_tokens), streams.sink)
            elif i in ids and a.cancel_after is not None and ticks == a.tick + a.cancel_after:
                sched.cancel(ids[i])
        sched.tick()
        ticks += 1
    return [(streams.tokens(ids[i]), streams.outputs[ids[i]][-1].finish_reason) for i in range(len(workload))]


def run(sched: Scheduler, prompts: list[list[int]], start_every: int = 0, new_tokens: int = NEW_TOKENS
        ) -> list[list[int]]:
    """Submit the prompts (all at once, or one every `start_every` ticks while the others run) and tick until every
    request has finished; -> their tokens."""
    arrivals = [Arrival(p, new_tokens, tick=i * start_every) for i, p in enumerate(prompts)]
    return [tokens for tokens, _ in run_workload(sched, arrivals)]


@pytest.mark.parametrize("kv_dtype", ["float16", "int8"])  # int8: its blocks fill at a piece's end, as alone
def test_concurrent_greedy_streams_equal_each_request_alone(default_weights, kv_dtype):
    with one_torch_thread():
        engine = serve_like_engine(default_weights, kv_dtype)
        prompts = [story(engine, t) for t in TOPICS]
        sched = Scheduler(engine, SchedulerConfig(max_concurrency=16))
        alone = [run(sched, [p])[0] for p in prompts]  # the later ones hit the earlier ones' cached blocks
        together = run(sched, prompts)  # every prompt's own blocks are cached now: other hits, other pieces
        staggered = run(sched, prompts[::-1], start_every=5)  # arriving while the others decode
    assert all(len(t) == NEW_TOKENS for t in alone)
    assert together == alone
    assert staggered == alone[::-1]
    assert sched.stats().prefix_hits > 0 and sched.cache.pool.num_used == 0


def test_a_preempted_request_is_recomputed_to_the_same_tokens(serve_engine, default_weights):
    """A pool too small for all of them: the newest request is preempted and its prompt and reply recomputed in
    pieces; its tokens are still those it gives alone."""
    with one_torch_thread():
        prompts = [story(serve_engine, t) for t in TOPICS[:4]]
        small = serve_like_engine(default_weights, pool_tokens=256, max_context=256)
        sched = Scheduler(small)
        alone = [run(sched, [p])[0] for p in prompts]
        together = run(sched, prompts)
    assert sched.stats().num_preemptions >= 1
    assert together == alone


@pytest.mark.parametrize("kv_dtype, block_size, seed", [("float16", 16, 3), ("int8", 8, 7)])
def test_a_random_workload_on_a_small_pool_gives_every_finished_stream_its_tokens_alone(default_weights, kv_dtype,
                                                                                       block_size, seed):
    """Arrivals over time, shared prefixes computed in flight or taken from the prefix cache, cancellations, a
    pool that cannot hold every request (preemptions): each request that ran to its length has the tokens it
    gets alone (one request at a time, on another engine)."""
    with one_torch_thread():
        engine = serve_like_engine(default_weights, kv_dtype, block_size, pool_tokens=256, max_context=256)
        workload = random_workload(engine, seed)
        sched = Scheduler(engine)
        together = run_workload(sched, workload)
        fresh = serve_like_engine(default_weights, kv_dtype, block_size, max_context=256)
        alone = [run(Scheduler(fresh), [a.prompt], new_tokens=a.new_tokens)[0] for a in workload]
    stats = sched.stats()
    assert stats.num_preemptions >= 1 and stats.prefix_hits > 0  # the workload did reach those paths
    finished = [i for i, (_, reason) in enumerate(together) if reason == "length"]
    assert len(finished) >= len(workload) // 2
    assert [together[i][0] for i in finished] == [alone[i] for i in finished]
    assert engine.cache.pool.num_used == 0


def test_logits_of_a_prompt_cut_into_pieces_equal_those_of_other_cuts(serve_engine):
    """The property the scheduler relies on, at the engine: steps of at most step_rows rows give the same bits
    however the prompt is cut, whether its leading blocks were computed now or served by the prefix cache."""
    rows = SchedulerConfig().step_rows
    ids = story(serve_engine, "a kite that would not land")  # a prompt no other test sends
    cache, results, hits = serve_engine.cache, [], []
    with one_torch_thread():
        for seq_id, piece in enumerate((rows, rows // 2, 5, 1), start=900):
            start = cache.prepare(seq_id, ids)  # the first computes all but the template's block; the others
            # hit its blocks too
            hits.append(start)
            while start < len(ids):
                logits = serve_engine.step([seq_id], [ids[start:start + piece]])[0]
                start += piece
            results.append(logits)
            cache.release(seq_id)
    assert all(h > hits[0] for h in hits[1:])  # the later cuts start where the first one's blocks end
    assert all(torch.equal(results[0], r) for r in results[1:])
