"""How int4 KV error splits between keys and values, and what per-channel keys buy (README, KV precision).

Run: .venv/bin/python docs/bench/kv_precision/error_sources.py  (the default model, ~1 minute on one core).
Relative round-trip error of keys and values of every layer over 1,024 tokens of real English, quantized
per token and per channel at a few group sizes."""

import statistics

import torch

from engine.bench.common import make_cache, real_text, using_cache
from engine.config import EngineConfig
from engine.engine import Engine
from engine.kv import quant

torch.set_num_threads(1)

e = Engine.load(None, EngineConfig(cache="contiguous", weights="int4", kv_dtype="float32"))
ids = e.tokenizer.encode(real_text(), add_special_tokens=False)[5000:6024]
c = make_cache(e, "contiguous", kv="float32", max_context=1100)
c.prepare(0, ids)
with using_cache(e, c):
    for s in range(0, len(ids), 256):
        e.step([0], [ids[s : s + 256]])
buf = c.reservations[0]
n = len(ids)
K, V = buf.k[:, :, :n].float(), buf.v[:, :, :n].float()  # [L, H, N, D]


def rel(a, b):
    return float((a - b).norm() / a.norm())


def keys_channel(k, g):  # k [H,N,D]
    h, nn, d = k.shape
    m = nn // g * g
    q, p = quant.quantize_keys_int4(k[:, :m].reshape(h, m // g, g, d))
    return quant.dequantize_keys_int4(q, p, torch.float32), m


def per_token(x, group):
    h, nn, d = x.shape
    xs = x.reshape(h, nn * d // group, group)
    q, p = quant.quantize_values_int4(xs)
    return quant.dequantize_values_int4(q, p, torch.float32).reshape(h, nn, d)


rows = []
for L in range(K.shape[0]):
    k, v = K[L], V[L]
    kc16, m = keys_channel(k, 16)
    kc32, m32 = keys_channel(k, 32)
    ch = k.abs().amax(dim=1)  # [H, D]
    rows.append(
        (
            L,
            rel(k[:, :m], kc16),
            rel(k[:, :m32], kc32),
            rel(k, per_token(k, 64)),
            rel(k, per_token(k, 32)),
            rel(v, per_token(v, 64)),
            rel(v, per_token(v, 32)),
            float((ch.amax(1) / ch.median(1).values).mean()),
            float(k[:, 0].norm() / k[:, 1:].norm(dim=-1).mean()),
        )
    )

names = [
    "keys/chan16",
    "keys/chan32",
    "keys/token64",
    "keys/token32",
    "vals/token64",
    "vals/token32",
    "key outlier max/median chan",
    "pos0 key norm ratio",
]
for i, nm in enumerate(names):
    col = [r[i + 1] for r in rows]
    print(f"{nm:32s} mean {statistics.mean(col):.4f} max {max(col):.4f} (layer {rows[col.index(max(col))][0]})")
vc16 = []
vt16 = []
vc32 = []
for L in range(V.shape[0]):
    v = V[L]
    vv, m = keys_channel(v, 16)
    vc16.append(rel(v[:, :m], vv))
    vv, m = keys_channel(v, 32)
    vc32.append(rel(v[:, :m], vv))
    vt16.append(rel(v, per_token(v, 16)))
print("vals/chan16", statistics.mean(vc16), "vals/chan32", statistics.mean(vc32), "vals/token16", statistics.mean(vt16))
