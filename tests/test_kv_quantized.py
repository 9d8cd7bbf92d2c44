"""Quantized KV precisions on every layout: int8 (symmetric) and int4 (KIVI-style: keys per channel over a block,
values per token, a scale and a minimum each, the block being filled in full precision) for contiguous and paged.

A contiguous cache quantizes groups of 32 tokens the way a paged pool quantizes its blocks, and both are read by
the same attention routine: contiguous int4 gives the bits of a paged int4 pool with blocks of 32. The compiled
kernels and the pure PyTorch path hold the same codes and agree within float rounding."""

from __future__ import annotations

import pytest
import torch

from engine import kernels
from engine.kv import quant
from engine.kv.attention import KeyMap
from engine.kv.precision import CONTIGUOUS_GROUP, bytes_per_element
from tests.engine_helpers import english_ids, held_storage_bytes, one_torch_thread
from tests.test_batch_invariance import PROMPT, decode, same_bits

QUANTIZED = ("int8", "int4")
SMALL = {"kv_residual": 32, "kv_sink": 8}  # the tiny model's short prompts: a residual and a sink that they pass


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_torch_thread():
        yield


@pytest.mark.parametrize("kv", QUANTIZED)
@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_a_layout_stores_codes_and_scales_in_the_precision_it_was_given(tiny_engine_factory, layout, kv):
    engine = tiny_engine_factory(layout, 16, kv_dtype=kv)
    decode(engine, 1, PROMPT, 8)
    stats = engine.cache.stats(1)
    assert engine.cache.name == f"{layout}-{kv}" and stats.precision == kv == engine.kv_dtype_name
    codes = quant.CODECS[kv].storage(1, 1, 1, 16, 64, "meta")[0].dtype
    tensors = engine.cache.storage_tensors() if layout == "paged" else engine.cache.reservations[1].tensors
    assert tensors[0].dtype == codes
    assert stats.bytes_window > 0 and stats.bytes_used >= stats.bytes_theoretical + stats.bytes_window


@pytest.mark.parametrize("full_precision", [{"kv_residual": 0, "kv_sink": 0}, SMALL])
def test_contiguous_int4_gives_the_bits_of_a_paged_int4_pool_with_blocks_of_its_group(tiny_engine_factory,
                                                                                     full_precision):
    contiguous = decode(tiny_engine_factory("contiguous", 16, kv_dtype="int4", **full_precision), 1, PROMPT, 64)
    paged = decode(tiny_engine_factory("paged", CONTIGUOUS_GROUP, kv_dtype="int4", **full_precision), 1, PROMPT, 64)
    assert same_bits(contiguous, paged)


def test_the_residual_and_the_sink_are_read_in_full_precision_and_the_middle_as_codes(tiny_engine_factory):
    engine = tiny_engine_factory("paged", 8, kv_dtype="int4", **SMALL)
    decode(engine, 1, PROMPT, 64)
    held = engine.cache.tokens_held(1)
    state = engine.cache.state
    assert state.seqs[1].upto == (held - 32) // 8 * 8 > 8  # the blocks 32 tokens behind the newest hold codes
    assert engine.cache.seqs[1].hashes and len(engine.cache.seqs[1].hashes) == state.seqs[1].upto // 8
    full = decode(tiny_engine_factory("paged", 8, kv_dtype="float32"), 1, PROMPT, 64)
    none = decode(tiny_engine_factory("paged", 8, kv_dtype="int4", kv_residual=0, kv_sink=0), 1, PROMPT, 64)
    kept = decode(tiny_engine_factory("paged", 8, kv_dtype="int4", **SMALL), 1, PROMPT, 64)
    error = [float((a - b).abs().max()) for a, b in zip(kept, full)]
    error_without = [float((a - b).abs().max()) for a, b in zip(none, full)]
    assert sum(error) < sum(error_without)  # full precision where attention looks most costs less error


def test_a_sequence_sharing_a_quantized_prefix_reads_the_sink_its_first_holder_kept(tiny_engine_factory):
    engine = tiny_engine_factory("paged", 8, kv_dtype="int4", **SMALL)
    prompt = PROMPT * 3
    first = decode(engine, 1, prompt, 1)
    assert engine.cache.prepare(2, prompt) > 0  # the prefix cache serves the second sequence
    second = engine.step([2], [prompt[engine.cache.tokens_held(2):]])[0]
    assert torch.equal(second, first[0])
    assert engine.cache.sink_rows  # kept for the prefix cache, and counted as the cache's memory
    assert engine.cache.stats(1).bytes_allocated == held_storage_bytes(engine.cache)


def test_int4_key_parameters_take_8_bits_a_channel_and_keep_every_value_within_half_a_step():
    k = torch.randn(3, 4, 16, 64) * torch.linspace(0.2, 5, 64) + 2 * torch.randn(64)  # outlier channels, offsets
    codes, params = quant.quantize_keys_int4(k)
    assert params.dtype == torch.uint8 and params.shape == (3, 4, quant.key_params_bytes(64)) == (3, 4, 132)
    scale, _ = quant.key_scales_int4(params)  # [3, 4, 64]
    back = quant.dequantize_keys_int4(codes, params, torch.float32).view_as(k)
    assert ((back - k).abs() <= scale[:, :, None] / 2 * (1 + 1e-5)).all()  # no value clipped by its channel's range
    assert bytes_per_token_ratio("int4", 16) <= 0.3  # the bound, scales included, at the default block


def test_tiles_hold_a_blocks_rows_in_the_order_the_kernels_read_them():
    """Keys: dword g of the 16 tokens of a tile side by side (one register of a token a lane); values: byte j of a
    quad's four tokens side by side (four tokens a lane). Rows come back unchanged."""
    rows = torch.randint(0, 256, (2, 32, 24), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    keys, values = quant.to_tiles(rows, keys=True), quant.to_tiles(rows, keys=False)
    w = rows.shape[-1]
    for t in (0, 5, 17, 31):
        tile = keys[1, t // 16 * 16:t // 16 * 16 + 16].reshape(-1)
        for g in range(w // 4):
            at = (g * 16 + t % 16) * 4
            assert torch.equal(tile[at:at + 4], rows[1, t, 4 * g:4 * g + 4])
        quad = values[1, t // 4 * 4:t // 4 * 4 + 4].reshape(-1)
        assert torch.equal(quad[t % 4::4], rows[1, t])
    assert torch.equal(quant.from_tiles(keys, keys=True), rows)
    assert torch.equal(quant.from_tiles(values, keys=False), rows)


def bytes_per_token_ratio(kv: str, block: int) -> float:
    return bytes_per_element(kv, block, 64) / bytes_per_element("float16", block, 64)


@pytest.mark.skipif(not kernels.available(), reason="the compiled CPU kernels are not built here")
@pytest.mark.parametrize("codec", [quant.INT8, quant.INT4], ids=lambda c: c.name)
@pytest.mark.parametrize("d", [64, 96])
def test_the_kernel_quantizes_keys_and_values_to_the_bits_of_the_pure_pytorch_codec(codec, d):
    h, bs, t = 3, 16, 128
    k = torch.randn(1, h, t, d) * torch.linspace(0.2, 5, d) + 2 * torch.randn(d)
    v = torch.randn(1, h, t, d) * torch.linspace(3, 0.1, t)[:, None]
    k[..., 5], v[:, :, 7] = 0.0, 1e-7  # a constant channel and a near-constant token: the scales' floors
    stores = [[s[0]] for s in codec.storage(1, h, t // bs, bs, d, "cpu")]
    window_dtype = torch.float16 if codec.bits == 4 else torch.float32
    window = torch.zeros(2, h, bs, d, dtype=window_dtype)  # no residual, no sink: a block is quantized as it fills
    keys = KeyMap.build([list(range(t // bs))], torch.zeros(t // bs, dtype=torch.int32),
                        torch.arange(t // bs, dtype=torch.int32) * bs, bs, [0], [t], torch.device("cpu"))
    kernels.ops().write_kv_quant(*stores, [window[0]], [window[1]], k, v, keys.table, keys.block_store,
                                 keys.block_start, bs, keys.q_pos, torch.zeros(1, dtype=torch.int32), 0, 0,
                                 codec.bits)
    held_k, held_v = (x[0].to(window_dtype).float() for x in (k, v))  # a block is quantized from its window rows
    key_codes, key_params = codec.quantize_keys(held_k.view(h, t // bs, bs, d))
    value_codes, value_params = codec.quantize_values(held_v)
    key_rows, value_rows = key_codes.reshape(h, t, -1), value_codes.reshape(h, t, -1)
    if kernels.kv_tiled(codec.bits, d, bs, "cpu"):  # stored as the AVX-512 path reads them
        key_rows, value_rows = quant.to_tiles(key_rows, keys=True), quant.to_tiles(value_rows, keys=False)
    assert torch.equal(stores[0][0], key_rows) and torch.equal(stores[1][0], value_rows)
    assert torch.equal(stores[2][0], key_params.reshape(stores[2][0].shape))
    assert torch.equal(stores[3][0], value_params.reshape(stores[3][0].shape))


@pytest.mark.skipif(not kernels.available(), reason="the compiled CPU kernels are not built here")
@pytest.mark.parametrize("kv", QUANTIZED)
@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_the_kernels_and_the_pure_pytorch_path_agree(tiny_engine_factory, layout, kv):
    compiled = decode(tiny_engine_factory(layout, 16, kv_dtype=kv), 1, PROMPT, 16)
    with kernels.pure_pytorch():
        pure = decode(tiny_engine_factory(layout, 16, kv_dtype=kv), 1, PROMPT, 16)
    # the kernels put each 32 tokens' softmax weights on an 8-bit grid, the pure path keeps them in float32: int8's
    # logits measured up to 0.62% of the largest apart after 16 steps (the attention itself: test_attention_kernel)
    for a, b in zip(compiled, pure):
        assert torch.allclose(a, b, atol=2e-2 * float(b.abs().max()))


GREEDY_STEPS = 48
# float32's top two logits closer than this may go either way under the precision's rounding (and each instruction
# set's kernels round their own way). Measured on the Intel Xeon along english_320's continuation: the AVX-512
# kernels' disagreements sat at gaps of 0.0002 (int8, bfloat16) and 0.014 (int4, bfloat16); built for AVX2, int4 also
# flipped gaps of 0.04, 0.17 and 0.90 (its KL there 0.00131 nats, AVX-512's 0.00136: the same accuracy), and int8
# flipped a gap of 0.151 on a 700-token text
NEAR_TIE = {"int8": 0.25, "int4": 1.0, "bfloat16": 0.25}
CLEAR_DECISIONS = 35  # of the 49 positions, at least this many are not near ties (so the test says something)


@pytest.fixture(scope="module")
def english_320(tokenizer) -> list[int]:
    return english_ids(tokenizer, 320)  # longer than int4's residual: its middle is read from codes


@pytest.fixture(scope="module")
def float32_greedy(default_engine, english_320) -> list[torch.Tensor]:
    """The logits of english_320's greedy continuation through a float32 cache, shared by every precision's test."""
    default_engine.set_cache("paged", 16)
    try:
        return decode(default_engine, 11, english_320, GREEDY_STEPS)
    finally:
        default_engine.cache.release(11)


def teacher_forced(engine, seq_id: int, prompt: list[int], tokens: list[int]) -> list[torch.Tensor]:
    """The prompt's last logits, then the logits after each of `tokens` fed in turn (whatever the cache would pick)."""
    engine.cache.prepare(seq_id, prompt)
    out = [engine.step([seq_id], [prompt])[0]]
    out += [engine.step([seq_id], [[t]])[0] for t in tokens]
    engine.cache.release(seq_id)
    return out


def top_two_gap(logits: torch.Tensor) -> float:
    top = torch.topk(logits.float(), 2).values
    return float(top[0] - top[1])


@pytest.mark.default_model
@pytest.mark.parametrize("kv", [*QUANTIZED, "bfloat16"])
def test_greedy_decoding_picks_float32s_token_wherever_float32_is_not_a_near_tie(default_engine, english_320,
                                                                                  float32_greedy, kv):
    """Along float32's greedy continuation (its tokens fed to both), each precision picks float32's token at every
    position where float32's top two logits are the precision's NEAR_TIE or more apart."""
    tokens = [int(x.argmax()) for x in float32_greedy]
    gaps = [top_two_gap(x) for x in float32_greedy]
    assert sum(g >= NEAR_TIE[kv] for g in gaps) >= CLEAR_DECISIONS
    try:
        default_engine.set_cache("paged", 16)
        default_engine.set_kv_dtype(kv)
        got = [int(x.argmax()) for x in teacher_forced(default_engine, 12, english_320, tokens[:-1])]
    finally:
        default_engine.set_kv_dtype(None)
        default_engine.set_cache("paged", 16)
    differ = [(i, round(g, 4)) for i, (a, b, g) in enumerate(zip(tokens, got, gaps)) if a != b]
    print(f"\n{kv}: {len(tokens) - len(differ)} of {len(tokens)} tokens as float32's; where not (position, "
          f"float32's gap): {differ}")
    assert all(g < NEAR_TIE[kv] for _, g in differ)
