"""The runners a benchmark compares, behind one small interface: the engine with one KV strategy, transformers
(same weights, same process, same threads) with its dynamic or quantized cache, and llama.cpp when installed.

prefill_ms(ids): one prompt from an empty state. decode_ms(ids, contexts, steps): feed ids in order; on reaching
each context (ascending), time `steps` single-token forwards (the next ids) -> {context: [ms, ...]}. Decode times
are the forward alone (no sampling), for every peer alike.
"""

from __future__ import annotations

import importlib.util
import inspect
import itertools

import torch

from engine.bench.common import BenchContext, bar, make_cache, prefill, timed_ms, using_cache
from engine.engine import PREFILL_CHUNK, Engine

_seq_ids = itertools.count(10_000)


class EnginePeer:
    def __init__(self, engine: Engine, strategy: str, pool_tokens: int, block_size: int = 16):
        self.engine, self.strategy = engine, strategy
        self.name = f"engine {strategy}, {engine.weight_format} weights"
        self.pool_tokens, self.block_size = pool_tokens, block_size

    def _cache(self):
        return make_cache(self.engine, self.strategy, self.block_size, self.pool_tokens)

    def prefill_ms(self, ids: list[int]) -> float:
        e, seq = self.engine, next(_seq_ids)
        with using_cache(e, self._cache()) as cache:
            cache.prepare(seq, ids)
            chunk = PREFILL_CHUNK if cache.keeps_kv else len(ids)
            return timed_ms(lambda: prefill(e, seq, ids, chunk), e.synchronize)[1]

    def decode_ms(self, ids: list[int], contexts: list[int], steps: int) -> dict[int, list[float]]:
        e, seq, out = self.engine, next(_seq_ids), {}
        with using_cache(e, self._cache()) as cache:
            cache.prepare(seq, ids)
            held = 0
            for context in bar(contexts, f"{self.name} contexts"):
                if cache.keeps_kv:
                    prefill(e, seq, ids[held:context], PREFILL_CHUNK)
                out[context] = [self._step_ms(cache, seq, ids, context + i) for i in range(steps)]
                held = context + steps
        return out

    def _step_ms(self, cache, seq: int, ids: list[int], position: int) -> float:
        feed = ids[position:position + 1] if cache.keeps_kv else ids[:position + 1]
        return timed_ms(lambda: self.engine.step([seq], [feed]), self.engine.synchronize)[1]


class HFPeer:
    """transformers' LlamaForCausalLM: a forward with past_key_values, exactly what its generate loop runs."""

    def __init__(self, model, name: str = "transformers", quantized_backend: str | None = None):
        self.model, self.name, self.backend = model, name, quantized_backend
        self.device = next(model.parameters()).device
        # transformers renamed past_key_values to cache (5.x deprecates the old name)
        self.cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def new_cache(self):
        from transformers import DynamicCache, QuantizedCache

        if self.backend is None:
            return DynamicCache(config=self.model.config)
        return QuantizedCache(self.backend, self.model.config)

    @torch.inference_mode()
    def forward(self, ids: list[int], cache, last_only: bool = True) -> torch.Tensor:
        x = torch.tensor([ids], device=self.device)
        extra = {"logits_to_keep": 1} if last_only else {}
        extra[self.cache_arg] = cache
        return self.model(input_ids=x, use_cache=True, **extra).logits  # [1, T, V]

    def prefill_ms(self, ids: list[int]) -> float:
        cache = self.new_cache()
        return timed_ms(lambda: self.forward(ids, cache), _sync(self.device))[1]

    def decode_ms(self, ids: list[int], contexts: list[int], steps: int) -> dict[int, list[float]]:
        cache, held, out = self.new_cache(), 0, {}
        sync = _sync(self.device)
        for context in bar(contexts, f"{self.name} contexts"):
            for start in range(held, context, PREFILL_CHUNK):
                self.forward(ids[start:min(start + PREFILL_CHUNK, context)], cache)
            out[context] = [timed_ms(lambda p=p: self.forward(ids[p:p + 1], cache), sync)[1]
                            for p in range(context, context + steps)]
            held = context + steps
        return out


class LlamaCppPeer:
    """llama.cpp (llama-cpp-python) on the GGUF file itself: its own quantized weights, not dequantized ones."""

    name = "llama.cpp"

    def __init__(self, gguf_path, n_ctx: int):
        from llama_cpp import Llama

        self.llm = Llama(model_path=str(gguf_path), n_ctx=n_ctx, n_threads=torch.get_num_threads(),
                         n_batch=512, verbose=False)

    def prefill_ms(self, ids: list[int]) -> float:
        self.llm.reset()
        return timed_ms(lambda: self.llm.eval(ids))[1]

    def decode_ms(self, ids: list[int], contexts: list[int], steps: int) -> dict[int, list[float]]:
        self.llm.reset()
        held, out = 0, {}
        for context in bar(contexts, "llama.cpp contexts"):
            self.llm.eval(ids[held:context])
            out[context] = [timed_ms(lambda p=p: self.llm.eval(ids[p:p + 1]))[1]
                            for p in range(context, context + steps)]
            held = context + steps
        return out


def _sync(device: torch.device):
    return torch.cuda.synchronize if device.type == "cuda" else None


# ---- the peers outside the engine, and what is installed
def external_peers(ctx: BenchContext, n_ctx: int) -> tuple[dict, list[str]]:
    """transformers (dynamic cache, then each installed quantized-cache backend) and llama.cpp if installed."""
    found = {"transformers": HFPeer(ctx.hf_model())}
    backends = hf_quantized_backends()
    for backend, state in backends.items():
        if state == "available":
            name = f"transformers {backend} cache"
            found[name] = HFPeer(ctx.hf_model(), name, backend)
    notes = [f"transformers QuantizedCache backend {b}: {s}" for b, s in backends.items()]
    llama = llama_cpp_status(ctx.gguf_path)
    notes.append(f"llama.cpp: {llama}")
    if llama == "available":
        found["llama.cpp"] = LlamaCppPeer(ctx.gguf_path, n_ctx)
        notes.append("llama.cpp runs the GGUF's own quantized weights (Q4_1 for the default model), so it reads "
                     "fewer weight bytes than the float peers.")
    return found, notes


def llama_cpp_status(gguf_path) -> str:
    if importlib.util.find_spec("llama_cpp") is None:
        return "not installed (pip install llama-cpp-python to add llama.cpp as a peer; never a dependency)"
    if gguf_path is None:
        return "skipped: the model is not a GGUF file"
    return "available"


def hf_quantized_backends() -> dict[str, str]:
    """transformers.QuantizedCache backends: 'available' or why not. fp8 needs only torch's float8 dtype."""
    return {
        "quanto": _module_status("optimum.quanto", "optimum-quanto"),
        "hqq": _module_status("hqq", "hqq"),
        "fp8": "available" if _fp8_works() else "not supported by this torch/transformers",
    }


def _module_status(module: str, package: str) -> str:
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        found = False
    return "available" if found else f"not installed (pip package {package})"


def _fp8_works() -> bool:
    try:
        from transformers import QuantizedCache  # noqa: F401
    except ImportError:
        return False
    return hasattr(torch, "float8_e4m3fn")
