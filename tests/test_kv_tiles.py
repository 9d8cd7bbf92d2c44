"""Quantized stores whose codes sit in tiles (engine.kernels.kv_tiled: AVX-512 builds, heads of 64, blocks of 16
and more), through the engine: the compiled kernels write and read the tiles, the pure PyTorch path writes, reads
and truncates through quant.to_tiles / from_tiles, and a store written by one is read by the other (a truncation
into a quantized block brings its kept rows back to the window through the pure path, whichever path wrote them).

The tiny models of the other tests have heads of 16, which keep rows; these tests use heads of 64, as the default
model's. Where the kernels keep rows for these heads too (AVX2 machines) the same behaviours are checked on rows."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine import kernels
from engine.config import EngineConfig
from engine.engine import Engine
from engine.model import LlamaModel
from tests.engine_helpers import one_torch_thread

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the compiled CPU kernels are not built here")

PROMPT = list(range(300, 349))  # 49 tokens: three blocks of 16 and one token
KEEP = 20  # a truncation inside a block (paged) and a group of 32 (contiguous) that hold codes


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def wide_model(tiny_config) -> LlamaModel:
    return LlamaModel.random(dataclasses.replace(tiny_config, head_dim=64), seed=0, std=0.1)


def engine_of(model, tokenizer, layout: str, kv: str, sink: int) -> Engine:
    return Engine(model, tokenizer, EngineConfig(cache=layout, block_size=16, kv_dtype=kv, kv_residual=0,
                                                 kv_sink=sink), "tiny-random")


def decode_truncate_continue(engine: Engine) -> list[torch.Tensor]:
    """Prefill, four greedy steps, back to KEEP tokens (into a block that holds codes), then the prompt's tail
    again and four greedy steps: every step's logits."""
    cache = engine.cache
    cache.prepare(1, PROMPT)
    out = [engine.step([1], [PROMPT])[0]]
    for _ in range(4):
        out.append(engine.step([1], [[int(out[-1].argmax())]])[0])
    cache.truncate(1, KEEP)
    out.append(engine.step([1], [PROMPT[KEEP:]])[0])
    for _ in range(4):
        out.append(engine.step([1], [[int(out[-1].argmax())]])[0])
    return out


@pytest.mark.parametrize("sink", (0, 5))
@pytest.mark.parametrize("kv", ("int8", "int4"))
@pytest.mark.parametrize("layout", ("paged", "contiguous"))
def test_tiled_codes_read_alike_through_the_kernels_and_the_pure_pytorch_path(wide_model, tokenizer, layout, kv,
                                                                              sink):
    """A sink of 5 starts the codes inside a tile. The kernels put each 32 tokens' softmax weights on an 8-bit grid
    and the pure path does not, so the two agree within that rounding (as on rows: test_kv_quantized); a tile read
    in another order than it was written moves logits by far more."""
    compiled_engine = engine_of(wide_model, tokenizer, layout, kv, sink)
    assert compiled_engine.cache.state.tiled == kernels.kv_tiled(8 if kv == "int8" else 4, 64, 16, "cpu")
    compiled = decode_truncate_continue(compiled_engine)
    with kernels.pure_pytorch():
        pure = decode_truncate_continue(engine_of(wide_model, tokenizer, layout, kv, sink))
    for a, b in zip(compiled, pure):
        assert torch.allclose(a, b, atol=2e-2 * float(b.abs().max()))


@pytest.mark.parametrize("kv", ("int8", "int4"))
def test_a_sequence_sharing_tiled_blocks_continues_as_their_first_holder(wide_model, tokenizer, kv):
    engine = engine_of(wide_model, tokenizer, "paged", kv, 0)
    engine.cache.prepare(1, PROMPT)
    engine.step([1], [PROMPT[:48]])
    first = engine.step([1], [PROMPT[48:]])[0]  # one row, as the sharer's (a 49-row prefill rounds otherwise)
    held = engine.cache.prepare(2, PROMPT)
    assert held == 48  # three blocks of codes from the prefix cache
    assert torch.equal(engine.step([2], [PROMPT[held:]])[0], first)
