"""Every float KV strategy produces the same greedy tokens: alone, batched in one pool, and across turns."""

from __future__ import annotations

import pytest
import torch

from engine.chat import Message, prompt_ids
from engine.config import BLOCK_SIZES, EngineConfig
from engine.engine import Engine
from engine.model import LlamaModel
from tests.engine_helpers import greedy, memoized_contiguous_replies, one_torch_thread, run_turn

LONG = 256  # tokens per default-model run
# 'none' recomputes the whole context every step (O(n^2): ~4 min for 256 tokens on a 2-core AMD EPYC): it decodes
# NONE_STEPS tokens greedily, then takes one step at each of NONE_SAMPLED given the reference's tokens before it,
# which is what its greedy run computes there whenever the tokens before agree
NONE_STEPS = 32
NONE_SAMPLED = (48, 64, 96, 128, 160, 192, 224, LONG - 1)

PROMPTS = {
    "story": "Write a long story about a dragon who learns to bake bread.",
    "science": "Explain in detail how photosynthesis works, step by step.",
    "short": "Hi!",
}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_torch_thread():
        yield


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
    """Greedy replies of a fresh contiguous run on the tiny model (the factory's weights): name -> 48 ids."""
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


@pytest.mark.parametrize("cache", ["contiguous", "paged", "paged-int8"])
def test_a_step_mixing_a_prefill_and_a_decode_matches_separate_steps(tiny_engine_factory, cache):
    a_prompt, b_prompt, b_next = list(range(300, 320)), list(range(400, 437)), 77
    together, apart = tiny_engine_factory(cache, 8), tiny_engine_factory(cache, 8)
    for engine in (together, apart):
        engine.cache.prepare(2, b_prompt + [b_next])
        engine.step([2], [b_prompt])
        engine.cache.prepare(1, a_prompt)
    mixed = together.step([1, 2], [a_prompt, [b_next]])  # [2, V]: A prefills 20 tokens while B decodes one
    alone = [apart.step([1], [a_prompt])[0], apart.step([2], [[b_next]])[0]]
    # 21 rows take the prefill matmul, one row the decode kernel: the last bits may differ (measured 2e-6), and
    # int8's 8-bit softmax weights can turn that into a step of one weight (measured 1.3e-5)
    close = dict(atol=1e-4, rtol=1e-4) if cache == "paged-int8" else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mixed[0], alone[0], **close)
    torch.testing.assert_close(mixed[1], alone[1], **close)


# ---- the default model: 256 greedy tokens, token for token --------------------------------------------
# In int4, the format `auto` picks and users run (the other formats: tests/test_weight_generation.py); 'none' in
# float32, where its prefill path and the decode kernels round alike. A fresh contiguous run of each prompt is the
# reference, computed once per session (tests/conftest.py).

SECOND_MESSAGE = "Now write a short poem about that dragon."


@pytest.fixture
def engine(int4_engine):
    yield int4_engine
    int4_engine.set_cache("paged", 16)


@pytest.mark.default_model
@pytest.mark.parametrize("block_size", [1, 32, 64])
def test_greedy_256_tokens_of_paged_are_identical_to_contiguous(engine, int4_contiguous_reply, block_size):
    expected, _ = int4_contiguous_reply([], PROMPTS["story"])
    engine.set_cache("paged", block_size)
    got = fresh_reply(engine, PROMPTS["story"], LONG)
    assert len(got) == LONG and len(set(got)) > LONG // 5  # a real text, not a loop of one token
    assert got == expected


@pytest.mark.default_model
def test_none_recomputes_the_tokens_of_contiguous_greedily_and_at_positions_up_to_256(default_engine, tokenizer):
    expected, _ = memoized_contiguous_replies(default_engine)([], PROMPTS["story"])  # float32
    try:
        default_engine.set_cache("none")
        assert fresh_reply(default_engine, PROMPTS["story"], NONE_STEPS) == expected[:NONE_STEPS]
        prompt = prompt_ids(tokenizer, None, [Message("user", PROMPTS["story"])])
        for t in NONE_SAMPLED:
            context = prompt + expected[:t]
            default_engine.cache.prepare(7, context)
            try:
                assert int(default_engine.step([7], [context])[0].argmax()) == expected[t], t
            finally:
                default_engine.cache.release(7)
    finally:
        default_engine.set_cache("paged", 16)


@pytest.mark.default_model
def test_paged_16_matches_contiguous_on_a_first_turn_and_on_a_second_turn_served_from_the_prefix_cache(
        engine, int4_contiguous_reply):
    expected_first, history = int4_contiguous_reply([], PROMPTS["story"])  # before the paged turns: it sets the cache
    expected_second, _ = int4_contiguous_reply(history, SECOND_MESSAGE)
    engine.set_cache("paged", 16)
    conv = engine.new_conversation()
    first = run_turn(engine, conv, PROMPTS["story"], greedy(LONG))
    assert first.tokens == expected_first
    assert [(m.role, m.content) for m in conv.messages] == [(m.role, m.content) for m in history]

    second = run_turn(engine, conv, SECOND_MESSAGE, greedy(LONG))
    assert second.done.prefix_hit_tokens > first.done.n_prompt_tokens  # the first turn's prompt and more
    assert second.prefill[0].n_tokens == second.done.n_prompt_tokens - second.done.prefix_hit_tokens
    assert second.tokens == expected_second


@pytest.mark.default_model
def test_batched_decode_of_several_sequences_in_one_paged_pool_matches_each_alone(engine, tokenizer,
                                                                                  int4_contiguous_reply):
    story, history = int4_contiguous_reply([], PROMPTS["story"])
    poem, _ = int4_contiguous_reply(history, SECOND_MESSAGE)
    story_ids = prompt_ids(tokenizer, None, [Message("user", PROMPTS["story"])])
    poem_ids = prompt_ids(tokenizer, None, [*history, Message("user", SECOND_MESSAGE)])
    engine.set_cache("paged", 16)
    # two different prompt lengths, and the same prompt twice: sequences must not disturb one another
    got = greedy_batch(engine, {301: story_ids, 302: poem_ids, 303: story_ids}, LONG // 2)
    assert got == {301: story[:LONG // 2], 302: poem[:LONG // 2], 303: story[:LONG // 2]}
    assert engine.kv_stats().num_blocks_used == 0
