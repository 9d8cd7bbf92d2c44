"""Decode steps of fixed shapes, what a CUDA graph captures and replays (engine/graphs.py, engine/kv/fixed.py).

On this CPU the body runs eagerly on the same buffers a replay reads (capture=False): it must give the eager
step's tokens, the same bits for every layout, and be capturable: no op that reads a value back to the host, and
the same ops with the same shapes whatever the values, for every step of a shape."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from engine import kernels
from engine.config import EngineConfig
from engine.engine import Engine
from engine.graphs import DecodeGraphs
from engine.kv.fixed import BUCKET_TOKENS, Planner, bucket_keys, bucket_rows, spare_slot
from engine.model import LlamaModel
from engine.weights.formats import quantize_int4
from engine.weights.linear import Int4Linear
from tests.engine_helpers import OpRecorder

PROMPT = [(7 * i + 3) % 900 + 100 for i in range(BUCKET_TOKENS - 20)]  # crosses a bucket 20 steps in


def with_fixed_steps(engine):
    engine.graphs = DecodeGraphs(engine.model, capture=False)
    return engine


def greedy(engine, seq_id: int, prompt: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    engine.cache.prepare(seq_id, prompt)
    token = int(engine.step([seq_id], [prompt])[0].argmax())
    tokens, logits = [token], []
    for _ in range(steps):
        logits.append(engine.step([seq_id], [[token]])[0])
        token = int(logits[-1].argmax())
        tokens.append(token)
    return tokens, logits


def test_shapes_bucket_rows_to_powers_of_two_and_keys_to_whole_buckets():
    assert [bucket_rows(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]
    assert [bucket_keys(n) for n in (1, 256, 257, 700)] == [256, 256, 512, 768]


def test_padded_writes_put_back_a_slot_the_step_does_not_write():
    assert spare_slot([0, 1, 3]) == 2
    assert spare_slot([5]) == 0 and spare_slot([]) == 0


@pytest.mark.parametrize("cache, block_size", [("contiguous", 16), ("paged", 1), ("paged", 16), ("paged", 64)])
def test_a_fixed_step_gives_the_eager_steps_tokens(tiny_engine_factory, cache, block_size):
    eager = tiny_engine_factory(cache, block_size)
    fixed = with_fixed_steps(tiny_engine_factory(cache, block_size))
    want, want_logits = greedy(eager, 1, PROMPT, 40)
    got, got_logits = greedy(fixed, 1, PROMPT, 40)
    assert got == want
    torch.testing.assert_close(torch.stack(got_logits), torch.stack(want_logits), atol=1e-4, rtol=0)
    assert fixed.graphs.captures >= 2  # the keys' bucket changed at 256 tokens (and a grown pool's stores moved)


def test_as_on_cuda_a_fixed_step_gives_the_eager_steps_tokens(tiny_engine_factory):
    """What CUDA runs (the pure PyTorch path, float16 activations, `auto`'s bfloat16 weights there): the eager
    step and the fixed one agree on the greedy tokens, their logits within float16's rounding."""
    with kernels.pure_pytorch():
        eager = tiny_engine_factory("paged", weights="bfloat16", dtype="float16")
        fixed = with_fixed_steps(tiny_engine_factory("paged", weights="bfloat16", dtype="float16"))
        want, want_logits = greedy(eager, 1, PROMPT, 32)
        got, got_logits = greedy(fixed, 1, PROMPT, 32)
    assert got == want
    torch.testing.assert_close(torch.stack(got_logits), torch.stack(want_logits), atol=0.02, rtol=0.01)


@pytest.mark.parametrize("cache", ["paged", "contiguous"])
def test_a_step_planned_by_extending_the_last_gives_the_bits_of_one_planned_from_every_key(tiny_engine_factory,
                                                                                          cache):
    """Across a bucket, a grown pool, a rollback, a fork and a batch: extending the last step's indices (work by
    sequences) and planning from every key give the same logits."""
    engines = [with_fixed_steps(tiny_engine_factory(cache)) for _ in range(2)]
    engines[1].graphs.planner = Planner(incremental=False)
    logits: list[list[torch.Tensor]] = [[], []]
    for engine, out in zip(engines, logits):
        engine.cache.prepare(1, PROMPT)
        engine.step([1], [PROMPT])
        for token in range(30):
            out.append(engine.step([1], [[token + 7]]))
        engine.cache.truncate(1, engine.cache.tokens_held(1) - 5)  # a speculative rollback
        for token in range(4):
            out.append(engine.step([1], [[token + 40]]))
        engine.cache.fork(1, 2)
        for token in range(3):
            out.append(engine.step([1], [[token + 50]]))
        for token in range(6):
            out.append(engine.step([1, 2], [[token + 60], [token + 70]]))
    assert all(torch.equal(a, b) for a, b in zip(*logits))
    assert engines[0].graphs.planner.extended >= 30 and engines[1].graphs.planner.extended == 0


def test_a_plan_extends_the_last_only_while_the_old_keys_stay_in_their_blocks(tiny_engine_factory):
    engine = with_fixed_steps(tiny_engine_factory("paged"))
    greedy(engine, 1, PROMPT[:50], 2)
    planner = engine.graphs.planner
    view = engine.cache.begin_step([1], [[5]])
    assert planner.same_blocks(view, planner.last)
    planner.last.tables[0][0] += 1  # as if the first block had been copied elsewhere
    assert not planner.same_blocks(view, planner.last)


def test_every_layout_gives_the_same_bits_through_fixed_steps(tiny_engine_factory):
    runs = [greedy(with_fixed_steps(tiny_engine_factory(c, b)), 1, PROMPT, 24)
            for c, b in [("contiguous", 16), ("paged", 1), ("paged", 16), ("paged", 64)]]
    for tokens, logits in runs[1:]:
        assert tokens == runs[0][0]
        assert all(torch.equal(a, b) for a, b in zip(logits, runs[0][1]))


def test_a_batch_of_sequences_steps_through_one_fixed_shape(tiny_engine_factory):
    """Three sequences of different lengths in one step (rows padded to four) give each its own eager logits."""
    eager, fixed = tiny_engine_factory("paged"), with_fixed_steps(tiny_engine_factory("paged"))
    prompts = [PROMPT[:40], PROMPT[:300], PROMPT[5:120]]
    for engine in (eager, fixed):
        for i, prompt in enumerate(prompts):
            engine.cache.prepare(i, prompt)
            engine.step([i], [prompt])
    tokens = [[11], [12], [13]]
    for _ in range(6):
        want, got = eager.step([0, 1, 2], tokens), fixed.step([0, 1, 2], tokens)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        tokens = [[int(t)] for t in want.argmax(-1)]
    assert fixed.graphs.captures == 1


def test_steps_a_fixed_shape_cannot_take_run_eagerly(tiny_engine_factory):
    """Quantized codes, several new tokens (a prompt, speculative verify rows) and all-position logits."""
    quantized = with_fixed_steps(tiny_engine_factory("paged", kv_dtype="int8"))
    greedy(quantized, 1, PROMPT[:50], 3)
    assert quantized.graphs.captures == 0
    engine = with_fixed_steps(tiny_engine_factory("paged"))
    engine.cache.prepare(1, PROMPT[:50])
    engine.step([1], [PROMPT[:50]])
    engine.step([1], [[5]], all_logits=True)
    assert engine.graphs.captures == 0
    engine.step([1], [[5]])
    assert engine.graphs.captures == 1


def test_a_model_with_sliding_window_layers_steps_eagerly(tiny_config, tokenizer):
    """Its windows live in per-sequence rings that the fixed step does not read: every step is eager, and right."""
    config = dataclasses.replace(tiny_config, sliding_window=32, sliding_layers=(True, False))
    engines = [Engine(LlamaModel.random(config, seed=0, std=0.1), tokenizer, EngineConfig(cache="paged"))
               for _ in range(2)]
    with_fixed_steps(engines[1])
    assert engines[1].cache.windows is not None
    (want, want_logits), (got, got_logits) = (greedy(e, 1, PROMPT[:80], 6) for e in engines)
    assert got == want and all(torch.equal(a, b) for a, b in zip(got_logits, want_logits))
    assert engines[1].graphs.captures == 0


def test_a_token_outside_the_vocabulary_is_refused_and_the_cache_keeps_what_it_held(tiny_engine_factory):
    engine = with_fixed_steps(tiny_engine_factory("paged"))
    engine.cache.prepare(1, PROMPT[:50])
    engine.step([1], [PROMPT[:50]])
    vocab = engine.model.config.vocab_size
    for bad in (vocab, -1):
        with pytest.raises(IndexError, match=f"embedding row {bad} is outside"):
            engine.step([1], [[bad]])
        assert engine.cache.tokens_held(1) == 50


def test_a_capture_the_device_refuses_leaves_every_step_eager(tiny_engine_factory, capfd):
    """Where a capture fails (a CUDA device refusing an op), that step and the later ones run eagerly and give the
    eager step's logits; the reason is said once. (The capture itself needs CUDA: here it is made to raise.)"""
    eager, engine = tiny_engine_factory("paged"), with_fixed_steps(tiny_engine_factory("paged"))
    graphs = engine.graphs
    graphs.capture = True

    def refused(entry, stores):
        raise RuntimeError("operation not permitted when stream is capturing")

    graphs.record = refused
    want, want_logits = greedy(eager, 1, PROMPT[:50], 4)
    got, got_logits = greedy(engine, 1, PROMPT[:50], 4)
    assert got == want and all(torch.equal(a, b) for a, b in zip(got_logits, want_logits))
    assert "not permitted" in graphs.refused and not graphs.entries
    assert capfd.readouterr().err.count("without CUDA graphs") == 1


def test_new_weights_drop_the_graphs_that_name_the_old_ones(tiny_engine_factory):
    engine = with_fixed_steps(tiny_engine_factory("paged"))
    greedy(engine, 1, PROMPT[:50], 2)
    assert len(engine.graphs.entries) == 1
    engine.model.forget_one_call_plans()  # what a weight conversion does
    graphs = engine.graphs
    engine.step([1], [[5]])
    assert graphs.captures == 2 and len(graphs.entries) == 1


FORBIDDEN = {f"aten.{name}" for name in ("_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2",
                                         "unique_consecutive", "unique_dim", "lift_fresh", "lift_fresh_copy", "equal",
                                         "is_nonzero", "repeat_interleave")}
MASK_INDEXING = {"aten.index", "aten.index_put", "aten.index_put_"}


def host_reads(ops: list[tuple]) -> list[tuple]:
    """Ops a CUDA graph's capture refuses: values read back to the host, shapes that depend on values, tensors made
    from Python data, and indexing by a mask."""
    return [op for op in ops if op[0] in FORBIDDEN or op[0] in MASK_INDEXING
            and any(dtype == torch.bool for _, dtype in op[1][1:])]


@pytest.mark.parametrize("weights", ["bfloat16", "int4", "int8", "float32"])
def test_the_fixed_step_body_is_capturable(tiny_engine_factory, weights):
    """The body as CUDA would run it (the pure PyTorch path, float16 activations; `auto` weights are bfloat16 on
    CUDA): no op reads a value back to the host, and two steps of one shape with other tokens and positions run
    the same ops on the same shapes."""
    with kernels.pure_pytorch():
        engine = with_fixed_steps(tiny_engine_factory("paged", weights=weights, dtype="float16"))
        greedy(engine, 1, PROMPT[:50], 1)
        graphs, steps = engine.graphs, []
        body = graphs.body

        def recorded_body(entry, stores):
            with OpRecorder() as recorder:
                logits = body(entry, stores)
            steps.append(recorder.ops)
            return logits

        graphs.body = recorded_body
        for token in (5, 900):
            engine.step([1], [[token]])
    assert len(steps) == 2 and steps[0] and not host_reads(steps[0])
    assert steps[0] == steps[1]


@pytest.mark.parametrize("pure", [True, False])
def test_an_int4_tables_lookup_reads_ids_back_only_to_check_them(pure):
    """The eager lookup checks its ids on the host (what the recorder must flag); with checked ids (the fixed
    step checks them before it runs) it does not."""
    with kernels.pure_pytorch() if pure else contextlib.nullcontext():
        table = Int4Linear(quantize_int4(torch.randn(64, 64)))
    ids = torch.tensor([[3, 60]])
    for checked in (False, True):
        with OpRecorder() as recorder:
            rows = table.rows(ids, torch.float16, checked)
        assert rows.shape == (1, 2, 64)
        assert bool(host_reads(recorder.ops)) is not checked
