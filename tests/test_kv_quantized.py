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
from engine.kv.precision import CONTIGUOUS_GROUP
from tests.engine_helpers import one_torch_thread
from tests.test_batch_invariance import PROMPT, decode, same_bits

QUANTIZED = ("int8", "int4")


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


def test_contiguous_int4_gives_the_bits_of_a_paged_int4_pool_with_blocks_of_its_group(tiny_engine_factory):
    contiguous = decode(tiny_engine_factory("contiguous", 16, kv_dtype="int4"), 1, PROMPT, 24)
    paged = decode(tiny_engine_factory("paged", CONTIGUOUS_GROUP, kv_dtype="int4"), 1, PROMPT, 24)
    assert same_bits(contiguous, paged)


@pytest.mark.skipif(not kernels.available(), reason="the compiled CPU kernels are not built here")
@pytest.mark.parametrize("kv", QUANTIZED)
@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_the_kernels_and_the_pure_pytorch_path_agree(tiny_engine_factory, layout, kv):
    compiled = decode(tiny_engine_factory(layout, 16, kv_dtype=kv), 1, PROMPT, 16)
    with kernels.pure_pytorch():
        pure = decode(tiny_engine_factory(layout, 16, kv_dtype=kv), 1, PROMPT, 16)
    for a, b in zip(compiled, pure):
        assert torch.allclose(a, b, atol=1e-3 * float(b.abs().max()))
