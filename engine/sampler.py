"""Next-token sampling: repetition penalty, then greedy or temperature / top-k / top-p, seeded."""

from __future__ import annotations

import torch

from engine.config import SamplingParams

FIRST_CANDIDATES = 64  # top-p without top-k: the most likely tokens looked at first (x4 until they reach p)


class Sampler:
    def __init__(self, params: SamplingParams, device: torch.device):
        self.params = params
        self.generator = torch.Generator(device="cpu")
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()
        self.device = device
        self.seen = SeenTokens()

    def __call__(self, logits: torch.Tensor, history: list[int]) -> int:
        """logits: [V] float32 -> the next token id."""
        logits = apply_repetition_penalty(logits, history, self.params.repetition_penalty, self.seen)
        if self.params.greedy:
            return greedy_token(logits)
        ids, probs = self.candidates(logits.float().cpu() / self.params.temperature)
        return int(ids[draw(probs, self.generator)])

    def candidates(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [V] (divided by the temperature) -> (ids [n], probs [n]): the tokens top-k and top-p keep (most
        likely first; every token, in id order, when neither filters) and their renormalized probabilities. Only
        the kept tokens are sorted: sorting all of a 49,152-token vocabulary took 4 ms a token, a fifth of a
        decode step."""
        p = self.params
        if p.top_k and p.top_k < logits.numel():
            top, ids = torch.topk(logits, p.top_k)  # sorted, most likely first
            if int((logits >= top[-1]).sum()) > p.top_k:  # ties with the k-th are kept too
                ids = torch.nonzero(logits >= top[-1]).squeeze(1)
                top, order = logits[ids].sort(descending=True)
                ids = ids[order]
            probs = torch.softmax(top, dim=-1)
        elif p.top_p < 1.0:
            probs, ids = most_likely_reaching(torch.softmax(logits, dim=-1), p.top_p)
        else:
            return torch.arange(logits.numel()), torch.softmax(logits, dim=-1)
        if p.top_p < 1.0:
            before = probs.cumsum(0) - probs  # mass of the tokens ranked above
            keep = before < p.top_p
            probs, ids = probs[keep], ids[keep]
        return ids, probs / probs.sum()

    def distribution(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] (divided by the temperature) -> [V] the probabilities plain sampling draws from."""
        ids, probs = self.candidates(logits)
        return torch.zeros(logits.numel(), dtype=probs.dtype).index_put_((ids,), probs)


def greedy_token(logits: torch.Tensor) -> int:
    """logits [V] -> the index of the largest, the first of equal ones (NaN counting as largest), as argmax gives it:
    torch.max's index takes a third of argmax's time on this CPU (21 against 63 us for 49,152 float32 logits), a
    saving each row of each step."""
    return int(logits.max(0).indices)


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """An index drawn from probs [n] (>= 0, normalized by their sum) by inverting the cumulative sum with one uniform
    number: torch.multinomial took 2.7 ms for a 49,152-token vocabulary."""
    cdf = probs.cumsum(0)
    u = torch.rand((), generator=generator) * cdf[-1]
    return min(int(torch.searchsorted(cdf, u, right=True)), probs.numel() - 1)


def most_likely_reaching(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """probs [V] -> (probs [n], ids [n]) of the n most likely tokens, sorted, with n large enough that their mass
    reaches top_p (or n = V)."""
    n = min(FIRST_CANDIDATES, probs.numel())
    while True:
        top, ids = torch.topk(probs, n)
        if n == probs.numel() or float(top.cumsum(0)[-1]) >= top_p:  # as candidates() sums them
            return top, ids
        n = min(4 * n, probs.numel())


class SeenTokens:
    """The distinct token ids of a history, brought up to date with the tokens appended since the last call (read
    again from the start when the history is not the previous one extended): the repetition penalty of a long chat
    read its whole history every token (4,000 tokens: 0.7 ms)."""

    def __init__(self):
        self.tokens: list[int] = []
        self.distinct: set[int] = set()
        self.ids: torch.Tensor | None = None  # int64 [V]: the first len(distinct) are the distinct ids, as met

    def of(self, history: list[int], logits: torch.Tensor) -> torch.Tensor:
        """-> int64 [distinct ids]"""
        n = len(self.tokens)
        if (self.ids is None or self.ids.numel() < logits.numel() or self.ids.device != logits.device
                or len(history) < n or history[:n] != self.tokens):
            self.tokens, self.distinct, n = [], set(), 0
            self.ids = torch.empty(logits.numel(), dtype=torch.int64, device=logits.device)
        new = [t for t in dict.fromkeys(history[n:]) if t not in self.distinct]  # (in order, once each)
        if new:
            self.ids[len(self.distinct):len(self.distinct) + len(new)] = torch.tensor(new)
            self.distinct.update(new)
        self.tokens.extend(history[n:])
        return self.ids[:len(self.distinct)]


def apply_repetition_penalty(logits: torch.Tensor, history: list[int], penalty: float,
                             seen: SeenTokens | None = None) -> torch.Tensor:
    """The CTRL / Hugging Face rule: seen tokens' positive logits are divided, negative ones multiplied. seen: the
    distinct ids kept across the calls of one growing history (the same values as without it)."""
    if penalty == 1.0 or not history:
        return logits
    ids = seen.of(history, logits) if seen is not None else torch.tensor(sorted(set(history)), device=logits.device)
    picked = logits[ids]
    logits = logits.clone()
    logits[ids] = torch.where(picked > 0, picked / penalty, picked * penalty)
    return logits
