"""Sliding-window layers hold only their window, and nothing a model computes changes.

Gemma 2 (one of two layers slides) and Gemma 3 (five of six) as the tiny random GGUFs of test_architectures.py,
with a window of 8 tokens. Every cache kind runs the window-only cache (the model's own config) beside a cache that
keeps every token of every layer (the same model, its config told that no layer slides: the layers still mask
their window, the cache keeps it all), over prompts longer than the window, decode steps, prefix reuse across turns,
speculative rollback and fork, and compares logits bit for bit; the reported bytes are compared with the per-layer
formula: global layers x context + sliding layers x min(context, window).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine import loader
from engine.config import EngineConfig, ModelConfig, SamplingParams, SpeculativeConfig
from engine.engine import Engine, make_cache
from engine.kv.base import KVCacheFull
from engine.kv.factory import CacheShape, new_cache
from engine.kv.window import PARKED, SlidingLayers
from engine.model import LlamaModel
from engine.speculative import verify_segments
from tests.engine_helpers import greedy as greedy_params
from tests.engine_helpers import one_torch_thread
from tests.test_architectures import CASES, random_reference, write_case

CONTEXT = 256
WINDOW = 8
FLOAT = 4  # bytes a float32 element


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_torch_thread():
        yield


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def gemma_weights(request, tmp_path_factory, monkeypatch_module):
    """(the tiny random model, its tokenizer)."""
    tmp = tmp_path_factory.mktemp(request.param)
    monkeypatch_module.setenv("KVSCOPE_CACHE_DIR", str(tmp / "cache"))
    case = CASES[request.param]
    weights = loader.load_weights(str(write_case(tmp, case, random_reference(case))))
    return LlamaModel.from_hf_state_dict(weights.config, weights.state_dict, max_positions=CONTEXT), weights.tokenizer


@pytest.fixture(scope="module")
def gemma(gemma_weights):
    return gemma_weights[0]


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def keeping_everything(config: ModelConfig) -> ModelConfig:
    """The config a cache that keeps every layer whole is built from (the model itself still slides)."""
    return dataclasses.replace(config, sliding_layers=(), sliding_window=0)


def cache_for(config: ModelConfig, layout: str, precision: str = "float32", block_size: int = 8):
    return new_cache(layout, precision, CacheShape(config, torch.float32, torch.device("cpu"), CONTEXT),
                     block_size=block_size)


def pair(model, layout, precision="float32", block_size=8):
    """(window-only cache, cache that keeps everything)."""
    return (cache_for(model.config, layout, precision, block_size),
            cache_for(keeping_everything(model.config), layout, precision, block_size))


def step(model, cache, seq_id: int, tokens: list[int], commit: bool = True) -> torch.Tensor:
    """Logits [len(tokens), V] of one step."""
    view = cache.begin_step([seq_id], [tokens])
    logits = model(torch.tensor([tokens]), view, all_logits=True)[0]
    if commit:
        cache.commit_step(view)
    return logits


def greedy(model, cache, seq_id: int, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor, int]:
    """(tokens generated, logits of every step [len(prompt) - hit + n - 1, V], the prefix hit)."""
    hit = cache.prepare(seq_id, prompt)
    rows = [step(model, cache, seq_id, prompt[hit:])]
    out = [int(rows[-1][-1].argmax())]
    for _ in range(n - 1):
        rows.append(step(model, cache, seq_id, out[-1:]))
        out.append(int(rows[-1][-1].argmax()))
    return out, torch.cat(rows), hit


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 200, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def per_layer_token(config: ModelConfig) -> int:
    return 2 * FLOAT * config.num_kv_heads * config.head_dim


# ---- what is held, and that the logits are those of a full cache ----------------------------------------------


def test_the_tiny_gemmas_slide_with_a_window_shorter_than_the_prompts(gemma):
    layers = SlidingLayers.of(gemma.config, CONTEXT)
    assert layers.window == WINDOW and layers.num_sliding >= 1 and layers.num_global >= 1
    assert layers.slots == WINDOW + 16, "the window and one tile of slack"


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_prefill_and_decode_give_the_full_caches_logits_bit_for_bit(gemma, layout, precision):
    ours, full = pair(gemma, layout, precision)
    tokens, logits, _ = greedy(gemma, ours, 1, prompt(40), 40)
    ref_tokens, ref_logits, _ = greedy(gemma, full, 1, prompt(40), 40)
    assert tokens == ref_tokens
    assert torch.equal(logits, ref_logits)
    assert ours.stats(1).bytes_allocated < full.stats(1).bytes_allocated


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_the_rings_do_not_grow_with_the_context(gemma, layout):
    cache = cache_for(gemma.config, layout)
    layers = cache.sliding
    greedy(gemma, cache, 1, prompt(30), 2)
    at_32 = cache.window_bytes()
    greedy(gemma, cache, 1, cache_tokens(cache, 1) + prompt(100, seed=5), 2)
    assert cache.window_bytes() == at_32 == layers.num_sliding * layers.slots * per_layer_token(gemma.config)
    assert cache.tokens_held(1) > 4 * layers.slots


def cache_tokens(cache, seq_id: int) -> list[int]:
    return list(cache.reservations[seq_id].tokens if hasattr(cache, "reservations") else cache.seqs[seq_id].tokens)


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_the_reported_bytes_for_a_long_sequence_match_the_per_layer_formula(gemma, layout):
    cache = cache_for(gemma.config, layout)
    greedy(gemma, cache, 1, prompt(150), 50)
    c, layers, context = gemma.config, cache.sliding, cache.tokens_held(1)
    formula = per_layer_token(c) * (layers.num_global * context + layers.num_sliding * min(context, WINDOW))
    stats = cache.stats(1)
    assert context == 199 and stats.bytes_theoretical == formula
    rings = layers.num_sliding * layers.slots * per_layer_token(c)
    if layout == "contiguous":
        assert stats.bytes_allocated == layers.num_global * CONTEXT * per_layer_token(c) + rings
        assert stats.bytes_used == formula
    else:
        assert stats.bytes_allocated == stats.num_blocks * layers.num_global * 8 * per_layer_token(c) + rings
        window = layers.num_sliding * WINDOW * per_layer_token(c)
        assert stats.bytes_used == stats.num_blocks_used * layers.num_global * 8 * per_layer_token(c) + window
        assert stats.bytes_budget == cache.layout.max_blocks * cache.bytes_per_block() + rings, "pool + rings"
    full = cache_for(keeping_everything(c), layout)
    greedy(gemma, full, 1, prompt(150), 50)
    assert full.stats(1).bytes_theoretical == per_layer_token(c) * c.num_layers * context


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_a_batch_of_sequences_at_different_positions_gives_the_full_caches_logits(gemma, layout):
    """The scheduler's step: two sequences, one past its window by far, one within it, decoding together."""
    results = []
    for cache in pair(gemma, layout):
        rows = []
        for seq_id, n in ((1, 50), (2, 5)):
            cache.prepare(seq_id, prompt(n, seed=seq_id))
            rows.append(step(gemma, cache, seq_id, prompt(n, seed=seq_id)))
        for t in range(34):
            view = cache.begin_step([1, 2], [[3 + t], [40 + t]])
            rows.append(gemma(torch.tensor([[3 + t], [40 + t]]), view))
            cache.commit_step(view)
        results.append(torch.cat(rows))
    assert torch.equal(*results)


# ---- turns, rollback, fork --------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_a_next_turn_reuses_the_held_prefix_and_gives_the_full_caches_logits(gemma, layout):
    ours, full = pair(gemma, layout)
    results = []
    for cache in (ours, full):
        first, _, _ = greedy(gemma, cache, 1, prompt(40), 32)
        second_prompt = prompt(40) + first + prompt(12, seed=3)
        results.append(greedy(gemma, cache, 1, second_prompt, 32))
    (tokens, logits, hit), (ref_tokens, ref_logits, ref_hit) = results
    assert hit == ref_hit == 40 + 32 - 1, "all but the last generated token (never fed) is held"
    assert tokens == ref_tokens and torch.equal(logits, ref_logits)


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_a_rolled_back_draft_leaves_the_logits_of_the_full_cache(gemma, layout):
    """A verify step of 6 tokens of which 2 are kept, then decoding on: as the full cache, bit for bit."""
    results = []
    for cache in pair(gemma, layout):
        tokens, _, _ = greedy(gemma, cache, 1, prompt(40), 20)
        past = cache.tokens_held(1)
        step(gemma, cache, 1, tokens[-1:] + prompt(5, seed=7))
        cache.truncate(1, past + 2)
        results.append(greedy(gemma, cache, 1, cache_tokens(cache, 1) + [tokens[0]], 33))
    (tokens, logits, hit), (ref_tokens, ref_logits, ref_hit) = results
    assert hit == ref_hit and tokens == ref_tokens and torch.equal(logits, ref_logits)


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_a_rollback_past_the_ring_is_refused_and_changes_nothing(gemma, layout):
    cache = cache_for(gemma.config, layout)
    greedy(gemma, cache, 1, prompt(60), 2)
    held, stats = cache.tokens_held(1), cache.stats(1)
    assert cache.rollback_limit == cache.sliding.slots - WINDOW + 1
    with pytest.raises(KVCacheFull, match="sliding layers no longer hold"):
        cache.truncate(1, held - cache.rollback_limit - 1)
    assert cache.tokens_held(1) == held and cache.stats(1) == stats
    cache.truncate(1, held - cache.rollback_limit)  # within the slack
    cache.truncate(1, 0)  # nothing to keep: always possible
    assert cache.tokens_held(1) == 0


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_a_prompt_that_keeps_less_than_the_ring_holds_is_computed_again_and_stays_exact(gemma, layout):
    """An edited earlier message: the common prefix ends far behind the ring, so the prompt runs from its start,
    with the logits of a full cache that computes it from its start too, and the full cache's tokens."""
    edited = prompt(60)[:30] + prompt(20, seed=9)
    results = []
    for cache in pair(gemma, layout):
        greedy(gemma, cache, 1, prompt(60), 10)
        results.append(greedy(gemma, cache, 1, edited, 20))
    (tokens, logits, hit), (ref_tokens, _, ref_hit) = results
    assert (hit, ref_hit) == (0, 30)
    fresh_tokens, fresh_logits, _ = greedy(gemma, pair(gemma, layout)[1], 1, edited, 20)
    assert tokens == ref_tokens == fresh_tokens and torch.equal(logits, fresh_logits)


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_forked_sequences_each_give_the_full_caches_logits(gemma, layout):
    results = []
    for cache in pair(gemma, layout):
        greedy(gemma, cache, 1, prompt(40), 20)
        cache.fork(1, 2)
        a = greedy(gemma, cache, 1, cache_tokens(cache, 1) + [5], 33)
        b = greedy(gemma, cache, 2, cache_tokens(cache, 2) + [6], 33)
        results.append((a, b))
        if layout == "paged":
            cache.pool.check_invariants()
    for ours, ref in zip(*results):
        assert ours[0] == ref[0] and torch.equal(ours[1], ref[1]) and ours[2] == ref[2] == 59


# ---- the paged pool's prefix cache ---------------------------------------------------------------------------


def test_a_released_sequences_parked_window_lets_a_new_sequence_reuse_its_blocks(gemma):
    """The server's next turn: a new sequence with the whole history as its prompt."""
    results = []
    for cache in pair(gemma, "paged"):
        first, _, _ = greedy(gemma, cache, 1, prompt(40), 25)
        history = cache_tokens(cache, 1)
        cache.release(1)
        results.append(greedy(gemma, cache, 2, history + first[-1:] + prompt(10, seed=4), 33))
        cache.pool.check_invariants()
    (tokens, logits, hit), (ref_tokens, ref_logits, ref_hit) = results
    assert hit == ref_hit == 64, "the last full block of the 64 tokens held"
    assert tokens == ref_tokens and torch.equal(logits, ref_logits)


def test_a_prefix_hit_without_its_window_is_not_taken_by_the_sliding_cache(gemma):
    """Sequence 1 is still running far past the shared prefix: its blocks are cached but its ring holds its own
    newest keys, not those before position 40; the new sequence computes its prompt from the start (the logits
    of a full cache that does too, the tokens of one that reuses the blocks)."""
    shared = prompt(80)[:40] + prompt(9, seed=8)
    results = []
    for cache in pair(gemma, "paged"):
        greedy(gemma, cache, 1, prompt(80), 2)
        results.append(greedy(gemma, cache, 2, shared, 33))
        cache.pool.check_invariants()
    (tokens, logits, hit), (ref_tokens, _, ref_hit) = results
    assert (hit, ref_hit) == (0, 40)
    fresh_tokens, fresh_logits, _ = greedy(gemma, pair(gemma, "paged")[1], 2, shared, 33)
    assert tokens == ref_tokens == fresh_tokens and torch.equal(logits, fresh_logits)


def test_parked_windows_are_bounded_and_counted_in_the_allocated_bytes(gemma):
    cache = cache_for(gemma.config, "paged")
    ring = cache.sliding.num_sliding * cache.sliding.slots * per_layer_token(gemma.config)
    for seq_id in range(PARKED + 3):
        greedy(gemma, cache, seq_id, prompt(20, seed=100 + seq_id), 1)
        cache.release(seq_id)
    assert len(cache.windows.parked) == PARKED
    assert cache.stats().bytes_allocated == cache.stats().num_blocks * cache.bytes_per_block() + PARKED * ring


# ---- quantized caches ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_a_quantized_cache_keeps_its_sliding_layers_window_unquantized(gemma, layout, precision):
    """The codes hold the global layers; the sliding layers' rows stay float32, so the logits are on average no
    further from a float cache's than those of the same precision keeping every layer in codes (the mean error:
    int4's own float16 window rows make the largest single difference of either a near thing, 0.024 vs 0.022)."""
    ours, full = pair(gemma, layout, precision)
    exact = cache_for(gemma.config, layout)
    logits = greedy(gemma, ours, 1, prompt(150), 40)[1]  # past int4's 128 full-precision tokens and its sink
    ref = greedy(gemma, exact, 1, prompt(150), 40)[1]
    all_codes = greedy(gemma, full, 1, prompt(150), 40)[1]
    assert (logits - ref).abs().mean() <= (all_codes - ref).abs().mean()
    context, layers = ours.tokens_held(1), ours.sliding
    stats = ours.stats(1)
    window = layers.num_sliding * min(context, WINDOW) * per_layer_token(gemma.config)
    assert stats.bytes_theoretical == int(ours.store_bytes_per_token() * context) + window
    assert ours.store_config.num_layers == layers.num_global
    assert stats.bytes_allocated < full.stats(1).bytes_allocated


# ---- which caches slide -----------------------------------------------------------------------------------------


def test_a_window_no_shorter_than_the_context_keeps_every_layer_whole(gemma):
    assert SlidingLayers.of(gemma.config, WINDOW) is None
    assert SlidingLayers.of(keeping_everything(gemma.config), CONTEXT) is None
    assert cache_for(keeping_everything(gemma.config), "paged").windows is None


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_a_model_whose_every_layer_slides_holds_no_global_layer(layout):
    """Mistral 7B v0.1's kind: the main store has no layer at all, the rings hold everything."""
    config = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=8, sliding_window=WINDOW, sliding_layers=(True, True))
    model = LlamaModel.random(config, seed=0, std=0.2)
    ours, full = cache_for(config, layout), cache_for(keeping_everything(config), layout)
    ids = [t % 64 for t in prompt(30, seed=1)]
    a, b = greedy(model, ours, 1, ids, 40), greedy(model, full, 1, ids, 40)
    assert a[0] == b[0] and torch.equal(a[1], b[1])
    assert ours.store_config.num_layers == 0
    assert ours.stats(1).bytes_theoretical == 2 * FLOAT * 2 * 8 * 2 * WINDOW, "2 layers x window, whatever the context"


def test_a_verify_forward_is_cut_to_what_the_ring_can_roll_back(gemma):
    cache = cache_for(gemma.config, "contiguous")
    limit = cache.rollback_limit
    assert verify_segments(cache, 100, limit) == [limit]
    assert verify_segments(cache, 100, 2 * limit + 3) == [limit, limit, 3]
    assert verify_segments(cache_for(keeping_everything(gemma.config), "contiguous"), 100, 40) == [40]


# ---- through the engine: turns and speculative decoding ------------------------------------------------------


def engine_for(gemma_weights, layout: str, keep_everything: bool = False) -> Engine:
    model, tokenizer = gemma_weights
    engine = Engine(model, tokenizer, EngineConfig(cache=layout, block_size=8), "tiny-gemma")
    if keep_everything:
        engine.model_config = keeping_everything(model.config)
        engine.cache = make_cache(layout, engine, 8, None)
    return engine


REPEAT = "Repeat after me: the cat sat on the mat, the cat sat on the mat, and the dog lay by the door."


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_speculative_turns_give_the_plain_greedy_reply_of_a_full_cache(gemma_weights, layout):
    """Lookup drafts of up to 32 tokens: each verify forward is cut to what the ring can roll back; two turns, the
    second reusing the first's history, each the reply plain decoding gives through a cache that keeps it all."""
    lookup = SpeculativeConfig("lookup", max_draft_tokens=32, adaptive=False)
    spec = SamplingParams(**{**greedy_params(60).__dict__, "speculative": lookup})
    replies = []
    for engine, params in ((engine_for(gemma_weights, layout), spec),
                           (engine_for(gemma_weights, layout, keep_everything=True), greedy_params(60))):
        conv = engine.new_conversation("You are a test assistant.")
        turns = [list(engine.generate(conv, REPEAT, params)) for _ in range(2)]
        replies.append(([list(m.token_ids) for m in conv.messages if m.role == "assistant"], turns))
    (ours, turns), (ref, ref_turns) = replies
    assert ours == ref and len(ours) == 2
    assert turns[1][-1].prefix_hit_tokens == ref_turns[1][-1].prefix_hit_tokens > 100
    widest = max(getattr(e, "n_drafted", 0) for turn in turns for e in turn)
    assert widest > engine_for(gemma_weights, layout).cache.rollback_limit, "more drafts than one forward may roll back"
