"""The decode step of two kernel builds in one process: the working tree's and a git revision's.

Separate processes differ by more than a kernel change (where the weights and the pool land, the machine's phase:
2-core VMs here swing 10-20% between runs), and a build that switches between an old and a new code path at
run time is not the old build (its old path measured 6% slower than the original). So both builds are loaded
side by side: the revision's `cpu_kernels.cpp` is compiled under another op namespace (`kvscope_<rev>`), two
engines are loaded, each holding one build's ops, and their steps alternate (TURN at a time, the order reversed
every other round, the first round discarded), each on its own paged pool (blocks of 16) prefilled to the context.

Run: .venv/bin/python docs/bench/step/two_builds.py REV [CONTEXT] [THREADS] [ROUNDS] [KV,KV,...] [SEQUENCES]
(defaults: 4096 tokens, 1 thread, 9 rounds, float16,bfloat16,int8,int4, 1 sequence; with more, each step decodes
that many sequences of CONTEXT tokens at once). Prints each precision's median step (and its minimum) for both
builds and the ratio working tree / revision."""

import functools
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

from engine import kernels
from engine.bench.common import make_cache, prefill, random_ids, using_cache
from engine.config import EngineConfig
from engine.engine import Engine

TURN = 16


def load_revision(rev: str) -> object:
    """The kernels of git revision `rev`, built under the op namespace kvscope_<rev> (its own directory)."""
    source = subprocess.run(["git", "show", f"{rev}:engine/kernels/cpu_kernels.cpp"], check=True,
                            capture_output=True, text=True, cwd=Path(__file__).parents[3]).stdout
    name = "kvscope_" + re.sub(r"\W", "_", rev)
    source, found = re.subn(r"TORCH_LIBRARY\(kvscope,", f"TORCH_LIBRARY({name},", source)
    if found != 1:
        raise SystemExit(f"{rev}: its cpu_kernels.cpp has no TORCH_LIBRARY(kvscope, ...)")
    folder = Path(tempfile.gettempdir()) / f"kvscope-two-builds-{name}"
    folder.mkdir(exist_ok=True)
    path = folder / "cpu_kernels.cpp"
    if not path.exists() or path.read_text() != source:
        path.write_text(source)
    cpp_extension.load(f"{name}_kernels", [str(path)], build_directory=str(folder), is_python_module=False,
                       extra_cflags=kernels.CFLAGS, extra_ldflags=["-fopenmp"])
    return getattr(torch.ops, name)


def runners(ops: object, kvs: list[str], context: int, sequences: int) -> dict[str, tuple]:
    """An engine whose kernels are `ops`, a pool per precision with `sequences` prefilled (plans made now)."""
    kernels._load = functools.cache(lambda: ops)  # the engine looks its ops up as it loads and plans
    engine = Engine.load(config=EngineConfig(cache="paged", weights="int4"))
    ids = random_ids(context + TURN, engine.model_config.vocab_size)
    out = {}
    for kv in kvs:
        cache = make_cache(engine, "paged", block_size=16, pool_tokens=sequences * (context + 2 * TURN), kv=kv)
        with using_cache(engine, cache):
            for seq in range(sequences):
                cache.prepare(seq, ids[:context])
                prefill(engine, seq, ids[:context])
        out[kv] = (engine, cache)
    return out


def main() -> None:
    rev = sys.argv[1]
    context, threads, rounds = (int(a) for a in (sys.argv[2:5] + ["4096", "1", "9"][len(sys.argv[2:5]):]))
    kvs = (sys.argv[5] if len(sys.argv) > 5 else "float16,bfloat16,int8,int4").split(",")
    seqs = list(range(int(sys.argv[6]) if len(sys.argv) > 6 else 1))
    torch.set_num_threads(threads)
    current = kernels.ops()
    if current is None:
        raise SystemExit("the working tree's kernels are not built here")
    builds = {"tree": runners(current, kvs, context, len(seqs)),
              rev: runners(load_revision(rev), kvs, context, len(seqs))}
    order = [(build, kv) for build in builds for kv in kvs]
    times = {key: [] for key in order}
    for r in range(rounds):
        for build, kv in order if r % 2 == 0 else order[::-1]:
            engine, cache = builds[build][kv]
            with using_cache(engine, cache):
                for i in range(TURN):
                    start = time.perf_counter()
                    engine.step(seqs, [[7 + i]] * len(seqs))
                    if r:
                        times[(build, kv)].append(time.perf_counter() - start)
                    for seq in seqs:
                        cache.truncate(seq, context)
    for kv in kvs:
        tree, old = (statistics.median(times[(b, kv)]) * 1e3 for b in builds)
        lows = [min(times[(b, kv)]) * 1e3 for b in builds]
        print(f"{len(seqs)} x {context} tokens, {threads}t, {kv}: tree {tree:.2f} ms (min {lows[0]:.2f}), "
              f"{rev} {old:.2f} ms (min {lows[1]:.2f}): {tree / old:.3f}x")


if __name__ == "__main__":
    main()
