"""Sampling: greedy, seeded temperature sampling, top-k, top-p and the repetition penalty."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from engine import kernels
from engine.config import ConfigError, SamplingParams
from engine.sampler import (
    Sampler,
    SeenTokens,
    draw,
    greedy_token,
    penalize,
    penalized_greedy,
    top_candidates,
)

CPU = torch.device("cpu")
PROBS = [0.5, 0.3, 0.15, 0.05]  # tokens 0..3, already sorted by probability


def distinct_ids(history: list[int]) -> torch.Tensor:
    return torch.tensor(sorted(set(history)), dtype=torch.int64)


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor([math.log(p) for p in probs])


def random_logits(seed: int = 0, vocab: int = 1000) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 3


def draws(params: SamplingParams, logits: torch.Tensor, n: int) -> list[int]:
    sampler = Sampler(params, CPU)
    return [sampler(logits, []) for _ in range(n)]


def sample(**kwargs) -> SamplingParams:
    return SamplingParams(**{"temperature": 1.0, "top_k": 0, "top_p": 1.0, "repetition_penalty": 1.0, **kwargs})


def test_greedy_picks_the_largest_logit_whatever_the_seed():
    logits = random_logits()
    for seed in (None, 0, 1):
        assert draws(sample(temperature=0, seed=seed), logits, 3) == [int(logits.argmax())] * 3


def test_the_greedy_token_is_argmaxs_the_first_of_equal_largest_and_a_nan_first_of_all():
    for seed in range(20):
        logits = random_logits(seed, vocab=49_152)
        assert greedy_token(logits) == int(logits.argmax())
        top = int(logits.argmax())
        logits[top + 7:top + 9] = logits[top]  # ties after the first largest
        logits[3] = logits[top] if seed % 2 else logits[3]  # and one before it, every other time
        assert greedy_token(logits) == int(logits.argmax()) == (min(3, top) if seed % 2 else top)
        logits[11] = float("nan")
        assert greedy_token(logits) == int(logits.argmax()) == 11


def test_seeded_sampling_is_reproducible():
    logits = random_logits(1, vocab=50) / 3  # a flat distribution: many tokens are likely
    first = draws(sample(seed=1234), logits, 40)
    assert draws(sample(seed=1234), logits, 40) == first
    assert len(set(first)) > 5
    assert draws(sample(seed=4321), logits, 40) != first


def test_top_k_1_is_greedy():
    for seed in range(5):
        logits = random_logits(seed)
        assert draws(sample(top_k=1, seed=seed, temperature=1.5), logits, 5) == [int(logits.argmax())] * 5


def test_top_k_samples_only_the_k_most_likely_tokens():
    logits = random_logits(2, vocab=100)
    top3 = set(torch.topk(logits, 3).indices.tolist())
    assert set(draws(sample(top_k=3, seed=0, temperature=5.0), logits, 300)) == top3


@pytest.mark.parametrize(("top_p", "kept"), [(0.45, {0}), (0.75, {0, 1}), (0.9, {0, 1, 2}), (1.0, {0, 1, 2, 3})])
def test_top_p_keeps_the_smallest_set_of_tokens_reaching_p(top_p, kept):
    assert set(draws(sample(top_p=top_p, seed=0), logits_of(PROBS), 2000)) == kept


def test_top_p_renormalizes_over_the_kept_tokens():
    got = draws(sample(top_p=0.75, seed=7), logits_of(PROBS), 4000)
    share = got.count(0) / len(got)
    assert abs(share - 0.5 / 0.8) < 0.03  # 0.625 expected


def test_temperature_sharpens_and_flattens():
    logits = logits_of(PROBS)
    cold = draws(sample(temperature=0.1, seed=3), logits, 500)
    hot = draws(sample(temperature=10.0, seed=3), logits, 500)
    assert cold.count(0) > 490
    assert hot.count(3) > 80  # near uniform: ~125 expected


def test_repetition_penalty_lowers_seen_tokens_and_leaves_the_others():
    logits = torch.tensor([2.0, -2.0, 1.0, -1.0, 0.5])
    penalized = penalize(logits, distinct_ids([0, 1, 1]), 2.0)
    assert penalized.tolist() == [1.0, -4.0, 1.0, -1.0, 0.5]  # positive divided, negative multiplied
    assert logits.tolist() == [2.0, -2.0, 1.0, -1.0, 0.5]  # the input is not modified


def test_no_repetition_penalty_changes_nothing():
    logits = random_logits()
    assert torch.equal(penalize(logits, distinct_ids([1, 2, 3]), 1.0), logits)
    assert torch.equal(penalize(logits, distinct_ids([]), 1.5), logits)


def test_a_penalty_kept_across_a_growing_history_gives_the_bits_of_one_computed_afresh():
    """The sampler keeps the history's tokens as a mask it brings up to date; a history that went back (a
    speculative draft rolled back, another conversation) is read again."""
    seen, history = SeenTokens(), []
    rng = torch.Generator().manual_seed(0)
    for step in range(300):
        history.append(int(torch.randint(0, 50 if step % 2 else 1000, (), generator=rng)))
        if step % 60 == 59:
            history = history[:-5]
        if step == 200:
            history = [7, 8, 9]
        logits = torch.randn(1000, generator=rng)
        kept, afresh = seen.of(history, logits), distinct_ids(history)
        assert torch.equal(penalize(logits, kept, 1.3), penalize(logits, afresh, 1.3))


def test_the_repetition_penalty_can_change_the_greedy_choice():
    logits = torch.tensor([3.0, 2.5, 0.0])
    sampler = Sampler(SamplingParams(temperature=0, repetition_penalty=1.5), CPU)
    assert sampler(logits, []) == 0
    assert sampler(logits, [0]) == 1  # 3.0 / 1.5 = 2.0 < 2.5


@pytest.mark.parametrize("bad", [dict(temperature=-0.1), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5),
                                 dict(repetition_penalty=0.0), dict(max_new_tokens=0)])
def test_out_of_range_parameters_are_refused(bad):
    with pytest.raises(ConfigError):
        SamplingParams(**bad)


def full_sort_distribution(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """The rule spelled out over the whole vocabulary: mask below the k-th logit, softmax, sort every token,
    keep those whose higher-ranked mass is below p, renormalize."""
    if top_k:
        logits = logits.masked_fill(logits < torch.topk(logits, top_k).values[-1], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    ranked, order = probs.sort(descending=True)
    ranked[ranked.cumsum(0) - ranked >= top_p] = 0.0
    kept = torch.zeros_like(probs).scatter_(0, order, ranked)
    return kept / kept.sum()


@pytest.mark.parametrize(("top_k", "top_p", "scale"), [(40, 0.95, 3.0), (8, 0.5, 1.0), (0, 0.95, 3.0),
                                                       (0, 0.9, 0.05), (0, 1.0, 1.0), (49152, 0.7, 1.0)])
def test_the_sampled_distribution_is_the_rule_over_the_whole_vocabulary(top_k, top_p, scale):
    """Only the kept tokens are sorted (a vocabulary of 49,152 took 4 ms a token to sort): the distribution is the
    full rule's, also where top-p alone must look past the first candidates (a flat distribution, scale 0.05)."""
    logits = random_logits(5, vocab=49152) * scale
    sampler = Sampler(sample(top_k=top_k, top_p=top_p), CPU)
    ids, probs = sampler.candidates(logits)
    assert torch.all(probs[:-1] >= probs[1:]) or (top_k, top_p) == (0, 1.0)  # most likely first where filtered
    assert torch.allclose(sampler.distribution(logits), full_sort_distribution(logits, top_k, top_p), atol=1e-7)
    assert len(ids) > 64 or scale > 1.0 or top_k


def test_ties_with_the_k_th_logit_are_all_kept():
    logits = torch.tensor([3.0, 1.0, 2.0, 1.0, 1.0, 0.0])
    assert Sampler(sample(top_k=2), CPU).candidates(logits)[0].tolist() == [0, 2]
    ids, _ = Sampler(sample(top_k=3), CPU).candidates(logits)
    assert sorted(ids.tolist()) == [0, 1, 2, 3, 4]  # three tokens tie at the third place


def test_a_draw_follows_the_probabilities_and_never_picks_a_zero():
    gen = torch.Generator().manual_seed(0)
    probs = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.2, 0.0])
    counts = torch.zeros(6)
    for _ in range(6000):
        counts[draw(probs, gen)] += 1
    assert counts[[0, 2, 5]].sum() == 0
    assert (counts / 6000 - probs).abs().max() < 0.02


def awkward_logits(seed: int, vocab: int = 49152) -> torch.Tensor:
    """Real-sized logits with what a quantized head gives: many exact ties (values on a coarse grid), -inf."""
    x = torch.round(random_logits(seed, vocab) * 4) / 4
    x[torch.randint(vocab, (50,), generator=torch.Generator().manual_seed(seed))] = float("-inf")
    return x


def seen_of(seed: int, vocab: int, n: int = 300) -> torch.Tensor:
    return torch.randint(vocab, (n,), generator=torch.Generator().manual_seed(100 + seed)).unique()


@pytest.mark.skipif(not kernels.available(), reason="the compiled kernels do not build here")
@pytest.mark.parametrize("k", [1, 2, 40, 1000])
@pytest.mark.parametrize("penalty", [1.0, 1.1, 0.8])
def test_the_compiled_top_k_gives_torchs_candidates_bit_for_bit(k, penalty):
    """The kernel's one pass (penalty, top-k, ties with the k-th kept, largest first, equal ones by id) against the
    same rule in torch's ops, on logits full of ties."""
    for seed in range(3):
        logits, seen = awkward_logits(seed), seen_of(seed, 49152)
        values, ids = top_candidates(logits, seen, penalty, k)
        with kernels.pure_pytorch():
            want_values, want_ids = top_candidates(logits, seen, penalty, k)
        assert torch.equal(ids, want_ids) and torch.equal(values, want_values)
        assert len(ids) >= k and torch.all(values[:-1] >= values[1:])
        penalized = penalize(logits, distinct_ids(seen.tolist()), penalty)
        assert torch.equal(values, penalized[ids])
        assert int((penalized >= values[-1]).sum()) == len(ids)  # every tie with the k-th, nothing below it


@pytest.mark.parametrize("torch_only", [False, True])
def test_equal_candidates_come_by_id_and_nans_come_alone(torch_only):
    logits = torch.tensor([1.0, 3.0, 2.0, 3.0, 2.0, 0.0])
    with kernels.pure_pytorch() if torch_only else contextlib.nullcontext():
        assert top_candidates(logits, None, 1.0, 2)[1].tolist() == [1, 3]
        assert top_candidates(logits, None, 1.0, 3)[1].tolist() == [1, 3, 2, 4]
        assert top_candidates(logits, torch.tensor([1]), 1.5, 1)[1].tolist() == [3]  # 3.0 / 1.5 = 2.0
        logits[[4, 2]] = float("nan")
        assert top_candidates(logits, None, 1.0, 3)[1].tolist() == [2, 4]


def test_the_penalized_greedy_token_is_the_greedy_token_of_the_penalized_logits():
    for seed in range(4):
        logits = awkward_logits(seed, vocab=5000)
        history = seen_of(seed, 5000, 200).tolist()
        for penalty in (1.0, 1.3, 0.7):
            want = greedy_token(penalize(logits, distinct_ids(history), penalty))
            assert penalized_greedy(logits, torch.tensor(history), penalty) == want
    logits = torch.tensor([0.0, float("nan"), 5.0, float("nan")])
    assert penalized_greedy(logits, torch.tensor([2]), 2.0) == 1


def test_a_seeded_reply_draws_the_same_tokens_with_the_compiled_kernels_and_without():
    """The app's default sampling (top-k 40, top-p 0.95, penalty 1.1) over a growing history: the same tokens."""
    params = SamplingParams(seed=7)

    def reply(n: int = 60) -> list[int]:
        sampler, history = Sampler(params, CPU), [5, 9, 9, 300]
        for i in range(n):
            history.append(sampler(awkward_logits(i, vocab=8000) * 0.5, history))
        return history

    with kernels.pure_pytorch():
        want = reply()
    assert reply() == want


@pytest.mark.skipif(not kernels.available(), reason="the compiled kernels do not build here")
def test_a_seen_id_outside_the_vocabulary_is_refused_by_name():
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        top_candidates(torch.zeros(10), torch.tensor([3, 10]), 1.2, 2)
