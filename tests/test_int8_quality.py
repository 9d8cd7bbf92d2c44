"""int8 KV quantization: the quantizer's error bounds, and paged-int8 against float on real English text."""

from __future__ import annotations

import pytest
import torch

from engine.kv import quant
from engine.kv.paged import PagedCache
from engine.kv.paged_quant import PagedInt8Cache
from engine.model import LlamaModel
from tests.engine_helpers import forward_through_cache, kl_and_top1, log_probs, one_torch_thread

FP16_REL = 2.0**-10  # a float16 scale is within this relative distance of the exact one (with margin)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_torch_thread():
        yield


def randn(*shape, seed=0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def round_trip_keys(k: torch.Tensor) -> torch.Tensor:
    q, scale = quant.quantize_keys(k)
    return quant.dequantize_keys(q, scale, torch.float32).view(k.shape)


# ---- keys: one scale per (head, group of tokens, channel) ----------------------------------------------


def test_keys_quantize_to_int8_with_one_float16_scale_per_head_group_and_channel():
    k = randn(3, 4, 16, 32)  # [H, G, T, D]
    q, scale = quant.quantize_keys(k)
    assert q.dtype == torch.int8 and q.shape == k.shape
    assert scale.dtype == quant.SCALE_DTYPE == torch.float16 and scale.shape == (3, 4, 32)
    assert q.abs().max() == 127  # the largest magnitude of each channel uses the full range
    assert q.min() >= -127


def test_key_round_trip_error_is_at_most_half_a_step_of_its_channel():
    k = randn(2, 3, 16, 64)
    absmax = k.abs().amax(dim=2, keepdim=True)  # [H, G, 1, D]
    bound = absmax / 127 / 2 + absmax * FP16_REL
    assert ((round_trip_keys(k) - k).abs() <= bound).all()


def test_an_outlier_key_channel_does_not_cost_the_other_channels_precision():
    k = randn(2, 2, 16, 64)
    k[..., 5] *= 100.0  # one channel 100x larger, as in real attention keys
    error = (round_trip_keys(k) - k).abs()
    others = torch.cat([error[..., :5], error[..., 6:]], dim=-1)
    typical = k[..., :5].abs().amax()
    assert others.max() <= typical / 127  # as precise as if the outlier were not there
    assert error[..., 5].max() <= k[..., 5].abs().amax() / 127  # the outlier keeps its own relative precision
    # the same keys quantized with one scale per token (the value scheme) lose 10x more on those channels
    h, g, t, d = k.shape
    per_token = quant.dequantize_values(*quant.quantize_values(k.view(h, g * t, d)), torch.float32)
    per_token_error = (per_token.view(k.shape) - k).abs()
    per_token_others = torch.cat([per_token_error[..., :5], per_token_error[..., 6:]], dim=-1)
    assert per_token_others.mean() > 10 * others.mean()


def test_key_scales_are_separate_per_group_of_tokens():
    k = randn(1, 2, 16, 8)
    k[:, 1] *= 1000.0  # the second block of tokens is much larger
    _, scale = quant.quantize_keys(k)
    assert (scale[:, 1].float() > 100 * scale[:, 0].float()).all()
    error = (round_trip_keys(k) - k).abs()
    assert error[:, 0].max() <= k[:, 0].abs().amax() / 127


# ---- values: one scale per (head, token) ----------------------------------------------------------------


def test_values_quantize_to_int8_with_one_float16_scale_per_head_and_token():
    v = randn(3, 20, 32)  # [H, N, D]
    q, scale = quant.quantize_values(v)
    assert q.dtype == torch.int8 and q.shape == v.shape
    assert scale.dtype == torch.float16 and scale.shape == (3, 20)
    expected = v.abs().amax(dim=-1) / 127
    torch.testing.assert_close(scale.float(), expected, atol=0, rtol=FP16_REL)


def test_value_round_trip_error_is_at_most_half_a_step_of_its_token():
    v = randn(2, 50, 64)
    absmax = v.abs().amax(dim=-1, keepdim=True)
    back = quant.dequantize_values(*quant.quantize_values(v), torch.float32)
    assert ((back - v).abs() <= absmax / 127 / 2 + absmax * FP16_REL).all()


def test_a_large_value_token_does_not_cost_the_other_tokens_precision():
    v = randn(1, 8, 64)
    v[:, 3] *= 1000.0
    back = quant.dequantize_values(*quant.quantize_values(v), torch.float32)
    small = torch.cat([v[:, :3], v[:, 4:]], dim=1)
    small_back = torch.cat([back[:, :3], back[:, 4:]], dim=1)
    assert (small_back - small).abs().max() <= small.abs().amax() / 127


def test_all_zero_inputs_round_trip_to_zero_without_nans():
    zeros_k, zeros_v = torch.zeros(1, 1, 4, 8), torch.zeros(1, 4, 8)
    assert torch.equal(round_trip_keys(zeros_k), zeros_k)
    assert torch.equal(quant.dequantize_values(*quant.quantize_values(zeros_v), torch.float32), zeros_v)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs_round_trip_within_bounds(dtype):
    v = randn(2, 10, 32).to(dtype)
    back = quant.dequantize_values(*quant.quantize_values(v), dtype)
    assert back.dtype == dtype
    absmax = v.float().abs().amax(dim=-1, keepdim=True)
    assert ((back.float() - v.float()).abs() <= absmax / 127 + absmax * 2**-7).all()


# ---- the cache: what is quantized when ------------------------------------------------------------------


def test_int8_reads_float_until_a_block_fills_then_quantized_keys(tiny_config):
    model = LlamaModel.random(tiny_config, seed=3, std=0.1)
    ids = torch.randint(1000, (20,), generator=torch.Generator().manual_seed(0)).tolist()
    args = (tiny_config, torch.float32, torch.device("cpu"), 64)
    exact = forward_through_cache(model, PagedCache(*args, block_size=8), ids, prefill=5)
    int8 = forward_through_cache(model, PagedInt8Cache(*args, block_size=8), ids, prefill=5)
    # positions 0-6: the first block is still partly filled, so attention read full-precision keys
    torch.testing.assert_close(int8[:7], exact[:7], atol=1e-5, rtol=1e-5)
    # from position 7 on (the block is full), every step reads quantized keys and values
    assert ((int8[7:] - exact[7:]).abs().amax(dim=-1) > 1e-5).all()


# ---- the default model on real English text -----------------------------------------------------------

# Measured on SmolLM2-135M-Instruct, float32 weights, blocks of 16, 1,024 positions of the Python language
# reference teacher-forced 16 at a time (README, KV precision): mean KL(float || int8) ~0.0002-0.0004 nats,
# top-1 agreement ~99%. The bounds are the issue's: int8 keeps 0.0005 nats and 98.5%.
MAX_MEAN_KL = 0.0005
MIN_TOP1 = 0.985

BOUNDS = {"int8": (MAX_MEAN_KL, MIN_TOP1), "int4": (0.0047, 0.97)}  # the KV precision issue's targets


def quantized_vs_float(default_engine, english_1024, float32_log_probs, kv: str):
    """(KL(float || kv) per position, top-1 agreement per position) over 1,024 positions of English."""
    try:
        default_engine.set_cache("paged", 16)
        default_engine.set_kv_dtype(kv)
        kl, agree = kl_and_top1(float32_log_probs, log_probs(default_engine, english_1024))
    finally:
        default_engine.set_kv_dtype(None)
        default_engine.set_cache("paged", 16)
    print(f"\n{kv} vs float over {kl.numel()} positions: mean KL {kl.mean():.6f} nats, max {kl.max():.4f}, "
          f"top-1 agreement {agree.float().mean():.4f}")
    return kl, agree


@pytest.fixture(scope="module")
def int8_vs_float(default_engine, english_1024, float32_log_probs):
    return quantized_vs_float(default_engine, english_1024, float32_log_probs, "int8")


@pytest.mark.default_model
def test_int4_keys_per_channel_with_a_residual_and_a_sink_stay_within_their_bound(default_engine, english_1024,
                                                                                   float32_log_probs):
    kl, agree = quantized_vs_float(default_engine, english_1024, float32_log_probs, "int4")
    max_kl, min_top1 = BOUNDS["int4"]
    assert kl.mean() > 0 and kl.mean() <= max_kl, f"mean KL {kl.mean():.5f} nats"
    assert agree.float().mean() >= min_top1, f"top-1 agreement {agree.float().mean():.4f}"


@pytest.mark.default_model
def test_int8_next_token_distributions_stay_close_to_float(int8_vs_float):
    kl, _ = int8_vs_float
    assert kl.numel() >= 1000
    assert kl.min() > -1e-5  # a KL divergence is never negative (up to rounding)
    assert kl.mean() > 0  # the int8 cache really was read
    assert kl.mean() <= MAX_MEAN_KL, f"mean KL {kl.mean():.5f} nats"


@pytest.mark.default_model
def test_int8_top1_agrees_with_float(int8_vs_float):
    _, agree = int8_vs_float
    assert agree.float().mean() >= MIN_TOP1, f"top-1 agreement {agree.float().mean():.4f}"
