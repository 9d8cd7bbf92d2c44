"""Shared fixtures: a tiny random Llama with the real tokenizer (fast), the same written as model folders (for
real loads), and the real default model, loaded once for the whole session."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test` runs one worker per core: one torch thread each
    os.environ["OMP_NUM_THREADS"] = "1"

from engine import kernels, loader  # noqa: E402

# every test, and every process a test starts, uses the kernels built for this checkout, also where a test points
# KVSCOPE_CACHE_DIR at a fresh folder (a build there costs 30-60 s)
os.environ.setdefault("KVSCOPE_KERNELS_DIR", str(kernels.build_dir()))
from engine.config import EngineConfig, ModelConfig  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.model import LlamaModel  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    import torch

    torch.set_num_threads(1)  # in case a plugin imported torch before OMP_NUM_THREADS was set

TINY = dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
            rope_theta=10000.0, max_position_embeddings=1024, tie_word_embeddings=True)


@pytest.fixture(scope="session", autouse=True)
def frozen_imports():
    """What collection imported (torch, transformers, Qt, pyqtgraph: some 400,000 objects) moves to the collector's
    permanent generation, so the gc.collect() after each app test costs milliseconds instead of half a second, and
    gc.get_objects() counts what the tests create."""
    freeze_what_is_alive()
    yield
    gc.unfreeze()


def freeze_what_is_alive() -> None:
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="session")
def default_weights():
    """The default model's converted weights and tokenizer (converted once into the user cache)."""
    weights = loader.load_weights(None)
    freeze_what_is_alive()  # what loading imported (most of transformers) joins the permanent generation
    return weights


@pytest.fixture(scope="session")
def tokenizer(default_weights):
    return default_weights.tokenizer


@pytest.fixture(scope="session")
def tiny_config(tokenizer) -> ModelConfig:
    return ModelConfig(vocab_size=len(tokenizer), eos_token_ids=(2,), **TINY)


@pytest.fixture(scope="session")
def tiny_model(tiny_config) -> LlamaModel:
    return LlamaModel.random(tiny_config, seed=0, std=0.1)


@pytest.fixture
def tiny_engine_factory(tiny_config, tokenizer):
    """tiny_engine_factory(cache="paged", block_size=16, **EngineConfig fields) -> a real Engine on a tiny model."""

    def make(cache: str = "paged", block_size: int = 16, **kwargs) -> Engine:
        model = LlamaModel.random(tiny_config, seed=0, std=0.1)
        return Engine(model, tokenizer, EngineConfig(cache=cache, block_size=block_size, **kwargs), "tiny-random")

    return make


@pytest.fixture(scope="session")
def tiny_model_folder(tmp_path_factory, tokenizer) -> Path:
    """The tiny random Llama of `bench --tiny` as a Hugging Face folder with the real tokenizer (loads in ~0.5 s)."""
    from engine.bench.common import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("models") / "tiny-random", tokenizer)


@pytest.fixture(scope="session")
def small_vocab_model_folder(tmp_path_factory, tokenizer) -> Path:
    """The tiny Llama with a 400-token byte-level BPE vocabulary trained on real text and the real chat template:
    a whole model load (config, safetensors, tokenizer) in milliseconds, for tests that load many times."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from engine.bench.common import real_text, write_tiny_model

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator([real_text()[:20_000]], trainer)
    small = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|im_start|>", eos_token="<|im_end|>")
    small.chat_template = tokenizer.chat_template
    return write_tiny_model(tmp_path_factory.mktemp("models") / "small-vocab", small)


@pytest.fixture(scope="session")
def default_engine(default_weights) -> Engine:
    """The real SmolLM2-135M-Instruct (paged cache); tests switch strategy with set_cache."""
    model = LlamaModel.from_hf_state_dict(default_weights.config, default_weights.state_dict)
    # float32 weights (the GGUF's blocks dequantized): the reference every format is measured against
    return Engine(model, default_weights.tokenizer, EngineConfig(cache="paged", weights="float32"),
                  default_weights.name)


@pytest.fixture(scope="session")
def english_1024(tokenizer) -> list[int]:
    from tests.engine_helpers import english_ids

    return english_ids(tokenizer, 1024)


@pytest.fixture(scope="session")
def float32_log_probs(default_engine, english_1024):
    """[1024, V] teacher-forced log-probabilities of english_1024's next tokens: float32 weights and cache,
    paged in blocks of 16, 16 tokens a forward. The reference every quality bound (weight formats, KV
    precisions) is measured against, computed once per session."""
    from tests.engine_helpers import log_probs

    assert default_engine.weight_format == "float32"
    default_engine.set_cache("paged", 16)
    default_engine.set_kv_dtype(None)
    return log_probs(default_engine, english_1024)


@pytest.fixture(scope="session")
def int4_engine(default_weights) -> Engine:
    """The real default model in int4, the format `auto` picks here (the GGUF's own Q4_1 integers); tests switch
    its strategy with set_cache."""
    from tests.engine_helpers import engine_in_format

    return engine_in_format(default_weights, "int4")


@pytest.fixture(scope="session")
def int4_contiguous_reply(int4_engine):
    """int4_contiguous_reply(history, message, n=256) -> (n greedy token ids of a fresh `contiguous` turn, the
    messages after it), memoized for the session: the reference the exact caches are held to. A first call
    switches the shared int4 engine to 'contiguous': ask for references before setting up a strategy."""
    from tests.engine_helpers import memoized_contiguous_replies

    return memoized_contiguous_replies(int4_engine)


@pytest.fixture
def window(qtbot, tmp_path, tiny_engine_factory):
    """The main window on a tiny paged engine, with settings in tmp_path; torn down after the test."""
    from test_app_support import dispose, make_settings, open_window

    window = open_window(qtbot, make_settings(tmp_path), tiny_engine_factory(cache="paged", block_size=16))
    yield window
    dispose(window)
