"""The compiled attention alone, per KV precision: one decode row of the default model's shape (9 query heads over
3 KV heads of 64) over 30 layers of synthetic caches of CONTEXT tokens in a paged layout with blocks of 16 (the
quantized ones with their full-precision residual and sink), one thread. The precisions take turns; prints the
best and the median CPU time (the thread's own, less disturbed by a loaded machine than the wall clock) of
REPEATS runs of the 30 layers, and each one's ratio to bfloat16. Between two layers the next layer's part of a
buffer as large as the model's int4 weights is read (untimed), as a decode step's projections do, so each layer's
keys and values come from memory rather than from the processor's caches.

Run: .venv/bin/python docs/bench/kv_precision/attention.py [CONTEXT] [REPEATS]  (default 4096 15)."""

import statistics
import sys
import time

import torch

from engine import kernels
from engine.kv.attention import KeyMap
from engine.kv.quant import CODECS
from engine.kv.quantized import RESIDUAL, SINK, WINDOW_DTYPE

LAYERS, HQ, HKV, D, BS = 30, 9, 3, 64, 16
WEIGHTS_BYTES = 4 << 20  # ~ one layer's int4 weights of the default model
torch.set_num_threads(1)


def key_map(tokens):
    blocks = -(-tokens // BS)
    return KeyMap.build([list(range(blocks))], torch.zeros(blocks, dtype=torch.int32),
                        torch.arange(blocks, dtype=torch.int32) * BS, BS, [tokens - 1], [1], torch.device("cpu"))


def float_runner(name, tokens, q, keys):
    dtype = getattr(torch, name)
    slots = keys.table.shape[1] * BS
    stores = [(torch.randn(HKV, slots, D).to(dtype), torch.randn(HKV, slots, D).to(dtype)) for _ in range(LAYERS)]
    ops = kernels.ops()
    where = (keys.table, keys.block_store, keys.block_start, BS, keys.q_pos)
    return [lambda k=k, v=v: ops.attention(q, [k], [v], *where) for k, v in stores]


def quant_runner(name, tokens, q, keys):
    codec, residual, sink = CODECS[name], RESIDUAL[name], SINK[name]
    blocks = keys.table.shape[1]
    ops = kernels.ops()
    layers = []
    for _ in range(LAYERS):
        k = torch.randn(1, HKV, tokens, D) * torch.linspace(0.5, 4, D)  # a few larger channels, as real keys have
        v = torch.randn(1, HKV, tokens, D)
        stores = [[t[0]] for t in codec.storage(1, HKV, blocks, BS, D, "cpu")]
        windows = torch.zeros(2, HKV, sink + residual + BS, D, dtype=WINDOW_DTYPE[name] or torch.float32)
        pos = torch.arange(tokens, dtype=torch.int32)[None]
        prefill = KeyMap.build([list(range(blocks))], keys.block_store, keys.block_start, BS, [0], [tokens],
                               torch.device("cpu"))
        ops.write_kv_quant(*stores, [windows[0]], [windows[1]], k, v, prefill.table, prefill.block_store,
                           prefill.block_start, BS, pos, torch.zeros(1, dtype=torch.int32), residual, sink, codec.bits)
        layers.append((stores, windows))
    full = (tokens - residual) // BS * BS
    upto = torch.tensor([full], dtype=torch.int32)
    where = (keys.table, keys.block_store, keys.block_start, BS, keys.q_pos, upto, residual, sink, codec.bits)
    return [lambda s=s, w=w: ops.attention_quant(q, *s, [w[0]], [w[1]], *where) for s, w in layers]


def main():
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 15
    q, keys = torch.randn(1, HQ, 1, D), key_map(tokens)
    runners = {"bfloat16": float_runner("bfloat16", tokens, q, keys)}
    runners |= {name: quant_runner(name, tokens, q, keys) for name in ("int8", "int4")}
    samples = {name: [] for name in runners}
    weights = torch.ones(LAYERS, WEIGHTS_BYTES // 4)
    for _ in range(repeats):
        for name, layers in runners.items():
            total = 0.0
            for layer, attend in enumerate(layers):
                weights[layer].sum()  # the layer's projections pass through the caches
                start = time.thread_time()
                attend()
                total += time.thread_time() - start
            samples[name].append(total * 1000)
    best = {n: min(s) for n, s in samples.items()}
    for name, s in samples.items():
        print(f"{name:9s} best {best[name]:6.2f} ms  median {statistics.median(s):6.2f} ms  "
              f"best/bf16 {best[name] / best['bfloat16']:.3f}x")


if __name__ == "__main__":
    main()
