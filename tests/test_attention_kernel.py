"""The compiled attention itself, for every head size and float store: it computes softmax attention, and a row's
bits depend on nothing but its own keys (not the block size, the blocks' places, the batch or the other rows).

Head sizes 32, 64, 96 and 128 take the 16-lane path on AVX-512 machines (32 channels a step: 64 at once, then a
last 32), 16 and 80 the 8-lane one; the tiny models of the other tests have heads of 16, so these are the tests
that reach the wide path on small inputs."""

import pytest
import torch

from engine import kernels
from engine.kv import quant
from engine.kv.attention import FLOAT_STORES
from engine.kv.quantized import WINDOW_DTYPE

pytestmark = pytest.mark.skipif(kernels.ops() is None, reason="the compiled kernels are not built here")

HQ, HKV = 6, 2  # groups of 3 query heads, as the default model's
HEAD_DIMS = (16, 32, 64, 80, 96, 128)
TOKENS = 300  # two key tiles of 256


def laid_out(keys: torch.Tensor, values: torch.Tensor, block_size: int, seed: int) -> tuple:
    """keys, values [HKV, T, D] -> one store each with the blocks in a shuffled order, and the block table."""
    blocks = -(-keys.shape[1] // block_size)
    place = torch.randperm(blocks, generator=torch.Generator().manual_seed(seed))  # block b sits at place[b]
    k_store = torch.zeros(HKV, blocks * block_size, keys.shape[2], dtype=keys.dtype)
    v_store = torch.zeros_like(k_store)
    for b in range(blocks):
        span = slice(b * block_size, min((b + 1) * block_size, keys.shape[1]))
        at = place[b].item() * block_size
        k_store[:, at:at + span.stop - span.start] = keys[:, span]
        v_store[:, at:at + span.stop - span.start] = values[:, span]
    table = torch.arange(blocks, dtype=torch.int32)[None]
    return k_store, v_store, table, torch.zeros(blocks, dtype=torch.int32), (place * block_size).to(torch.int32)


def attend(q, keys, values, positions, block_size=16, seed=0):
    """q [1, HQ, T, D] at `positions` over keys, values [HKV, TOKENS, D] as stored -> [1, T, HQ * D]."""
    k_store, v_store, table, block_store, block_start = laid_out(keys, values, block_size, seed)
    q_pos = torch.tensor([positions], dtype=torch.int32)
    return kernels.ops().attention(q.contiguous(), [k_store], [v_store], table, block_store, block_start,
                                   block_size, q_pos)


def reference(q, keys, values, positions, weighed=None):
    """softmax(q k / sqrt(D)) v in float64 over the stored keys and values, each row over keys 0..its position;
    `weighed`: what the values are weighed with instead of themselves (|v|: the size of the weighted sum)."""
    d = q.shape[-1]
    k, v = keys.double().repeat_interleave(HQ // HKV, 0), values.double().repeat_interleave(HQ // HKV, 0)
    v = v if weighed is None else weighed(v)
    rows = []
    for t, p in enumerate(positions):
        scores = (q[0, :, t].double()[:, None, :] @ k[:, :p + 1].transpose(1, 2))[:, 0] / d ** 0.5
        rows.append((scores.softmax(-1)[:, None, :] @ v[:, :p + 1])[:, 0].reshape(-1))
    return torch.stack(rows)[None]


def bfloat16_rounded(q: torch.Tensor) -> torch.Tensor:
    """The query as a bfloat16 store's attention reads it: scaled by 1 / sqrt(D) in float32 and rounded to bfloat16,
    as its keys are (here scaled back in float64)."""
    scale = torch.tensor(q.shape[-1], dtype=torch.float32).rsqrt()
    return (q * scale).bfloat16().double() / scale.double()


def inputs(d: int, dtype: torch.dtype, rows: int = 1, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(HKV, TOKENS, d, generator=g).to(dtype)
    values = torch.randn(HKV, TOKENS, d, generator=g).to(dtype)
    q = torch.randn(1, HQ, rows, d, generator=g) * 0.5
    return q, keys, values


@pytest.mark.parametrize("dtype", FLOAT_STORES)
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_the_compiled_attention_is_softmax_attention_for_every_head_size_and_store(d, dtype):
    q, keys, values = inputs(d, dtype, rows=4)
    positions = [0, 100, 256, TOKENS - 1]  # one key, a part of a tile, a tile and one key, two tiles
    out = attend(q, keys, values, positions)
    if dtype != torch.bfloat16:
        torch.testing.assert_close(out.double(), reference(q, keys, values, positions), atol=2e-6, rtol=1e-5)
        return
    # bfloat16 stores meet a bfloat16 query and bfloat16 softmax weights (vdpbf16ps where the processor has it):
    # each weight within 2^-9 of itself, so a value's sum within 2^-9 of the sum of p |v| (twice that allowed)
    expected = reference(bfloat16_rounded(q), keys, values, positions)
    bound = 2 ** -8 * reference(bfloat16_rounded(q), keys, values, positions, weighed=torch.abs) + 2e-6
    assert ((out.double() - expected).abs() <= bound).all()


@pytest.mark.parametrize("dtype", FLOAT_STORES)
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_block_size_and_the_blocks_places_change_no_bit(d, dtype):
    q, keys, values = inputs(d, dtype)
    first = attend(q, keys, values, [TOKENS - 1], block_size=16, seed=0)
    for block_size, seed in ((1, 1), (8, 2), (64, 3), (16, 4)):
        assert torch.equal(attend(q, keys, values, [TOKENS - 1], block_size, seed), first)


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_a_decode_row_gives_the_bits_it_gives_among_prefill_rows(d):
    q, keys, values = inputs(d, torch.bfloat16, rows=5)
    positions = list(range(TOKENS - 5, TOKENS))
    among = attend(q, keys, values, positions)
    alone = attend(q[:, :, -1:], keys, values, positions[-1:])
    assert torch.equal(alone[:, 0], among[:, -1])


def test_padding_rows_give_zeros_and_leave_the_other_rows_bits():
    # rows 4-15 pad the first group of 16 query rows; rows 16-19 are a whole group of padding (no key tile at all)
    q, keys, values = inputs(64, torch.bfloat16, rows=20)
    positions = list(range(TOKENS - 4, TOKENS))
    padded = attend(q, keys, values, positions + [-1] * 16)
    alone = attend(q[:, :, :4], keys, values, positions)
    assert torch.equal(padded[:, :4], alone)
    assert torch.equal(padded[:, 4:], torch.zeros_like(padded[:, 4:]))


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_a_sequence_gives_the_same_bits_alone_and_beside_another(d):
    q, keys, values = inputs(d, torch.float16)
    other_q, other_keys, other_values = inputs(d, torch.float16, seed=1)
    alone = attend(q, keys, values, [TOKENS - 1])
    # the two sequences in one store, one block table each; the other one shorter
    k_store = torch.cat([keys, other_keys], 1)
    v_store = torch.cat([values, other_values], 1)
    blocks = TOKENS // 20
    table = torch.stack([torch.arange(blocks), blocks + torch.arange(blocks)]).to(torch.int32)
    block_start = (torch.arange(2 * blocks) * 20).to(torch.int32)
    both = kernels.ops().attention(torch.cat([q, other_q]).contiguous(), [k_store], [v_store], table,
                                   torch.zeros(2 * blocks, dtype=torch.int32), block_start, 20,
                                   torch.tensor([[TOKENS - 1], [TOKENS - 40]], dtype=torch.int32))
    assert torch.equal(both[:1], alone)


# ---- the quantized stores: int8 and int4 codes, read by integer dot products

QUANT_HEAD_DIMS = (32, 64, 96, 128)  # int4: 64 and 128 take the AVX-512 value path, 32 and 96 the AVX2 one


def quantized(codec, keys, values, block_size=16, sink=0):
    """keys, values [HKV, TOKENS, D] -> the codec's stores (every full block as codes: no residual), the window
    (the first `sink` rows, then the last part block), their KeyMap arguments and what the attention reads [HKV,
    TOKENS, D] each: the sink's rows, then what the codes dequantize to, then the window's rows."""
    blocks, d = -(-TOKENS // block_size), keys.shape[2]
    stores = [[s[0]] for s in codec.storage(1, HKV, blocks, block_size, d, "cpu")]
    window = torch.zeros(2, HKV, sink + block_size, d, dtype=WINDOW_DTYPE[codec.name] or torch.float32)
    table = torch.arange(blocks, dtype=torch.int32)[None]
    block_store = torch.zeros(blocks, dtype=torch.int32)
    block_start = torch.arange(blocks, dtype=torch.int32) * block_size
    where = (table, block_store, block_start, block_size)
    prefill_pos = torch.arange(TOKENS, dtype=torch.int32)[None]
    kernels.ops().write_kv_quant(*stores, [window[0]], [window[1]], keys[None], values[None], *where, prefill_pos,
                                 torch.zeros(1, dtype=torch.int32), 0, sink, codec.bits)
    full = TOKENS // block_size * block_size
    k_codes, v_codes, k_params, v_params = (s[0] for s in stores)
    if kernels.kv_tiled(codec.bits, d, block_size, "cpu"):  # the codes as rows
        k_codes, v_codes = (quant.from_tiles(c[:, :full], keys) for c, keys in ((k_codes, True), (v_codes, False)))
    g = full // block_size
    k_back = codec.dequantize_keys(k_codes[:, :full].reshape(HKV, g, block_size, -1), k_params[:, :g], torch.float32)
    v_back = codec.dequantize_values(v_codes[:, :full], v_params[:, :full], torch.float32)
    rows = WINDOW_DTYPE[codec.name] or torch.float32  # what the window's rows are held in
    held = [x.to(rows).float() for x in (keys, values)]
    seen_k = torch.cat([held[0][:, :sink], k_back[:, sink:], held[0][:, full:]], dim=1)
    seen_v = torch.cat([held[1][:, :sink], v_back[:, sink:], held[1][:, full:]], dim=1)
    return stores, window, where, full, seen_k, seen_v


@pytest.mark.parametrize("sink", (0, 5))
@pytest.mark.parametrize("bits", (8, 4))
@pytest.mark.parametrize("d", QUANT_HEAD_DIMS)
def test_the_quantized_attention_is_softmax_attention_over_what_its_codes_hold(d, bits, sink):
    """The kernel rounds each block's query to integers (int8 keys: 15 bits, int4: 8) and each 32 tokens' softmax
    weights to 8 bits, so it is close to, not equal to, float64 attention over the dequantized codes (measured:
    int8 at most 0.11% of the output's largest value, int4 0.6%). A channel or token read from the wrong place
    moves rows by far more. A sink of 5 rows starts the codes inside a block (and a tile, where codes are tiled)."""
    from engine.kv.quant import CODECS

    codec = CODECS[f"int{bits}"]
    q, keys, values = inputs(d, torch.float32, rows=4)
    keys = keys * torch.linspace(0.5, 3, d)  # channels of different ranges, as real keys have
    stores, window, where, full, seen_k, seen_v = quantized(codec, keys, values, sink=sink)
    positions = [0, 100, 256, TOKENS - 1]  # one key, a part of a tile, a tile and one key, two tiles and the window
    q_pos = torch.tensor([positions], dtype=torch.int32)
    out = kernels.ops().attention_quant(q.contiguous(), *stores, [window[0]], [window[1]], *where, q_pos,
                                        torch.tensor([full], dtype=torch.int32), 0, sink, bits)
    expected = reference(q, seen_k, seen_v, positions)
    error = (out.double() - expected).abs().amax() / expected.abs().amax()
    assert error < {8: 0.003, 4: 0.012}[bits], f"largest error {error:.4f} of the largest output"
    wrong = reference(q, seen_k, seen_v.roll(1, dims=1), positions)  # every value one token off
    assert (wrong - expected).abs().amax() / expected.abs().amax() > 10 * error
