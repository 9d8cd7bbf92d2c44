"""OpenAI's logits-level parameters as one adjustment the scheduler applies before its sampler, and the
log-probabilities of the wire format.

The order follows vLLM: logit_bias, then presence / frequency penalties (OpenAI's formula over the tokens
generated so far: logit[j] -= frequency * count[j] + presence * (count[j] > 0)), then min_p (a token is kept when
its probability after temperature is at least min_p times the most likely token's). The sampler then applies the
repetition penalty, temperature, top-k and top-p.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from server.protocol import SamplingRequest


class LogitsAdjust:
    def __init__(self, bias: dict[int, float], presence: float, frequency: float, min_p: float,
                 temperature: float):
        self.bias_ids = torch.tensor(list(bias), dtype=torch.long)
        self.bias_values = torch.tensor(list(bias.values()), dtype=torch.float32)
        self.presence, self.frequency = presence, frequency
        self.min_p, self.temperature = min_p, temperature

    @classmethod
    def of(cls, body: SamplingRequest, vocab_size: int) -> LogitsAdjust | None:
        """The request's adjustment, or None when every parameter is neutral."""
        bias = body.logit_bias_ids(vocab_size)
        presence, frequency, min_p = body.presence_penalty or 0.0, body.frequency_penalty or 0.0, body.min_p or 0.0
        temperature = 1.0 if body.temperature is None else body.temperature
        if not bias and presence == 0 and frequency == 0 and (min_p == 0 or temperature == 0):
            return None
        return cls(bias, presence, frequency, min_p, temperature)

    def __call__(self, logits: torch.Tensor, generated: list[int]) -> torch.Tensor:
        """logits: [V] -> adjusted [V] (a new tensor; the scheduler's logits are left as they were)."""
        out = logits.float().clone()
        if self.bias_ids.numel():
            out[self.bias_ids.to(out.device)] += self.bias_values.to(out.device)
        if generated and (self.presence or self.frequency):
            ids, counts = torch.tensor(generated, device=out.device).unique(return_counts=True)
            out[ids] -= self.frequency * counts.float() + self.presence
        if self.min_p > 0 and self.temperature > 0:
            threshold = out.max() + self.temperature * math.log(self.min_p)  # p_j / p_max >= min_p, after T
            out = out.masked_fill(out < threshold, float("-inf"))
        return out


class TokenText:
    """Token id -> its text, remembered (a top-k list decodes the same tokens again and again)."""

    def __init__(self, tokenizer, lock):
        self.tokenizer, self.lock = tokenizer, lock
        self.known: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self.known.get(token_id)
        if text is None:
            with self.lock:
                text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self.known[token_id] = text
        return text


def chat_logprobs(outputs, text_of: Callable[[int], str]) -> dict:
    """The chat format: {"content": [{token, logprob, bytes, top_logprobs: [...]}, ...], "refusal": None}."""
    def entry(token_id: int, logprob: float) -> dict:
        text = text_of(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = [{**entry(o.token_id, o.logprob), "top_logprobs": [entry(t, lp) for t, lp in o.top_logprobs]}
               for o in outputs if o.logprob is not None]
    return {"content": content, "refusal": None}


def text_logprobs(outputs, text_of: Callable[[int], str], offset: int = 0) -> dict:
    """The legacy completions format: tokens, token_logprobs, top_logprobs (dicts), text_offset."""
    tokens, logprobs, tops, offsets = [], [], [], []
    for o in (o for o in outputs if o.logprob is not None):
        text = text_of(o.token_id)
        tokens.append(text)
        logprobs.append(o.logprob)
        tops.append({text_of(t): lp for t, lp in o.top_logprobs} if o.top_logprobs else None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}
