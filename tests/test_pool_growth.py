"""A paged pool starts empty and grows with its sequences, in chunks, up to a budget; growth never moves a held
block, a sequence spread over chunks attends exactly as over one tensor, and trailing free chunks go back; a
server's pool is held whole from the start instead."""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch.overrides import TorchFunctionMode

from engine import hugepages
from engine.config import ConfigError, EngineConfig
from engine.kv import quant
from engine.kv.base import KVCacheFull, StepView
from engine.kv.chunks import ChunkLayout
from engine.kv.paged import PagedCache
from engine.kv.paged_quant import PagedInt8Cache, PagedQuantCache
from tests.engine_helpers import greedy, one_torch_thread, run_turn

BS = 16
PAGED = ["paged", "paged-int8"]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_torch_thread():
        yield


def distinct(seq_id: int, n: int, start: int = 0) -> list[int]:
    """n token ids no other sequence of the test uses (so no prefix is shared by accident)."""
    return [1000 * seq_id + i for i in range(start, start + n)]


def feed(engine, seq_id: int, tokens: list[int], all_logits: bool = False) -> torch.Tensor:
    """Run the tokens as one step of the sequence (prepare on its first step): its logits."""
    if engine.cache.tokens_held(seq_id) == 0:
        engine.cache.prepare(seq_id, tokens)
    return engine.step([seq_id], [tokens], all_logits=all_logits)[0]


def single_tensor_pool(engine, strategy: str, pool_tokens: int) -> None:
    """Give the engine a pool of the same budget that is one chunk from its first block: a single tensor."""
    cls = PagedCache if strategy == "paged" else PagedInt8Cache
    engine.cache = cls(engine.model_config, engine.dtype, engine.device, engine.max_context, block_size=BS,
                       pool_tokens=pool_tokens, first_chunk_tokens=pool_tokens)


# ---- the layout ----------------------------------------------------------------------------------------


def test_chunks_double_the_pool_up_to_the_chunk_cap_and_the_last_is_clipped_to_the_budget():
    layout = ChunkLayout(block_size=BS, max_blocks=100, first_chunk_blocks=4, max_chunk_blocks=16)
    while layout.next_chunk_blocks():
        layout.add_chunk()
    assert layout.sizes == [4, 4, 8, 16, 16, 16, 16, 16, 4]
    assert layout.starts == [0, 4, 8, 16, 32, 48, 64, 80, 96]
    assert layout.num_blocks == 100
    with pytest.raises(ValueError, match="budget of 100 blocks"):
        layout.add_chunk()
    assert layout.locate(37) == (4, 5)
    assert layout.remove_last_chunk() == 4 and layout.num_blocks == 96 and layout.next_chunk_blocks() == 4


def test_a_sequence_is_read_as_one_slice_per_chunk_when_its_blocks_there_are_consecutive():
    layout = ChunkLayout(block_size=4, max_blocks=16, first_chunk_blocks=4, max_chunk_blocks=16)
    layout.add_chunk(), layout.add_chunk(), layout.add_chunk()  # blocks 0-3 | 4-7 | 8-15
    table = [1, 2, 3, 4, 5, 9, 8]  # 27 tokens: the last block holds 3
    pieces = layout.pieces(table, 27)
    assert [(p.chunk, p.indices) for p in pieces] == [(0, [0, 1, 2]), (1, [3, 4]), (2, [5, 6])]
    assert pieces[0].slots == slice(4, 16) and pieces[1].slots == slice(0, 8)
    assert pieces[2].slots == [4, 5, 6, 7, 0, 1, 2]  # blocks 9 then 8 (its 3 tokens): gathered, in order
    assert layout.key_positions(pieces, 27) is None  # piece order is position order
    out_of_order = layout.pieces([8, 0, 9], 12)
    assert [p.chunk for p in out_of_order] == [2, 0]
    assert layout.key_positions(out_of_order, 12) == [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7]


# ---- growth ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", PAGED)
def test_a_pool_starts_empty_and_grows_in_chunks_as_its_sequences_need_blocks(tiny_engine_factory, strategy):
    engine = tiny_engine_factory(strategy, BS, max_context=1024)
    cache, per_block = engine.cache, engine.cache.bytes_per_block()
    assert (engine.kv_stats().num_blocks, cache.storage_tensors()) == (0, [])
    assert engine.kv_stats().num_blocks_budget == 64  # one context: 1024 tokens
    feed(engine, 1, distinct(1, 50))  # 4 blocks: the first chunk (64 tokens)
    assert cache.layout.sizes == [4]
    feed(engine, 1, distinct(1, 950, start=50))  # 1,000 tokens, 63 blocks
    assert cache.layout.sizes == [4, 4, 8, 16, 32]  # the pool doubled until the blocks fit
    pool_bytes = sum(t.nbytes for t in cache.storage_tensors())
    assert pool_bytes == 64 * per_block == engine.kv_stats().bytes_budget


@pytest.mark.parametrize("strategy", PAGED)
def test_growth_moves_no_block_a_sequence_holds(tiny_engine_factory, strategy):
    engine = tiny_engine_factory(strategy, BS, max_context=1024)
    feed(engine, 1, distinct(1, 40))
    cache = engine.cache
    table, num_chunks = list(cache.seqs[1].blocks), len(cache.chunks)
    plan = cache.read_plan(table, 40)

    def held_keys_values() -> list[torch.Tensor]:
        layers = range(engine.model_config.num_layers)
        return [t.clone() for layer in layers for piece in plan.pieces for t in cache.read_piece(layer, piece)]

    before = held_keys_values()
    feed(engine, 2, distinct(2, 600))  # grows the pool by several chunks
    assert len(cache.chunks) > num_chunks
    assert cache.seqs[1].blocks == table
    assert all(torch.equal(a, b) for a, b in zip(before, held_keys_values()))
    alone = tiny_engine_factory(strategy, BS, max_context=1024)
    feed(alone, 1, distinct(1, 40))
    torch.testing.assert_close(feed(engine, 1, [7]), feed(alone, 1, [7]), atol=1e-5, rtol=1e-5)


def same_step(a: tuple, b: tuple) -> bool:
    """Two flattened steps name the same tensors (by identity) and the same numbers, in the same order."""
    return all(len(x) == len(y) and all(p is q if isinstance(p, torch.Tensor) else p == q for p, q in zip(x, y))
               for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "int8", "int4"])
def test_a_step_flattened_from_the_pools_layer_groups_names_what_each_layers_fused_kv_names(tiny_engine_factory,
                                                                                            kv_dtype):
    engine = tiny_engine_factory("paged", BS, max_context=1024, kv_dtype=kv_dtype)
    cache, layers = engine.cache, engine.model_config.num_layers

    def check(seq_ids: list[int]) -> None:
        view = cache.begin_step(seq_ids, [[7]] * len(seq_ids))
        assert same_step(view.fused_step(layers), StepView.fused_step(view, layers))
        cache.commit_step(view)

    feed(engine, 1, distinct(1, 40))
    check([1])
    short = range(10, 16)
    for seq_id in short:  # one partly filled block each: the pool grows by two chunks, the groups are made again
        feed(engine, seq_id, distinct(seq_id, 10))
    assert cache.layout.sizes == [4, 4, 8]
    check([1, *short])
    for seq_id in short:  # and again when the chunks go back
        cache.release(seq_id)
    assert cache.layout.sizes == [4]
    check([1])


@pytest.mark.parametrize("strategy", PAGED)
def test_a_sequence_over_many_chunks_decodes_like_one_in_a_single_tensor_pool(tiny_engine_factory, strategy):
    grown, single = (tiny_engine_factory(strategy, BS, max_context=1024) for _ in range(2))
    single_tensor_pool(single, strategy, 1024)
    prompt = distinct(1, 300)
    for engine in (grown, single):
        for start in range(0, 300, 50):  # prefill steps of 50 tokens over more and more chunks
            feed(engine, 1, prompt[start:start + 50])
    assert grown.cache.layout.sizes == [4, 4, 8, 16] and single.cache.layout.sizes == [64]
    for token in distinct(2, 20):
        torch.testing.assert_close(feed(grown, 1, [token]), feed(single, 1, [token]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("strategy", PAGED)
def test_a_sequence_whose_blocks_are_out_of_order_across_chunks_attends_in_position_order(tiny_engine_factory,
                                                                                          strategy):
    engine = tiny_engine_factory(strategy, BS, max_context=1024, pool_tokens=128)  # chunks of 4 and 4 blocks
    reference = tiny_engine_factory(strategy, BS, max_context=1024)
    steps = [distinct(1, 32), distinct(1, 64, start=32), distinct(1, 16, start=96)]
    feed(engine, 1, steps[0])  # blocks 0, 1
    feed(engine, 2, distinct(2, 32))  # blocks 2, 3
    feed(engine, 1, steps[1])  # blocks 4-7: a new chunk
    engine.cache.release(2)  # blocks 2 and 3 are cached; the budget is reached
    got = feed(engine, 1, steps[2], all_logits=True)  # evicts block 2: table 0 1 4 5 6 7 2
    cache = engine.cache
    assert cache.seqs[1].blocks == [0, 1, 4, 5, 6, 7, 2]
    assert cache.layout.key_positions(cache.layout.pieces(cache.seqs[1].blocks, 112), 112) is not None
    for tokens in steps[:2]:
        feed(reference, 1, tokens)
    expected = feed(reference, 1, steps[2], all_logits=True)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    for token in distinct(3, 5):
        torch.testing.assert_close(feed(engine, 1, [token]), feed(reference, 1, [token]), atol=1e-5, rtol=1e-5)


def test_the_pool_grows_before_it_evicts_the_prefix_cache(tiny_engine_factory):
    engine = tiny_engine_factory("paged", BS, max_context=1024)
    prompt = distinct(1, 40)
    feed(engine, 1, prompt)
    engine.cache.release(1)  # two full blocks cached
    feed(engine, 2, distinct(2, 100))  # 7 blocks: the pool grows rather than evicting the cached two
    assert engine.kv_stats().num_blocks_cached == 2
    assert engine.cache.prepare(3, prompt + [5, 6]) == 32


# ---- the budget -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", PAGED)
def test_reaching_the_budget_raises_kv_cache_full_and_changes_nothing(tiny_engine_factory, strategy):
    engine = tiny_engine_factory(strategy, BS, max_context=1024, pool_tokens=128)
    feed(engine, 1, distinct(1, 120))  # 8 blocks: the whole budget
    engine.cache.prepare(2, distinct(2, 20))
    before = engine.kv_stats()
    with pytest.raises(KVCacheFull, match="KV budget is reached: 2 blocks needed, 0 free and 0 cached of 8"):
        engine.step([2], [distinct(2, 20)])
    assert engine.kv_stats() == before
    engine.cache.release(1)  # 7 cached blocks and a free one: now the budget holds the new sequence
    feed(engine, 2, distinct(2, 20))
    assert engine.kv_stats().num_blocks == 8


def test_the_kv_budget_in_mib_sets_the_most_the_pool_grows_to(tiny_engine_factory, tiny_config):
    per_block = BS * tiny_config.kv_bytes_per_token(4)  # 8 KiB on the tiny float32 model
    engine = tiny_engine_factory("paged", BS, max_context=1024, kv_budget_mib=0.05)  # 52,428 bytes
    stats = engine.kv_stats()
    assert (stats.num_blocks_budget, stats.bytes_budget, stats.bytes_allocated) == (6, 6 * per_block, 0)
    engine.set_kv_budget(None)
    assert engine.kv_stats().num_blocks_budget == 64 and engine.config.kv_budget_mib is None
    with pytest.raises(ConfigError, match="holds no block"):
        engine.set_kv_budget(0.001)
    assert engine.config.kv_budget_mib is None and engine.kv_stats().num_blocks_budget == 64
    for bad in (0, -1.0):
        with pytest.raises(ConfigError, match="positive number of MiB"):
            EngineConfig(kv_budget_mib=bad)


def test_a_chunk_on_huge_pages_is_made_ahead_and_joins_the_pool_when_it_grows(tiny_config):
    """The default model's shapes in bfloat16: chunks of 128 tokens and more take huge pages, whose first write is
    slow; the next one is made (and its pages written) on a background thread once the free blocks run low, counted
    as allocated from then on, and the growth that needs it takes that very tensor."""
    if not hugepages.available():
        pytest.skip("this Linux gives no huge pages: chunks fault a small page at a time")
    shapes = dataclasses.replace(tiny_config, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64)
    cache = PagedCache(shapes, torch.bfloat16, "cpu", 8192, block_size=BS)
    per_block = cache.bytes_per_block()
    cache.make_room(4)
    held = cache.pool.allocate(4)  # the first chunk, 64 tokens (1.5 MiB): small pages, nothing made ahead
    assert cache._next_chunk is None and cache.bytes_allocated() == 4 * per_block
    cache.make_room(1)  # no free block left: the next chunk (4 blocks) is wanted now, so it grows...
    held += cache.pool.allocate(1)
    assert cache.layout.sizes == [4, 4] and cache._next_chunk is None  # ...and its 2.9 MiB start on huge pages
    for _ in range(2):  # while a free block is left beyond the one wanted, nothing is made ahead
        cache.make_room(1)
        assert cache._next_chunk is None
        held += cache.pool.allocate(1)
    cache.make_room(1)  # the last free block wanted: the next chunk (8 blocks) is made now
    blocks, made = cache._next_chunk
    assert blocks == 8 and cache.bytes_allocated() == 16 * per_block
    held += cache.pool.allocate(1)
    ahead = made.result()
    cache.make_room(1)
    assert cache.layout.sizes == [4, 4, 8] and cache.chunks[-1] is ahead and cache.bytes_allocated() == 16 * per_block
    assert all(t.count_nonzero() == 0 for t in ahead)
    cache.pool.free(held)
    cache.give_back()
    assert cache._next_chunk is None and cache.chunks == []


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_a_chunk_made_ahead_runs_no_torch_operation_on_the_background_thread(tiny_config, monkeypatch, codec):
    """The background thread only writes the pages: a torch operation there (a quantized pool's scales zeroed in
    parallel) started a second OpenMP team on a thread that stays, and then libgomp stopped spinning between parallel
    regions in the whole process (more threads than cores): llama.cpp, on the same OpenMP in `bench`, took 2.4x as
    long a step at two threads from then on, and so would torch's own parallel operations."""
    if not hugepages.available():
        pytest.skip("this Linux gives no huge pages: chunks fault a small page at a time")
    calls = []

    class Recording(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            calls.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    background = ThreadPoolExecutor(1, initializer=lambda: Recording().__enter__())  # the mode stays on its thread
    monkeypatch.setattr(hugepages, "_FAULTING", background)
    shapes = dataclasses.replace(tiny_config, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64)
    cache = PagedQuantCache(shapes, torch.float32, "cpu", 8192, block_size=BS, codec=quant.CODECS[codec])
    held = []
    while cache._next_chunk is None:
        cache.make_room(1)
        held += cache.pool.allocate(1)
    blocks, made = cache._next_chunk
    ahead = made.result()

    assert calls == []
    assert [t.shape for t in ahead] == [t.shape for t in cache._chunk_tensors(blocks, "cpu")]
    assert all(t.count_nonzero() == 0 for t in ahead)
    cache.pool.free(held)
    background.shutdown()


# ---- what a chat sees -----------------------------------------------------------------------------------


def test_a_short_chat_allocates_at_most_twice_what_it_uses_while_contiguous_reserves_the_context(
        tiny_engine_factory):
    paged = tiny_engine_factory("paged", BS, max_context=1024)
    turn = run_turn(paged, paged.new_conversation(), "Hi", greedy(76))
    allocated = [ev.kv.bytes_allocated for ev in turn.steps]
    assert allocated == sorted(allocated) and len(set(allocated)) <= len(paged.cache.layout.sizes)
    last = turn.steps[-1].kv
    assert last.bytes_allocated <= 2 * last.bytes_used
    assert last.bytes_budget == 64 * paged.cache.bytes_per_block() >= 8 * last.bytes_allocated
    contiguous = tiny_engine_factory("contiguous", BS, max_context=1024)
    first = run_turn(contiguous, contiguous.new_conversation(), "Hi", greedy(2)).steps[0].kv
    assert first.bytes_allocated == 1024 * contiguous.model_config.kv_bytes_per_token(4)


@pytest.mark.parametrize("strategy", PAGED)
def test_releasing_gives_back_the_trailing_chunks_whose_blocks_are_all_free(tiny_engine_factory, strategy):
    engine = tiny_engine_factory(strategy, BS, max_context=1024)
    conv = engine.new_conversation()
    run_turn(engine, conv, "Hi", greedy(10))  # under 64 tokens: blocks in the first chunk
    assert engine.cache.layout.sizes == [4]
    short = range(10, 16)
    for seq_id in short:  # six sequences of one partly filled (unhashed) block each
        feed(engine, seq_id, distinct(seq_id, 10))
    assert engine.cache.layout.sizes == [4, 4, 8]
    for seq_id in short:
        engine.cache.release(seq_id)
    assert engine.cache.layout.sizes == [4]  # the two trailing chunks held only free blocks
    assert engine.kv_stats().bytes_allocated >= 4 * engine.cache.bytes_per_block()
    engine.forget(conv)  # its full blocks stay in the prefix cache, so the first chunk stays
    cache = engine.cache
    cache.pool.check_invariants()
    assert (cache.pool.num_used, cache.layout.sizes) == (0, [4])
    assert cache.pool.num_cached >= 1 and not cache.pool.can_give_back(4)
    feed(engine, 20, distinct(20, 100))  # and it grows again
    assert cache.layout.sizes == [4, 4, 8]


# ---- a server's pool: held whole from the start ----------------------------------------------------------------


@pytest.mark.parametrize("strategy", PAGED)
def test_a_reserved_pool_holds_its_whole_budget_from_the_start_and_never_gives_it_back(tiny_engine_factory, strategy):
    engine = tiny_engine_factory(strategy, BS, max_context=1024)
    cache = engine.cache
    held = engine.reserve_kv_pool()
    assert cache.layout.sizes == [4, 4, 8, 16, 32] and cache.layout.next_chunk_blocks() == 0
    assert held == engine.kv_stats().bytes_budget == engine.kv_stats().bytes_allocated
    assert all(t.count_nonzero() == 0 for t in cache.storage_tensors())
    storage = [t.data_ptr() for t in cache.storage_tensors()]
    for seq_id in range(10, 16):  # what made a growing pool grow and give back (the test above)
        feed(engine, seq_id, distinct(seq_id, 10))
    for seq_id in range(10, 16):
        engine.cache.release(seq_id)
    assert cache.give_back() == 0 and [t.data_ptr() for t in cache.storage_tensors()] == storage
    cache.pool.check_invariants()
    assert (cache.pool.num_used, engine.kv_stats().bytes_allocated) == (0, held)


@pytest.mark.parametrize("strategy", PAGED)
def test_a_reserved_pool_decodes_the_bits_a_growing_pool_decodes(tiny_engine_factory, strategy):
    grown, reserved = (tiny_engine_factory(strategy, BS, max_context=1024) for _ in range(2))
    reserved.reserve_kv_pool()
    prompt = distinct(1, 300)
    for engine in (grown, reserved):
        for start in range(0, 300, 50):
            feed(engine, 1, prompt[start:start + 50])
    for token in distinct(2, 20):
        assert torch.equal(feed(grown, 1, [token]), feed(reserved, 1, [token]))


@pytest.mark.parametrize("strategy", PAGED)
def test_reserving_a_pool_that_holds_sequences_keeps_what_they_hold(tiny_engine_factory, strategy):
    grown, reserved = (tiny_engine_factory(strategy, BS, max_context=1024) for _ in range(2))
    for engine in (grown, reserved):
        feed(engine, 1, distinct(1, 100))
        feed(engine, 2, distinct(2, 2 * BS))
        engine.cache.release(2)  # its full blocks stay cached, their keys and values with them
    reserved.reserve_kv_pool()
    assert reserved.cache.layout.next_chunk_blocks() == 0
    for token in distinct(3, 10):
        assert torch.equal(feed(grown, 1, [token]), feed(reserved, 1, [token]))
    for engine in (grown, reserved):
        assert engine.cache.prepare(4, distinct(2, 2 * BS) + [7]) == 2 * BS  # the cached blocks found again
    assert torch.equal(feed(grown, 4, [7]), feed(reserved, 4, [7]))


@pytest.mark.parametrize("strategy", PAGED)
def test_a_pool_reserved_up_to_a_limit_holds_the_chunks_that_fit_and_grows_past_them_as_before(tiny_engine_factory,
                                                                                                 strategy):
    engine = tiny_engine_factory(strategy, BS, max_context=1024)
    cache, per_block = engine.cache, engine.cache.bytes_per_block()
    assert engine.reserve_kv_pool(max_bytes=20 * per_block) == 16 * per_block  # 4 + 4 + 8 blocks; 16 more would not fit
    assert cache.layout.sizes == [4, 4, 8]
    short = range(10, 30)
    for seq_id in short:  # twenty sequences of one partly filled (unhashed) block each: past what the pool holds
        feed(engine, seq_id, distinct(seq_id, 10))
    assert cache.layout.sizes == [4, 4, 8, 16]
    for seq_id in short:
        cache.release(seq_id)
    assert cache.layout.sizes == [4, 4, 8]  # the grown chunk goes back, the held ones stay, all their blocks free
    cache.pool.check_invariants()
    assert cache.pool.num_free == 16 and cache.give_back() == 0


def test_a_cache_that_is_not_a_pool_holds_nothing_more(tiny_engine_factory):
    engine = tiny_engine_factory("contiguous", BS, max_context=1024)
    assert engine.reserve_kv_pool() == 0 and engine.kv_stats().bytes_allocated == 0
