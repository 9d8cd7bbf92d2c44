"""The paged caches under speculative decoding: random verify steps, rollbacks, plain steps, forks and releases
on a real PagedCache / PagedInt8Cache and the tiny model, against a model of what each sequence has accepted.

After every operation: the pool's own invariants hold, every reference count is exactly the number of block
tables naming the block (no leak), each sequence holds exactly its accepted tokens, and no block holding a
rejected draft has ever been registered in the prefix cache.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from engine.config import EngineConfig
from engine.engine import Engine
from engine.kv.base import KVCacheFull
from engine.kv.block_pool import BlockPool
from engine.kv.recompute import RecomputeCache
from engine.model import LlamaModel
from engine.speculative import verify_segments
from tests.engine_helpers import one_torch_thread

TOKEN = st.integers(5, 8)  # few values, so prefixes repeat and hashes collide on purpose
POOL_BLOCKS = 10


def chain_hashes(tokens: list[int], block_size: int) -> list[int]:
    hashes, parent = [], None
    for i in range(len(tokens) // block_size):
        parent = BlockPool.chain_hash(parent, tokens[i * block_size:(i + 1) * block_size])
        hashes.append(parent)
    return hashes


class SpeculativePagedMachine(RuleBasedStateMachine):
    """engine_for(strategy, block_size) is set by the test before the machine runs."""

    engine_for = None

    @initialize(strategy=st.sampled_from(["paged", "paged-int8", "paged-int4"]), block_size=st.sampled_from([1, 8]))
    def make_cache(self, strategy, block_size):
        self.engine = type(self).engine_for(strategy, block_size)
        self.cache = self.engine.cache
        self.bs = block_size
        self.accepted: dict[int, list[int]] = {}  # what each sequence should hold
        self.accepted_hashes: set[int] = set()  # chain hashes of full blocks made of accepted tokens only
        self.next_id = 0

    # -- helpers
    def _accept(self, seq_id: int, tokens: list[int]) -> None:
        self.accepted[seq_id] = tokens
        self.accepted_hashes.update(chain_hashes(tokens, self.bs))

    def _drop(self, seq_id: int) -> None:
        self.cache.release(seq_id)
        del self.accepted[seq_id]

    def _step(self, seq_id: int, tokens: list[int], tentative: int = 0) -> None:
        self.engine.step([seq_id], [tokens], all_logits=True, num_tentative=[tentative])

    # -- rules
    @rule(prompt=st.lists(TOKEN, min_size=1, max_size=3 * 8))
    def start_a_sequence(self, prompt):
        seq_id, self.next_id = self.next_id, self.next_id + 1
        held = self.cache.prepare(seq_id, prompt)  # may share cached full blocks of an earlier prompt
        assert self.cache.seqs[seq_id].tokens == prompt[:held]
        try:
            self._step(seq_id, prompt[held:])
        except KVCacheFull:
            self._accept(seq_id, prompt[:held])
            return
        self._accept(seq_id, prompt)

    @precondition(lambda self: self.accepted)
    @rule(data=st.data(), token=TOKEN, drafts=st.lists(TOKEN, min_size=1, max_size=10))
    def verify_drafts_and_roll_back_the_rejected(self, data, token, drafts):
        seq_id = data.draw(st.sampled_from(sorted(self.accepted)))
        n_accepted = data.draw(st.integers(0, len(drafts)))
        fed, past = [token] + drafts, len(self.accepted[seq_id])
        start = 0
        for length in verify_segments(self.cache, past, len(fed)):
            if start > n_accepted:  # this piece starts with a rejected draft: it never runs
                break
            try:
                self._step(seq_id, fed[start:start + length], tentative=length - 1)
            except KVCacheFull:
                if start == 0:
                    return  # nothing changed: the engine takes a plain step instead
                self._drop(seq_id)  # the engine fails the turn and releases the sequence
                return
            start += length
        self.cache.truncate(seq_id, past + 1 + n_accepted)
        self._accept(seq_id, self.accepted[seq_id] + fed[:1 + n_accepted])

    @precondition(lambda self: self.accepted)
    @rule(data=st.data(), token=TOKEN)
    def plain_step(self, data, token):
        seq_id = data.draw(st.sampled_from(sorted(self.accepted)))
        try:
            self._step(seq_id, [token])
        except KVCacheFull:
            return
        self._accept(seq_id, self.accepted[seq_id] + [token])

    @precondition(lambda self: self.accepted)
    @rule(data=st.data())
    def truncate(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.accepted)))
        keep = data.draw(st.integers(0, len(self.accepted[seq_id])))
        try:
            self.cache.truncate(seq_id, keep)
        except KVCacheFull:  # a shared block to copy and no free block: nothing changed
            return
        self.accepted[seq_id] = self.accepted[seq_id][:keep]

    @precondition(lambda self: self.accepted)
    @rule(data=st.data())
    def release(self, data):
        self._drop(data.draw(st.sampled_from(sorted(self.accepted))))

    @precondition(lambda self: any(len(t) > 1 for t in self.accepted.values()))
    @rule(data=st.data(), extra=st.lists(TOKEN, min_size=1, max_size=4))
    def fork_from_the_prefix_cache(self, data, extra):
        source = data.draw(st.sampled_from(sorted(s for s, t in self.accepted.items() if len(t) > 1)))
        self.start_a_sequence(self.accepted[source] + extra)

    @precondition(lambda self: any(self.accepted.values()) and self.cache.name == "paged")
    @rule(data=st.data(), token=TOKEN)
    def held_keys_and_values_are_those_of_the_accepted_tokens(self, data, token):
        """A probe step (then rolled back) gives the logits of recomputing the accepted tokens from scratch."""
        seq_id = data.draw(st.sampled_from(sorted(s for s, t in self.accepted.items() if t)))
        tokens = self.accepted[seq_id]
        try:
            got = self.engine.step([seq_id], [[token]], num_tentative=[1])[0]
        except KVCacheFull:
            return
        self.cache.truncate(seq_id, len(tokens))
        fresh = RecomputeCache(self.engine.model_config, self.engine.dtype, self.engine.device, 1024)
        view = fresh.begin_step([0], [tokens + [token]])
        expected = self.engine.model(torch.tensor([tokens + [token]]), view)[0]
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)

    # -- invariants
    @invariant()
    def the_pool_is_consistent_and_reference_counts_are_exact(self):
        pool = self.cache.pool
        pool.check_invariants()
        holders = [0] * pool.num_blocks
        for seq in self.cache.seqs.values():
            for block in seq.blocks:
                holders[block] += 1
        assert [pool.refcount(b) for b in range(pool.num_blocks)] == holders

    @invariant()
    def each_sequence_holds_exactly_its_accepted_tokens(self):
        assert set(self.cache.seqs) == set(self.accepted)
        for seq_id, tokens in self.accepted.items():
            seq = self.cache.seqs[seq_id]
            assert seq.tokens == tokens
            assert len(seq.blocks) == -(-len(tokens) // self.bs)
            coded = self.cache.state.seqs[seq_id].upto if hasattr(self.cache, "state") else len(tokens)
            assert seq.hashes == chain_hashes(tokens[:coded], self.bs)  # a block in the window has no codes yet
        if hasattr(self.cache, "state"):
            assert set(self.cache.state.seqs) == set(self.accepted)

    @invariant()
    def no_block_holding_a_rejected_token_is_in_the_prefix_cache(self):
        pool = self.cache.pool
        registered = {pool.block_hash_of(b) for b in range(pool.num_blocks)} - {None}
        assert registered <= self.accepted_hashes

    def teardown(self):
        if hasattr(self, "cache"):
            for seq_id in list(self.accepted):
                self._drop(seq_id)
            self.cache.pool.check_invariants()
            assert self.cache.pool.num_used == 0


def test_speculative_steps_and_rollbacks_keep_the_paged_pools_exact(tiny_config, tokenizer):
    model = LlamaModel.random(tiny_config, seed=0, std=0.1)
    engines = {}

    def engine_for(strategy, block_size):
        key = (strategy, block_size)
        layout, kv = ("paged", {"kv_dtype": "int4", "kv_residual": 8}) if strategy == "paged-int4" else (strategy, {})
        if key not in engines:
            config = EngineConfig(cache=layout, block_size=block_size, pool_tokens=POOL_BLOCKS * block_size, **kv)
            engines[key] = Engine(model, tokenizer, config, "tiny-random")
        engines[key].set_cache(layout, block_size)  # a fresh, empty pool for each example
        return engines[key]

    SpeculativePagedMachine.engine_for = staticmethod(engine_for)
    with one_torch_thread():
        run_state_machine_as_test(SpeculativePagedMachine, settings=settings(
            max_examples=40, stateful_step_count=25, deadline=None, derandomize=True,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]))


@pytest.mark.parametrize("strategy", ["paged", "paged-int8"])
def test_a_rejected_draft_that_filled_a_block_leaves_no_trace_in_the_prefix_cache(tiny_engine_factory, strategy):
    engine = tiny_engine_factory(strategy, 8)
    cache = engine.cache
    prompt = list(range(10, 16))  # 6 tokens: the block fills at position 7
    cache.prepare(1, prompt)
    engine.step([1], [prompt])
    drafts = [50, 51, 52, 53]  # positions 7..10 with the fed token at 6
    for length in verify_segments(cache, 6, 5)[:1]:  # the draft at position 7 is rejected: one piece runs
        engine.step([1], [([16] + drafts)[:length]], num_tentative=[length - 1])
    cache.truncate(1, 7)  # keep the fed token only
    pool = cache.pool
    assert [pool.block_hash_of(b) for b in range(pool.num_blocks)] == [None] * pool.num_blocks
    engine.step([1], [[17]])  # the model's own token fills the block: now it is registered
    assert cache.seqs[1].hashes == chain_hashes(prompt + [16, 17], 8)
    assert pool.lookup(cache.seqs[1].hashes[0], prompt + [16, 17]) == cache.seqs[1].blocks[0]
