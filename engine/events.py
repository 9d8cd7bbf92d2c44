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
    n_drafted: int = 0  # speculative decoding: draft tokens this step verified (0: a plain step)
    n_accepted: int = 0  # ...of which the model accepted this many; the step produced n_accepted + 1 tokens

    @property
    def per_token_ms(self) -> float:
        return self.latency_ms / max(self.n_tokens, 1)

    @property
    def n_produced(self) -> int:
        """Tokens this step added to the reply (the last may be a stop token): 1 for a plain step."""
        return self.n_accepted + 1 if self.token_id is not None else 0

    @property
    def ms_per_produced_token(self) -> float:
        return self.latency_ms / max(self.n_produced, 1)


@dataclass(frozen=True)
class TrimEvent:
    """The conversation outgrew the context: its oldest turns were dropped (never the system prompt)."""

    dropped_messages: int
    dropped_tokens: int
    context_limit: int  # the tokens the prompt and the reply's reserve had to fit in
    reason: str = "context"  # "context": the model's context; "budget": what the KV budget holds


@dataclass(frozen=True)
class DoneEvent:
    text: str
    n_prompt_tokens: int
    n_generated_tokens: int
    ttft_ms: float
    decode_tok_s: float
    finish_reason: str  # "stop" (end-of-turn token), "length" (max_new_tokens or context), "cancelled", "budget"
    strategy: str
    prefix_hit_tokens: int
    n_decode_steps: int = 0  # decode steps (events) of the reply
    n_decode_forwards: int = 0  # model forwards they ran (a verify step under paged-int8 may run two)
    n_drafted: int = 0  # speculative decoding: draft tokens verified over the reply
    n_accepted: int = 0  # ...and accepted

    @property
    def n_decode_tokens(self) -> int:
        """Tokens produced by decode steps (the prefill produced the first; a stop token counts)."""
        return max(self.n_generated_tokens - 1 + (self.finish_reason == "stop"), 0)

    @property
    def acceptance_rate(self) -> float:
        return self.n_accepted / self.n_drafted if self.n_drafted else 0.0

    @property
    def tokens_per_forward(self) -> float:
        return self.n_decode_tokens / self.n_decode_forwards if self.n_decode_forwards else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.n_decode_tokens / self.n_decode_steps if self.n_decode_steps else 0.0


Event = StepEvent | TrimEvent | DoneEvent
