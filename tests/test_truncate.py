"""The KV interface's truncate verb: after keeping the first k tokens, a sequence continues exactly as if it
had only ever seen those k tokens, in every strategy, and the paged pool neither leaks nor corrupts shares."""

from __future__ import annotations

import pytest
import torch

from engine.config import CACHE_STRATEGIES

TOKENS = list(range(5, 5 + 70))


def logits_after(engine, seq_id: int, prefix: list[int], tail: list[int]) -> torch.Tensor:
    if not engine.cache.keeps_kv:
        return engine.step([seq_id], [prefix + tail])[0]
    held = engine.cache.prepare(seq_id, prefix + tail)
    engine.step([seq_id], [prefix[held:]])
    return engine.step([seq_id], [tail])[0]


@pytest.mark.parametrize("strategy", CACHE_STRATEGIES)
@pytest.mark.parametrize("keep", [0, 7, 16, 33, 48])
def test_a_truncated_sequence_continues_like_a_fresh_one(tiny_engine_factory, strategy, keep):
    engine = tiny_engine_factory(cache=strategy, block_size=16)
    tail = [900, 901, 902]
    expected = logits_after(engine, 1, TOKENS[:keep], tail) if keep else None
    engine.cache.release(1)

    held = engine.cache.prepare(2, TOKENS)
    engine.step([2], [TOKENS[held:]])
    engine.cache.truncate(2, keep)
    if engine.cache.keeps_kv:
        assert engine.cache.tokens_held(2) == keep
    if keep and engine.cache.keeps_kv:
        got = engine.step([2], [tail])[0]
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=5e-2 if strategy == "paged-int8" else 1e-5)


@pytest.mark.parametrize("strategy", ["paged", "paged-int8"])
def test_truncating_a_shared_prefix_copies_instead_of_rewriting_it(tiny_engine_factory, strategy):
    engine = tiny_engine_factory(cache=strategy, block_size=16)
    cache = engine.cache
    cache.prepare(1, TOKENS)
    engine.step([1], [TOKENS])
    before = engine.step([1], [[7]])[0]
    cache.truncate(1, len(TOKENS))
    assert cache.prepare(2, TOKENS) == 64  # four full blocks shared from the prefix cache
    engine.step([2], [TOKENS[64:]])
    cache.truncate(2, 40)  # cuts into a shared block: copy-on-write
    engine.step([2], [[1, 2, 3]])
    again = engine.step([1], [[7]])[0]
    torch.testing.assert_close(again, before)
    cache.release(1)
    cache.release(2)
    cache.pool.check_invariants()
    assert cache.pool.num_used == 0


@pytest.mark.parametrize("strategy", CACHE_STRATEGIES)
def test_keeping_more_than_is_held_is_refused(tiny_engine_factory, strategy):
    engine = tiny_engine_factory(cache=strategy)
    engine.cache.prepare(1, TOKENS[:10])
    engine.step([1], [TOKENS[:10]])
    with pytest.raises(ValueError, match="cannot keep"):
        engine.cache.truncate(1, 11)
