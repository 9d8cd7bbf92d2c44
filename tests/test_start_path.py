"""The start path from a converted model: it imports only what it uses, holds no tensor twice, and its faster
dequantization gives the same bits as before."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import loader
from engine.config import ModelConfig
from engine.model import LlamaModel, random_hf_state_dict
from engine.weights.convert import to_auto_format
from engine.weights.formats import QuantizedWeight, quantize_int4, quantize_int8
from engine.weights.gguf_blocks import quantize_int8_groups
from engine.weights.linear import build_linear
from tests.gguf_files import write_tiny_gguf

ROOT = Path(__file__).resolve().parents[1]
SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
             head_dim=16, max_position_embeddings=64, tie_word_embeddings=True)


def reference_dequantize(q: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """The formula as first written: codes to dtype, times the scale, plus the minimum (two roundings)."""
    n, k = q.shape
    g = q.group_size
    w = q.unpacked_codes().to(dtype).view(n, k // g, g) * q.scales.to(dtype)[..., None]
    if q.minimums is not None:
        w = w + q.minimums.to(dtype)[..., None]
    return w.view(n, k)


WEIGHTS = {"int4/32": lambda w: quantize_int4(w), "int4/64": lambda w: quantize_int4(w, 64),
           "int8 per channel": quantize_int8, "int8/32": lambda w: quantize_int8_groups(w, 32)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("make", WEIGHTS.values(), ids=WEIGHTS.keys())
def test_in_place_dequantization_gives_the_bits_of_the_formula(make, dtype):
    q = make(torch.randn(96, 128, generator=torch.Generator().manual_seed(0)))
    assert torch.equal(q.dequantize(dtype), reference_dequantize(q, dtype))
    module = build_linear(q)
    assert torch.equal(module.transient_dense(dtype), module.dense(dtype))


def test_a_prefill_dequantizes_every_projection_into_one_reused_buffer():
    g = torch.Generator().manual_seed(1)
    first, second = (build_linear(quantize_int4(torch.randn(64, 128, generator=g))) for _ in range(2))
    a = first.transient_dense(torch.float32)
    b = second.transient_dense(torch.float32)
    assert a.data_ptr() == b.data_ptr()  # the same storage: no fresh tensor (and its page faults) per call


def test_a_load_converts_in_place_and_the_model_consumes_what_it_was_given():
    config = ModelConfig(**SMALL)
    state = random_hf_state_dict(config, seed=0, std=0.05)
    reference = LlamaModel.from_hf_state_dict(config, dict(state))
    converted = to_auto_format(state, "int4", {})
    assert converted is state  # the same dict: each original freed as its conversion replaces it
    model = LlamaModel.from_hf_state_dict(config, state, consume=True)
    assert state == {}  # nothing left for the caller to keep alive beside the model
    assert {m.format_name for m in model.projections().values()} <= {"int4", "int8"}
    assert reference.config == model.config


def test_a_start_from_the_cache_imports_neither_transformers_nor_gguf_nor_dynamo(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(cache))
    path, _ = write_tiny_gguf(tmp_path / "tiny.gguf")
    loader.load_weights(str(path))  # the conversion, which does use transformers and gguf
    script = ("import sys; from engine import loader; from engine.model import LlamaModel; "
              "w = loader.load_weights(sys.argv[1]); LlamaModel.from_hf_state_dict(w.config, w.state_dict); "
              "print(sorted({m.split('.')[0] for m in sys.modules} & {'transformers', 'gguf'}), "
              "'torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "KVSCOPE_CACHE_DIR": str(cache)}, timeout=300)  # kernels: conftest
    assert out.stdout.split() == ["[]", "False"], out.stderr[-2000:]
