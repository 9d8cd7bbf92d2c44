"""What every benchmark shares: the loaded engine and peers, cache construction, timing, machine facts, text."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from engine import loader
from engine.config import EngineConfig
from engine.engine import Engine
from engine.kv.base import KVCache
from engine.kv.factory import new_cache
from engine.machine import cpu_model

ENGINE_STRATEGIES = ("none", "contiguous", "paged", "paged-int8")
SEED = 1234


# ---- the loaded models, shared by every benchmark of a run
@dataclass
class BenchContext:
    engine: Engine
    model_arg: str | None  # what --model said (None: the default GGUF); with --tiny, the tiny model's folder
    quick: bool
    tiny: bool = False  # a tiny random model (smoke runs): every code path runs, the numbers mean nothing
    _hf_model: object | None = field(default=None, repr=False)
    _engines: dict = field(default_factory=dict, repr=False)  # weight format -> Engine
    _text_ids: list[int] | None = field(default=None, repr=False)
    _scratch: tempfile.TemporaryDirectory | None = field(default=None, repr=False)  # holds the tiny model

    @property
    def gguf_path(self) -> Path | None:
        """The GGUF file the engine's weights came from, if any (llama.cpp's input)."""
        path = loader.default_model_path() if self.model_arg is None else Path(self.model_arg).expanduser()
        return path if path.suffix.lower() == ".gguf" else None

    @property
    def hf_folder(self) -> Path | str:
        """A Hugging Face folder with the engine's exact weights (the GGUF's dequantized conversion), or the model
        id that --model named (transformers finds it in its local cache, as the engine did)."""
        gguf = self.gguf_path
        if gguf:
            return loader.gguf_cache_folder(gguf)
        path = Path(self.model_arg).expanduser()
        return path if path.exists() else self.model_arg

    def engine_with_weights(self, fmt: str) -> Engine:
        """The same model loaded with its weights in `fmt` (the shared engine when that is its format)."""
        if fmt == self.engine.weight_format:
            return self.engine
        if fmt not in self._engines:
            status(f"loading the engine with {fmt} weights")
            config = EngineConfig(cache="paged", pool_tokens=1024, weights=fmt)
            self._engines[fmt] = Engine.load(self.model_arg, config)
        return self._engines[fmt]

    def hf_source(self) -> tuple[str, dict]:
        """What transformers loads the same weights from: the GGUF itself (dequantized by transformers), or the
        folder / model id that --model named."""
        gguf = self.gguf_path
        if gguf:
            return str(gguf.parent), {"gguf_file": gguf.name}
        return str(self.hf_folder), {}

    def hf_model(self):
        """transformers' own Llama on the same weights, dtype and device (loaded once, on first use)."""
        if self._hf_model is None:
            from transformers import AutoModelForCausalLM

            source, extra = self.hf_source()
            status(f"loading the transformers peer from {source}")
            model = AutoModelForCausalLM.from_pretrained(source, dtype=self.engine.dtype, **extra)
            self._hf_model = model.to(self.engine.device).eval()
        return self._hf_model

    def close(self) -> None:
        """Remove the tiny model's folder, if there is one (it also goes when the context is collected)."""
        if self._scratch is not None:
            self._scratch.cleanup()

    def text_ids(self) -> list[int]:
        """Real English text (the Python docs' topic pages shipped with the standard library), tokenized."""
        if self._text_ids is None:
            self._text_ids = self.engine.tokenizer.encode(real_text(), add_special_tokens=False)
        return self._text_ids


def load_context(model: str | None, quick: bool, tiny: bool = False, weights: str | None = None,
                 kv_dtype: str | None = None) -> BenchContext:
    """The engine every benchmark shares. tiny: a random tiny Llama written as a Hugging Face folder (the real
    loading path, the real tokenizer, transformers loads it as a peer) and quick sizes: a smoke run."""
    scratch = None
    if tiny:
        scratch = tempfile.TemporaryDirectory(prefix="kvscope-tiny-model-")
        model = str(write_tiny_model(Path(scratch.name) / "tiny-random", tiny_tokenizer(model)))
        status(f"a tiny random model in {model} (--tiny: the numbers mean nothing)")
    status("loading the engine")
    config = EngineConfig(cache="paged", pool_tokens=1024, weights=weights, kv_dtype=kv_dtype)  # benchmarks build
    # their own caches, contiguous and paged ones in the engine's KV precision
    engine = Engine.load(model, config, progress=lambda message, _fraction: status(message))
    return BenchContext(engine, model, quick or tiny, tiny, _scratch=scratch)


# ---- a tiny random model for smoke runs: the shape of a Llama, the size of a toy
TINY_LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=8192, rope_theta=10000.0,
                  rms_norm_eps=1e-5, tie_word_embeddings=True)


def write_tiny_model(folder: Path, tokenizer) -> Path:
    """A seeded random tiny Llama as a Hugging Face folder: config.json, model.safetensors and the tokenizer."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    from engine.config import ModelConfig
    from engine.model import random_hf_state_dict

    hf = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                     eos_token_id=tokenizer.eos_token_id, **TINY_LLAMA).to_dict()
    hf["architectures"] = ["LlamaForCausalLM"]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf, indent=2))
    state = random_hf_state_dict(ModelConfig.from_hf_dict(hf), seed=SEED, std=0.1)
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    tokenizer.save_pretrained(str(folder))
    return folder


def tiny_tokenizer(model: str | None):
    """The tokenizer of --model (a Hugging Face folder) or of the default model, for the tiny model."""
    from transformers import AutoTokenizer

    folder = Path(model).expanduser() if model else loader.gguf_cache_folder(loader.default_model_path())
    if (folder / "tokenizer.json").is_file() or (folder / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(str(folder))
    return loader.load_weights(model).tokenizer  # converts the default GGUF once, then reads its tokenizer


def real_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def random_ids(n: int, vocab_size: int, seed: int = SEED) -> list[int]:
    """n token ids drawn uniformly, away from the special tokens at the start of the vocabulary."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab_size - 1, (n,), generator=g).tolist()


# ---- caches
def make_cache(engine: Engine, strategy: str, block_size: int = 16, pool_tokens: int | None = None,
               max_context: int | None = None, kv: str | None = None) -> KVCache:
    """A cache of the engine's model, with no budget: strategy a layout, a preset ('paged-int8') or a bench row
    name ('paged, KV int4'); kv a precision (None: the engine's)."""
    from engine.bench.report import parse_kv_row

    layout, named_kv = parse_kv_row(strategy)
    return new_cache(layout, named_kv or kv or engine.kv_precision, engine.cache_shape(max_context),
                     block_size, pool_tokens)


@contextmanager
def using_cache(engine: Engine, cache: KVCache) -> Iterator[KVCache]:
    """Run the engine on `cache` inside the block; the engine's own cache comes back afterwards."""
    previous = engine.cache
    engine.cache = cache
    try:
        yield cache
    finally:
        engine.cache = previous


def prefill(engine: Engine, seq_id: int, ids: list[int], chunk: int = 1024) -> None:
    """Append ids to the sequence's cache in chunks (the sequence must have been prepared)."""
    for start in range(0, len(ids), chunk):
        engine.step([seq_id], [ids[start:start + chunk]])


# ---- timing
def timed_ms(fn: Callable[[], object], sync: Callable[[], None] | None = None) -> tuple[object, float]:
    start = time.perf_counter()
    result = fn()
    if sync:
        sync()
    return result, (time.perf_counter() - start) * 1000


def median(values: Iterable[float]) -> float:
    values = list(values)
    return statistics.median(values) if values else float("nan")


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def rotated(items: list | tuple, round_: int) -> list:
    """The order a round of turns takes: round r starts at the r-th item and goes round the list."""
    start = round_ % len(items)
    return [*items[start:], *items[:start]]


# ---- progress and messages
def bar(iterable: Iterable, desc: str, total: int | None = None) -> tqdm:
    return tqdm(iterable, desc=desc, total=total, file=sys.stderr, leave=False, dynamic_ncols=True)


def status(message: str) -> None:
    tqdm.write(f"[bench] {message}", file=sys.stderr)


# ---- the machine


def machine_info(engine: Engine) -> dict:
    import transformers

    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": str(engine.device),
        "model": engine.model_name,
        "model_dtype": engine.dtype_name,
        "cache_dtypes": {"contiguous": engine.kv_dtype_name, "paged": engine.kv_dtype_name,
                         "paged-int8": "int8 + float16 scales"},
        "max_context": engine.max_context,
    }
