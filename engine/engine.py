"""The Engine: a loaded model, one KV-cache strategy, conversations, and generation as a stream of events."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import threading
import time
from collections.abc import Iterator

import torch

from engine import hugepages, loader
from engine.chat import Conversation, PromptTooLong, fit_to_context
from engine.config import EngineConfig, SamplingParams, cache_preset
from engine.detokenizer import IncrementalDetokenizer
from engine.events import DoneEvent, Event, StepEvent, TrimEvent
from engine.graphs import DecodeGraphs
from engine.kv import precision
from engine.kv.base import BLOCK_OTHER, KVCache, KVCacheFull, KVStats
from engine.kv.factory import CacheShape, new_cache
from engine.model import LlamaModel
from engine.sampler import Sampler
from engine.speculative import Speculator
from engine.weights.convert import apply_format, resolve_auto, to_auto_format

END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>", "</s>", "<|end|>",
                      "<end_of_turn>")  # ChatML / Qwen, Llama 3, SmolLM, Mistral, Phi-3, Gemma
PREFILL_CHUNK = 1024


def pick_device(requested: str | None) -> torch.device:
    if requested:
        return torch.device(requested)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def pick_dtype(requested: str | None, device: torch.device) -> torch.dtype:
    if requested:
        return getattr(torch, requested)
    # measured on CPU: float32 matmuls beat bf16/fp16 for prefill by 4-10x and tie for decode
    return torch.float32 if device.type == "cpu" else torch.float16


def release_freed_memory() -> None:
    """Hand the heap that loading freed (temporary float32 and int32 copies, one tensor at a time) back to the
    system, so the process's resident size is what it holds (glibc keeps freed heap otherwise)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def largest_layer_shape(config) -> tuple[int, int]:
    """The fused gate/up projection: the largest matrix of a decoder layer, [N, K]."""
    return 2 * config.intermediate_size, config.hidden_size


def projection_bytes(config) -> int:
    """float32 bytes of every decoder layer's projections: what one decode step streams."""
    attention = config.hidden_size * config.head_dim * (2 * config.num_heads + 2 * config.num_kv_heads)
    return 4 * config.num_layers * (attention + 3 * config.hidden_size * config.intermediate_size)


def auto_weight_format(device: torch.device, config, cache_dir) -> str:
    """What `auto` stands for with this model on this device (engine/weights/convert.py: resolve_auto)."""
    return resolve_auto(device, largest_layer_shape(config), cache_dir, projection_bytes(config))


def make_cache(strategy: str, engine: Engine, block_size: int, pool_tokens: int | None) -> KVCache:
    """The engine's own cache: its precision, its budget, its prefix-reuse switch."""
    budget = engine.config.kv_budget_mib
    cache = new_cache(strategy, engine.kv_precision, engine.cache_shape(), block_size, pool_tokens,
                      budget_bytes=None if budget is None else int(budget * 2**20))
    cache.prefix_reuse = engine.config.prefix_reuse
    return cache


class Engine:
    weights_file_bytes = 0  # the size of the file(s) the weights were read from, when loaded from disk
    weights_report = ""  # a GGUF's tensors: which kept their integers, which were converted (loader)
    def __init__(self, model: LlamaModel, tokenizer, config: EngineConfig | None = None, name: str = "model"):
        self.config = config or EngineConfig()
        self.device = pick_device(self.config.device)
        self.dtype = pick_dtype(self.config.dtype, self.device)
        if self.config.num_threads:
            torch.set_num_threads(self.config.num_threads)
        self.model = model.to(device=self.device).eval()
        self.model.set_activation_dtype(self.dtype)
        self.weight_format = self._apply_weight_format(self.config.weights)
        self.tokenizer = tokenizer
        self.model_config = model.config
        self.model_name = name
        self.max_context = min(self.config.max_context or self.model_config.max_position_embeddings,
                               model.rotary.cos.shape[0])
        self.stop_token_ids = self._stop_tokens()
        self._cancel = threading.Event()
        self._resolve_kv_precision(self.config.kv_dtype)
        self.cache = make_cache(self.config.cache, self, self.config.block_size, self.config.pool_tokens)
        self.graphs = self.decode_graphs()

    def decode_graphs(self) -> DecodeGraphs | None:
        """Decode steps as CUDA graphs, on CUDA unless the config turns them off (engine/graphs.py)."""
        return DecodeGraphs(self.model, capture=True) if self.device.type == "cuda" and self.config.cuda_graphs \
            else None

    @classmethod
    def load(cls, model: str | None = None, config: EngineConfig | None = None,
             progress: loader.Progress | None = None) -> Engine:
        """Load a model; weights convert to config.weights tensor by tensor as they are read (default: auto)."""
        config = config or EngineConfig()
        if config.weights is None:
            config = EngineConfig(**{**config.__dict__, "weights": "auto"})
        if config.kv_dtype is None:
            config = EngineConfig(**{**config.__dict__, "kv_dtype": "auto"})
        fmt = None if config.weights == "auto" else config.weights
        weights = loader.load_weights(model, progress, fmt)
        if config.weights == "auto":
            fmt = auto_weight_format(pick_device(config.device), weights.config, loader.cache_root())
            weights.state_dict = to_auto_format(weights.state_dict, fmt, weights.gguf_types)
            config = EngineConfig(**{**config.__dict__, "weights": fmt})
        max_positions = min(config.max_context or weights.config.max_position_embeddings,
                            weights.config.max_position_embeddings)
        net = LlamaModel.from_hf_state_dict(weights.config, weights.state_dict, max_positions, consume=True)
        # every tensor is already in its format (auto: never below its file's precision); the constructor must not
        # convert the whole model to one format again
        engine = cls(net, weights.tokenizer, EngineConfig(**{**config.__dict__, "weights": None}), weights.name)
        engine.config = config
        engine.weights_file_bytes = weights.file_bytes
        engine.weights_report = weights.report  # which tensors kept their integers, which were converted
        del weights, net
        release_freed_memory()
        return engine

    def _apply_weight_format(self, fmt: str | None) -> str:
        if fmt == "auto":
            fmt = auto_weight_format(self.device, self.model.config, None)
        if fmt is not None:
            apply_format(self.model, fmt)
        hugepages.pack_buffers(self.model)  # the weights a step streams, on huge pages (same values)
        return self.model.weight_format

    @property
    def weights_resident_bytes(self) -> int:
        return self.model.resident_bytes

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def cache_strategy(self) -> str:
        return self.cache.name

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def _stop_tokens(self) -> tuple[int, ...]:
        ids = set(self.model_config.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            ids.add(self.tokenizer.eos_token_id)
        vocab = self.tokenizer.get_vocab()
        ids.update(vocab[t] for t in END_OF_TURN_TOKENS if t in vocab)
        return tuple(sorted(ids))

    # ---- settings between turns
    def set_cache(self, strategy: str, block_size: int | None = None) -> None:
        """Switch strategy; every conversation re-prefills its history into the new cache on its next turn."""
        new_config = EngineConfig(**{**self.config.__dict__, "cache": strategy,
                                     "block_size": block_size or self.config.block_size})
        self.cache = make_cache(new_config.cache, self, new_config.block_size, new_config.pool_tokens)
        self.config = new_config
        self.graphs = self.decode_graphs()  # the old cache's graphs name its stores

    def set_weights(self, fmt: str) -> None:
        """Convert the loaded weights in place (Engine.load reads them from the file instead, when there is one);
        the cache is rebuilt: keys and values computed with the old weights are stale."""
        self.weight_format = self._apply_weight_format(fmt)
        self.config = EngineConfig(**{**self.config.__dict__, "weights": self.weight_format})
        self.set_cache(self.config.cache)

    def set_kv_dtype(self, kv_dtype: str | None) -> None:
        """The precision contiguous and paged caches store K/V in (None: the activations'); a new cache, as
        set_cache builds: every conversation re-prefills its history into it on its next turn."""
        strategy = self.config.cache
        layout, fixed = cache_preset(strategy)
        if fixed is not None and kv_dtype != fixed:  # a preset's precision is replaced: its layout stays
            strategy = layout
        new_config = EngineConfig(**{**self.config.__dict__, "kv_dtype": kv_dtype, "cache": strategy})
        self._resolve_kv_precision(kv_dtype)
        self.config = new_config
        self.set_cache(self.config.cache)

    def _resolve_kv_precision(self, kv_dtype: str | None) -> None:
        """kv_precision: the setting resolved (auto measured); kv_dtype: the float dtype it stores, or for a
        quantized precision the activations' (its full-precision window keeps int8's rows so, int4's in float16)."""
        self.kv_precision = precision.resolve(kv_dtype, self.device, self.dtype, loader.cache_root())
        self.kv_dtype = self.dtype if self.kv_precision in precision.QUANTIZED else getattr(torch, self.kv_precision)

    def cache_shape(self, max_context: int | None = None) -> CacheShape:
        """What every cache of this engine shares (a bench may ask for a shorter context)."""
        return CacheShape(self.model_config, self.dtype, self.device, max_context or self.max_context,
                          residual=self.config.kv_residual, sink=self.config.kv_sink)

    @property
    def kv_dtype_name(self) -> str:
        """The precision the cache stores K/V in ('paged-int8' is int8 whatever the setting)."""
        return self.cache.precision if self.cache.keeps_kv else self.kv_precision

    def set_kv_budget(self, mib: float | None) -> None:
        """The most a paged pool may grow to (None: one context's worth); a new cache, as set_cache builds."""
        new_config = EngineConfig(**{**self.config.__dict__, "kv_budget_mib": mib})
        old_config, self.config = self.config, new_config
        try:
            self.cache = make_cache(new_config.cache, self, new_config.block_size, new_config.pool_tokens)
        except ValueError:
            self.config = old_config
            raise

    def reserve_kv_pool(self, max_bytes: int | None = None) -> int:
        """A paged pool grown now to its whole budget, or as far as max_bytes allows, its pages written, and kept
        (see PagedCache.reserve): what `serve` does before it takes requests. -> the bytes held; 0 for a cache that
        is not a pool. A new cache (set_cache, set_kv_budget, ...) starts empty again."""
        return self.cache.reserve(max_bytes)

    def set_prefix_reuse(self, on: bool) -> None:
        """Keep each conversation's cache between turns (on) or prefill the whole history every turn (off)."""
        self.config = EngineConfig(**{**self.config.__dict__, "prefix_reuse": on})
        self.cache.prefix_reuse = on

    def new_conversation(self, system_prompt: str | None = None) -> Conversation:
        return Conversation(system_prompt=system_prompt)

    def forget(self, conv: Conversation) -> None:
        self.cache.release(conv.seq_id)

    def kv_stats(self, conv: Conversation | None = None) -> KVStats:
        return self.cache.stats(conv.seq_id if conv else None)

    def cancel(self) -> None:
        self._cancel.set()

    # ---- generation
    def generate(self, conv: Conversation, user_message: str | None,
                 params: SamplingParams | None = None) -> Iterator[Event]:
        """Add the user's message (None: regenerate the last reply) and stream the reply as events.

        On any error the conversation is restored and the sequence's cache rolled back to what it held
        before the turn; the engine stays usable.
        """
        params = params or SamplingParams()
        self._cancel.clear()
        snapshot, held = conv.snapshot(), self.cache.tokens_held(conv.seq_id)
        try:
            self._add_turn(conv, user_message)
            yield from self._reply(conv, params)
        except BaseException:
            conv.restore(snapshot)
            self._roll_back(conv.seq_id, held)
            raise

    def _roll_back(self, seq_id: int, held: int) -> None:
        """After a failed turn the sequence holds the `held` tokens it held before it (blocks the turn filled stay
        in the prefix cache, free to evict); when that cannot be, it holds nothing."""
        try:
            if self.cache.tokens_held(seq_id) >= held:
                self.cache.truncate(seq_id, held)
                return
        except Exception:  # noqa: BLE001 - e.g. no free block for a copy-on-write: fall back to releasing
            pass
        self.cache.release(seq_id)

    def _add_turn(self, conv: Conversation, user_message: str | None) -> None:
        if user_message is not None:
            conv.add("user", user_message)
            return
        if conv.messages and conv.messages[-1].role == "assistant":
            conv.messages.pop()
        if not conv.messages or conv.messages[-1].role != "user":
            raise ValueError("nothing to regenerate: the conversation has no user message to answer")

    def _reply(self, conv: Conversation, params: SamplingParams) -> Iterator[Event]:
        ids, trim = self._fit_prompt(conv, params)
        if trim is not None:
            yield trim
        run = _Run(self, conv.seq_id, ids, params)
        yield from run.prefill()
        yield from run.decode()
        text = run.text()
        conv.add("assistant", text, tuple(run.generated))
        yield DoneEvent(text, len(ids), len(run.generated), run.ttft_ms, run.decode_tok_s(),
                        run.finish_reason, self.cache.name, run.prefix_hit, *run.decode_counts())

    def budget_tokens(self, seq_id: int) -> int | None:
        """The most tokens the sequence could hold under the cache's budget: the budget's blocks less those other
        sequences hold (None: the cache has no block budget)."""
        kv = self.cache.stats(seq_id)
        if not kv.num_blocks_budget:
            return None
        others = kv.block_states.count(BLOCK_OTHER)
        return max(kv.num_blocks_budget - others, 0) * kv.block_size

    def _fit_prompt(self, conv: Conversation, params: SamplingParams) -> tuple[list[int], TrimEvent | None]:
        """The prompt ids, the oldest turns dropped where the context, or the KV budget, cannot hold the history
        and room for the reply; the TrimEvent says what left and why (None: nothing did)."""
        budget = self.budget_tokens(conv.seq_id)
        by_budget = budget is not None and budget < self.max_context
        limit = budget if by_budget else self.max_context
        reserve = min(params.max_new_tokens, limit // 4)
        try:
            ids, dropped_messages, dropped_tokens = fit_to_context(self.tokenizer, conv, limit, reserve)
        except PromptTooLong as e:
            if not by_budget:
                raise
            raise PromptTooLong(f"{e}".split(", but the context")[0] + f", but the KV budget "
                                f"({self.config.kv_budget_mib:g} MiB) holds {limit} tokens for this conversation and "
                                f"{reserve} are kept for the reply: raise the KV budget (Settings → KV budget) or "
                                f"shorten the message") from None
        trim = TrimEvent(dropped_messages, dropped_tokens, limit, "budget" if by_budget else "context")
        return ids, trim if dropped_messages else None

    # ---- one forward step, timed
    def step(self, seq_ids: list[int], new_tokens: list[list[int]], all_logits: bool = False,
             num_tentative: list[int] | None = None, logits_for: list[int] | None = None) -> torch.Tensor:
        """num_tentative[i]: how many of sequence i's trailing new tokens are unverified drafts (the prefix
        cache does not register a block holding one until a later step or a truncate keeps it).
        logits_for: the positions in seq_ids whose logits the caller reads (a prompt's piece that does not end
        it needs none): only their rows go through the head -> [len(logits_for), V]; None: every sequence's."""
        view = self.cache.begin_step(seq_ids, new_tokens)
        view.num_tentative = num_tentative
        logits = self.graphs.step(view, new_tokens) if self.graphs is not None and not all_logits else None
        if logits is None:
            width = max(len(t) for t in new_tokens)
            ids = torch.tensor([t + [0] * (width - len(t)) for t in new_tokens], device=self.device)  # [B, T]
            logits = self.model(ids, view, all_logits=all_logits, logits_for=logits_for)
        elif logits_for is not None:
            logits = logits[logits_for]  # a captured graph computes every row's
        self.cache.commit_step(view)
        return logits

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()


class _Run:
    """The state of one reply being generated for one sequence: each decode step yields one token, or several
    when speculative decoding verifies drafts (engine.speculative)."""

    def __init__(self, engine: Engine, seq_id: int, prompt: list[int], params: SamplingParams):
        self.engine, self.seq_id, self.prompt, self.params = engine, seq_id, prompt, params
        self.sampler = Sampler(params, engine.device)
        self.detok = IncrementalDetokenizer(engine.tokenizer)
        self.generated: list[int] = []
        self.stop_ids = set(params.stop_token_ids or engine.stop_token_ids)
        self.prefix_hit = 0
        self.ttft_ms = 0.0
        self.decode_ms = 0.0
        self.finish_reason: str | None = None
        self.n_decode_steps = self.n_decode_forwards = self.n_drafted = self.n_accepted = 0
        spec = params.speculative
        self.speculator = Speculator(engine, seq_id, spec, self.sampler) if spec.enabled else None

    def _timed_step(self, tokens: list[int]) -> tuple[int, float]:
        e = self.engine
        start = time.perf_counter()
        logits = e.step([self.seq_id], [tokens])[0]  # [V]
        token = self.sampler(logits, self.prompt + self.generated)
        e.synchronize()
        return token, (time.perf_counter() - start) * 1000

    def _accept(self, token: int) -> str:
        if token in self.stop_ids:
            self.finish_reason = "stop"
            return self.detok.flush()
        self.generated.append(token)
        return self.detok.add(token)

    def _event(self, phase, pos, n_tokens, ms, hit, token=None, text="", drafted=0, accepted=0) -> StepEvent:
        e = self.engine
        return StepEvent(phase, pos, n_tokens, ms, e.cache.stats(self.seq_id), hit, e.cache.name, token, text,
                         drafted, accepted)

    def prefill(self) -> Iterator[StepEvent]:
        e, prompt = self.engine, self.prompt
        held = self.prefix_hit = e.cache.prepare(self.seq_id, prompt)
        chunk = PREFILL_CHUNK if e.cache.keeps_kv else len(prompt)
        for start in range(held, len(prompt), chunk):
            if e._cancel.is_set():
                self.finish_reason = "cancelled"
                return
            end = min(start + chunk, len(prompt))
            token, ms = self._timed_step(prompt[start:end])
            self.ttft_ms += ms
            last = end == len(prompt)
            text = self._accept(token) if last else ""
            yield self._event("prefill", end - 1, end - start, ms, held if start == held else 0,
                              token if last else None, text)

    def decode(self) -> Iterator[StepEvent]:
        e = self.engine
        while self.finish_reason is None:
            context = len(self.prompt) + len(self.generated)
            if len(self.generated) >= self.params.max_new_tokens or context >= e.max_context:
                self.finish_reason = "length"
            elif e._cancel.is_set():
                self.finish_reason = "cancelled"
            else:
                try:
                    event = self._speculative_step(context) or self._plain_step(context)
                except KVCacheFull:  # the budget is reached: the reply so far is kept, as a stop keeps it
                    self.finish_reason = "budget"
                    self._hold_only_the_reply(context - 1)
                    return
                yield event

    def _plain_step(self, context: int) -> StepEvent:
        e = self.engine
        feed = self.generated[-1:] if e.cache.keeps_kv else self.prompt + self.generated
        token, ms = self._timed_step(feed)
        self._count(ms, 1)
        if self.speculator:
            self.speculator.policy.record_plain(ms)
        return self._event("decode", context - 1, len(feed), ms, 0, token, self._accept(token))

    def _speculative_step(self, context: int) -> StepEvent | None:
        """Draft, verify in one forward, roll back the rejected drafts; None: take a plain step instead."""
        e = self.engine
        if self.speculator is None:
            return None
        room = min(self.params.max_new_tokens - len(self.generated), e.max_context - context)
        start = time.perf_counter()
        result = self.speculator.step(self.prompt + self.generated, room)
        if result is None:
            return None
        e.synchronize()
        ms = (time.perf_counter() - start) * 1000
        self.speculator.policy.record_verify(ms, result.n_drafted, result.n_accepted)
        text, used = "", 0
        while used < len(result.tokens) and self.finish_reason is None:
            text += self._accept(result.tokens[used])
            used += 1
        if used < len(result.tokens):  # a stop token among the accepted drafts: hold only what was used
            e.cache.truncate(self.seq_id, len(self.prompt) + len(self.generated))
        self._count(ms, result.n_forwards, result.n_drafted, used - 1)
        return self._event("decode", context - 1 + used - 1, result.n_fed, ms, 0, result.tokens[used - 1], text,
                           result.n_drafted, used - 1)

    def _hold_only_the_reply(self, keep: int) -> None:
        """After a step the budget refused: the sequence holds at most the prompt and the reply's fed tokens (a
        verify that ran part of its forwards may have left drafts); a truncate that needs a block it cannot get
        leaves them, and the next turn's prepare drops them."""
        cache = self.engine.cache
        with contextlib.suppress(KVCacheFull):
            if cache.tokens_held(self.seq_id) > keep:
                cache.truncate(self.seq_id, keep)

    def _count(self, ms: float, forwards: int, drafted: int = 0, accepted: int = 0) -> None:
        self.decode_ms += ms
        self.n_decode_steps += 1
        self.n_decode_forwards += forwards
        self.n_drafted += drafted
        self.n_accepted += accepted

    def decode_counts(self) -> tuple[int, int, int, int]:
        return self.n_decode_steps, self.n_decode_forwards, self.n_drafted, self.n_accepted

    def text(self) -> str:
        return self.detok.text + self.detok.flush()

    def decode_tok_s(self) -> float:
        steps = len(self.generated) - 1 + (self.finish_reason == "stop")
        return steps / (self.decode_ms / 1000) if self.decode_ms else 0.0
