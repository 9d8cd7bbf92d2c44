"""Next-token sampling: repetition penalty, then greedy or temperature / top-k / top-p, seeded."""

from __future__ import annotations

import math

import torch

from engine import kernels
from engine.config import SamplingParams

NO_IDS = torch.empty(0, dtype=torch.int64)
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
        seen = self.seen_ids(history, logits)
        if self.params.greedy:
            return penalized_greedy(logits, seen, self.params.repetition_penalty)
        if self.top_k_filters(logits):
            ids, probs = self.top_k_choices(logits, seen)
            return ids[draw_listed(probs, self.generator)]
        ids, probs = self.candidates(logits, seen)
        return int(ids[draw(probs, self.generator)])

    def seen_ids(self, history: list[int], logits: torch.Tensor) -> torch.Tensor | None:
        """The ids the repetition penalty applies to after `history` (None where it changes nothing), kept up to
        date across the calls of a growing history (speculative decoding's judged rows extend it too)."""
        return self.seen.of(history, logits) if penalized(self.params, history) else None

    def top_k_filters(self, logits: torch.Tensor) -> bool:
        return 0 < self.params.top_k < logits.numel()

    def top_k_choices(self, logits: torch.Tensor, seen: torch.Tensor | None) -> tuple[list[int], list[float]]:
        """Where top-k filters: (ids, probs) as candidates() gives them, as lists. Top-k picks from the penalized
        logits (the temperature keeps their order) in one pass, and the temperature and top-p work on the few it
        keeps in Python floats: each torch op on a token's path cost 10-20 us in the app, its code and data cold
        after a step (the sampler took 0.86 ms a token at two threads with torch's ops, 0.2 ms so)."""
        p = self.params
        values, ids = top_candidates(logits, seen, p.repetition_penalty, p.top_k)
        probs = temperature_and_top_p(values.tolist(), p.temperature, p.top_p)
        return ids[:len(probs)].tolist(), probs

    def candidates(self, logits: torch.Tensor, seen: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [V]; seen: the ids the repetition penalty applies to (None: none) -> (ids [n], probs [n]): the
        tokens top-k and top-p keep (most likely first; every token, in id order, when neither filters) and their
        renormalized probabilities at the temperature. Only the kept tokens are sorted: sorting all of a
        49,152-token vocabulary took 4 ms a token, a fifth of a decode step."""
        p = self.params
        if self.top_k_filters(logits):
            ids, probs = self.top_k_choices(logits, seen)
            return torch.tensor(ids, dtype=torch.int64), torch.tensor(probs, dtype=torch.float32)
        logits = penalize(logits, seen, p.repetition_penalty).float().cpu() / p.temperature
        if p.top_p == 1.0:
            return torch.arange(logits.numel()), torch.softmax(logits, dim=-1)
        probs, ids = most_likely_reaching(torch.softmax(logits, dim=-1), p.top_p)
        before = probs.cumsum(0) - probs  # mass of the tokens ranked above
        keep = before < p.top_p
        probs, ids = probs[keep], ids[keep]
        return ids, probs / probs.sum()

    def distribution(self, logits: torch.Tensor, seen: torch.Tensor | None = None) -> torch.Tensor:
        """logits [V], seen as candidates() takes them -> [V] the probabilities plain sampling draws from."""
        ids, probs = self.candidates(logits, seen)
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


def temperature_and_top_p(top: list[float], temperature: float, top_p: float) -> list[float]:
    """Logits sorted largest first -> the probabilities of the first n at the temperature, renormalized over the
    n that top-p keeps (those whose higher-ranked mass is below top_p; all where top_p is 1)."""
    weights = [math.exp((x - top[0]) / temperature) for x in top]
    total = sum(weights)
    probs = [w / total for w in weights]
    if top_p < 1.0:
        n, before = 0, 0.0
        while n < len(probs) and before < top_p:
            before += probs[n]
            n += 1
        probs = probs[:n]
        kept = sum(probs)
        probs = [q / kept for q in probs]
    return probs


def draw_listed(probs: list[float], generator: torch.Generator) -> int:
    """draw() over a short list: the index where the cumulative sum first exceeds one uniform number times their sum."""
    u = float(torch.rand((), generator=generator)) * sum(probs)
    mass = 0.0
    for i, q in enumerate(probs):
        mass += q
        if mass > u:
            return i
    return len(probs) - 1


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
        self.written = None  # self.ids as a NumPy array (the same memory): new ids written without a torch op
        self.latest: torch.Tensor | None = None  # the view last returned, while no id was added

    def of(self, history: list[int], logits: torch.Tensor) -> torch.Tensor:
        """-> int64 [distinct ids] on the CPU (each torch op here cost ~20 us a token in the app, cold after a step)"""
        n = len(self.tokens)
        if self.ids is None or self.ids.numel() < logits.numel() or len(history) < n or history[:n] != self.tokens:
            self.tokens, self.distinct, n = [], set(), 0
            self.ids = torch.empty(logits.numel(), dtype=torch.int64)
            self.written, self.latest = self.ids.numpy(), None
        new = [t for t in dict.fromkeys(history[n:]) if t not in self.distinct]  # (in order, once each)
        if new:
            self.written[len(self.distinct):len(self.distinct) + len(new)] = new
            self.distinct.update(new)
            self.latest = None
        self.tokens.extend(history[n:])
        if self.latest is None:
            self.latest = self.ids[:len(self.distinct)]
        return self.latest


def penalized(params: SamplingParams, history: list[int]) -> bool:
    """Whether the repetition penalty changes anything after `history`."""
    return params.repetition_penalty != 1.0 and bool(history)


def penalize(logits: torch.Tensor, seen: torch.Tensor | None, penalty: float) -> torch.Tensor:
    """The CTRL / Hugging Face rule: the seen ids' positive logits are divided by the penalty, negative ones
    multiplied (a new tensor; logits itself where nothing changes)."""
    if penalty == 1.0 or seen is None or seen.numel() == 0:
        return logits
    seen = seen.to(logits.device)
    picked = logits[seen]
    logits = logits.clone()
    logits[seen] = torch.where(picked > 0, picked / penalty, picked * penalty)
    return logits


def top_candidates(logits: torch.Tensor, seen: torch.Tensor | None, penalty: float,
                   k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [V] -> (values [n], ids [n]): the k largest penalized logits and every one equal to the k-th,
    largest first, equal ones by id; where any is NaN (the largest, as torch.topk takes it), the NaNs, by id.
    The compiled kernel in one pass where it runs (torch's ops for it cost ~0.75 ms a token in the app at two
    threads); the same values and order from torch's ops elsewhere."""
    ops = kernels.for_activations(logits)
    seen = NO_IDS if seen is None else seen
    if ops is not None and logits.dim() == 1 and seen.device.type == "cpu":
        values, ids = ops.top_candidates(logits.contiguous(), seen, penalty, k)
        return values, ids
    x = penalize(logits, seen, penalty)
    nan = torch.isnan(x)
    if bool(nan.any()):
        ids = torch.nonzero(nan).squeeze(1)
        return x[ids], ids
    ids = torch.nonzero(x >= torch.topk(x, k).values[-1]).squeeze(1)  # in id order
    values, order = x[ids].sort(descending=True, stable=True)
    return values, ids[order]


def penalized_greedy(logits: torch.Tensor, seen: torch.Tensor | None, penalty: float) -> int:
    """greedy_token of the penalized logits: the largest, the first of equal ones (NaN counting as largest)."""
    if penalty == 1.0 or seen is None or seen.numel() == 0:
        return greedy_token(logits)
    return int(top_candidates(logits, seen, penalty, 1)[1][0])
