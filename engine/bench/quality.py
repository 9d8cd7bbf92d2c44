"""quality: what each KV precision costs. Teacher-forced over real text, a paged cache in every precision
(bfloat16, float16, int8, int4) against a float32 paged cache through the engine (and transformers' quantized
cache against its dynamic cache where a backend is installed): perplexity of both, mean and max KL divergence
of the next-token distributions, top-1 agreement."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.bench import peers, report
from engine.bench.common import BenchContext, bar, make_cache, using_cache

POSITIONS, QUICK_POSITIONS = 4096, 1024
TINY_POSITIONS = 128  # --tiny: every code path, on a random model whose figures mean nothing
TESTED_PRECISIONS = ("bfloat16", "float16", "int8", "int4")  # each against a float32 cache
WINDOW = 2048  # the longest context a position sees
CHUNK = 64  # tokens per teacher-forced forward

METHOD = (
    "The text (the Python docs' topic pages, tokenized) is cut into windows of up to 2,048 tokens; each window "
    "starts a fresh sequence and runs through both caches in chunks of 64 tokens with the logits of every "
    "position (engine.step(..., all_logits=True); for transformers, forwards with past_key_values). Position i "
    "predicts token i+1. KL = KL(full precision || quantized) in nats, averaged over positions."
)


@dataclass
class Agreement:
    """Running sums over positions of two models' next-token distributions against the true next tokens."""

    n: int = 0
    nll_ref: float = 0.0
    nll_test: float = 0.0
    kl: float = 0.0
    kl_max: float = 0.0
    agree: int = 0
    kl_by_chunk: list[float] = field(default_factory=list)

    def add(self, ref: torch.Tensor, test: torch.Tensor, targets: torch.Tensor) -> None:
        """ref, test: [T, V] logits; targets: [T] token ids."""
        lr, lt = ref.float().log_softmax(-1), test.float().log_softmax(-1)
        kl = (lr.exp() * (lr - lt)).sum(-1)  # [T]
        self.n += len(targets)
        self.nll_ref -= lr.gather(1, targets[:, None]).sum().item()
        self.nll_test -= lt.gather(1, targets[:, None]).sum().item()
        self.kl += kl.sum().item()
        self.kl_max = max(self.kl_max, kl.max().item())
        self.agree += (lr.argmax(-1) == lt.argmax(-1)).sum().item()
        self.kl_by_chunk.append(kl.mean().item())

    def result(self) -> dict:
        return {"positions": self.n, "perplexity_full": math.exp(self.nll_ref / self.n),
                "perplexity_quantized": math.exp(self.nll_test / self.n), "mean_kl": self.kl / self.n,
                "max_kl": self.kl_max, "top1_agreement": self.agree / self.n, "kl_by_chunk": self.kl_by_chunk}


def run(ctx: BenchContext, quick: bool) -> dict:
    n = TINY_POSITIONS if ctx.tiny else QUICK_POSITIONS if quick else POSITIONS
    ids = ctx.text_ids()[: n + 1]
    windows = [(s, min(s + WINDOW, n)) for s in range(0, n, WINDOW)]
    out = {"method": METHOD, "windows": windows, "chunk": CHUNK}
    for kv in TESTED_PRECISIONS:
        out[f"engine KV {kv} vs float32"] = compare(ids, windows, engine_runner(ctx, kv), f"engine {kv}")
    backends = peers.hf_quantized_backends()
    for backend, state in backends.items():
        if state == "available":
            out[f"transformers {backend} cache vs dynamic"] = compare(ids, windows, hf_runner(ctx, backend),
                                                                      f"transformers {backend}")
    out["notes"] = [f"transformers QuantizedCache backend {b}: {s}" for b, s in backends.items()]
    llama = peers.llama_cpp_status(ctx.gguf_path)
    if llama == "available":
        for kv in LLAMA_KV_TYPES:
            out[f"llama.cpp {kv} cache vs f16"] = compare(ids, windows, llama_runner(ctx, kv), f"llama.cpp {kv}")
    out["notes"].append(f"llama.cpp (llama-cpp-python) quantized caches: {llama}; each against its own f16 cache, "
                        "on the same GGUF (its own weights), flash attention on (llama.cpp needs it to quantize V)")
    return out


LLAMA_KV_TYPES = {"q8_0": 8, "q4_0": 2}  # ggml type ids (ggml.h), as llama.cpp's -ctk / -ctv take them
GGML_F16 = 1


def llama_runner(ctx: BenchContext, kv: str) -> Runner:
    """llama.cpp with an f16 cache, then with `kv` for keys and values: every position's logits per chunk."""
    import numpy as np
    from llama_cpp import Llama

    def one(cache_type: int):
        llm = Llama(model_path=str(ctx.gguf_path), n_ctx=WINDOW + CHUNK, n_batch=CHUNK, n_ubatch=CHUNK,
                    n_threads=torch.get_num_threads(), logits_all=True, type_k=cache_type, type_v=cache_type,
                    flash_attn=True, verbose=False)

        def step(chunk: list[int]) -> torch.Tensor:
            start = llm.n_tokens
            llm.eval(chunk)
            return torch.from_numpy(np.array(llm.scores[start:start + len(chunk)], dtype=np.float32))  # [T, V]

        return step

    return lambda: (one(GGML_F16), one(LLAMA_KV_TYPES[kv]))


Runner = Callable[[], tuple[Callable[[list[int]], torch.Tensor], Callable[[list[int]], torch.Tensor]]]


def compare(ids: list[int], windows: list[tuple[int, int]], runner: Runner, label: str) -> dict:
    acc = Agreement()
    for start, end in bar(windows, f"quality {label} windows"):
        ref, test = runner()  # fresh state for each window
        for s in range(start, end, CHUNK):
            chunk = ids[s:min(s + CHUNK, end)]
            targets = torch.tensor(ids[s + 1:s + 1 + len(chunk)])
            acc.add(ref(chunk), test(chunk), targets)
    return acc.result()


def engine_runner(ctx: BenchContext, kv: str) -> Runner:
    e = ctx.engine

    def one(precision: str):
        cache = make_cache(e, "paged", pool_tokens=WINDOW + 64, kv=precision)
        cache.prepare(0, [])

        def step(chunk: list[int]) -> torch.Tensor:
            with using_cache(e, cache):
                return e.step([0], [chunk], all_logits=True)[0]  # [T, V]

        return step

    return lambda: (one("float32"), one(kv))


def hf_runner(ctx: BenchContext, backend: str) -> Runner:
    model = ctx.hf_model()

    def one(peer: peers.HFPeer):
        cache = peer.new_cache()
        return lambda chunk: peer.forward(chunk, cache, last_only=False)[0].cpu()  # [T, V]

    return lambda: (one(peers.HFPeer(model)), one(peers.HFPeer(model, backend, backend)))


def comparisons(r: dict) -> dict:
    return {k: v for k, v in r.items() if isinstance(v, dict) and "mean_kl" in v}


def summarize(r: dict) -> str:
    rows = [[name, c["positions"], c["perplexity_full"], c["perplexity_quantized"],
             c["perplexity_quantized"] / c["perplexity_full"], c["mean_kl"], c["max_kl"],
             report.pct(c["top1_agreement"])] for name, c in comparisons(r).items()]
    table = report.md_table(["comparison", "positions", "perplexity (full)", "perplexity (quantized)",
                             "ppl ratio", "mean KL (nats)", "max KL", "top-1 agreement"], rows)
    return report.section("quality: quantized KV cache vs full precision", r["method"], table,
                          "\n".join(f"- {n}" for n in r["notes"]))


def plot(r: dict, path) -> None:
    fig, (ax,) = report.figure(1, width=7)
    for name, c in comparisons(r).items():
        xs = [CHUNK * (i + 1) for i in range(len(c["kl_by_chunk"]))]
        ax.plot(xs, [k if k > 0 else float("nan") for k in c["kl_by_chunk"]], label=name, lw=1,
                color=report.color(name))
    ax.set(title="KL(full || quantized) per 64-token chunk", xlabel="position in the text (tokens)",
           ylabel="mean KL (nats)", yscale="log")
    ax.grid(alpha=0.3)
    report.legend_outside(ax)
    report.save(fig, path)
