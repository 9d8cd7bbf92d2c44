"""Replay a conversation's exact tokens under another configuration, teacher-forced (no Qt here).

A conversation's turns are token sequences: each turn's whole prompt (the chat template over the history, as
the engine built it) and the reply's tokens as they were generated. `replay` feeds them through an Engine set to
one ReplayConfig (cache strategy, KV precision, block size, prefix reuse; the engine's weights must be the
config's), as a generation would — prefill the part of the prompt the cache does not hold, then one decode step
per reply token — except that each step is fed the recorded token instead of a sampled one. Every step reports
its position, latency and KVStats and the greedy token the model would have picked there, so that configurations
can be compared on the same tokens at the same positions, and their greedy choices checked for agreement.

The engine's own cache and settings are set aside for the replay and put back after it (also on error or
cancel): the live conversation keeps its cache.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

from engine.chat import Conversation, prompt_ids
from engine.config import BLOCK_SIZES, CACHE_STRATEGIES, WEIGHT_FORMATS, ConfigError
from engine.events import StepEvent
from engine.sampler import greedy_token

REPLAY_SEQ_ID = -7  # the replay's sequence in its own cache (never a conversation's id, which are positive)


class ReplayError(ValueError):
    """The conversation cannot be replayed under this configuration; the message says why."""


@dataclass(frozen=True)
class ReplayConfig:
    """One configuration to replay under. kv_dtype / weights None: the engine's current ones."""

    cache: str = "paged"
    kv_dtype: str | None = None
    weights: str | None = None
    block_size: int = 16
    prefix_reuse: bool = True

    @property
    def label(self) -> str:
        """'paged 16 · KV float32 · int4 weights · no prefix reuse': what sets it apart, readable."""
        parts = [f"{self.cache} {self.block_size}" if self.cache.startswith("paged") else self.cache]
        if self.kv_dtype and self.cache in ("contiguous", "paged"):
            parts.append(f"KV {self.kv_dtype}")
        if self.weights:
            parts.append(f"{self.weights} weights")
        if not self.prefix_reuse and self.cache != "none":
            parts.append("no prefix reuse")
        return " · ".join(parts)

    def to_dict(self) -> dict:
        return {"cache": self.cache, "kv_dtype": self.kv_dtype, "weights": self.weights,
                "block_size": self.block_size, "prefix_reuse": self.prefix_reuse}

    @classmethod
    def from_dict(cls, data: dict) -> ReplayConfig:
        """Raises ValueError when the data does not name a valid configuration."""
        config = cls(**{name: data[name] for name in ("cache", "kv_dtype", "weights", "block_size", "prefix_reuse")
                        if name in data})
        if config.cache not in CACHE_STRATEGIES or config.block_size not in BLOCK_SIZES \
                or config.weights not in (None, *WEIGHT_FORMATS) or not isinstance(config.prefix_reuse, bool) \
                or not (config.kv_dtype is None or isinstance(config.kv_dtype, str)):
            raise ValueError(f"not a replay configuration: {data!r}")
        return config


@dataclass(frozen=True)
class Turn:
    """One turn as tokens: the whole prompt the reply answered, and the reply's tokens."""

    prompt: tuple[int, ...]
    reply: tuple[int, ...]


@dataclass(frozen=True)
class ReplayStep:
    """A step of the replay: which turn it belongs to, and the step as a generation reports it (token_id is
    the greedy token the model would have picked after the step's last position)."""

    turn: int
    event: StepEvent


def conversation_turns(tokenizer, conv: Conversation) -> list[Turn]:
    """The conversation's visible turns as tokens. A reply generated in this session keeps its own token ids;
    a reply read from a file without them is tokenized from its text."""
    visible = conv.visible_messages()
    turns = []
    for i, message in enumerate(visible):
        if message.role != "assistant":
            continue
        prompt = prompt_ids(tokenizer, conv.system_prompt, visible[:i])
        reply = message.token_ids or tuple(tokenizer.encode(message.content, add_special_tokens=False))
        turns.append(Turn(tuple(prompt), tuple(reply)))
    return turns


def check_turns(turns: Sequence[Turn], max_context: int) -> None:
    if not turns:
        raise ReplayError("the conversation has no reply to replay yet: send a message first")
    for i, turn in enumerate(turns):
        if not turn.prompt:
            raise ReplayError(f"turn {i + 1} has an empty prompt")
        if len(turn.prompt) + len(turn.reply) > max_context:
            raise ReplayError(f"turn {i + 1} needs {len(turn.prompt) + len(turn.reply)} tokens, more than the "
                              f"context of {max_context}")


def replay(engine, turns: Sequence[Turn], config: ReplayConfig, cancelled=lambda: False) -> Iterator[ReplayStep]:
    """Teacher-force every turn through `engine` set to `config`; stops early (quietly) when cancelled()."""
    check_turns(turns, engine.max_context)
    if config.weights and config.weights != engine.weight_format:
        raise ReplayError(f"this engine holds {engine.weight_format} weights, not {config.weights}: replay under "
                          f"other weights needs an engine loaded with them")
    with configured(engine, config):
        for index, turn in enumerate(turns):
            for event in _replay_turn(engine, turn):
                yield ReplayStep(index, event)
                if cancelled():
                    return


@contextlib.contextmanager
def configured(engine, config: ReplayConfig):
    """The engine with a fresh cache built for `config`; its own cache and settings come back afterwards."""
    saved = engine.cache, engine.config, engine.kv_dtype
    try:
        try:
            if config.kv_dtype is not None and config.kv_dtype != engine.config.kv_dtype:
                engine.set_kv_dtype(config.kv_dtype)
            engine.set_cache(config.cache, config.block_size)
            engine.set_prefix_reuse(config.prefix_reuse)
        except (ConfigError, ValueError) as e:
            raise ReplayError(f"cannot replay under {config.label}: {e}") from None
        yield engine
    finally:
        with contextlib.suppress(Exception):  # the replay's cache goes whatever happened
            engine.cache.release(REPLAY_SEQ_ID)
        engine.cache, engine.config, engine.kv_dtype = saved


def _replay_turn(engine, turn: Turn) -> Iterator[StepEvent]:
    prompt, reply = list(turn.prompt), list(turn.reply)
    cache = engine.cache
    held = cache.prepare(REPLAY_SEQ_ID, prompt)
    chunk = engine_prefill_chunk() if cache.keeps_kv else len(prompt)
    for start in range(held, len(prompt), chunk):
        end = min(start + chunk, len(prompt))
        greedy, ms = _timed_greedy_step(engine, prompt[start:end])
        yield _event(engine, "prefill", end - 1, end - start, ms, held if start == held else 0, greedy)
    context = list(prompt)
    for token in reply:
        context.append(token)
        feed = [token] if cache.keeps_kv else context
        greedy, ms = _timed_greedy_step(engine, feed)
        yield _event(engine, "decode", len(context) - 1, len(feed), ms, 0, greedy)


def engine_prefill_chunk() -> int:
    from engine.engine import PREFILL_CHUNK  # the same chunks as a generation

    return PREFILL_CHUNK


def _timed_greedy_step(engine, tokens: list[int]) -> tuple[int, float]:
    start = time.perf_counter()
    logits = engine.step([REPLAY_SEQ_ID], [tokens])[0]  # [V]: the last position's
    greedy = greedy_token(logits)
    engine.synchronize()
    return greedy, (time.perf_counter() - start) * 1000


def _event(engine, phase: str, pos: int, n_tokens: int, ms: float, hit: int, greedy: int) -> StepEvent:
    return StepEvent(phase, pos, n_tokens, ms, engine.cache.stats(REPLAY_SEQ_ID), hit, engine.cache.name, greedy)


def with_engine_weights(config: ReplayConfig, engine) -> ReplayConfig:
    """The config with its weights and KV precision named (the engine's, where the config left them open)."""
    return replace(config, weights=config.weights or engine.weight_format,
                   kv_dtype=config.kv_dtype or engine.kv_dtype_name)
