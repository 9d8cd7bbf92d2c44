"""`python -m engine.bench.cuda_graphs [--out DIR]`: on a CUDA device, decode steps replayed as CUDA graphs
against the same engine stepping eagerly (EngineConfig.cuda_graphs=False), one sequence and a batch of 8, at
512 / 2,048 / 4,096 tokens; the two engines alternate 8 steps at a time, 4 rounds, in one process.

Not part of `main.py bench` (whose figures are the CPU's): run it where a GPU is lent, in one call, beside
`pytest tests/test_cuda.py tests/test_graphs.py`. Writes cuda_graphs.json and prints a markdown table."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from engine.bench.common import median, prefill, random_ids, timed_ms
from engine.config import EngineConfig
from engine.engine import Engine

CONTEXTS = (512, 2048, 4096)
BATCHES = (1, 8)
TURN, ROUNDS = 8, 4


def prefill_all(engine: Engine, seq_ids: list[int], ids: list[int], context: int) -> None:
    for seq_id in seq_ids:
        engine.cache.release(seq_id)
        engine.cache.prepare(seq_id, ids[:context])
        prefill(engine, seq_id, ids[:context])


def steps_ms(engine: Engine, seq_ids: list[int], token: int) -> list[float]:
    return [timed_ms(lambda: engine.step(seq_ids, [[token]] * len(seq_ids)), engine.synchronize)[1]
            for _ in range(TURN)]


def measure(engines: dict[str, Engine], context: int, batch: int, ids: list[int]) -> dict[str, float]:
    """Median ms per step of each engine, alternating TURN steps at a time (the first turn warms up: captures)."""
    seq_ids = list(range(batch))
    for engine in engines.values():
        prefill_all(engine, seq_ids, ids, context)
        steps_ms(engine, seq_ids, 7)
    samples = {name: [] for name in engines}
    for _ in range(ROUNDS):
        for name, engine in engines.items():
            samples[name] += steps_ms(engine, seq_ids, 7)
    for engine in engines.values():
        for seq_id in seq_ids:
            engine.cache.release(seq_id)
    return {name: median(ms) for name, ms in samples.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench-out/cuda-graphs", help="output folder")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("kvscope cuda_graphs: no CUDA device here (the CPU's step needs no graphs)", file=sys.stderr)
        return 2
    pool = max(BATCHES) * (max(CONTEXTS) + (ROUNDS + 1) * TURN + 16)
    engines = {name: Engine.load(None, EngineConfig(cache="paged", device="cuda", cuda_graphs=on, pool_tokens=pool))
               for name, on in (("graphs", True), ("eager", False))}
    ids = random_ids(max(CONTEXTS) + 8, engines["graphs"].model_config.vocab_size)
    rows = []
    for batch in BATCHES:
        for context in CONTEXTS:
            ms = measure(engines, context, batch, ids)
            rows.append({"batch": batch, "context": context, **ms, "speedup": ms["eager"] / ms["graphs"]})
            print(f"| {batch} | {context} | {ms['graphs']:.2f} | {ms['eager']:.2f} | {rows[-1]['speedup']:.2f}x |",
                  flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "weights": engines["graphs"].weight_format, "kv": engines["graphs"].kv_precision,
              "captures": engines["graphs"].graphs.captures, "refused": engines["graphs"].graphs.refused, "rows": rows}
    (out / "cuda_graphs.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
