"""The KL of int4 KV variants against a float32 cache (README, KV precision), on the pure PyTorch path with
fake quantization (the quantized values kept in float16), 1,536 teacher-forced positions in chunks of 64.

Run: .venv/bin/python docs/bench/kv_precision/int4_variants.py GROUP RESIDUAL SINK  (e.g. 16 128 32).
Each variant: keys per channel (chan) or per token (token), int8 keys (k8); values per token over 64 or 32
channels, per channel (chan), or int8 (v8). RESIDUAL newest and SINK first tokens are read in full precision."""

import sys

import torch

from engine import kernels
from engine.bench.common import make_cache, real_text, using_cache
from engine.bench.quality import Agreement
from engine.config import EngineConfig
from engine.engine import Engine
from engine.kv import quant
from engine.kv.contiguous_quant import ContiguousQuantCache

torch.set_num_threads(1)


def fq_channel(x, dim):  # asymmetric int4 over `dim`, fake-quantized
    c, s, m = quant._asymmetric(x, dim)
    return c.float() * s.float() + m.float()


def make_codec(keys_mode, vals_mode, sink):
    def qk(k):  # [H,G,T,D]
        if keys_mode == "k8":
            q, sc = quant.quantize_keys(k)
            out = q.float() * sc.float()[:, :, None]
        else:
            out = fq_channel(k, 2) if keys_mode == "chan" else fq_channel(k, 3)
        return out.half(), torch.zeros(k.shape[0], k.shape[1], 1, dtype=torch.float16)

    def dk(q, p, dtype, out=None):
        h, g, t, d = q.shape
        return q.to(dtype).reshape(h, g * t, d)

    def qv(v):  # [H,N,D]
        h, n, d = v.shape
        if vals_mode == "v8":
            q, sc = quant.quantize_values(v)
            out = q.float() * sc.float()[..., None]
        elif vals_mode == "chan":
            G = GROUP
            out = fq_channel(v.reshape(h, n // G, G, d), 2).reshape(h, n, d)
        else:
            g = int(vals_mode)
            out = fq_channel(v.reshape(h, n, d // g, g), 3).reshape(h, n, d)
        return out.half(), torch.zeros(h, n, 1, dtype=torch.float16)

    def dv(q, p, dtype, out=None):
        return q.to(dtype)

    class C(quant.KVCodec):
        def storage(self, layers, heads, blocks, block_size, head_dim, device):
            slots = blocks * block_size
            return [
                torch.zeros(layers, heads, slots, head_dim, dtype=torch.float16),
                torch.zeros(layers, heads, slots, head_dim, dtype=torch.float16),
                torch.zeros(layers, heads, blocks, 1, dtype=torch.float16),
                torch.zeros(layers, heads, slots, 1, dtype=torch.float16),
            ]

    return C("fake", 4, qk, dk, qv, dv)


GROUP = int(sys.argv[1])
VARIANTS = [v.split("/") for v in sys.argv[4:]] or [("chan", "64"), ("token", "64"), ("k8", "64"), ("chan", "v8")]
R = int(sys.argv[2])
SINK = int(sys.argv[3])


e = Engine.load(None, EngineConfig(cache="contiguous", weights="int4", kv_dtype="float32"))
ids = e.tokenizer.encode(real_text(), add_special_tokens=False)[9000 : 9000 + 1537]


def run(cache):
    cache.prepare(0, [])
    outs = []
    with using_cache(e, cache):
        for s in range(0, 1536, 64):
            outs.append(e.step([0], [ids[s : s + 64]], all_logits=True)[0])
    return outs


with kernels.pure_pytorch():
    ref = run(make_cache(e, "contiguous", kv="float32", max_context=1600))
    for km, vm in VARIANTS:
        c = ContiguousQuantCache(
            e.model_config,
            torch.float32,
            e.device,
            1600,
            codec=make_codec(km, vm, False),
            group=GROUP,
            residual=R,
            sink=SINK,
        )
        out = run(c)
        a = Agreement()
        for i, (r, t) in enumerate(zip(ref, out)):
            a.add(r, t, torch.tensor(ids[i * 64 + 1 : i * 64 + 65]))
        res = a.result()
        print(
            GROUP, R, SINK, km, vm, "KL", round(res["mean_kl"], 5), "top1", round(res["top1_agreement"], 4), flush=True
        )
