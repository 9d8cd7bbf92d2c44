"""A step's result for a sequence never depends on how its keys are laid out or on what else is in the batch.

The compiled kernels (engine/kernels) compute every output row with one fixed order of operations: a decode
projection's row does not depend on the other rows, and attention sums a query's scores and values in position
order whatever the cache layout, block size, pool growth or batch. These tests compare bits (torch.equal),
not tolerances. The pure PyTorch path is layout-invariant too (it gathers every layout into the same tensor).
"""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch

from engine import kernels
from engine.config import BLOCK_SIZES, EngineConfig
from engine.engine import Engine
from engine.model import LlamaModel, op_by_op
from engine.weights.convert import to_format
from engine.weights.formats import QuantizedWeight, quantize_int4, quantize_int8
from engine.weights.linear import DECODE_ROWS, build_linear
from tests.engine_helpers import OpRecorder, one_torch_thread, torch_threads

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the compiled kernels could not be built here")

PROMPT = list(range(300, 341))  # 41 tokens: a partly filled block for every block size above 1
STEPS = 24


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_torch_thread():
        yield


def q8_0(w: torch.Tensor) -> QuantizedWeight:
    """int8 in groups of 32 along K, as GGUF's Q8_0."""
    n, k = w.shape
    groups = w.view(n, k // 32, 32)
    scales = (groups.abs().amax(-1) / 127).clamp(min=1e-8).half()
    return QuantizedWeight(8, (groups / scales.float()[..., None]).round().to(torch.int8).view(n, k), scales)


WEIGHTS = {
    "int4 groups of 32": lambda w: quantize_int4(w, 32),
    "int4 groups of 64": lambda w: quantize_int4(w, 64),
    "int8 per channel": quantize_int8,
    "int8 groups of 32 (Q8_0)": q8_0,
    "float32": lambda w: w,
    "bfloat16": lambda w: w.to(torch.bfloat16),
}


def rows_alone_and_together(module, x: torch.Tensor) -> torch.Tensor:
    """Each row of x through the module alone; asserts that the first r rows together give the same bits, for every
    r from 2 (a group of up to 8 rows, then what is left: every split the kernels make). -> the rows' outputs."""
    alone = torch.cat([module(x[i:i + 1]) for i in range(len(x))])
    for rows in range(2, len(x) + 1):
        assert torch.equal(module(x[:rows]), alone[:rows]), rows
    return alone


@pytest.mark.parametrize("fmt", list(WEIGHTS))
# the default model's widths (int4 minimums over 18 and 48 groups); 1,024 rows of 1,536: a job in several spans
@pytest.mark.parametrize("k, n", [(128, 200), (576, 48), (1536, 48), (1536, 1024)])
def test_a_decode_projection_gives_each_row_the_same_bits_for_1_to_16_rows(fmt, k, n):
    torch.manual_seed(0)
    module = build_linear(WEIGHTS[fmt](torch.randn(n, k) * 0.05))
    assert module.kernel_name.startswith("kvscope.")
    rows_alone_and_together(module, torch.randn(16, k))


@pytest.mark.parametrize("fmt", ["int4 groups of 32", "int8 per channel", "int8 groups of 32 (Q8_0)"])
def test_a_projection_over_an_odd_number_of_blocks_computes_its_weights_with_the_same_bits_per_row(fmt):
    torch.manual_seed(0)
    q = WEIGHTS[fmt](torch.randn(48, 160) * 0.05)  # 5 blocks of 32: the last one has no pair
    module = build_linear(q)
    # the 16-row layout takes any number of rows (17: two groups of 8 and one alone); a row at a time, 16 at most
    x = torch.randn(DECODE_ROWS + 1 if module.rows16 else DECODE_ROWS, 160)
    got = rows_alone_and_together(module, x)
    want = x @ q.dequantize().T
    assert (got - want).norm() / want.norm() < 0.01


def test_the_int_kernels_compute_what_the_dequantized_weights_give():
    torch.manual_seed(1)
    w, x = torch.randn(96, 256) * 0.05, torch.randn(4, 256)
    for make in (lambda v: quantize_int4(v, 32), lambda v: quantize_int4(v, 64), quantize_int8, q8_0):
        q = make(w)
        want = x @ q.dequantize().T
        got = build_linear(q)(x)
        # activations are quantized to int16 with one scale a row: far below 1% of the output's scale
        assert (got - want).norm() / want.norm() < 0.01


def test_the_thread_count_changes_no_bit_of_a_projection_or_a_step(tiny_config, tokenizer):
    torch.manual_seed(2)
    module = build_linear(quantize_int4(torch.randn(300, 128) * 0.05, 32))
    x = torch.randn(3, 128)
    runs = []
    for threads in (1, 2, 3):  # the kernels' threads claim chunks of rows; more threads than cores too
        with torch_threads(threads):
            engine = tiny_engine(tiny_config, tokenizer, "int4", cache="paged", block_size=8)
            runs.append((module(x), decode(engine, 1, PROMPT, 8)))
    for projection, steps in runs[1:]:
        assert torch.equal(projection, runs[0][0])
        assert same_bits(steps, runs[0][1])


def decode(engine: Engine, seq_id: int, prompt: list[int], steps: int, prefill_chunk: int = 1024) -> list:
    """Prefill in chunks, then greedy steps; every step's logits."""
    engine.cache.prepare(seq_id, prompt)
    for start in range(0, len(prompt), prefill_chunk):
        logits = engine.step([seq_id], [prompt[start:start + prefill_chunk]])[0]
    out = [logits]
    for _ in range(steps):
        out.append(engine.step([seq_id], [[int(out[-1].argmax())]])[0])
    return out


def tiny_engine(tiny_config, tokenizer, fmt: str, **config) -> Engine:
    model = LlamaModel.random(tiny_config, seed=0, std=0.1)
    engine = Engine(model, tokenizer, EngineConfig(weights=fmt, **config), "tiny-random")
    return engine


def same_bits(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("fmt", ["float32", "int4", "int8"])
def test_every_exact_layout_gives_the_same_bits(tiny_config, tokenizer, fmt):
    reference = decode(tiny_engine(tiny_config, tokenizer, fmt, cache="contiguous"), 1, PROMPT, STEPS)
    for block_size in BLOCK_SIZES:
        paged = tiny_engine(tiny_config, tokenizer, fmt, cache="paged", block_size=block_size)
        assert same_bits(decode(paged, 1, PROMPT, STEPS), reference), block_size


def test_a_pool_that_grew_over_several_chunks_gives_the_same_bits_as_one_tensor(tiny_config, tokenizer):
    contiguous = tiny_engine(tiny_config, tokenizer, "int4", cache="contiguous")
    reference = decode(contiguous, 1, PROMPT, 120, prefill_chunk=13)
    grown = tiny_engine(tiny_config, tokenizer, "int4", cache="paged", block_size=8)
    got = decode(grown, 1, PROMPT, 120, prefill_chunk=13)  # chunks of 13 rows: steps that span blocks
    assert len(grown.cache.layout.sizes) >= 3  # 161 tokens over chunks of 8, 8, 16 blocks
    assert same_bits(got, reference)


@pytest.mark.parametrize("cache", ["contiguous", "paged"])
def test_a_sequence_gives_the_same_bits_alone_and_in_a_batch(tiny_config, tokenizer, cache):
    alone = decode(tiny_engine(tiny_config, tokenizer, "int4", cache=cache), 1, PROMPT, STEPS)
    engine = tiny_engine(tiny_config, tokenizer, "int4", cache=cache)
    others = {2: list(range(500, 530)), 3: list(range(700, 777))}
    for seq_id, prompt in others.items():
        engine.cache.prepare(seq_id, prompt)
        engine.step([seq_id], [prompt])
    engine.cache.prepare(1, PROMPT)
    got = [engine.step([1], [PROMPT])[0]]
    feeds = {2: 11, 3: 12}
    for _ in range(STEPS):
        ids = [1, 2, 3]
        logits = engine.step(ids, [[int(got[-1].argmax())], [feeds[2]], [feeds[3]]])
        got.append(logits[0])
        feeds = {2: int(logits[1].argmax()), 3: int(logits[2].argmax())}
    assert same_bits(got, alone)


@pytest.mark.parametrize("fmt", ["int4", "int8", "float32"])
def test_a_step_that_asks_for_some_sequences_logits_gives_them_the_bits_of_the_whole_batch(tiny_config, tokenizer, fmt):
    """A serving step feeds prompt tokens that sample nothing beside decoding rows: only the rows that sample go
    through the head, and they get the bits the whole batch's head gives them."""
    prompts = {1: PROMPT, 2: list(range(500, 530)), 3: list(range(700, 777))}
    everyone, chosen = (tiny_engine(tiny_config, tokenizer, fmt, cache="paged") for _ in range(2))
    for engine in (everyone, chosen):
        for seq_id, prompt in prompts.items():
            engine.cache.prepare(seq_id, prompt)
            engine.step([seq_id], [prompt])
    feeds = [[11], [12], [13]]
    for logits_for in ([2, 0], [1], [], [2, 0, 1]):
        all_rows = everyone.step([1, 2, 3], feeds)
        some = chosen.step([1, 2, 3], feeds, logits_for=logits_for)
        assert some.shape == (len(logits_for), tiny_config.vocab_size)
        assert torch.equal(some, all_rows[logits_for])
        feeds = [[int(row.argmax())] for row in all_rows]
    assert torch.equal(chosen.step([1, 2, 3], feeds), everyone.step([1, 2, 3], feeds))  # the same keys kept


def test_verify_rows_give_the_bits_of_plain_decode_steps(tiny_config, tokenizer):
    """A speculative verify step feeds several tokens at once: each row's logits equal the plain step's."""
    plain = tiny_engine(tiny_config, tokenizer, "int4", cache="paged")
    steps = decode(plain, 1, PROMPT, 6)
    tokens = [int(s.argmax()) for s in steps[:6]]
    verify = tiny_engine(tiny_config, tokenizer, "int4", cache="paged")
    verify.cache.prepare(1, PROMPT)
    verify.step([1], [PROMPT])
    rows = verify.step([1], [tokens], all_logits=True)[0]  # [6, V]
    assert all(torch.equal(rows[i], steps[i + 1]) for i in range(6))


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_a_prompt_prefilled_at_once_gives_the_bits_of_one_fed_a_few_tokens_at_a_time(tiny_config, tokenizer, fmt):
    """Quantized weights in the kernels' 16-row layout take a prefill's rows through the decode kernel too, so a
    prompt's chunking changes no bit of what follows it."""
    whole = tiny_engine(tiny_config, tokenizer, fmt, cache="paged")
    if not whole.model.layers[0].self_attn.qkv_proj.rows16:
        pytest.skip("the kernels' 16-row layout is built for AVX2 and AVX-512 only")
    reference = decode(whole, 1, PROMPT, STEPS)
    for chunk in (1, 7, 16):
        assert same_bits(decode(tiny_engine(tiny_config, tokenizer, fmt, cache="paged"), 1, PROMPT, STEPS, chunk),
                         reference), chunk


def test_the_pure_pytorch_path_is_layout_invariant_too(tiny_config, tokenizer):
    with kernels.pure_pytorch():
        reference = decode(tiny_engine(tiny_config, tokenizer, "float32", cache="contiguous"), 1, PROMPT, STEPS)
        for block_size in (1, 16, 64):
            paged = tiny_engine(tiny_config, tokenizer, "float32", cache="paged", block_size=block_size)
            assert same_bits(decode(paged, 1, PROMPT, STEPS), reference), block_size


def test_the_pure_pytorch_path_and_the_kernels_agree_closely(tiny_config, tokenizer):
    compiled = decode(tiny_engine(tiny_config, tokenizer, "float32", cache="paged"), 1, PROMPT, 8)
    with kernels.pure_pytorch():
        plain = decode(tiny_engine(tiny_config, tokenizer, "float32", cache="paged"), 1, PROMPT, 8)
    for a, b in zip(compiled, plain):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def ops_in_a_decode_step(tiny_config, tokenizer, cache: str, num_layers: int) -> list[str]:
    config = dataclasses.replace(tiny_config, num_layers=num_layers)
    engine = Engine(LlamaModel.random(config, seed=0, std=0.1), tokenizer, EngineConfig(cache=cache, weights="int4"))
    decode(engine, 1, PROMPT, 2)
    with OpRecorder() as recorder:
        engine.step([1], [[5]])
    return recorder.names


def ops_per_layer(tiny_config, tokenizer, cache: str) -> tuple[int, collections.Counter]:
    """Every op the dispatcher runs in a decode step, per layer (and printed with those outside the layers)."""
    two, four = (ops_in_a_decode_step(tiny_config, tokenizer, cache, n) for n in (2, 4))
    per_layer = (len(four) - len(two)) // 2
    added = collections.Counter(four) - collections.Counter(two)
    layer_ops = collections.Counter({op: n // 2 for op, n in added.items()})
    print(f"\n{cache}: {per_layer} ops per layer {dict(sorted(layer_ops.items()))}, "
          f"{len(two) - 2 * per_layer} outside the layers")
    return per_layer, layer_ops


@pytest.mark.parametrize("cache", ["contiguous", "paged", "paged-int8"])
def test_a_decode_step_runs_all_its_layers_as_one_call(tiny_config, tokenizer, cache):
    """The lean step: every layer of a decode step (projections, rotary, KV write, attention, norms) in one
    compiled call, however many layers there are."""
    per_layer, layer_ops = ops_per_layer(tiny_config, tokenizer, cache)
    assert per_layer == 0 and not layer_ops
    assert ops_in_a_decode_step(tiny_config, tokenizer, cache, 4).count("kvscope.decoder_layers") == 1


@pytest.mark.parametrize("cache", ["contiguous", "paged", "paged-int8"])
def test_op_by_op_a_decode_layer_runs_few_ops(tiny_config, tokenizer, cache):
    with op_by_op():
        per_layer, layer_ops = ops_per_layer(tiny_config, tokenizer, cache)
    attention = "kvscope.attention_quant" if cache == "paged-int8" else "kvscope.attention"
    assert {attention: 1, "kvscope.int4_linear": 4, "kvscope.rope_qkv": 1, "kvscope.silu_mul": 1,
            "kvscope.add_rms_norm": 2}.items() <= layer_ops.items()
    assert per_layer <= 16


def batch_and_verify(engine: Engine) -> list:
    """Three sequences decoding in one batch, then a verify step of four rows: every step's logits."""
    prompts = {1: PROMPT, 2: list(range(500, 530)), 3: list(range(700, 777))}
    out = []
    for seq_id, prompt in prompts.items():
        engine.cache.prepare(seq_id, prompt)
        out.append(engine.step([seq_id], [prompt])[0])
    for step in range(STEPS):
        out.extend(engine.step([1, 2, 3], [[7 + step], [11 + step], [13 + step]]))
    out.extend(engine.step([2], [[3, 4, 5, 6]], all_logits=True))
    return out


@pytest.mark.parametrize("cache", ["contiguous", "paged", "paged-int8", "paged-int4", "contiguous-int4", "paged-bf16"])
@pytest.mark.parametrize("fmt", ["int4", "int8", "float32", "bfloat16"])
def test_the_one_call_layer_gives_the_bits_of_op_by_op(tiny_config, tokenizer, cache, fmt):
    layout, _, precision = cache.partition("-")
    kv = {"kv_dtype": {"bf16": "bfloat16"}.get(precision, precision)} if precision else {}
    one_call = batch_and_verify(tiny_engine(tiny_config, tokenizer, fmt, cache=layout, **kv))
    with op_by_op():
        reference = batch_and_verify(tiny_engine(tiny_config, tokenizer, fmt, cache=layout, **kv))
    assert same_bits(one_call, reference)


@pytest.mark.parametrize("cache", ["contiguous", "paged", "paged-int4"])
def test_global_layers_beside_sliding_ones_run_as_one_call_with_the_bits_of_op_by_op(tiny_config, tokenizer, cache):
    """Layers 1 and 3 slide (a ring holds their window) and run op by op; the plain global layers, whose stores
    are the cache's layers 0 and 1, run as one call."""
    config = dataclasses.replace(tiny_config, num_layers=4, sliding_window=8, sliding_layers=(False, True) * 2)
    layout, _, precision = cache.partition("-")

    def run() -> list:
        model = LlamaModel.random(config, seed=0, std=0.1)
        kv = {"kv_dtype": precision} if precision else {}
        return batch_and_verify(Engine(model, tokenizer, EngineConfig(weights="int4", cache=layout, **kv)))

    with OpRecorder() as recorder:
        one_call = run()
    assert recorder.names.count("kvscope.decoder_layer") > 0
    with op_by_op():
        assert same_bits(one_call, run())


def test_the_hidden_states_a_decode_step_hands_back_survive_later_steps(tiny_config, tokenizer):
    """The one-call step reuses its layers' tensors from one step to the next (engine/kernels: StepArena), never
    one that something outside still holds: the tensor itself, or only a view of its storage."""
    engine = tiny_engine(tiny_config, tokenizer, "int4", cache="paged")
    decode(engine, 1, PROMPT, 2)

    def hidden_states(token: int) -> torch.Tensor:  # [1, 1, H]
        view = engine.cache.begin_step([1], [[token]])
        out = engine.model.hidden_states(torch.tensor([[token]]), view)
        engine.cache.commit_step(view)
        return out

    with OpRecorder() as recorder:
        held = hidden_states(5)
    assert recorder.names.count("kvscope.decoder_layers") == 1
    row = hidden_states(6)[0, 0]  # the step's tensor dropped, a view of it kept
    held_then, row_then = held.clone(), row.clone()
    for token in range(7, 12):
        hidden_states(token)
    assert torch.equal(held, held_then) and torch.equal(row, row_then)


def test_a_weight_format_changed_live_runs_in_the_one_call_layer_with_its_new_weights(tiny_config, tokenizer):
    engine = tiny_engine(tiny_config, tokenizer, "float32", cache="paged")
    decode(engine, 1, PROMPT, 2)  # the layers' one-call arguments are looked up: float32 tensors
    engine.set_weights("int4")
    engine.cache.release(1)
    fresh = tiny_engine(tiny_config, tokenizer, "int4", cache="paged")
    assert same_bits(decode(engine, 1, PROMPT, 8), decode(fresh, 1, PROMPT, 8))


def test_the_default_weights_format_keeps_the_heads_int8_codes(tiny_config):
    w = torch.randn(tiny_config.vocab_size, 64) * 0.05
    head = build_linear(to_format(w, "int4", "lm_head"))
    assert head.format_name == "int8" and head.kernel_name.startswith("kvscope.int8_linear")
