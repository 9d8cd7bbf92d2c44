"""Every float KV strategy produces the same greedy tokens: alone, batched in one pool, and across turns."""

from __future__ import annotations

import pytest

from engine.chat import Message, prompt_ids
from engine.config import BLOCK_SIZES
from tests.engine_helpers import greedy, run_turn

LONG = 256  # tokens per default-model run

PROMPTS = {
    "story": "Write a long story about a dragon who learns to bake bread.",
    "science": "Explain in detail how photosynthesis works, step by step.",
    "short": "Hi!",
}


def greedy_batch(engine, prompts: dict[int, list[int]], n: int) -> dict[int, list[int]]:
    """Greedy-decode several sequences together: one right-padded prefill, then one forward per step."""
    seq_ids = list(prompts)
    for s in seq_ids:
        assert engine.cache.prepare(s, prompts[s]) == 0
    logits = engine.step(seq_ids, [prompts[s] for s in seq_ids])  # [B, V]
    out = {s: [int(row.argmax())] for s, row in zip(seq_ids, logits)}
    for _ in range(n - 1):
        logits = engine.step(seq_ids, [[out[s][-1]] for s in seq_ids])
        for s, row in zip(seq_ids, logits):
            out[s].append(int(row.argmax()))
    for s in seq_ids:
        engine.cache.release(s)
    return out


def fresh_reply(engine, message: str, n: int, history: list[Message] = ()) -> list[int]:
    conv = engine.new_conversation()
    conv.messages = [Message(m.role, m.content) for m in history]
    try:
        return run_turn(engine, conv, message, greedy(n)).tokens
    finally:
        engine.forget(conv)


# ---- the tiny random model: every strategy and block size, quickly ------------------------------------


@pytest.fixture(scope="module")
def tiny_reference(tiny_config, tokenizer):
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.model import LlamaModel

    engine = Engine(LlamaModel.random(tiny_config, seed=0, std=0.1), tokenizer, EngineConfig(cache="contiguous"))
    return {name: fresh_reply(engine, text, 48) for name, text in PROMPTS.items()}


def test_the_tiny_reference_is_not_degenerate(tiny_reference):
    for tokens in tiny_reference.values():
        assert len(tokens) == 48 and len(set(tokens)) > 5


@pytest.mark.parametrize(("cache", "block_size"),
                         [("none", 16), ("contiguous", 16)] + [("paged", bs) for bs in BLOCK_SIZES])
def test_tiny_greedy_tokens_are_identical_under_every_float_strategy(tiny_engine_factory, tiny_reference,
                                                                     cache, block_size):
    engine = tiny_engine_factory(cache, block_size)
    for name, text in PROMPTS.items():
        assert fresh_reply(engine, text, 48) == tiny_reference[name], name


@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_tiny_batched_decode_in_one_pool_matches_each_sequence_alone(tiny_engine_factory, tokenizer,
                                                                     tiny_reference, block_size):
    engine = tiny_engine_factory("paged", block_size)
    prompts = {100 + i: prompt_ids(tokenizer, None, [Message("user", t)]) for i, t in enumerate(PROMPTS.values())}
    assert len({len(p) for p in prompts.values()}) == len(prompts)  # different prompt lengths
    got = greedy_batch(engine, prompts, 48)
    assert list(got.values()) == list(tiny_reference.values())
    assert engine.kv_stats().num_blocks_used == 0


def test_tiny_batched_decode_with_contiguous_matches_each_sequence_alone(tiny_engine_factory, tokenizer,
                                                                         tiny_reference):
    engine = tiny_engine_factory("contiguous")
    prompts = {100 + i: prompt_ids(tokenizer, None, [Message("user", t)]) for i, t in enumerate(PROMPTS.values())}
    assert list(greedy_batch(engine, prompts, 48).values()) == list(tiny_reference.values())


def test_tiny_second_conversation_reuses_the_first_ones_cached_prefix(tiny_engine_factory, tiny_reference):
    engine = tiny_engine_factory("paged", 16)
    first = engine.new_conversation()
    run_turn(engine, first, PROMPTS["story"], greedy(8))
    second = engine.new_conversation()
    turn = run_turn(engine, second, PROMPTS["science"], greedy(48))
    assert turn.done.prefix_hit_tokens >= 16  # the shared system prompt, in whole blocks
    assert turn.prefill[0].n_tokens == turn.done.n_prompt_tokens - turn.done.prefix_hit_tokens
    assert turn.tokens == tiny_reference["science"]


# ---- the default model: 256 greedy tokens, token for token --------------------------------------------


@pytest.fixture
def engine(default_engine):
    yield default_engine
    default_engine.set_cache("paged", 16)


@pytest.fixture(scope="module")
def contiguous_reference(default_engine):
    """Greedy replies of a fresh contiguous run, computed on first use: name -> LONG token ids."""
    replies: dict[str, list[int]] = {}

    def get(name: str) -> list[int]:
        if name not in replies:
            default_engine.set_cache("contiguous")
            replies[name] = fresh_reply(default_engine, PROMPTS[name], LONG)
        return replies[name]

    return get


@pytest.mark.default_model
@pytest.mark.parametrize(("cache", "block_size"), [("none", 16), ("paged", 1), ("paged", 16), ("paged", 64)])
def test_greedy_256_tokens_are_identical_to_contiguous(engine, contiguous_reference, cache, block_size):
    expected = contiguous_reference("story")
    engine.set_cache(cache, block_size)
    got = fresh_reply(engine, PROMPTS["story"], LONG)
    assert len(got) == LONG and len(set(got)) > 50  # a real text, not a loop of one token
    assert got == expected


@pytest.mark.default_model
def test_batched_decode_of_several_sequences_in_one_paged_pool_matches_each_alone(engine, tokenizer,
                                                                                  contiguous_reference):
    expected = {name: contiguous_reference(name) for name in PROMPTS}
    engine.set_cache("paged", 16)
    prompts = {200 + i: prompt_ids(tokenizer, None, [Message("user", PROMPTS[name])])
               for i, name in enumerate(expected)}
    assert len({len(p) for p in prompts.values()}) == len(prompts)
    got = greedy_batch(engine, prompts, LONG)
    for (name, tokens), seq_id in zip(expected.items(), prompts):
        assert got[seq_id] == tokens, name


@pytest.mark.default_model
def test_a_second_turn_served_from_the_prefix_cache_matches_a_fresh_contiguous_run(engine):
    engine.set_cache("paged", 16)
    conv = engine.new_conversation()
    first = run_turn(engine, conv, "Name three colours.", greedy(64, run_to_length=False))
    assert first.done.finish_reason == "stop"  # a whole reply, so the history re-tokenizes as generated
    history = list(conv.messages)
    second = run_turn(engine, conv, PROMPTS["story"], greedy(LONG))
    assert second.done.prefix_hit_tokens > first.done.n_prompt_tokens
    engine.forget(conv)

    engine.set_cache("contiguous")
    assert fresh_reply(engine, PROMPTS["story"], LONG, history) == second.tokens
