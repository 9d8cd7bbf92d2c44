"""A first conversion streams: each GGUF tensor is read, converted and written before the next, with progress
tensor by tensor, and the safetensors file it writes holds exactly what the whole-model reader reads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from engine import loader
from engine.weights.safetensors_stream import SafetensorsStream
from tests.gguf_files import write_tiny_gguf


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(cache))
    return cache


def test_a_streamed_file_reads_back_every_tensor_bit_for_bit(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {"f32": torch.randn(3, 5, generator=g), "bf16": torch.randn(4, 8, generator=g).bfloat16(),
               "f16": torch.randn(7, generator=g).half(), "i8": torch.randint(-127, 127, (6, 32), dtype=torch.int8),
               "u8": torch.randint(0, 255, (2, 16), dtype=torch.uint8), "empty": torch.zeros(0, 4),
               "strided": torch.randn(8, 6, generator=g).t()}
    stream = SafetensorsStream(tmp_path / "m.safetensors", metadata={"format": "pt"})
    for name, t in tensors.items():
        stream.add(name, t)
    stream.finish()
    back = load_file(str(tmp_path / "m.safetensors"))
    assert back.keys() == tensors.keys()
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
    with safe_open(str(tmp_path / "m.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
    assert [p.name for p in tmp_path.iterdir()] == ["m.safetensors"]  # the side file is gone


def test_nothing_is_written_at_the_path_until_the_stream_finishes(tmp_path):
    stream = SafetensorsStream(tmp_path / "m.safetensors")
    stream.add("x", torch.ones(4))
    assert not (tmp_path / "m.safetensors").exists()
    stream.close()
    assert list(tmp_path.iterdir()) == []


def test_a_tensor_added_twice_is_refused(tmp_path):
    stream = SafetensorsStream(tmp_path / "m.safetensors")
    stream.add("x", torch.ones(4))
    with pytest.raises(ValueError, match="added twice"):
        stream.add("x", torch.ones(4))
    stream.close()


def test_the_converted_file_holds_what_the_whole_model_reader_reads(tmp_path):
    path, _ = write_tiny_gguf(tmp_path / "tiny.gguf")  # Q4_1, Q4_0, Q5_0 and Q8_0 blocks, F32 norms
    loader.load_weights(str(path))
    saved = load_file(str(loader.gguf_cache_folder(path) / "model.safetensors"))
    expected = loader.stored_tensors(loader.read_gguf_weights(path, loader.gguf_model_config(path)))
    assert saved.keys() == expected.keys()
    for name, t in expected.items():
        assert torch.equal(saved[name], t), name


def test_a_conversion_reports_progress_tensor_by_tensor(tmp_path):
    path, _ = write_tiny_gguf(tmp_path / "tiny.gguf")
    reports: list[tuple[str, float]] = []
    loader.load_weights(str(path), progress=lambda message, fraction: reports.append((message, fraction)))
    converting = [f for m, f in reports if m.startswith("converting tiny.gguf")]
    assert len(converting) == 2 * 9 + 2  # every tensor the model uses: 9 a layer, the embedding and final norm
    assert converting == sorted(converting) and converting[-1] == pytest.approx(0.95)
    assert reports[-1] == ("loaded", 1.0)
