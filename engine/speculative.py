"""Speculative decoding: draft a few tokens cheaply, verify them in one forward, keep what the model agrees with.

Drafters propose; the model judges. One verify step feeds [last token + k drafts] through the active KV-cache
strategy and reads the logits of every fed position: row j judges draft j, the row after the last accepted draft
gives the model's own next token. Rejected drafts leave the cache with `cache.truncate(seq_id, keep)`.

- Greedy: accept the longest prefix the model's argmax agrees with, plus the model's own next token; the output
  is the plain greedy output.
- Sampling: the speculative-sampling rule (Leviathan et al. 2023; Chen et al. 2023). A draft x drawn from q is
  kept with probability min(1, p(x) / q(x)); on rejection the token is drawn from max(0, p - q), renormalised. p is
  the distribution plain sampling draws from (repetition penalty, temperature, top-k, top-p: engine.sampler), so
  every produced token has exactly the plain distribution. Prompt lookup is deterministic: q is a point mass.

Per strategy: `contiguous` and `paged` verify in one forward; `none` verifies by recomputing the whole sequence
plus the drafts; `paged-int8` splits the verify forward where a block fills, so a block is quantized only from
accepted tokens and every query sees the same keys as in plain decoding (see `verify_segments`).
"""

from __future__ import annotations

import statistics
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass, field

import torch

from engine.config import ConfigError, SpeculativeConfig
from engine.kv.base import KVCacheFull
from engine.sampler import Sampler, draw, draw_listed, penalized_greedy


# ---- drafters -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Draft:
    tokens: list[int]
    probs: torch.Tensor | None = None  # [k, V]: the drafter's distribution of each token; None: a point mass


class Drafter(ABC):
    """Proposes up to k tokens to follow `tokens` (the whole sequence so far)."""

    def start(self, sampler: Sampler) -> None:  # noqa: B027 - optional hook, nothing to do by default
        """A new reply begins, sampled with this sampler's parameters."""

    @abstractmethod
    def propose(self, tokens: list[int], k: int) -> Draft:
        """Up to k draft tokens (possibly none)."""


class PromptLookupDrafter(Drafter):
    """Drafting without a second model: find the most recent earlier occurrence of the sequence's last n tokens
    (n from max_ngram down to min_ngram) and propose the k tokens that followed it."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ConfigError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, tokens: list[int], k: int) -> Draft:
        if k < 1 or len(tokens) < 2:
            return Draft([])
        ids = torch.tensor(tokens)  # [L]
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            start = self._last_match(ids, n)
            if start is not None:
                return Draft(tokens[start + n: start + n + k])
        return Draft([])

    @staticmethod
    def _last_match(ids: torch.Tensor, n: int) -> int | None:
        """Start of the latest earlier window equal to the last n ids that has a token after it."""
        windows = ids[:-1].unfold(0, n, 1)  # [L - n, n]: every window followed by at least one token
        hits = (windows == ids[-n:]).all(dim=1).nonzero()
        return int(hits[-1]) if len(hits) else None


class DraftModelDrafter(Drafter):
    """A second, smaller model sharing the tokenizer drafts k tokens, one step each, in its own engine's cache.

    Greedy replies draft greedily (a point mass); sampled replies draw from the draft model's distribution under
    the same parameters and hand that distribution over for the acceptance rule."""

    def __init__(self, draft_engine, seq_id: int = 0):
        self.engine, self.seq_id = draft_engine, seq_id
        self.sampler: Sampler | None = None

    def start(self, sampler: Sampler) -> None:
        self.sampler = sampler
        self.generator = torch.Generator().manual_seed(int(torch.randint(2**62, (1,), generator=sampler.generator)))

    def propose(self, tokens: list[int], k: int) -> Draft:
        e, cache = self.engine, self.engine.cache
        held = cache.prepare(self.seq_id, tokens) if cache.keeps_kv else 0
        logits = e.step([self.seq_id], [tokens[held:]])[0]  # [V]
        out, rows = [], []
        for i in range(k):
            token, q = self._pick(logits, tokens + out)
            out.append(token)
            if q is not None:
                rows.append(q)
            if i + 1 < k:
                feed = [token] if cache.keeps_kv else tokens + out
                logits = e.step([self.seq_id], [feed])[0]
        return Draft(out, torch.stack(rows) if rows else None)

    def _pick(self, logits: torch.Tensor, history: list[int]) -> tuple[int, torch.Tensor | None]:
        params = self.sampler.params
        if params.greedy:
            return penalized_greedy(logits, self.sampler.seen_ids(history, logits), params.repetition_penalty), None
        q = target_probs(self.sampler, logits, history)
        return draw(q, self.generator), q


def make_drafter(config: SpeculativeConfig, engine, seq_id: int) -> Drafter:
    if config.mode == "lookup":
        return PromptLookupDrafter(config.max_ngram, config.min_ngram)
    draft_engine = getattr(engine, "draft_engine", None)
    if draft_engine is None:
        raise ConfigError("speculative mode 'draft' needs a draft model: set engine.draft_engine to a loaded Engine")
    if draft_engine.model_config.vocab_size != engine.model_config.vocab_size:
        raise ConfigError(f"the draft model's vocabulary ({draft_engine.model_config.vocab_size}) differs from the "
                          f"model's ({engine.model_config.vocab_size}): it must share the tokenizer")
    return DraftModelDrafter(draft_engine, seq_id)


# ---- acceptance -----------------------------------------------------------------------------------------------
def target_probs(sampler: Sampler, logits: torch.Tensor, history: list[int]) -> torch.Tensor:
    """The distribution plain sampling draws from after `history`: [V] float32 on the CPU."""
    return sampler.distribution(logits, sampler.seen_ids(history, logits))  # the very same sampling code


def judge(sampler: Sampler, logits: torch.Tensor, history: list[int], draft: int,
          draft_probs: torch.Tensor | None = None) -> int | None:
    """None if the model accepts `draft` after `history`, else the token it produces instead.

    logits: [V] for the position the draft would fill; draft_probs: [V], the drafter's q (None: a point mass)."""
    p = sampler.params
    if p.greedy:
        token = penalized_greedy(logits, sampler.seen_ids(history, logits), p.repetition_penalty)
        return None if token == draft else token
    if sampler.top_k_filters(logits):
        return judge_listed(sampler, logits, history, draft, draft_probs)
    target = target_probs(sampler, logits, history)  # [V]
    q = draft_probs.float().cpu() if draft_probs is not None else None
    q_draft = float(q[draft]) if q is not None else 1.0
    if float(torch.rand((), generator=sampler.generator)) * q_draft < float(target[draft]):
        return None
    residual = target.clone()
    if q is None:
        residual[draft] = 0.0
    else:
        residual = (residual - q).clamp_min_(0.0)
    if float(residual.sum()) <= 0.0:  # p <= q everywhere: only possible when p == q, so any draw from p is right
        residual = target
    return draw(residual, sampler.generator)  # draw() normalizes by the sum


def judge_listed(sampler: Sampler, logits: torch.Tensor, history: list[int], draft: int,
                 draft_probs: torch.Tensor | None) -> int | None:
    """judge() where top-k filters, over the few tokens plain sampling keeps (Sampler.top_k_choices): the target is
    zero elsewhere, and so is the residual max(p - q, 0). The same rule as the [V] tensors, the same two uniform
    numbers; a judged row took 0.74-0.97 ms in the app with them (torch ops over the vocabulary, cold after a
    step), 0.37-0.38 ms so."""
    ids, probs = sampler.top_k_choices(logits, sampler.seen_ids(history, logits))
    q_all = draft_probs.float().cpu() if draft_probs is not None else None  # [V]
    q = [float(i == draft) for i in ids] if q_all is None else q_all[torch.tensor(ids)].tolist()
    q_draft = float(q_all[draft]) if q_all is not None else 1.0
    p_draft = probs[ids.index(draft)] if draft in ids else 0.0
    if float(torch.rand((), generator=sampler.generator)) * q_draft < p_draft:
        return None
    residual = [max(pi - qi, 0.0) for pi, qi in zip(probs, q)]
    if sum(residual) <= 0.0:  # p <= q everywhere: only possible when p == q, so any draw from p is right
        residual = probs
    return ids[draw_listed(residual, sampler.generator)]


# ---- when speculation pays ------------------------------------------------------------------------------------
@dataclass
class SpeculationPolicy:
    """How many tokens to draft, and whether to keep speculating in this reply.

    k follows an exponential average r of the acceptance rate and what a draft token costs: a verify step of k
    drafts produces (1 - r^(k+1)) / (1 - r) tokens when each draft is accepted with probability r, and costs
    plain + k x extra ms (extra: measured per draft token, from verify steps against plain ones; the forward of
    k + 1 tokens is not free once the extra tokens' compute shows), so k maximises tokens per ms, in 1..max_k.
    The first PLAIN_SAMPLES decode steps (and one in every REMEASURE_EVERY) are plain, to know what a token costs
    without speculation; once the last WINDOW verify steps together produced tokens slower than that,
    speculation stands down for the reply."""

    max_k: int
    adaptive: bool = True
    rate: float = 0.5  # a first guess: k starts at 2 and grows as drafts are accepted
    standing_down: bool = False
    PLAIN_SAMPLES = 2
    PRIOR_DRAFT_COST = 0.25  # extra ms per draft token / plain step ms, until measured (this CPU: 0.17-0.3)
    REMEASURE_EVERY = 32
    WINDOW = 8
    plain_ms: deque = field(default_factory=lambda: deque(maxlen=5))
    recent: deque = field(default_factory=lambda: deque(maxlen=SpeculationPolicy.WINDOW))  # (ms, produced)
    verify_steps: int = 0
    last_was_verify: bool = False
    draft_cost: float | None = None  # measured extra ms per draft token / plain step ms (an average)

    @property
    def k(self) -> int:
        if not self.adaptive:
            return self.max_k
        r = min(self.rate, 0.95)
        cost = self.PRIOR_DRAFT_COST if self.draft_cost is None else self.draft_cost
        return max(range(1, self.max_k + 1), key=lambda k: (1 - r ** (k + 1)) / (1 - r) / (1 + cost * k))

    def wants_plain_step(self) -> bool:
        if not self.adaptive:
            return False
        remeasure = self.last_was_verify and self.verify_steps % self.REMEASURE_EVERY == 0
        return self.standing_down or len(self.plain_ms) < self.PLAIN_SAMPLES or remeasure

    def record_plain(self, ms: float) -> None:
        self.plain_ms.append(ms)
        self.last_was_verify = False

    def record_verify(self, ms: float, n_drafted: int, n_accepted: int) -> None:
        self.verify_steps += 1
        self.last_was_verify = True
        self.rate = 0.5 * self.rate + 0.5 * (n_accepted / n_drafted)
        self.recent.append((ms, n_accepted + 1))
        if self.plain_ms:
            plain = statistics.median(self.plain_ms)
            cost = max(ms - plain, 0.0) / plain / n_drafted
            self.draft_cost = cost if self.draft_cost is None else 0.8 * self.draft_cost + 0.2 * cost
        if self.adaptive and not self.pays():
            self.standing_down = True

    def pays(self) -> bool:
        """False once a full window of verify steps produced tokens slower than plain steps do."""
        if len(self.recent) < self.WINDOW or not self.plain_ms:
            return True
        ms_per_token = sum(ms for ms, _ in self.recent) / sum(n for _, n in self.recent)
        return ms_per_token <= statistics.median(self.plain_ms)


# ---- one verify step ------------------------------------------------------------------------------------------
@dataclass
class VerifyResult:
    tokens: list[int]  # produced: the accepted drafts, then the model's own token
    n_drafted: int
    n_accepted: int
    n_fed: int  # tokens the forwards processed
    n_forwards: int


def verify_segments(cache, past: int, n: int) -> list[int]:
    """Lengths of the forwards that verify n tokens fed at positions past..past+n-1.

    One forward, except under a quantized cache: there a block (a contiguous cache's group) is quantized in
    the step that fills it, and a query sees
    the blocks that are full at its own position quantized and its own block in full precision. A forward that
    starts with the token filling a block and stops before the next block's last slot matches that exactly, so
    the verify forward is cut before every position in a block's last slot. The next piece only runs when the
    draft it starts with was accepted: a block is never quantized from a rejected token.

    A cache whose sliding-window layers hold a ring (engine/kv/window.py) can roll a forward back to its first
    token only if it added at most `rollback_limit` tokens: the forward is cut to pieces that long, too."""
    bs, limit = cache.quantization_group, getattr(cache, "rollback_limit", 0)
    cuts = [q for q in range(past + 1, past + n) if bs and q % bs == bs - 1]
    bounds = [past]
    for end in cuts + [past + n]:
        while limit and end - bounds[-1] > limit:
            bounds.append(bounds[-1] + limit)
        bounds.append(end)
    return [b - a for a, b in zip(bounds, bounds[1:])]


class Speculator:
    """Drafts, verifies and rolls back, step by step, for one reply of one sequence."""

    def __init__(self, engine, seq_id: int, config: SpeculativeConfig, sampler: Sampler,
                 drafter: Drafter | None = None):
        self.engine, self.seq_id, self.sampler = engine, seq_id, sampler
        self.drafter = drafter or make_drafter(config, engine, seq_id)
        self.drafter.start(sampler)
        self.policy = SpeculationPolicy(config.max_draft_tokens, config.adaptive)

    def step(self, history: list[int], room: int) -> VerifyResult | None:
        """history: the sequence so far; its last token is not in the cache yet. room: the most tokens this step
        may produce. None when there is nothing to verify (no draft, no room, or no room in the cache)."""
        k = min(self.policy.k, room - 1)
        if k < 1 or self.policy.wants_plain_step():
            return None
        draft = self.drafter.propose(history, k)
        if not draft.tokens:
            return None
        try:
            return self._verify(history, draft)
        except _NoRoom:
            return None

    def _verify(self, history: list[int], draft: Draft) -> VerifyResult:
        cache, drafts = self.engine.cache, draft.tokens
        fed = history[-1:] + drafts
        past = len(history) - 1  # tokens held before this step
        produced: list[int] = []
        start = n_fed = n_forwards = 0
        for length in verify_segments(cache, past, len(fed)):
            rows = self._forward(history, fed, start, length, first=start == 0)  # [length, V]
            n_fed += length if cache.keeps_kv else past + start + length
            n_forwards += 1
            if self._judge_rows(rows, start, history, draft, produced):
                break
            start += length
        n_accepted = len(produced) - 1
        cache.truncate(self.seq_id, past + 1 + n_accepted)  # drop the rejected drafts; keep the accepted
        return VerifyResult(produced, len(drafts), n_accepted, n_fed, n_forwards)

    def _judge_rows(self, rows: torch.Tensor, start: int, history: list[int], draft: Draft,
                    produced: list[int]) -> bool:
        """Judge drafts start.. with rows [n, V]; appends to `produced`; True once the model's own token is in."""
        drafts = draft.tokens
        for r in range(rows.shape[0]):
            j = start + r  # row j judges drafts[j]; the row after the last draft gives the model's own token
            if j == len(drafts):
                produced.append(self.sampler(rows[r], history + produced))
                return True
            q = draft.probs[j] if draft.probs is not None else None
            other = judge(self.sampler, rows[r], history + produced, drafts[j], q)
            produced.append(drafts[j] if other is None else other)
            if other is not None:
                return True
        return False

    def _forward(self, history: list[int], fed: list[int], start: int, length: int, first: bool) -> torch.Tensor:
        e, piece = self.engine, fed[start:start + length]
        try:
            if not e.cache.keeps_kv:  # 'none': recompute the sequence with the drafts, read the last rows
                return recompute_last_rows(e, self.seq_id, history[:-1] + fed[:start + length], length)
            # the first token of every piece is accepted (the last produced token, or an accepted draft)
            return e.step([self.seq_id], [piece], all_logits=True, num_tentative=[length - 1])[0]  # [length, V]
        except KVCacheFull:
            if first:
                raise _NoRoom from None
            raise


class _NoRoom(Exception):
    """The cache cannot take the drafts now (nothing was changed): take a plain step instead."""


@torch.inference_mode()
def recompute_last_rows(engine, seq_id: int, sequence: list[int], n: int) -> torch.Tensor:
    """'none': run the whole sequence through the model, logits of its last n positions only: [n, V].

    The head is applied to the last n rows instead of all T (T x V floats would dwarf the step)."""
    cache, model = engine.cache, engine.model
    view = cache.begin_step([seq_id], [sequence])
    hidden = model.hidden_states(torch.tensor([sequence], device=engine.device), view)  # [1, T, H]
    logits = model.lm_head(hidden[0, -n:].contiguous()).float()  # [n, V]
    cache.commit_step(view)
    return logits

