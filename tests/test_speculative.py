"""Speculative decoding: prompt-lookup drafts, verification in one forward, rollback, acceptance, adaptivity.

The contract: greedy output is token-for-token the plain greedy output in every strategy; sampled output has
exactly the plain distribution; the reply's events and counts say what each verify step did.
"""

from __future__ import annotations

import pytest
import torch

from engine.config import ConfigError, SamplingParams, SpeculativeConfig
from engine.model import LlamaModel
from engine.sampler import Sampler
from engine.speculative import (
    Draft,
    Drafter,
    PromptLookupDrafter,
    SpeculationPolicy,
    Speculator,
    judge,
    target_probs,
    verify_segments,
)
from tests.engine_helpers import greedy, one_torch_thread

STRATEGIES = ["none", "contiguous", "paged", "paged-int8"]
REPEAT = "Repeat after me: the cat sat on the mat, the cat sat on the mat, and the dog lay by the door."
LOOKUP = SpeculativeConfig("lookup", max_draft_tokens=8, adaptive=False)  # verify on every step it can


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_torch_thread():
        yield


def reply_ids(engine, message: str, params: SamplingParams) -> tuple[list[int], list]:
    conv = engine.new_conversation("You are a test assistant.")
    events = list(engine.generate(conv, message, params))
    return list(conv.messages[-1].token_ids), events


def with_speculation(params: SamplingParams, spec: SpeculativeConfig) -> SamplingParams:
    return SamplingParams(**{**params.__dict__, "speculative": spec})


# ---- prompt lookup --------------------------------------------------------------------------------------------


def test_lookup_proposes_what_followed_the_most_recent_match_of_the_last_tokens():
    drafter = PromptLookupDrafter(max_ngram=3)
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert drafter.propose(tokens, 4).tokens == [7, 8, 5, 1]  # the later "1 2 3" wins over the first one
    assert drafter.propose(tokens, 2).tokens == [7, 8]


def test_lookup_prefers_the_longest_ngram_and_falls_back_to_shorter_ones():
    drafter = PromptLookupDrafter(max_ngram=3, min_ngram=1)
    tokens = [4, 5, 6, 10, 5, 6, 11, 3, 5, 6]
    assert drafter.propose(tokens, 1).tokens == [11]  # "5 6" most recently continued by 11 (no "3 5 6" before)
    tokens = [4, 5, 6, 10, 7, 5, 6, 11, 4, 5, 6]
    assert drafter.propose(tokens, 1).tokens == [10]  # "4 5 6" matches: its continuation beats "5 6 -> 11"


def test_lookup_proposes_nothing_without_an_earlier_match_and_never_matches_the_suffix_itself():
    drafter = PromptLookupDrafter(max_ngram=2, min_ngram=2)
    assert drafter.propose([1, 2, 3, 4], 3).tokens == []
    assert drafter.propose([1, 2], 3).tokens == []
    assert drafter.propose([7], 3).tokens == []
    assert drafter.propose([1, 2, 1, 2], 5).tokens == [1, 2]  # a continuation stops where the tokens do


def test_lookup_needs_sensible_ngram_bounds():
    with pytest.raises(ConfigError, match="min_ngram"):
        PromptLookupDrafter(max_ngram=1, min_ngram=2)
    with pytest.raises(ConfigError, match="max_draft_tokens"):
        SpeculativeConfig("lookup", max_draft_tokens=0)
    with pytest.raises(ConfigError, match="unknown speculative mode"):
        SpeculativeConfig("medusa")


# ---- greedy: the same tokens as plain decoding, every strategy ------------------------------------------------


@pytest.mark.parametrize("strategy, block_size", [("none", 16), ("contiguous", 16), ("paged", 16), ("paged", 1),
                                                  ("paged-int8", 16), ("paged-int8", 8), ("paged-int8", 1)])
def test_greedy_speculative_output_is_the_plain_greedy_output(tiny_engine_factory, strategy, block_size):
    n = 96 if strategy == "none" else 256
    plain, _ = reply_ids(tiny_engine_factory(strategy, block_size), REPEAT, greedy(n))
    spec, events = reply_ids(tiny_engine_factory(strategy, block_size), REPEAT, with_speculation(greedy(n), LOOKUP))
    assert spec == plain and len(spec) == n
    done = events[-1]
    assert done.n_accepted > n // 4, "the tiny model repeats itself, so lookup drafts must hit"
    assert done.n_decode_steps < n - 1


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_drafts_that_are_mostly_wrong_are_rolled_back_and_change_nothing(tiny_engine_factory, tiny_config,
                                                                         strategy):
    """A draft model with other weights disagrees with the model at varied depths: every rejection point."""
    engine = tiny_engine_factory(strategy, 8)
    engine.draft_engine = type(engine)(LlamaModel.random(tiny_config, seed=1, std=0.1), engine.tokenizer,
                                       None, "tiny-other")
    n = 48 if strategy == "none" else 96
    plain, _ = reply_ids(tiny_engine_factory(strategy, 8), "Hello there", greedy(n))
    spec_cfg = SpeculativeConfig("draft", max_draft_tokens=4, adaptive=False)
    spec, events = reply_ids(engine, "Hello there", with_speculation(greedy(n), spec_cfg))
    assert spec == plain
    verify = [e for e in events[1:-1] if e.n_drafted]
    assert {e.n_accepted for e in verify} - {4}, "some drafts must be rejected"


def test_a_draft_model_identical_to_the_model_has_every_draft_accepted(tiny_engine_factory, tiny_config):
    engine = tiny_engine_factory("paged")
    engine.draft_engine = type(engine)(LlamaModel.random(tiny_config, seed=0, std=0.1), engine.tokenizer,
                                       None, "tiny-same")
    spec_cfg = SpeculativeConfig("draft", max_draft_tokens=4, adaptive=False)
    plain, _ = reply_ids(tiny_engine_factory("paged"), "Hello there", greedy(41))
    spec, events = reply_ids(engine, "Hello there", with_speculation(greedy(41), spec_cfg))
    assert spec == plain
    done = events[-1]
    assert (done.n_drafted, done.n_accepted, done.n_decode_steps) == (32, 32, 8)  # 8 steps x (4 drafts + 1)


def test_draft_mode_without_a_draft_model_is_a_clear_error_that_changes_nothing(tiny_engine_factory):
    engine = tiny_engine_factory("paged")
    conv = engine.new_conversation()
    params = with_speculation(greedy(4), SpeculativeConfig("draft"))
    with pytest.raises(ConfigError, match="draft model"):
        list(engine.generate(conv, "Hello", params))
    assert conv.messages == []


# ---- what the events say --------------------------------------------------------------------------------------


def test_verify_steps_report_drafts_and_acceptances_and_add_up_to_the_reply(tiny_engine_factory):
    engine = tiny_engine_factory("paged")
    ids, events = reply_ids(engine, REPEAT, with_speculation(greedy(64), LOOKUP))
    steps, done = events[:-1], events[-1]
    decode = [e for e in steps if e.phase == "decode"]
    assert sum(e.n_produced for e in decode) == 63 == done.n_decode_tokens  # the prefill produced the first
    assert sum(e.n_drafted for e in decode) == done.n_drafted and sum(e.n_accepted for e in decode) == done.n_accepted
    assert all(0 <= e.n_accepted <= e.n_drafted <= 8 for e in decode)
    assert all(e.n_tokens == e.n_drafted + 1 for e in decode)  # one forward of [last token + drafts]
    assert done.n_decode_steps == len(decode) == done.n_decode_forwards
    assert "".join(e.text for e in steps) == done.text
    positions = [e.pos for e in decode]  # each step's last kept token: reply token i sits at n_prompt + i
    assert positions == sorted(positions) and positions[-1] == done.n_prompt_tokens + 62
    assert done.tokens_per_step == pytest.approx(63 / len(decode))
    (seq_id,) = engine.cache.seqs
    assert engine.cache.tokens_held(seq_id) == done.n_prompt_tokens + len(ids) - 1  # as after plain decoding


def test_a_stop_token_among_accepted_drafts_ends_the_reply_there(tiny_engine_factory):
    plain, _ = reply_ids(tiny_engine_factory("paged"), REPEAT, greedy(64))
    stop = plain[40]
    params = SamplingParams(temperature=0, repetition_penalty=1.0, max_new_tokens=64, stop_token_ids=(stop,),
                            speculative=LOOKUP)
    engine = tiny_engine_factory("paged")
    ids, events = reply_ids(engine, REPEAT, params)
    assert ids == plain[: plain.index(stop)]
    done = events[-1]
    assert done.finish_reason == "stop" and events[-2].token_id == stop
    (seq_id,) = engine.cache.seqs
    assert engine.cache.tokens_held(seq_id) == done.n_prompt_tokens + len(ids)


@pytest.mark.parametrize("max_new_tokens", [1, 2, 5, 17])
def test_speculation_never_produces_more_than_max_new_tokens(tiny_engine_factory, max_new_tokens):
    params = with_speculation(greedy(max_new_tokens), LOOKUP)
    ids, events = reply_ids(tiny_engine_factory("paged"), REPEAT, params)
    assert len(ids) == max_new_tokens and events[-1].finish_reason == "length"


def test_speculation_stops_at_the_context_limit_like_plain_decoding(tiny_engine_factory):
    plain, _ = reply_ids(tiny_engine_factory("paged", max_context=120), REPEAT, greedy(500))
    spec, events = reply_ids(tiny_engine_factory("paged", max_context=120), REPEAT,
                             with_speculation(greedy(500), LOOKUP))
    assert spec == plain and events[-1].finish_reason == "length"


def test_the_next_turn_reuses_as_much_prefix_after_a_speculative_reply_as_after_a_plain_one(tiny_engine_factory):
    hits = []
    for params in (greedy(40), with_speculation(greedy(40), LOOKUP)):
        engine = tiny_engine_factory("paged")
        conv = engine.new_conversation("sys")
        list(engine.generate(conv, REPEAT, params))
        done = list(engine.generate(conv, "again", params))[-1]
        hits.append((done.prefix_hit_tokens, done.n_prompt_tokens))
    assert hits[0] == hits[1] and hits[1][0] > 0


# ---- sampling: the plain distribution, exactly -----------------------------------------------------------------


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of observed counts against probabilities (cells expected below 5 are pooled)."""
    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]]).double()
    exp = torch.cat([expected[big], expected[~big].sum()[None]]).double()
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


def draw_first_token(sampler, logits, draft, q=None) -> int:
    other = judge(sampler, logits, [], draft, q)
    return draft if other is None else other


SAMPLING = SamplingParams(temperature=0.9, top_k=6, top_p=0.97, repetition_penalty=1.3, seed=7)
NUCLEUS_ONLY = SamplingParams(temperature=0.9, top_k=0, top_p=0.9, repetition_penalty=1.3, seed=7)


@pytest.mark.parametrize("params", [SAMPLING, NUCLEUS_ONLY], ids=["top-k: the kept tokens' lists", "top-p alone: [V]"])
def test_the_acceptance_rule_reproduces_the_target_distribution_for_point_mass_and_model_drafts(params):
    logits = torch.tensor([2.0, 1.5, 1.2, 0.3, -0.5, -1.0, -3.0, 0.9])  # [V]
    target = target_probs(Sampler(params, torch.device("cpu")), logits, [])
    q = torch.softmax(torch.tensor([0.1, 2.5, 0.2, 1.0, 0.0, 0.0, 0.0, 0.4]), 0)  # a draft model that disagrees
    n = 20000
    for mode in ("point mass on the second token", "a draft model's distribution"):
        sampler = Sampler(params, torch.device("cpu"))
        gen = torch.Generator().manual_seed(3)
        counts = torch.zeros(8)
        for _ in range(n):
            if mode.startswith("point"):
                counts[draw_first_token(sampler, logits, 1)] += 1
            else:
                counts[draw_first_token(sampler, logits, int(torch.multinomial(q, 1, generator=gen)), q)] += 1
        assert chi_square_p_value(counts, target) > 1e-3, mode
        assert (counts / n - target).abs().sum() / 2 < 0.02, mode


def test_the_statistical_check_would_catch_a_rule_that_always_accepts():
    logits = torch.tensor([2.0, 1.5, 1.2, 0.3, -0.5, -1.0, -3.0, 0.9])
    target = target_probs(Sampler(SAMPLING, torch.device("cpu")), logits, [])
    counts = torch.zeros(8)
    sampler = Sampler(SAMPLING, torch.device("cpu"))
    for _ in range(2000):  # accept the draft half the time regardless of p: a biased rule
        token = 1 if torch.rand((), generator=sampler.generator) < 0.5 else sampler(logits, [])
        counts[token] += 1
    assert chi_square_p_value(counts, target) < 1e-6


class FixedDrafter(Drafter):
    """Always proposes the same tokens: the test controls exactly what is verified."""

    def __init__(self, tokens: list[int]):
        self.tokens = tokens

    def propose(self, tokens, k):
        return Draft(self.tokens[:k])


@pytest.mark.parametrize("strategy", ["contiguous", "paged-int8"])
def test_speculative_sampling_on_the_tiny_model_has_the_plain_next_token_distributions(tiny_engine_factory,
                                                                                      strategy):
    """Many seeded verify steps from one context: the first produced token follows p(. | h) and, when it is the
    first draft, the second follows p(. | h, d0), with the penalty counting the drafts: plain sampling's laws."""
    engine = tiny_engine_factory(strategy, 8)
    text = "The quick brown fox jumps over the lazy dog, then naps in the sun."
    history = engine.tokenizer.encode(text, add_special_tokens=False)[:11]  # positions 10-12 fill no block
    params = SamplingParams(temperature=0.7, top_k=8, top_p=0.95, repetition_penalty=1.2, seed=11)
    cache, past = engine.cache, len(history) - 1
    cache.prepare(1, history)
    engine.step([1], [history[:-1]])
    logits0 = engine.step([1], [history[-1:]])[0]  # plain decoding's two steps
    probe = Sampler(params, engine.device)
    p0 = target_probs(probe, logits0, history)
    d0 = int(p0.argmax())
    logits1 = engine.step([1], [[d0]])[0]
    cache.truncate(1, past)
    p1 = target_probs(probe, logits1, history + [d0])
    d1 = int(p1.argsort(descending=True)[1])  # the second most likely: rejected often, accepted sometimes
    sampler = Sampler(params, engine.device)
    speculator = Speculator(engine, 1, SpeculativeConfig("lookup", 2, adaptive=False), sampler,
                            FixedDrafter([d0, d1]))
    first, second = torch.zeros(len(p0)), torch.zeros(len(p1))
    for _ in range(2000):
        out = speculator.step(history, room=3).tokens
        first[out[0]] += 1
        if out[0] == d0:
            second[out[1]] += 1
        cache.truncate(1, past)
    assert chi_square_p_value(first, p0) > 1e-3
    assert chi_square_p_value(second, p1) > 1e-3
    assert 0 < second[d1] < second.sum(), "the second draft was both accepted and rejected"


# ---- paged-int8 verifies in pieces that each see what plain decoding sees -----------------------------------


def test_int8_verification_is_cut_before_each_position_that_fills_a_block(tiny_engine_factory):
    cache = tiny_engine_factory("paged-int8", 8).cache
    assert verify_segments(cache, past=3, n=5) == [4, 1]  # position 7 fills the block: it starts a piece
    assert verify_segments(cache, past=7, n=5) == [5]  # the first token fills it: it is accepted already
    assert verify_segments(cache, past=6, n=12) == [1, 8, 3]
    assert verify_segments(tiny_engine_factory("paged", 8).cache, past=3, n=9) == [9]


# ---- adaptivity --------------------------------------------------------------------------------------------


def test_k_follows_the_acceptance_rate():
    policy = SpeculationPolicy(max_k=8)
    start = policy.k
    for _ in range(4):
        policy.record_verify(10.0, policy.k, policy.k)
    assert policy.k == 8 > start
    for _ in range(4):
        policy.record_verify(10.0, policy.k, 0)
    assert policy.k == 1


def test_k_stays_small_when_each_draft_token_costs_a_lot_and_grows_when_drafts_are_cheap():
    expensive, cheap = SpeculationPolicy(max_k=8), SpeculationPolicy(max_k=8)
    for policy, ms_per_draft in ((expensive, 20.0), (cheap, 0.5)):
        policy.record_plain(20.0)
        policy.record_plain(20.0)
        for _ in range(6):
            k = policy.k
            policy.record_verify(20.0 + ms_per_draft * k, k, k)  # every draft accepted
    assert expensive.k == 1 and expensive.draft_cost == pytest.approx(1.0, rel=0.05)
    assert cheap.k == 8


def test_speculation_stands_down_when_verify_steps_produce_tokens_slower_than_plain_steps():
    policy = SpeculationPolicy(max_k=4)
    assert policy.wants_plain_step()  # first, measure what a plain step costs
    policy.record_plain(50.0)
    policy.record_plain(52.0)
    assert not policy.wants_plain_step()
    for _ in range(SpeculationPolicy.WINDOW):
        policy.record_verify(60.0, 4, 0)  # 60 ms for one token, against 51 ms plain
    assert policy.standing_down and policy.wants_plain_step()


def test_speculation_keeps_going_while_it_pays():
    policy = SpeculationPolicy(max_k=4)
    policy.record_plain(50.0)
    policy.record_plain(50.0)
    for _ in range(3 * SpeculationPolicy.WINDOW):
        policy.record_verify(60.0, 4, 1)  # 30 ms per token
    assert not policy.standing_down


def test_without_adaptivity_every_step_drafts_the_maximum():
    policy = SpeculationPolicy(max_k=6, adaptive=False)
    for _ in range(20):
        policy.record_verify(100.0, 6, 0)
    assert (policy.k, policy.wants_plain_step(), policy.standing_down) == (6, False, False)


def test_adaptive_lookup_keeps_the_output_and_measures_plain_steps_first(tiny_engine_factory):
    spec = SpeculativeConfig("lookup", 8)  # adaptive
    plain, _ = reply_ids(tiny_engine_factory("paged"), "Hello", greedy(64))
    ids, events = reply_ids(tiny_engine_factory("paged"), "Hello", with_speculation(greedy(64), spec))
    assert ids == plain
    decode = [e for e in events if getattr(e, "phase", "") == "decode"]
    assert decode[0].n_drafted == decode[1].n_drafted == 0  # the first steps measure plain decoding


# ---- the real default model ----------------------------------------------------------------------------------

PASSAGE = ("The kettle whistled in the small kitchen while the rain kept falling on the roof. Anna poured the water "
           "over the tea leaves, waited three minutes, and carried two cups to the table by the window, where her "
           "brother was still reading the letter that had arrived that morning from their aunt in Lisbon.")
# the model copies the passage and then copies it again, with slips: about half the drafts are accepted, so every
# strategy both keeps accepted drafts and rolls rejected ones back (mostly rejected drafts, on prose: int4 weights,
# tests/test_weight_generation.py)
COPY_PROMPT = f"Here is a text:\n\n{PASSAGE}\n\nCopy the text above exactly three times, one per paragraph."


@pytest.mark.default_model
def test_greedy_speculation_on_the_real_model_is_token_identical_for_256_tokens_in_both_exact_layouts(default_engine):
    """float32 weights (int4's speculation: tests/test_weight_generation.py): speculation in `contiguous` and in
    `paged` gives plain `paged`'s 256 tokens, and keeps some drafts and rolls others back. 'none' recomputes the
    whole context per forward (minutes here for 256 tokens) and `paged-int8` verifies in pieces: both speculate on
    the tiny model above."""
    n = 256
    default_engine.set_cache("paged", 16)
    baseline, _ = reply_ids(default_engine, COPY_PROMPT, greedy(n))
    for strategy in ("contiguous", "paged"):
        default_engine.set_cache(strategy, 16)
        ids, events = reply_ids(default_engine, COPY_PROMPT, with_speculation(greedy(n), LOOKUP))
        assert ids == baseline, strategy
        done = events[-1]
        assert len(ids) == n
        assert n // 4 < done.n_accepted < done.n_drafted, f"{strategy}: drafts kept and drafts rolled back"
    default_engine.set_cache("paged", 16)


# ---- the chat CLI ---------------------------------------------------------------------------------------------


def test_the_cli_refuses_a_bad_draft_token_count_before_loading_anything(capsys):
    import main

    assert main.main(["chat", "--prompt", "hi", "--speculative", "lookup", "--draft-tokens", "0"]) == 2
    assert "max_draft_tokens" in capsys.readouterr().err


@pytest.mark.default_model
def test_the_cli_speculates_with_lookup_and_its_json_steps_say_what_each_step_verified():
    from tests.test_cli import chat, records, turns

    args = ("--prompt", COPY_PROMPT, "--temperature", "0", "--max-new-tokens", "32", "--json")
    plain = turns(records(chat(*args).stdout))
    spec = turns(records(chat(*args, "--speculative", "lookup", "--draft-tokens", "4").stdout))
    (plain_steps, plain_done), (steps, done) = plain[0], spec[0]
    assert done["text"] == plain_done["text"]
    assert all(0 <= s["n_accepted"] <= s["n_drafted"] <= 4 for s in steps)
    assert sum(s["n_drafted"] for s in steps) == done["n_drafted"] > 0
    assert done["n_decode_steps"] < plain_done["n_decode_steps"]
    assert all(s["n_drafted"] == 0 for s in plain_steps)


# ---- the benchmark's report -----------------------------------------------------------------------------------


def test_the_recorded_speculative_bench_summarises_and_plots_readably(tmp_path):
    import json
    from pathlib import Path

    from engine.bench import report
    from engine.bench import speculative as bench
    from tests.test_bench_plots import assert_readable

    recorded = Path(__file__).resolve().parents[1] / "docs" / "bench" / "speculative-quick" / "results.json"
    result = json.loads(recorded.read_text())["benchmarks"]["speculative"]
    text = bench.summarize(result)
    assert "input-grounded" in text and "free chat" in text and "Targets: paged input-grounded" in text
    bench.plot(result, tmp_path / "speculative.png")
    assert_readable(report.last_saved["axes"])


def test_word_4gram_overlap_is_the_share_of_the_replys_4grams_found_in_the_prompt():
    from engine.bench.speculative import word_4gram_overlap

    prompt = "the cat sat on the mat today"
    assert word_4gram_overlap("the cat sat on the mat", prompt) == 1.0
    assert word_4gram_overlap("the cat sat on a rug", prompt) == pytest.approx(1 / 3)
    assert word_4gram_overlap("too short", prompt) == 0.0
