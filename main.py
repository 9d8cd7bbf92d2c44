"""kvscope: chat with a local LLM and watch its KV cache. Sub-commands: gui (default), chat, bench, serve."""

from __future__ import annotations

import argparse
import sys

from engine.config import BLOCK_SIZES, CACHE_STRATEGIES, KV_DTYPES, WEIGHT_FORMATS, cache_preset


def add_model_options(p: argparse.ArgumentParser, default_cache: str | None = "paged") -> None:
    p.add_argument("--model", help="a .gguf file or a Hugging Face model folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--cache", choices=CACHE_STRATEGIES, default=default_cache, help="KV-cache strategy")
    p.add_argument("--block-size", type=int, choices=BLOCK_SIZES, default=None, help="paged block size (tokens)")
    p.add_argument("--weights", choices=WEIGHT_FORMATS, default=None,
                   help="weight format (default auto: the fastest measured on this machine that meets the quality "
                        "bounds; int4/int8 keep a GGUF's own integers)")
    add_prefix_reuse_option(p)
    add_kv_budget_option(p)
    add_threads_option(p)


def add_kv_dtype_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default=None,
                   help="the precision contiguous and paged caches keep keys and values in (default auto: the "
                        "fastest measured here, each within the quality bound)")


def add_cuda_graphs_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cuda-graphs", choices=("on", "off"), default=None,
                   help="on a CUDA device, replay decode steps as CUDA graphs, one per shape bucket (default: on; "
                        "off: every step launches its kernels one by one); no effect on a CPU")


def add_kv_budget_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-budget", type=float, metavar="MiB", default=None,
                   help="the most a paged KV pool grows to, in MiB (default: one context's worth); the pool starts "
                        "small and grows with the conversation")


def thread_count(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of threads, got {text!r}") from None
    if not 1 <= n <= 1024:
        raise argparse.ArgumentTypeError(f"threads must be between 1 and 1024, got {n}")
    return n


def add_threads_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=thread_count, default=None, metavar="N",
                   help="CPU threads for the engine (default: torch's, one per core); on a busy machine fewer "
                        "threads than cores avoid steps that wait for a descheduled thread")


def add_prefix_reuse_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefix-reuse", choices=("on", "off"), default=None,
                   help="keep a conversation's KV cache between turns and reuse the common prefix (default: on; "
                        "off: every turn prefills the whole history again)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvscope", description=__doc__)
    sub = parser.add_subparsers(dest="command", metavar="{gui,chat,bench,serve}")

    gui = sub.add_parser("gui", help="the desktop chat app (default)")
    add_model_options(gui, default_cache=None)
    add_kv_dtype_option(gui)
    gui.add_argument("--demo", nargs="+", metavar="PROMPT", help="send these prompts, one turn each, then exit")
    gui.add_argument("--screenshot", metavar="FILE.png", help="with --demo: save a screenshot of the window")

    chat = sub.add_parser("chat", help="chat in the terminal with the same engine")
    add_model_options(chat)
    add_kv_dtype_option(chat)
    add_cuda_graphs_option(chat)
    chat.add_argument("--system", help="system prompt")
    chat.add_argument("--max-new-tokens", type=int, default=512)
    chat.add_argument("--temperature", type=float, default=0.7, help="0 = greedy (deterministic)")
    chat.add_argument("--top-k", type=int, default=40)
    chat.add_argument("--top-p", type=float, default=0.95)
    chat.add_argument("--repetition-penalty", type=float, default=1.1)
    chat.add_argument("--seed", type=int)
    chat.add_argument("--prompt", help="one turn, then exit (default: one message per line of standard input)")
    chat.add_argument("--speculative", choices=("off", "lookup"), default="off",
                      help="speculative decoding: lookup drafts tokens from the conversation itself (prompt lookup) "
                           "and verifies them in one forward; the output is unchanged")
    chat.add_argument("--draft-tokens", type=int, default=8, metavar="K", help="most draft tokens per step (1-64)")
    chat.add_argument("--json", action="store_true", help="one JSON object per step, and one per reply")

    bench = sub.add_parser("bench", help="the benchmark suite")
    bench.add_argument("names", nargs="*", metavar="NAME", help="benchmarks to run (default: all)")
    bench.add_argument("--out", default="bench-out", help="output folder")
    bench.add_argument("--quick", action="store_true", help="a reduced run that finishes in a few minutes")
    bench.add_argument("--tiny", action="store_true",
                       help="a smoke run: a tiny random model, --quick sizes (every code path; numbers mean nothing)")
    bench.add_argument("--model", help="a .gguf file or a Hugging Face model folder")
    bench.add_argument("--weights", choices=WEIGHT_FORMATS, default=None,
                       help="the weight format of the engine the benchmarks share (default auto); decode and "
                            "prefill also measure the other formats")
    add_prefix_reuse_option(bench)
    add_kv_budget_option(bench)
    add_kv_dtype_option(bench)
    add_threads_option(bench)

    add_serve_parser(sub)
    return parser


def add_serve_parser(sub) -> None:
    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server with continuous batching")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--model", help="a .gguf file or a Hugging Face model folder (default: SmolLM2-135M-Instruct)")
    serve.add_argument("--cache", choices=CACHE_STRATEGIES, default="paged", help="KV-cache strategy")
    serve.add_argument("--block-size", type=int, choices=BLOCK_SIZES, default=None, help="paged block size (tokens)")
    serve.add_argument("--pool-tokens", type=int,
                       help="paged pool capacity in tokens, held from the start up to a quarter of the memory "
                            "available (default: one context)")
    serve.add_argument("--weights", choices=WEIGHT_FORMATS, default=None,
                       help="weight format (default auto: the fastest single-token decode measured on this machine)")
    add_kv_dtype_option(serve)
    add_cuda_graphs_option(serve)
    add_threads_option(serve)
    serve.add_argument("--max-concurrency", type=int, default=16, help="requests in the running batch at most")
    serve.add_argument("--prefill-rows-while-decoding", type=int, default=None, metavar="N",
                       help="prompt tokens a tick prefills while other requests decode, with a float KV cache "
                       "(default 1: one token per prefilling request, inside the decode step's forward; more: a "
                       "prefill step of its own, larger gaps between the running streams' tokens)")
    serve.add_argument("--api-key", help="require `Authorization: Bearer KEY` on every route but /health")
    serve.add_argument("--max-body-bytes", type=int, default=None, metavar="N",
                       help="the largest request body accepted, in bytes; larger ones get a 413 (default: "
                            "KVSCOPE_MAX_BODY_BYTES, else 4 MiB)")


def check_kv_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A KV precision the chosen cache cannot take is refused here, with what to ask for instead."""
    cache, kv = getattr(args, "cache", None), getattr(args, "kv_dtype", None)
    if kv in (None, "auto"):
        return
    if cache == "none":
        parser.error("--cache none keeps no keys or values, so --kv-dtype does not apply to it: leave --kv-dtype out, "
                     "or choose --cache contiguous or paged")
    layout, fixed = cache_preset(cache)
    if fixed is not None and kv != fixed:
        parser.error(f"--cache {cache} is the {layout} cache in {fixed}; for {kv} keys and values ask for "
                     f"--cache {layout} --kv-dtype {kv}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_kv_options(parser, args)
    command = args.command or "gui"
    if getattr(args, "threads", None):
        import torch

        torch.set_num_threads(args.threads)  # every thread's parallel regions (the app's worker included)
    if command == "chat":
        from engine.cli import run_chat

        return run_chat(args)
    if command == "bench":
        from engine.bench.suite import run_bench

        return run_bench(args)
    if command == "serve":
        from server.run import run_serve

        return run_serve(args)
    if args.command is None:
        args = build_parser().parse_args(["gui", *(argv if argv is not None else sys.argv[1:])])
    from app.main_window import run_gui

    return run_gui(args)


if __name__ == "__main__":
    sys.exit(main())
