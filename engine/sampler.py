"""Next-token sampling: repetition penalty, then greedy or temperature / top-k / top-p, seeded."""

from __future__ import annotations

import torch

from engine.config import SamplingParams


class Sampler:
    def __init__(self, params: SamplingParams, device: torch.device):
        self.params = params
        self.generator = torch.Generator(device="cpu")
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()
        self.device = device

    def __call__(self, logits: torch.Tensor, history: list[int]) -> int:
        """logits: [V] float32 -> the next token id."""
        logits = apply_repetition_penalty(logits, history, self.params.repetition_penalty)
        if self.params.greedy:
            return int(logits.argmax())
        probs = self._filtered_probs(logits.float().cpu() / self.params.temperature)
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def _filtered_probs(self, logits: torch.Tensor) -> torch.Tensor:
        p = self.params
        if p.top_k and p.top_k < logits.numel():
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            before = sorted_probs.cumsum(0) - sorted_probs  # mass of the tokens ranked above
            sorted_probs[before >= p.top_p] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return probs / probs.sum()


def apply_repetition_penalty(logits: torch.Tensor, history: list[int], penalty: float) -> torch.Tensor:
    """The CTRL / Hugging Face rule: seen tokens' positive logits are divided, negative ones multiplied."""
    if penalty == 1.0 or not history:
        return logits
    seen = torch.tensor(sorted(set(history)), device=logits.device)
    picked = logits[seen]
    logits = logits.clone()
    logits[seen] = torch.where(picked > 0, picked / penalty, picked * penalty)
    return logits
