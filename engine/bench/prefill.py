"""prefill: prompt tokens per second at 128, 512 and 2,048 tokens, the engine (paged) against the same peers."""

from __future__ import annotations

from engine.bench import peers, report
from engine.bench.common import BenchContext, bar, median, random_ids
from engine.engine import PREFILL_CHUNK

LENGTHS = (128, 512, 2048)
TINY_LENGTHS = (64, 256)  # --tiny: every code path, on a random model whose figures mean nothing
REPEATS, QUICK_REPEATS = 3, 1

METHOD = (
    "Each repeat prefills a fresh prompt of random token ids (a different prompt every time, so the prefix cache "
    "never hits) from an empty cache; tokens/s = length / median time. The engine runs its own prefill path "
    "(chunks of 1,024 tokens, logits of the last token only); transformers runs one forward with "
    "logits_to_keep=1. One warm-up prefill per peer is not counted."
)


def prefill_kernel(engine) -> str:
    """How a prefill chunk's projections run, in words (the first layer's MLP down projection as the example)."""
    projection = engine.model.layers[0].mlp.down_proj
    if projection.decodes(PREFILL_CHUNK):
        return f"a prefill chunk's projections run through the decode kernel ({projection.kernel_name}), any rows"
    return "prefill dequantizes each layer's weights once per chunk and multiplies in float32"


def run(ctx: BenchContext, quick: bool) -> dict:
    repeats = QUICK_REPEATS if quick else REPEATS
    lengths = TINY_LENGTHS if ctx.tiny else LENGTHS
    vocab = ctx.engine.model_config.vocab_size
    others, notes = peers.external_peers(ctx, max(lengths) + 8)
    # a quantized cache changes what decode reads, not the prefill forward: decode and quality measure those
    pool_tokens = max(lengths) + 64
    runners = {"paged": peers.EnginePeer(ctx.engine, "paged", pool_tokens)}
    if ctx.engine.weight_format != "float32":
        runners[report.weights_row("float32")] = peers.EnginePeer(ctx.engine_with_weights("float32"), "paged",
                                                                 pool_tokens)
    runners.update({name: peer for name, peer in others.items() if "cache" not in name})
    kernel = prefill_kernel(ctx.engine)
    notes.insert(0, f"'paged' runs the auto weight format ({ctx.engine.weight_format} here): {kernel}.")
    samples = {}
    for name, peer in bar(list(runners.items()), "prefill peers"):
        peer.prefill_ms(random_ids(32, vocab, seed=7))  # warm-up
        samples[name] = {str(n): [peer.prefill_ms(random_ids(n, vocab, seed=100 * n + i)) for i in range(repeats)]
                         for n in lengths}
    tok_s = {name: {n: int(n) / (median(ms) / 1000) for n, ms in s.items()} for name, s in samples.items()}
    weights = {"format": ctx.engine.weight_format, "resident_bytes": ctx.engine.weights_resident_bytes,
               "file_bytes": ctx.engine.weights_file_bytes, "prefill_kernel": kernel}
    return {"method": METHOD, "lengths": list(lengths), "repeats": repeats, "notes": notes,
            "tokens_per_s": tok_s, "samples_ms": samples, "weights": weights}


def summarize(r: dict) -> str:
    names = list(r["tokens_per_s"])
    rows = [[n, *[r["tokens_per_s"][name][str(n)] for name in names],
             *[_ratio(r, "paged", other, n) for other in names[1:]]] for n in r["lengths"]]
    headers = ["prompt tokens", *[f"{name} (tok/s)" for name in names], *[f"paged / {o}" for o in names[1:]]]
    notes = [n for n in r["notes"] if "QuantizedCache" not in n]
    return report.section("prefill: prompt tokens per second", r["method"], report.md_table(headers, rows),
                          "\n".join(f"- {n}" for n in notes))


def _ratio(r: dict, a: str, b: str, n: int) -> float:
    return r["tokens_per_s"][a][str(n)] / r["tokens_per_s"][b][str(n)]


def plot(r: dict, path) -> None:
    fig, (ax,) = report.figure(1, width=7)
    names = list(r["tokens_per_s"])
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        xs = [j + i * width for j in range(len(r["lengths"]))]
        ax.bar(xs, [r["tokens_per_s"][name][str(n)] for n in r["lengths"]], width, label=name,
               color=report.color(name))
    ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(r["lengths"]))],
                  [str(n) for n in r["lengths"]])
    ax.set(title="prefill throughput", xlabel="prompt tokens", ylabel="tokens / s")
    ax.grid(alpha=0.3, axis="y")
    report.legend_outside(ax)
    report.save(fig, path)
