"""The memory figures each strategy reports: allocated (storage held), used (live tokens), theoretical (formula)."""

from __future__ import annotations

import pytest

from engine.kv.base import BLOCK_CACHED, BLOCK_FREE, BLOCK_OTHER, BLOCK_OWN
from engine.kv.precision import CONTIGUOUS_GROUP, QUANTIZED, bytes_per_token
from tests.engine_helpers import greedy, held_storage_bytes, one_torch_thread, run_turn

LENGTHS = {1: 5, 2: 16, 3: 37}  # seq_id -> tokens held: under a block, exactly one block, two and a bit
BS = 16


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_torch_thread():
        yield


def hold(engine, lengths: dict[int, int]) -> None:
    """Prefill each sequence with distinct tokens (no shared prefix) so the cache holds it."""
    for seq_id, n in lengths.items():
        tokens = [1000 * seq_id + i for i in range(n)]
        engine.cache.prepare(seq_id, tokens)
        engine.step([seq_id], [tokens])


def formula(engine, bytes_per_element: float) -> float:
    return engine.model_config.kv_bytes_per_token(bytes_per_element)


def per_token(engine, stats) -> float:
    """The formula a cache reports: its element size; a quantized one's scales included (precision.py)."""
    if stats.precision in QUANTIZED:
        return bytes_per_token(engine.model_config, stats.precision, stats.block_size or CONTIGUOUS_GROUP)
    return formula(engine, stats.bytes_per_element)


def test_the_formula_is_2_x_bytes_x_layers_x_kv_heads_x_head_dim(tiny_config):
    c = tiny_config
    assert c.kv_bytes_per_token(4) == 2 * 4 * c.num_layers * c.num_kv_heads * c.head_dim == 512
    assert c.kv_bytes_per_token(1) == 128


@pytest.mark.parametrize("cache", ["none", "contiguous", "paged", "paged-int8"])
def test_allocated_bytes_are_the_storage_of_the_tensors_the_strategy_holds(tiny_engine_factory, cache):
    engine = tiny_engine_factory(cache, BS, max_context=256)
    assert engine.kv_stats().bytes_allocated == held_storage_bytes(engine.cache)
    hold(engine, LENGTHS)
    assert engine.kv_stats().bytes_allocated == held_storage_bytes(engine.cache)
    engine.cache.release(2)
    assert engine.kv_stats().bytes_allocated == held_storage_bytes(engine.cache)


@pytest.mark.parametrize("cache", ["contiguous", "paged", "paged-int8"])
def test_theoretical_bytes_are_the_formula_times_the_tokens_held(tiny_engine_factory, cache):
    engine = tiny_engine_factory(cache, BS, max_context=256)
    hold(engine, LENGTHS)
    stats = engine.kv_stats(None)
    assert stats.bytes_theoretical == int(per_token(engine, stats) * sum(LENGTHS.values()))
    assert engine.kv_stats().bytes_per_element == (1 if cache == "paged-int8" else 4)  # float32 tiny model


def test_none_holds_nothing_and_its_theoretical_bytes_are_for_the_context(tiny_engine_factory):
    engine = tiny_engine_factory("none")
    tokens = list(range(100, 137))
    engine.cache.prepare(7, tokens)
    engine.step([7], [tokens])
    stats = engine.cache.stats(7)
    assert (stats.bytes_allocated, stats.bytes_used, stats.tokens) == (0, 0, 37)
    assert stats.bytes_theoretical == formula(engine, 4) * 37
    assert engine.cache.tokens_held(7) == 0


def test_contiguous_reserves_the_whole_context_and_uses_the_formula_for_live_tokens(tiny_engine_factory):
    engine = tiny_engine_factory("contiguous", max_context=256)
    hold(engine, LENGTHS)
    stats = engine.kv_stats()
    assert stats.bytes_allocated == len(LENGTHS) * 256 * formula(engine, 4)
    assert stats.bytes_used == formula(engine, 4) * sum(LENGTHS.values())
    engine.cache.release(3)
    assert engine.kv_stats().bytes_allocated == 2 * 256 * formula(engine, 4)
    assert engine.kv_stats().bytes_used == formula(engine, 4) * (LENGTHS[1] + LENGTHS[2])


@pytest.mark.parametrize("block_size", [1, 8, 16, 64])
def test_paged_uses_the_formula_plus_at_most_one_partly_filled_block_per_sequence(tiny_engine_factory,
                                                                                block_size):
    engine = tiny_engine_factory("paged", block_size, max_context=256)
    hold(engine, LENGTHS)
    stats = engine.kv_stats()
    live = formula(engine, 4) * sum(LENGTHS.values())
    assert live <= stats.bytes_used < live + len(LENGTHS) * block_size * formula(engine, 4)
    assert stats.bytes_used == stats.num_blocks_used * block_size * formula(engine, 4)
    assert stats.num_blocks_used == sum(-(-n // block_size) for n in LENGTHS.values())


def test_paged_allocates_its_pool_as_it_grows_and_gives_trailing_free_chunks_back_on_release(tiny_engine_factory):
    engine = tiny_engine_factory("paged", BS, max_context=256, pool_tokens=320)
    per_block = BS * formula(engine, 4)
    before = engine.kv_stats()
    assert (before.num_blocks, before.bytes_allocated, before.bytes_used) == (0, 0, 0)
    assert (before.num_blocks_budget, before.bytes_budget) == (20, 320 * formula(engine, 4))
    hold(engine, LENGTHS)  # 1 + 1 + 3 blocks: chunks of 4 and 4 blocks (64 tokens each)
    held = engine.kv_stats()
    assert (held.num_blocks, held.num_blocks_used, held.bytes_allocated) == (8, 5, 8 * per_block)
    for seq_id in LENGTHS:
        engine.cache.release(seq_id)
    after = engine.kv_stats()
    assert (after.bytes_used, after.num_blocks_used) == (0, 0)
    # the full blocks stay in the prefix cache, so their chunk stays; the last chunk held only free blocks
    assert (after.num_blocks, after.num_blocks_cached, after.bytes_allocated) == (4, 3, 4 * per_block)
    assert after.num_blocks_free + after.num_blocks_cached == after.num_blocks


def test_paged_counts_a_shared_prefix_block_once(tiny_engine_factory):
    engine = tiny_engine_factory("paged", BS, max_context=256)
    prompt = list(range(500, 540))  # two full blocks and 8 tokens
    engine.cache.prepare(1, prompt)
    engine.step([1], [prompt])
    assert engine.cache.prepare(2, prompt + [7, 8, 9]) == 32  # the two full blocks come from the cache
    engine.step([2], [(prompt + [7, 8, 9])[32:]])
    stats = engine.kv_stats()
    assert stats.num_blocks_used == 3 + 1  # two shared, one partial block each
    assert stats.bytes_used == 4 * BS * formula(engine, 4) < formula(engine, 4) * (40 + 43)


def test_block_counts_and_states_add_up(tiny_engine_factory):
    engine = tiny_engine_factory("paged", BS, max_context=256)
    hold(engine, LENGTHS)
    stats = engine.cache.stats(3)
    assert stats.num_blocks_used + stats.num_blocks_free + stats.num_blocks_cached == stats.num_blocks
    assert len(stats.block_states) == stats.num_blocks
    assert stats.block_states.count(BLOCK_OWN) == 3  # sequence 3 holds 37 tokens in three blocks
    assert stats.tokens == 37


def test_a_sequences_map_shows_its_blocks_as_its_own_the_others_in_use_as_others_and_the_rest_free_or_cached(
        tiny_engine_factory):
    engine = tiny_engine_factory("paged", BS, max_context=256)
    hold(engine, LENGTHS)
    engine.cache.release(2)  # its full blocks stay in the prefix cache
    pool, own = engine.cache.pool, set(engine.cache.seqs[3].blocks)
    expected = [BLOCK_OWN if b in own else BLOCK_OTHER if pool.refcount(b) else BLOCK_CACHED if pool.is_cached(b)
                else BLOCK_FREE for b in range(pool.num_blocks)]
    states = engine.cache.stats(3).block_states
    assert list(states) == expected
    assert {BLOCK_OWN, BLOCK_OTHER, BLOCK_CACHED, BLOCK_FREE} <= set(states)


def test_paged_int8_counts_its_scales_and_is_smaller_than_paged(tiny_engine_factory, tiny_config):
    paged = tiny_engine_factory("paged", BS, max_context=256)
    int8 = tiny_engine_factory("paged-int8", BS, max_context=256)
    for engine in (paged, int8):
        hold(engine, LENGTHS)
    p, q = paged.kv_stats(), int8.kv_stats()
    assert q.num_blocks == p.num_blocks and q.num_blocks_used == p.num_blocks_used
    c = tiny_config
    scales_per_block = 2 * c.num_layers * c.num_kv_heads * (c.head_dim + BS)  # float16: keys per channel,
    int8_block = BS * formula(int8, 1) + scales_per_block                      # values per token
    assert q.bytes_allocated >= q.num_blocks * int8_block  # plus the full-precision windows and scratch
    assert q.bytes_used >= q.num_blocks_used * int8_block
    assert q.bytes_budget == q.num_blocks_budget * int8_block < p.bytes_budget
    assert q.bytes_used < p.bytes_used
    assert q.bytes_theoretical == int(bytes_per_token(c, "int8", BS) * sum(LENGTHS.values()))
    assert q.bytes_theoretical < p.bytes_theoretical // 3  # int8 and its scales: about a quarter of float32


@pytest.mark.parametrize("cache", ["none", "contiguous", "paged", "paged-int8"])
def test_every_step_event_reports_the_figures_for_its_position(tiny_engine_factory, cache):
    engine = tiny_engine_factory(cache, BS)
    conv = engine.new_conversation()
    turn = run_turn(engine, conv, "Hello there", greedy(20))
    for ev in turn.steps:
        assert ev.kv.tokens == ev.pos + 1
        assert ev.kv.bytes_theoretical == int(per_token(engine, ev.kv) * (ev.pos + 1))
        assert ev.kv.strategy == ev.strategy == cache
    assert [ev.pos for ev in turn.decode] == list(range(turn.prefill[-1].pos + 1, turn.steps[-1].pos + 1))
