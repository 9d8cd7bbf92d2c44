"""What a generation yields, step by step: plain frozen records, safe to pass between threads."""

from __future__ import annotations

from dataclasses import dataclass

from engine.kv.base import KVStats


@dataclass(frozen=True)
class StepEvent:
    phase: str  # "prefill" or "decode"
    pos: int  # context position of the last token this step processed (0-based)
    n_tokens: int  # tokens processed by this step's forward
    latency_ms: float  # wall clock of the step, synchronised with the device
    kv: KVStats
    prefix_hit_tokens: int  # prompt tokens served from the cache (prefill steps; 0 for decode)
    strategy: str
    token_id: int | None = None  # the token produced by this step
    text: str = ""  # the text that token adds to the reply (decode steps)

    @property
    def per_token_ms(self) -> float:
        return self.latency_ms / max(self.n_tokens, 1)


@dataclass(frozen=True)
class TrimEvent:
    """The conversation outgrew the context: its oldest turns were dropped (never the system prompt)."""

    dropped_messages: int
    dropped_tokens: int
    context_limit: int


@dataclass(frozen=True)
class DoneEvent:
    text: str
    n_prompt_tokens: int
    n_generated_tokens: int
    ttft_ms: float
    decode_tok_s: float
    finish_reason: str  # "stop" (end-of-turn token), "length" (max_new_tokens or context), "cancelled"
    strategy: str
    prefix_hit_tokens: int


Event = StepEvent | TrimEvent | DoneEvent
