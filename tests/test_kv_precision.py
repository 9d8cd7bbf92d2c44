"""KV precision apart from the layout: contiguous and paged caches store keys and values in float32, bfloat16 or
float16 (EngineConfig.kv_dtype, --kv-dtype, Engine.set_kv_dtype); the figures follow the bytes per element, every
exact layout gives the same bits in every precision, and the 16-bit caches stay within the quality bound."""

from __future__ import annotations

import pytest
import torch

from engine.config import ConfigError, EngineConfig
from engine.kv.precision import fastest_or_smallest, measure_attention, resolve
from tests.engine_helpers import greedy, kl_and_top1, log_probs, one_torch_thread, run_turn
from tests.test_batch_invariance import PROMPT, decode, same_bits

KL_BOUND = 0.0005  # nats, mean over the positions, against a float32 cache
PRECISIONS = ("bfloat16", "float16")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_torch_thread():
        yield


@pytest.mark.parametrize("kv_dtype", ["float32", *PRECISIONS])
def test_a_cache_stores_keys_and_values_in_its_precision_and_reports_its_bytes(tiny_engine_factory, kv_dtype):
    for cache in ("contiguous", "paged"):
        engine = tiny_engine_factory(cache, 16, kv_dtype=kv_dtype)
        assert engine.kv_dtype == getattr(torch, kv_dtype)
        conv = engine.new_conversation()
        run_turn(engine, conv, "Hello there", greedy(8))
        stats = engine.kv_stats(conv)
        size = torch.tensor([], dtype=engine.kv_dtype).element_size()
        assert stats.bytes_per_element == size
        assert stats.bytes_theoretical == engine.model_config.kv_bytes_per_token(size) * stats.tokens


@pytest.mark.parametrize("kv_dtype", PRECISIONS)
def test_every_exact_layout_gives_the_same_bits_in_a_16_bit_precision(tiny_engine_factory, kv_dtype):
    reference = decode(tiny_engine_factory("contiguous", 16, kv_dtype=kv_dtype), 1, PROMPT, 16)
    for block_size in (1, 16, 64):
        got = decode(tiny_engine_factory("paged", block_size, kv_dtype=kv_dtype), 1, PROMPT, 16)
        assert same_bits(got, reference), block_size


def test_switching_precision_between_turns_keeps_the_conversation(tiny_engine_factory):
    engine = tiny_engine_factory("paged", 16)
    conv = engine.new_conversation()
    run_turn(engine, conv, "Hello there", greedy(8))
    engine.set_kv_dtype("float16")
    turn = run_turn(engine, conv, "And again", greedy(8))
    assert engine.kv_dtype == torch.float16 and engine.cache.dtype == torch.float16
    assert turn.done.prefix_hit_tokens == 0  # a new cache: the history is prefilled again into it
    assert len(conv.messages) == 4


def test_an_unknown_precision_is_a_clear_error():
    with pytest.raises(ConfigError, match="unknown KV precision 'int3'"):
        EngineConfig(kv_dtype="int3")


def test_auto_picks_a_measured_precision_and_remembers_it(tmp_path):
    timings = measure_attention(tokens=64, stream_bytes=2**18, repeats=1)  # two layers of 64 tokens
    assert set(timings) == {"float32", "bfloat16", "float16"} and all(t > 0 for t in timings.values())
    chosen = resolve("auto", torch.device("cpu"), torch.float32, tmp_path)
    assert chosen in timings  # never a quantized precision: exact caches only
    assert resolve("auto", torch.device("cpu"), torch.float32, tmp_path) == chosen  # remembered: not re-measured
    assert resolve(None, torch.device("cpu"), torch.float32, tmp_path) == "float32"


def test_auto_takes_the_smallest_precision_within_15_percent_of_the_fastest():
    assert fastest_or_smallest({"float32": 100.0, "bfloat16": 114.0, "float16": 130.0}) == "bfloat16"
    assert fastest_or_smallest({"float32": 100.0, "bfloat16": 116.0, "float16": 120.0}) == "float32"
    assert fastest_or_smallest({"float32": 130.0, "bfloat16": 101.0, "float16": 100.0}) == "float16"  # same bytes


@pytest.mark.default_model
@pytest.mark.parametrize("kv_dtype", PRECISIONS)
def test_a_16_bit_cache_stays_within_the_quality_bound_on_real_english(default_engine, english_1024,
                                                                        float32_log_probs, kv_dtype):
    ids, reference = english_1024[:384], float32_log_probs[:384]
    try:
        default_engine.set_kv_dtype(kv_dtype)
        kl, agree = kl_and_top1(reference, log_probs(default_engine, ids))
    finally:
        default_engine.set_kv_dtype(None)
        default_engine.set_cache("paged", 16)
    agree = agree.float().mean()
    print(f"\n{kv_dtype} KV vs float32 KV over {kl.numel()} positions: mean KL {kl.mean():.7f} nats, "
          f"top-1 agreement {agree:.4f}")
    assert kl.mean() <= KL_BOUND and agree >= 0.985
