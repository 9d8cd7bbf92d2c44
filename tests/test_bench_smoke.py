"""The benchmark suite: a smoke run of every benchmark in the suite on a tiny random model (`bench --tiny`: every
code path, files and keys, no timing assertions; the real model's numbers are `make bench`'s job), and unit tests of
the workload generator, the roofline byte count and the target verdicts."""

from __future__ import annotations

import json
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest

from engine.bench import memory, roofline, step, targets
from engine.bench.common import load_context
from engine.bench.suite import BENCHMARKS, run_bench
from engine.bench.workload import WorkloadShape, describe, make_workload
from engine.config import EngineConfig, ModelConfig
from engine.engine import Engine
from engine.model import LlamaModel

ROOT = Path(__file__).resolve().parents[1]
SMALL = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
             head_dim=16)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, tokenizer):  # tokenizer: the default model is converted before the subprocess
    out = tmp_path_factory.mktemp("bench")
    cmd = [sys.executable, "main.py", "bench", "--tiny", "--out", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return out, json.loads((out / "results.json").read_text())


def test_the_tiny_bench_runs_every_benchmark_of_the_suite_without_an_error(tiny_run):
    out, results = tiny_run
    assert results["benchmarks_run"] == list(BENCHMARKS)
    assert {name: r.get("error") for name, r in results["benchmarks"].items()} == dict.fromkeys(BENCHMARKS)
    assert not [name for name, r in results["benchmarks"].items() if "plot_error" in r]
    for name in ("results.json", "summary.md", *(f"{name}.png" for name in BENCHMARKS)):
        assert (out / name).stat().st_size > 0, name
    assert results["tiny"] and results["quick"] and results["machine"]["model"] == "tiny-random"


@pytest.mark.parametrize("kv", ["float16", "bfloat16", "float32"])
def test_the_memory_benchmark_takes_the_bytes_of_the_precision_the_cache_stores(tokenizer, kv):
    """float32 activations over a 16-bit cache (what `auto` picks with the kernels): the formula counts the bytes the
    cache holds an element, so measured = formula (it had taken the activations' 4 B: 'measured / formula 0.5')."""
    config = ModelConfig(vocab_size=len(tokenizer), **memory.SMALL)
    model = LlamaModel.random(config, seed=0, std=0.05)
    engine_config = EngineConfig(cache="paged", dtype="float32", kv_dtype=kv, pool_tokens=64)
    engine = Engine(model, tokenizer, engine_config, "small")

    for strategy in ("contiguous", "paged"):
        row = memory.measure(engine, strategy, memory.TOKENS)
        assert row["dtype"] == kv
        assert row["formula_per_token"] == config.kv_bytes_per_token(4 if kv == "float32" else 2)
        assert row["measured_over_formula"] == 1.0
    assert memory.measure(engine, "paged-int8", memory.TOKENS)["dtype"] == "int8 (float32 window)"


def test_the_tiny_bench_writes_the_figures_the_summary_and_the_targets_read(tiny_run):
    out, results = tiny_run
    assert {"cpu", "cores", "torch", "device", "model_dtype", "cache_dtypes"} <= set(results["machine"])
    memory, concurrency = results["benchmarks"]["memory"], results["benchmarks"]["concurrency"]
    assert {"rows", "grouped_query", "seven_b", "formula_by_dtype"} <= set(memory)
    assert memory["seven_b"]["mib_per_token"] == 0.5 and memory["seven_b"]["gib_at_4096"] == 2.0
    names = {c["name"] for c in concurrency["configs"]}
    assert {"contiguous (full context)", "contiguous (prompt + max new)", "paged bs=16", "paged-int8 bs=16"} <= names
    assert {"unsorted", "bucketed"} <= set(concurrency["batched"]["paged bs=16"])
    assert "transformers" in results["benchmarks"]["decode"]["latency_ms"]  # the peer loaded the tiny folder
    assert any(t["name"].startswith("paged bs=16 utilisation") for t in results["targets"])
    summary = (out / "summary.md").read_text()
    assert "## Targets" in summary and all(f"![{name}]({name}.png)" in summary for name in BENCHMARKS)


def test_the_tiny_model_is_a_real_hugging_face_folder_of_the_real_tokenizer(tokenizer):
    ctx = load_context(None, quick=False, tiny=True)
    try:
        assert ctx.tiny and ctx.quick and ctx.gguf_path is None and ctx.hf_folder.name == "tiny-random"
        assert ctx.engine.model_config.vocab_size == len(tokenizer) and ctx.engine.model_config.num_layers == 2
        assert ctx.engine.tokenizer.encode("Hello") == tokenizer.encode("Hello")
        assert ctx.hf_model().config.num_hidden_layers == 2
    finally:
        folder = ctx.hf_folder
        ctx.close()
    assert not folder.exists()


def test_an_unknown_benchmark_name_is_refused_before_loading_anything(tmp_path, capsys):
    args = Namespace(names=["decode", "nosuch"], out=str(tmp_path / "x"), quick=True, model=None)
    assert run_bench(args) == 2
    assert "nosuch" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


# ---- the workload
def test_the_workload_is_seeded():
    assert make_workload(50, seed=3) == make_workload(50, seed=3)
    assert make_workload(50, seed=3) != make_workload(50, seed=4)


def test_the_workload_is_long_tailed_and_within_limits():
    shape = WorkloadShape()
    requests = make_workload(5000, seed=0, shape=shape)
    stats = describe(requests)
    for kind in ("prompt", "output"):
        s = stats[kind]
        assert s["mean"] > 1.2 * s["median"]  # right-skewed
        assert s["p99"] > 3 * s["median"]  # a long tail
    assert all(4 <= r.prompt_tokens <= shape.max_prompt for r in requests)
    assert all(1 <= r.output_tokens <= shape.max_new_tokens for r in requests)
    assert all(r.total_tokens <= shape.context_limit for r in requests)
    prompts = np.array([r.prompt_tokens for r in requests])
    assert abs(np.median(prompts) - shape.prompt_median) < 0.1 * shape.prompt_median


# ---- the roofline
def test_a_decode_step_reads_every_weight_once_with_a_tied_head():
    config = ModelConfig(**SMALL, tie_word_embeddings=True)
    model = LlamaModel.random(config)
    assert roofline.weight_bytes(model) == config.num_params * 4


def test_an_untied_embedding_table_counts_one_row():
    config = ModelConfig(**SMALL, tie_word_embeddings=False)
    model = LlamaModel.random(config)
    v, h = config.vocab_size, config.hidden_size
    assert roofline.weight_bytes(model) == (config.num_params - (v - 1) * h) * 4


def test_transformers_and_the_engine_count_the_same_weight_bytes():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = ModelConfig(**SMALL, tie_word_embeddings=False)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      tie_word_embeddings=False))
    assert roofline.weight_bytes(hf) == roofline.weight_bytes(LlamaModel.random(config))


def test_step_bytes_add_the_kv_of_the_context():
    config = ModelConfig(**SMALL)
    per_token = config.kv_bytes_per_token(4)
    assert per_token == 2 * 4 * 2 * 2 * 16
    assert roofline.step_bytes(1000, per_token, 512) == 1000 + 512 * per_token
    assert roofline.lower_bound_ms(10**9, 10.0) == pytest.approx(100.0)


def test_the_step_growth_takes_out_the_read_bandwidth_measured_beside_each_row():
    first = {"ms": 10.0, "bytes": 100, "read_gbs": 12.0}
    last = {"ms": 30.0, "bytes": 176, "read_gbs": 6.0}  # the later row ran while the machine read at half speed
    grown = step.growth(first, last)
    assert grown["latency"] == pytest.approx(3.0) and grown["latency_at_equal_bandwidth"] == pytest.approx(1.5)
    assert grown["bytes"] == pytest.approx(1.76)
    verdict = {t.name: t for t in targets.step_targets({"bytes": {"growth": {"paged": grown}, "first": 512,
                                                                   "last": 4096}})}
    target = verdict["paged step growth 512 -> 4096 tokens / growth of its bytes"]
    assert target.measured == pytest.approx(1.5 / 1.76) and target.passed  # 3.0 / 1.76 as measured would miss


def test_the_step_growth_measured_in_turns_decides_the_verdict_at_each_thread_count():
    apart = step.growth({"ms": 10.0, "bytes": 100, "read_gbs": 12.0}, {"ms": 30.0, "bytes": 176, "read_gbs": 12.0})
    in_turns = {"1t": {"first": 512, "last": 4096, "first_ms": 10.0, "last_ms": 19.0, "latency": 1.9,
                       "bytes": 1.76, "over_bytes": 1.9 / 1.76},
                "2t": {"first": 512, "last": 4096, "first_ms": 5.0, "last_ms": 12.0, "latency": 2.4,
                       "bytes": 1.76, "over_bytes": 2.4 / 1.76}}
    verdict = {t.name: t for t in targets.step_targets({"bytes": {"growth": {"paged": apart}, "first": 512,
                                                                   "last": 4096}, "growth": in_turns})}
    one, two = (verdict[f"paged step growth 512 -> 4096 tokens / growth of its bytes, {n} thread(s)"] for n in (1, 2))
    assert one.passed and one.measured == pytest.approx(1.9 / 1.76)
    assert not two.passed and two.measured == pytest.approx(2.4 / 1.76)
    assert "the rows measured apart: x3" in one.why  # the other figure stays in sight
    assert "paged step growth 512 -> 4096 tokens / growth of its bytes" not in verdict


def test_the_step_bench_counts_no_turn_an_engine_runner_takes_right_after_llama_cpp_or_the_probe():
    engines = {"paged", "paged, KV int4"}
    names = ["paged", "paged, KV int4", "llama.cpp", "read probe"]
    turns = step.schedule(names, engines)
    ran = [name for name, _, _ in turns if name != step.SETTLER]
    for i, (name, steps, counted) in enumerate(turns):
        if counted:  # a counted turn: the rest of a turn whose first steps warmed the same runner up
            assert turns[i - 1] == (name, step.WARMUP, False) and steps == step.TURN - step.WARMUP
        if name == step.SETTLER:
            assert not counted and steps == step.SETTLE_MAX and turns[i + 1][0] in engines
    # every engine turn that comes after llama.cpp's or the probe's starts only after the settle runner's steps
    warmups = [i for i, (name, steps, counted) in enumerate(turns) if name != step.SETTLER and not counted
               and steps == step.WARMUP]
    for before, after in zip(warmups, warmups[1:]):
        if turns[after][0] in engines and turns[before][0] not in engines:
            assert turns[after - 1][0] == step.SETTLER
    assert any(name == step.SETTLER for name, _, _ in turns)
    for name in names:  # each runner: every round's turn, counted after the first round
        assert sum(steps for n, steps, counted in turns if n == name and counted) == \
            (step.ROUNDS - 1) * (step.TURN - step.WARMUP)
    turn_order = ran[::2]  # (a turn: its warm-up, then its counted steps)
    assert turn_order[:len(names)] == names and turn_order[len(names):2 * len(names)] == names[1:] + names[:1]
    assert all(a != b for a, b in zip(turn_order, turn_order[1:]))  # nobody runs on its own warm caches
    assert sum(steps for name, steps, _ in turns if name == step.SETTLER) <= step.SETTLE_GROWTH
    assert step.SETTLE_MIN <= step.SETTLE_MAX


# ---- the verdicts
def test_targets_pass_and_miss_from_the_ratios():
    decode = {"latency_ms": {"paged": {"16": 10.0, "512": 10.0, "2048": 11.0, "4096": 25.0},
                             "contiguous": {"2048": 10.0}, "paged-int8": {"2048": 13.0},
                             "transformers": {"512": 30.0, "2048": 22.0},
                             "llama.cpp": {"512": 5.0, "4096": 24.0}},
              "roofline": {"multiple": {"paged": {"512": 1.5}}, "bound_ms": {"paged": {"512": 6.7}}}}
    prefill = {"tokens_per_s": {"paged": {"512": 300.0}, "paged, float32 weights": {"512": 400.0},
                                "llama.cpp": {"512": 150.0}},
               "weights": {"format": "int4", "resident_bytes": 120, "file_bytes": 100}}
    verdicts = {t.name: t for t in targets.evaluate({"decode": decode, "prefill": prefill})}
    assert not verdicts["paged decode vs llama.cpp at 512 (tok/s ratio, auto weights)"].passed  # 0.5x < 0.6x
    assert verdicts["paged decode vs llama.cpp at 4096 (tok/s ratio, auto weights)"].passed  # 0.96x >= 0.8x
    assert not verdicts["prefill at 512: auto weights / float32 weights (tok/s)"].passed  # 0.75x < 0.8x
    assert verdicts["prefill at 512 vs llama.cpp (tok/s)"].passed  # 2x >= 1.6x
    assert verdicts["weights resident / GGUF file"].passed  # 1.2x <= 1.3x
    assert verdicts["paged decode vs transformers at 512 (transformers / paged)"].passed
    missed = verdicts["paged decode vs transformers at 2048 (transformers / paged)"]
    assert not missed.passed and "missed by" in missed.margin
    assert verdicts["paged / contiguous latency at 2048"].passed  # 1.1 <= 1.15
    assert verdicts["paged-int8 / paged latency at 2048"].passed  # 1.18 <= 1.3
    assert not verdicts["paged latency growth 16 -> 4096"].passed  # 2.5x
    assert verdicts["paged decode / bandwidth lower bound at 512 (bytes actually read)"].passed  # 1.5 <= 1.5
