"""On a CUDA device (skipped elsewhere): decode steps captured as CUDA graphs replay what their eager body computes,
bit for bit, across a key bucket and a grown pool, alone and in a batch, on the real default model."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.graphs import DecodeGraphs
from engine.kv.fixed import BUCKET_TOKENS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPT = [(13 * i + 5) % 4000 + 200 for i in range(BUCKET_TOKENS - 24)]


@pytest.fixture(scope="module")
def engines():
    """The default model on CUDA twice: graphs captured, and the same bodies run eagerly."""
    captured = Engine.load(None, EngineConfig(cache="paged", device="cuda"))
    eager = Engine.load(None, EngineConfig(cache="paged", device="cuda"))
    eager.graphs = DecodeGraphs(eager.model, capture=False)
    return captured, eager


def greedy(engine: Engine, seq_ids: list[int], prompts: list[list[int]], steps: int) -> list[torch.Tensor]:
    for seq_id, prompt in zip(seq_ids, prompts):
        engine.cache.prepare(seq_id, prompt)
        engine.step([seq_id], [prompt])
    tokens, out = [[p[-1]] for p in prompts], []
    for _ in range(steps):
        logits = engine.step(seq_ids, tokens)  # [B, V]
        out.append(logits)
        tokens = [[int(t)] for t in logits.argmax(-1)]
    return out


def test_decode_steps_are_captured_and_replay_their_bodys_bits(engines):
    captured, eager = engines
    assert captured.graphs is not None and captured.graphs.capture
    got, want = greedy(captured, [1], [PROMPT], 48), greedy(eager, [1], [PROMPT], 48)
    assert captured.graphs.refused is None, captured.graphs.refused
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert captured.graphs.captures >= 2  # two key buckets


def test_a_batch_replays_its_graph(engines):
    captured, eager = engines
    prompts = [PROMPT[:40], PROMPT[:200], PROMPT[7:90]]
    got, want = greedy(captured, [11, 12, 13], prompts, 16), greedy(eager, [11, 12, 13], prompts, 16)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_graphs_give_the_eager_steps_logits(engines):
    """Fed the same tokens, a replayed step and the eager one (another padding of the keys: cuBLAS may sum in
    another order) agree within float16's rounding, and on the next token nearly always."""
    captured, _ = engines
    plain = Engine.load(None, EngineConfig(cache="paged", device="cuda", cuda_graphs=False))
    assert plain.graphs is None
    for engine in (captured, plain):
        engine.cache.prepare(21, PROMPT)
        engine.step([21], [PROMPT])
    token, agree = PROMPT[-1], 0
    for _ in range(32):
        got, want = captured.step([21], [[token]])[0], plain.step([21], [[token]])[0]
        torch.testing.assert_close(got, want, atol=0.1, rtol=0.02)
        agree += int(got.argmax()) == int(want.argmax())
        token = int(got.argmax())
    assert agree >= 30
