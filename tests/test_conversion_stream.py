"""A first conversion streams: each GGUF tensor is read, converted and written before the next, with progress
tensor by tensor, and the safetensors file it writes holds exactly what the whole-model reader reads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from engine import loader
from engine.weights.safetensors_io import SafetensorsStream
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


def test_a_conversion_reports_its_progress_every_few_percent_of_the_file(tmp_path):
    path, _ = write_tiny_gguf(tmp_path / "tiny.gguf")
    reports: list[tuple[str, float]] = []
    loader.load_weights(str(path), progress=lambda message, fraction: reports.append((message, fraction)))
    converting = [(m, f) for m, f in reports if m.startswith("converting tiny.gguf")]
    fractions = [f for _, f in converting]
    assert 5 <= len(converting) <= 100 // loader.PROGRESS_STEP + 1  # 20 tensors, the embedding a quarter of them
    assert fractions == sorted(fractions) and fractions[-1] == pytest.approx(0.95)
    assert converting[-1][0].startswith("converting tiny.gguf: 100%")
    assert reports[-1] == ("loaded", 1.0)


# ---- reading: one read per tensor, every length checked ------------------------------------------------------

def write_file(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    stream = SafetensorsStream(path)
    for name, t in tensors.items():
        stream.add(name, t)
    stream.finish()
    return path


def test_tensors_read_back_in_file_order_bit_for_bit(tmp_path):
    from engine.weights.safetensors_io import read_tensors

    tensors = {"b": torch.randn(4, 8).bfloat16(), "a": torch.randint(0, 255, (3, 16), dtype=torch.uint8),
               "c": torch.zeros(0)}
    got = list(read_tensors(write_file(tmp_path / "m.safetensors", tensors)))
    assert [name for name, _ in got] == ["b", "a", "c"]
    assert all(torch.equal(t, tensors[name]) and t.dtype == tensors[name].dtype for name, t in got)


@pytest.mark.parametrize("cut", [4, 30, -1])
def test_a_truncated_file_is_refused_by_name(tmp_path, cut):
    from engine.weights.safetensors_io import read_tensors

    path = write_file(tmp_path / "m.safetensors", {"x": torch.ones(64), "y": torch.ones(64)})
    path.write_bytes(path.read_bytes()[:cut])
    with pytest.raises(ValueError):
        list(read_tensors(path))


def test_a_quantized_weight_is_rebuilt_once_its_parts_are_read(tmp_path):
    from engine.weights.formats import quantize_int4
    from engine.weights.safetensors_io import read_tensors

    q = quantize_int4(torch.randn(8, 64))
    path = write_file(tmp_path / "m.safetensors", loader.stored_tensors({"w": q, "norm": torch.ones(8)}))
    weights = dict(loader.stored_weights(read_tensors(path)))
    assert torch.equal(weights["w"].dequantize(), q.dequantize()) and torch.equal(weights["norm"], torch.ones(8))
    with pytest.raises(ValueError, match="without all their parts: w"):
        dict(loader.stored_weights(iter([("w.qweight", q.codes), ("w.scales", q.scales)])))
