"""Decode latency per KV precision (README, KV precision): the whole step of the default model, int4 weights, one
thread, a paged pool with blocks of 16 per precision, each prefilled to the context; the runners alternate
TURN steps at a time for ROUNDS rounds in one process (the order reversed every other round), the first round
discarded. Prints the medians of the wall clock and of the thread's CPU time (on a machine shared with other work,
the CPU time is the steadier of the two: it leaves out the time the thread waits for a core), each precision's
ratio to bfloat16, and the spread of the per-round ratios.

Run: .venv/bin/python docs/bench/kv_precision/latency.py [CONTEXT ...]  (default 512 2048 4096)."""

import statistics
import sys
import time

import torch

from engine.bench.common import make_cache, prefill, random_ids, using_cache
from engine.config import EngineConfig
from engine.engine import Engine

PRECISIONS = ("bfloat16", "int8", "int4")
ROUNDS, TURN = 7, 4

torch.set_num_threads(1)


def runner(engine, kv, ids, context):
    cache = make_cache(engine, "paged", block_size=16, pool_tokens=context + ROUNDS * TURN + 8, kv=kv)
    with using_cache(engine, cache):
        cache.prepare(0, ids[:context])
        prefill(engine, 0, ids[:context])
    position = [context]

    def step():  # -> (wall, CPU) ms
        with using_cache(engine, cache):
            wall, cpu = time.perf_counter(), time.thread_time()
            engine.step([0], [[ids[position[0]]]])
            wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
        position[0] += 1
        return wall * 1000, cpu * 1000

    return step, cache


def measure(engine, context):
    ids = random_ids(context + ROUNDS * TURN + 8, engine.model_config.vocab_size)
    runners = {kv: runner(engine, kv, ids, context) for kv in PRECISIONS}
    rounds = []
    for r in range(ROUNDS):
        order = PRECISIONS if r % 2 == 0 else PRECISIONS[::-1]
        times = {kv: [runners[kv][0]() for _ in range(TURN)] for kv in order}
        if r:
            rounds.append({kv: [statistics.median(t[i] for t in ms) for i in (0, 1)] for kv, ms in times.items()})
    for _, cache in runners.values():
        cache.release(0)
    return rounds


def main():
    contexts = [int(a) for a in sys.argv[1:]] or [512, 2048, 4096]
    engine = Engine.load(config=EngineConfig(cache="paged", weights="int4", kv_dtype="float32"))
    for context in contexts:
        rounds = measure(engine, context)
        for i, clock in enumerate(("wall", "CPU")):
            med = {kv: statistics.median(r[kv][i] for r in rounds) for kv in PRECISIONS}
            line = [f"context {context}, {clock}:"] + [f"{kv} {med[kv]:.1f} ms" for kv in PRECISIONS]
            for kv in PRECISIONS[1:]:
                ratios = sorted(r[kv][i] / r["bfloat16"][i] for r in rounds)
                line.append(f"{kv}/bf16 {med[kv] / med['bfloat16']:.3f}x (rounds {ratios[0]:.2f}-{ratios[-1]:.2f})")
            print("  ".join(line), flush=True)


if __name__ == "__main__":
    main()
