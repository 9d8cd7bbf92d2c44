"""BlockPool: the free list, reference counts and prefix-hash map of a paged KV cache."""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from engine.kv.base import BLOCK_CACHED, BLOCK_FREE, BLOCK_OWN, KVCacheFull
from engine.kv.block_pool import BlockPool, PoolExhausted

BS = 4  # block size used by the unit tests


def tokens(start: int, block_size: int = BS) -> list[int]:
    return list(range(start, start + block_size))


def snapshot(pool: BlockPool, known: list[tuple[int, list[int]]] = ()) -> tuple:
    """Everything observable about the pool, plus the result of looking up each (hash, tokens) in known."""
    blocks = range(pool.num_blocks)
    return (
        pool.states(),
        [pool.refcount(b) for b in blocks],
        [pool.block_hash_of(b) for b in blocks],
        (pool.num_free, pool.num_cached, pool.num_used),
        [pool.lookup(h, toks) for h, toks in known],
    )


def register_chain(pool: BlockPool, blocks: list[int], first_token: int = 0) -> list[tuple[int, list[int]]]:
    """Register blocks as consecutive full blocks of one prompt; returns the (hash, tokens) of each."""
    chain, parent = [], None
    for i, block in enumerate(blocks):
        toks = tokens(first_token + i * pool.block_size, pool.block_size)
        parent = BlockPool.chain_hash(parent, toks)
        assert pool.register(block, parent, toks)
        chain.append((parent, toks))
    return chain


# ---- construction and counts ----------------------------------------------------------------------------


def test_a_fresh_pool_has_every_block_free():
    pool = BlockPool(num_blocks=5, block_size=BS)
    assert (pool.num_blocks, pool.block_size) == (5, BS)
    assert (pool.num_free, pool.num_cached, pool.num_used) == (5, 0, 0)
    assert pool.states() == [BLOCK_FREE] * 5
    pool.check_invariants()


@pytest.mark.parametrize("num_blocks, block_size", [(4, 0), (-1, 4)])
def test_a_pool_needs_a_block_size_of_at_least_one_token_and_no_negative_count(num_blocks, block_size):
    with pytest.raises(ValueError):
        BlockPool(num_blocks, block_size)


def test_a_pool_may_start_empty_and_then_has_nothing_to_allocate():
    pool = BlockPool(0, BS)
    assert (pool.num_blocks, pool.num_free, pool.num_cached, pool.num_used) == (0, 0, 0, 0)
    assert pool.allocate(0) == [] and not pool.can_allocate(1)
    with pytest.raises(PoolExhausted):
        pool.allocate(1)
    pool.check_invariants()


def test_pool_exhausted_is_a_kv_cache_full_error():
    assert issubclass(PoolExhausted, KVCacheFull)


# ---- allocation -------------------------------------------------------------------------------------------


def test_allocation_hands_out_the_lowest_ids_first_in_a_fresh_pool():
    pool = BlockPool(6, BS)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(3) == [2, 3, 4]
    assert (pool.num_free, pool.num_cached, pool.num_used) == (1, 0, 5)
    assert [pool.refcount(b) for b in range(6)] == [1, 1, 1, 1, 1, 0]
    assert pool.states() == [BLOCK_OWN] * 5 + [BLOCK_FREE]
    pool.check_invariants()


def test_allocating_zero_blocks_returns_nothing_and_a_negative_count_is_an_error():
    pool = BlockPool(2, BS)
    assert pool.allocate(0) == []
    with pytest.raises(ValueError):
        pool.allocate(-1)
    assert pool.num_free == 2


def test_freed_blocks_go_to_the_back_of_the_free_list():
    pool = BlockPool(4, BS)
    a, b, c, d = pool.allocate(4)
    pool.free([c, a])
    assert (pool.num_free, pool.num_used) == (2, 2)
    pool.free([d])
    assert pool.allocate(3) == [c, a, d]
    pool.check_invariants()


def test_can_allocate_counts_free_and_cached_blocks():
    pool = BlockPool(4, BS)
    blocks = pool.allocate(3)
    register_chain(pool, blocks[:1])
    pool.free(blocks)  # one cached, two free, plus the one never allocated
    assert (pool.num_free, pool.num_cached, pool.num_used) == (3, 1, 0)
    assert pool.can_allocate(4)
    assert not pool.can_allocate(5)


def test_exhaustion_raises_pool_exhausted_naming_the_counts_and_changes_nothing():
    pool = BlockPool(5, BS)
    blocks = pool.allocate(4)
    chain = register_chain(pool, blocks[:2])
    pool.free(blocks[:1])  # block 0 cached; block 4 free
    before = snapshot(pool, chain)
    with pytest.raises(PoolExhausted, match=r"cannot allocate 3 blocks: only 1 free and 1 cached"):
        pool.allocate(3)
    assert snapshot(pool, chain) == before
    pool.check_invariants()


# ---- sharing and freeing ----------------------------------------------------------------------------------


def test_sharing_a_used_block_adds_a_reference_and_each_free_drops_one():
    pool = BlockPool(3, BS)
    (block,) = pool.allocate(1)
    pool.share(block)
    pool.share(block)
    assert pool.refcount(block) == 3
    pool.free([block])
    assert (pool.refcount(block), pool.num_used, pool.num_free) == (2, 1, 2)
    pool.free([block, block])
    assert (pool.refcount(block), pool.num_used, pool.num_free) == (0, 0, 3)
    pool.check_invariants()


def test_sharing_a_free_unhashed_block_is_an_error():
    pool = BlockPool(3, BS)
    with pytest.raises(ValueError):
        pool.share(1)
    assert pool.refcount(1) == 0


def test_sharing_a_cached_block_takes_it_out_of_the_cache():
    pool = BlockPool(3, BS)
    (block,) = pool.allocate(1)
    [(h, toks)] = register_chain(pool, [block])
    pool.free([block])
    assert pool.is_cached(block) and pool.num_cached == 1
    pool.share(block)
    assert (pool.refcount(block), pool.num_cached, pool.num_used) == (1, 0, 1)
    assert not pool.is_cached(block)
    assert pool.block_hash_of(block) == h and pool.lookup(h, toks) == block
    pool.check_invariants()


def test_freeing_a_block_twice_raises_and_changes_nothing():
    pool = BlockPool(3, BS)
    a, b = pool.allocate(2)
    pool.free([a])
    before = snapshot(pool)
    with pytest.raises(ValueError):
        pool.free([b, a])  # b is valid, a is already free: neither changes
    with pytest.raises(ValueError):
        pool.free([b, b])  # b has one reference, freed twice in one call
    assert snapshot(pool) == before
    pool.check_invariants()


def test_freeing_a_cached_block_again_is_an_error():
    pool = BlockPool(2, BS)
    (block,) = pool.allocate(1)
    register_chain(pool, [block])
    pool.free([block])
    before = snapshot(pool)
    with pytest.raises(ValueError):
        pool.free([block])
    assert snapshot(pool) == before


@pytest.mark.parametrize("block", [-1, 3, 100])
def test_out_of_range_block_ids_are_errors_everywhere(block):
    pool = BlockPool(3, BS)
    pool.allocate(1)
    for call in (pool.share, pool.forget, pool.refcount, pool.block_hash_of, pool.is_cached):
        with pytest.raises(ValueError):
            call(block)
    with pytest.raises(ValueError):
        pool.free([0, block])
    with pytest.raises(ValueError):
        pool.register(block, 123, tokens(0))
    assert pool.refcount(0) == 1


# ---- growth and give-back ---------------------------------------------------------------------------------


def test_growing_adds_free_blocks_with_the_next_ids_at_the_back_of_the_free_list():
    pool = BlockPool(2, BS)
    a, b = pool.allocate(2)
    pool.free([a])
    assert pool.grow(3) == range(2, 5)
    assert (pool.num_blocks, pool.num_free, pool.num_used) == (5, 4, 1)
    assert pool.allocate(4) == [a, 2, 3, 4]  # the block freed before the growth comes first
    pool.check_invariants()


def test_growing_changes_no_held_block_and_no_cached_block():
    pool = BlockPool(3, BS)
    a, b, c = pool.allocate(3)
    chain = register_chain(pool, [a, b])
    pool.share(b)
    pool.free([a])
    before = [(pool.refcount(x), pool.block_hash_of(x)) for x in (a, b, c)]
    pool.grow(5)
    assert [(pool.refcount(x), pool.block_hash_of(x)) for x in (a, b, c)] == before
    assert [pool.lookup(h, toks) for h, toks in chain] == [a, b]
    assert pool.is_cached(a) and pool.num_free == 5
    pool.check_invariants()


def test_growing_by_less_than_one_block_is_an_error():
    pool = BlockPool(1, BS)
    for n in (0, -1):
        with pytest.raises(ValueError):
            pool.grow(n)
    assert pool.num_blocks == 1


def test_giving_back_removes_trailing_free_blocks_and_keeps_the_free_list_order():
    pool = BlockPool(6, BS)
    blocks = pool.allocate(6)
    pool.free([blocks[5], blocks[1], blocks[4]])
    assert pool.can_give_back(2) and not pool.can_give_back(3)
    pool.give_back(2)
    assert (pool.num_blocks, pool.num_free, pool.num_used) == (4, 1, 3)
    assert pool.states() == [BLOCK_OWN, BLOCK_FREE, BLOCK_OWN, BLOCK_OWN]
    assert pool.allocate(1) == [1]
    pool.check_invariants()


def test_giving_back_a_used_or_cached_block_raises_and_changes_nothing():
    pool = BlockPool(4, BS)
    a, b, c, d = pool.allocate(4)
    register_chain(pool, [c])
    pool.free([c, d])  # c cached, d free; a and b in use
    before = snapshot(pool)
    with pytest.raises(ValueError, match="block 2 is cached"):
        pool.give_back(2)
    with pytest.raises(ValueError, match="block 1 is in use"):
        pool.give_back(3)
    for n in (-1, 5):
        with pytest.raises(ValueError):
            pool.give_back(n)
        assert not pool.can_give_back(n)
    assert snapshot(pool) == before
    pool.give_back(1)
    assert pool.num_blocks == 3 and pool.is_cached(c)
    pool.check_invariants()


def test_a_pool_can_give_back_everything_and_grow_again():
    pool = BlockPool(3, BS)
    pool.free(pool.allocate(3))
    pool.give_back(3)
    assert (pool.num_blocks, pool.num_free) == (0, 0)
    pool.grow(2)
    assert pool.allocate(2) == [0, 1]
    pool.check_invariants()


# ---- prefix caching ---------------------------------------------------------------------------------------


def test_a_registered_block_is_found_by_its_hash_and_tokens():
    pool = BlockPool(4, BS)
    blocks = pool.allocate(2)
    chain = register_chain(pool, blocks)
    assert [pool.lookup(h, toks) for h, toks in chain] == blocks
    assert [pool.block_hash_of(b) for b in blocks] == [h for h, _ in chain]
    assert pool.num_used == 2  # registering does not change references
    pool.check_invariants()


def test_lookup_verifies_the_token_ids_so_the_same_hash_with_other_tokens_misses():
    pool = BlockPool(2, BS)
    (block,) = pool.allocate(1)
    [(h, toks)] = register_chain(pool, [block])
    assert pool.lookup(h, toks) == block
    assert pool.lookup(h, [t + 1 for t in toks]) is None
    assert pool.lookup(h + 1, toks) is None


def test_lookup_changes_neither_references_nor_lru_order():
    pool = BlockPool(3, BS)
    a, b = pool.allocate(2)
    (ha, ta), (hb, tb) = register_chain(pool, [a, b])
    pool.free([a, b])
    before = snapshot(pool)
    assert pool.lookup(ha, ta) == a
    assert snapshot(pool) == before
    assert pool.allocate(2)[1] == a  # the free block, then a: still the least recently used


def test_register_refuses_a_hash_already_held_by_another_block():
    pool = BlockPool(3, BS)
    a, b = pool.allocate(2)
    [(h, toks)] = register_chain(pool, [a])
    assert pool.register(b, h, toks) is False
    assert pool.block_hash_of(b) is None and pool.lookup(h, toks) == a
    pool.check_invariants()


def test_register_refuses_a_block_that_already_has_a_hash():
    pool = BlockPool(3, BS)
    (a,) = pool.allocate(1)
    [(h, toks)] = register_chain(pool, [a])
    other = BlockPool.chain_hash(None, tokens(100))
    assert pool.register(a, other, tokens(100)) is False
    assert pool.block_hash_of(a) == h and pool.lookup(other, tokens(100)) is None


def test_register_needs_a_used_block_and_exactly_block_size_token_ids():
    pool = BlockPool(3, BS)
    (a,) = pool.allocate(1)
    with pytest.raises(ValueError):
        pool.register(1, 7, tokens(0))  # free
    with pytest.raises(ValueError):
        pool.register(a, 7, tokens(0, BS - 1))  # not full
    with pytest.raises(ValueError):
        pool.register(a, 7, tokens(0, BS + 1))
    assert pool.block_hash_of(a) is None


def test_a_shared_hashed_block_is_cached_only_after_its_last_holder_frees_it():
    pool = BlockPool(2, BS)
    (a,) = pool.allocate(1)
    register_chain(pool, [a])
    pool.share(a)
    pool.free([a])
    assert (pool.refcount(a), pool.num_cached, pool.num_used) == (1, 0, 1)
    pool.free([a])
    assert (pool.refcount(a), pool.num_cached, pool.num_used) == (0, 1, 0)
    assert pool.states() == [BLOCK_CACHED, BLOCK_FREE]


def test_forget_drops_the_hash_so_the_block_is_freed_not_cached():
    pool = BlockPool(2, BS)
    (a,) = pool.allocate(1)
    [(h, toks)] = register_chain(pool, [a])
    pool.forget(a)
    assert pool.block_hash_of(a) is None and pool.lookup(h, toks) is None
    pool.forget(a)  # no hash: nothing to do
    pool.free([a])
    assert (pool.num_free, pool.num_cached) == (2, 0)
    with pytest.raises(ValueError):
        pool.forget(a)  # not in use
    pool.check_invariants()


def test_lru_eviction_takes_free_blocks_first_then_the_least_recently_freed_cached_blocks():
    pool = BlockPool(5, BS)
    a, b, c = pool.allocate(3)
    chain = register_chain(pool, [a, b, c])
    pool.free([a])
    pool.free([b])
    pool.free([c])
    pool.share(b)  # a prefix hit on b: no longer cached
    assert (pool.num_free, pool.num_cached, pool.num_used) == (2, 2, 1)
    assert pool.allocate(2) == [3, 4]  # the free list first
    assert pool.allocate(1) == [a]  # then the least recently used cached block
    assert pool.lookup(*chain[0]) is None and pool.block_hash_of(a) is None
    assert pool.allocate(1) == [c]
    assert pool.lookup(*chain[2]) is None
    assert pool.lookup(*chain[1]) == b  # b was in use, so it kept its hash
    assert [pool.refcount(x) for x in (a, b, c)] == [1, 1, 1]
    assert (pool.num_free, pool.num_cached, pool.num_used) == (0, 0, 5)
    with pytest.raises(PoolExhausted):
        pool.allocate(1)
    pool.check_invariants()


def test_one_allocation_may_mix_free_and_evicted_blocks():
    pool = BlockPool(3, BS)
    a, b = pool.allocate(2)
    register_chain(pool, [a, b])
    pool.free([b, a])  # b least recently used
    assert pool.allocate(3) == [2, b, a]
    assert pool.num_cached == 0 and pool.num_used == 3


# ---- chain_hash -------------------------------------------------------------------------------------------


# fixed values, computed once in another process: the hash must not depend on the process or on
# PYTHONHASHSEED (no salted hash() of str/bytes), so cached prefixes mean the same thing in every run
HASH_OF_1_2_3 = 154956592715776020826302627002659373417
HASH_OF_1_2_3_THEN_4_5 = 51980309345716001557715179954903667171


def test_chain_hash_is_deterministic_and_independent_of_the_sequence_type():
    assert BlockPool.chain_hash(None, [1, 2, 3]) == BlockPool.chain_hash(None, (1, 2, 3)) == HASH_OF_1_2_3
    assert BlockPool.chain_hash(HASH_OF_1_2_3, range(4, 6)) == HASH_OF_1_2_3_THEN_4_5


def test_chain_hash_depends_on_the_parent_and_on_every_token():
    base = BlockPool.chain_hash(None, [1, 2, 3])
    parent = BlockPool.chain_hash(None, [9])
    assert BlockPool.chain_hash(parent, [1, 2, 3]) != base
    assert BlockPool.chain_hash(BlockPool.chain_hash(None, [8]), [1, 2, 3]) != BlockPool.chain_hash(
        parent, [1, 2, 3]
    )
    assert BlockPool.chain_hash(None, [1, 2, 4]) != base
    assert BlockPool.chain_hash(None, [3, 2, 1]) != base
    assert BlockPool.chain_hash(None, [1, 2]) != base
    assert BlockPool.chain_hash(0, [1, 2, 3]) != base  # a parent of 0 is not "no parent"


# ---- a stateful model of sequences sharing blocks ---------------------------------------------------------


@dataclass
class Seq:
    """A sequence's block table; chain[i] = (hash, tokens) of its full block i (len(chain) <= len(blocks)).

    Blocks past the chain are still being written and belong to this sequence alone.
    """

    blocks: list[int] = field(default_factory=list)
    chain: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)


MODEL_BLOCK_SIZE = 2
token_block = st.tuples(*[st.integers(0, 2)] * MODEL_BLOCK_SIZE)  # few values, so prefixes repeat


class BlockPoolMachine(RuleBasedStateMachine):
    """Sequences allocate, grow, fork, hit cached prefixes and finish, against a reference model."""

    @initialize(num_blocks=st.integers(0, 8))
    def make_pool(self, num_blocks):
        self.pool = BlockPool(num_blocks, MODEL_BLOCK_SIZE)
        self.seqs: dict[int, Seq] = {}
        self.next_seq_id = 0
        self.registered: dict[int, tuple[int, tuple[int, ...]]] = {}  # hash -> (block, tokens), as the pool
        self.free_list = deque(range(num_blocks))  # idle unhashed blocks, next to hand out first
        self.lru: OrderedDict[int, None] = OrderedDict()  # idle hashed blocks, least recently used first
        self.prompts: list[list[tuple[int, tuple[int, ...]]]] = []  # chains ever written, for prefix hits

    # -- model helpers

    def expected_refcounts(self) -> list[int]:
        counts = [0] * self.pool.num_blocks
        for seq in self.seqs.values():
            for block in seq.blocks:
                counts[block] += 1
        return counts

    def hashed_blocks(self) -> dict[int, int]:
        return {block: h for h, (block, _) in self.registered.items()}

    def add_seq(self, seq: Seq) -> None:
        self.seqs[self.next_seq_id] = seq
        self.next_seq_id += 1

    def pick_seq(self, data, want=lambda seq: True) -> Seq:
        ids = [i for i, seq in self.seqs.items() if want(seq)]
        return self.seqs[data.draw(st.sampled_from(ids))]

    def allocate_expecting_model(self, n: int) -> list[int] | None:
        """Allocate n blocks and check the pool took the free list in order, then the LRU cached blocks."""
        num_free, num_cached = self.pool.num_free, self.pool.num_cached
        if n > num_free + num_cached:
            self.expect_exhaustion(n)
            return None
        blocks = self.pool.allocate(n)
        num_evicted = max(0, n - num_free)
        expected_evicted = list(self.lru)[:num_evicted]
        expected_free = [self.free_list.popleft() for _ in range(n - num_evicted)]
        assert blocks == expected_free + expected_evicted
        hashed = self.hashed_blocks()
        for block in expected_evicted:
            del self.lru[block]
            del self.registered[hashed[block]]
        return blocks

    def expect_exhaustion(self, n: int) -> None:
        known = [(h, list(toks)) for h, (_, toks) in self.registered.items()]
        before = snapshot(self.pool, known)
        try:
            self.pool.allocate(n)
        except PoolExhausted as error:
            assert f"cannot allocate {n} blocks" in str(error)
        else:
            raise AssertionError(f"allocating {n} blocks should have raised PoolExhausted")
        assert snapshot(self.pool, known) == before

    def free_in_model(self, blocks: list[int]) -> None:
        hashed = self.hashed_blocks()
        remaining = self.expected_refcounts()
        for block in blocks:
            remaining[block] -= 1
            if remaining[block] == 0 and block in hashed:
                self.lru[block] = None
            elif remaining[block] == 0:
                self.free_list.append(block)

    # -- rules

    @rule(k=st.integers(1, 4))
    def start_a_sequence(self, k):
        blocks = self.allocate_expecting_model(k)
        if blocks is not None:
            self.add_seq(Seq(blocks))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def append_a_block(self, data):
        seq = self.pick_seq(data)
        blocks = self.allocate_expecting_model(1)
        if blocks is not None:
            seq.blocks += blocks

    @precondition(lambda self: any(seq.chain for seq in self.seqs.values()))
    @rule(data=st.data())
    def fork_a_sequence_sharing_its_full_blocks(self, data):
        parent = self.pick_seq(data, lambda seq: seq.chain)
        j = data.draw(st.integers(1, len(parent.chain)))
        for block in parent.blocks[:j]:
            self.pool.share(block)
        self.add_seq(Seq(parent.blocks[:j], parent.chain[:j]))

    @precondition(lambda self: any(len(seq.chain) < len(seq.blocks) for seq in self.seqs.values()))
    @rule(data=st.data(), toks=token_block)
    def fill_and_register_the_next_block(self, data, toks):
        seq = self.pick_seq(data, lambda seq: len(seq.chain) < len(seq.blocks))
        block = seq.blocks[len(seq.chain)]
        assert self.pool.block_hash_of(block) is None and self.pool.refcount(block) == 1
        parent_hash = seq.chain[-1][0] if seq.chain else None
        h = BlockPool.chain_hash(parent_hash, toks)
        expected = h not in self.registered  # the same prefix may already sit in another block
        assert self.pool.register(block, h, list(toks)) is expected
        if expected:
            self.registered[h] = (block, toks)
        seq.chain.append((h, toks))
        self.prompts.append(list(seq.chain))

    @precondition(lambda self: self.prompts)
    @rule(data=st.data())
    def hit_a_cached_prefix(self, data):
        prompt = data.draw(st.sampled_from(self.prompts))
        hits = []
        for h, toks in prompt:
            block = self.pool.lookup(h, toks)
            expected = self.registered[h][0] if h in self.registered else None
            assert block == expected, "a prefix hit must return the block registered under its hash"
            if block is None:
                break
            hits.append(block)
        if not hits:
            return
        for block in hits:
            self.pool.share(block)
            self.lru.pop(block, None)
        self.add_seq(Seq(hits, prompt[: len(hits)]))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def finish_a_sequence(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)))
        blocks = list(reversed(self.seqs[seq_id].blocks))  # tail first, so it is evicted first
        self.free_in_model(blocks)
        del self.seqs[seq_id]
        self.pool.free(blocks)

    def last_full_block_is_its_own(self, seq: Seq) -> bool:
        return bool(seq.chain) and self.pool.refcount(seq.blocks[len(seq.chain) - 1]) == 1

    @precondition(lambda self: any(self.last_full_block_is_its_own(seq) for seq in self.seqs.values()))
    @rule(data=st.data())
    def rewrite_the_last_full_block(self, data):
        seq = self.pick_seq(data, self.last_full_block_is_its_own)
        block = seq.blocks[len(seq.chain) - 1]
        h = self.hashed_blocks().get(block)
        self.pool.forget(block)
        if h is not None:
            del self.registered[h]
        seq.chain.pop()

    @rule(n=st.integers(1, 4))
    def grow_the_pool(self, n):
        held = {seq_id: list(seq.blocks) for seq_id, seq in self.seqs.items()}
        old = self.pool.num_blocks
        assert self.pool.grow(n) == range(old, old + n)
        self.free_list.extend(range(old, old + n))
        assert {seq_id: seq.blocks for seq_id, seq in self.seqs.items()} == held

    @rule(n=st.integers(0, 6))
    def give_back_the_last_blocks_if_they_are_free(self, n):
        pool = self.pool
        in_free_list = set(self.free_list)
        expected = n <= pool.num_blocks and all(b in in_free_list for b in range(pool.num_blocks - n, pool.num_blocks))
        assert pool.can_give_back(n) is expected
        if not expected:
            known = [(h, list(toks)) for h, (_, toks) in self.registered.items()]
            before = snapshot(pool, known)
            with pytest.raises(ValueError):
                pool.give_back(n)
            assert snapshot(pool, known) == before
            return
        pool.give_back(n)
        kept = pool.num_blocks
        assert all(b < kept for seq in self.seqs.values() for b in seq.blocks), "a held block was given back"
        self.free_list = deque(b for b in self.free_list if b < kept)

    @rule()
    def give_back_the_whole_free_tail(self):
        in_free_list, n = set(self.free_list), 0
        while n < self.pool.num_blocks and self.pool.num_blocks - 1 - n in in_free_list:
            n += 1
        self.pool.give_back(n)
        assert n == self.pool.num_blocks or not self.pool.can_give_back(1)
        self.free_list = deque(b for b in self.free_list if b < self.pool.num_blocks)

    @rule(extra=st.integers(1, 3))
    def ask_for_more_than_the_pool_has(self, extra):
        self.expect_exhaustion(self.pool.num_free + self.pool.num_cached + extra)

    @rule()
    def allocate_everything_available_evicting_the_cache(self):
        blocks = self.allocate_expecting_model(self.pool.num_free + self.pool.num_cached)
        if blocks:
            self.add_seq(Seq(blocks))

    @precondition(lambda self: self.seqs and self.pool.num_blocks)
    @rule(data=st.data())
    def freeing_a_block_more_times_than_it_is_held_raises_and_changes_nothing(self, data):
        """A valid free of a held block, then one block freed once more than its reference count."""
        held = self.pick_seq(data).blocks[0]
        block = data.draw(st.integers(0, self.pool.num_blocks - 1))
        too_many = self.expected_refcounts()[block] + 1 - (block == held)
        before = snapshot(self.pool)
        try:
            self.pool.free([held] + [block] * too_many)
        except ValueError:
            pass
        else:
            raise AssertionError(f"freeing block {block} {too_many} time(s) should raise")
        assert snapshot(self.pool) == before

    # -- checked after every step

    @invariant()
    def the_pool_agrees_with_the_model(self):
        pool = self.pool
        pool.check_invariants()
        STEPS_RUN[0] += 1
        refcounts = self.expected_refcounts()
        assert [pool.refcount(b) for b in range(pool.num_blocks)] == refcounts
        assert pool.num_free + pool.num_cached + pool.num_used == pool.num_blocks
        assert pool.num_used == sum(1 for refs in refcounts if refs)
        assert [b for b in range(pool.num_blocks) if pool.is_cached(b)] == sorted(self.lru)
        assert pool.num_free == len(self.free_list)
        for h, (block, toks) in self.registered.items():
            assert pool.lookup(h, toks) == block
            assert pool.block_hash_of(block) == h
        hashed = self.hashed_blocks()
        assert [pool.block_hash_of(b) for b in range(pool.num_blocks)] == [
            hashed.get(b) for b in range(pool.num_blocks)
        ]

    def teardown(self):
        if not hasattr(self, "pool"):
            return
        for seq_id in sorted(self.seqs):
            self.pool.free(reversed(self.seqs.pop(seq_id).blocks))
        self.pool.check_invariants()
        assert self.pool.num_used == 0, "blocks leaked"
        assert self.pool.num_free + self.pool.num_cached == self.pool.num_blocks


STEPS_RUN = [0]  # operations checked against the model, across all examples of one run
MACHINE_SETTINGS = settings(max_examples=250, stateful_step_count=64, deadline=None)  # ~13,000 operations, ~15 s


def test_the_pool_agrees_with_the_reference_model_over_at_least_10000_random_operations():
    STEPS_RUN[0] = 0
    run_state_machine_as_test(BlockPoolMachine, settings=MACHINE_SETTINGS)
    assert STEPS_RUN[0] >= 10_000
