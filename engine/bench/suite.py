"""`main.py bench [NAME ...] [--out DIR] [--quick]`: run the benchmarks, write results.json, a PNG per benchmark
and summary.md. Results are written after every benchmark, so an interrupted run keeps what it measured."""

from __future__ import annotations

import os
import sys
import time
import traceback
from pathlib import Path

import torch

from engine.bench import (
    branches,
    concurrency,
    decode,
    growth,
    memory,
    prefill,
    quality,
    recompute,
    report,
    serve,
    speculative,
    step,
    targets,
    turns,
)
from engine.bench.common import bar, load_context, machine_info, status
from engine.loader import ModelLoadError

BENCHMARKS = {
    "recompute": recompute,
    "decode": decode,
    "step": step,
    "prefill": prefill,
    "turns": turns,
    "branches": branches,
    "memory": memory,
    "growth": growth,
    "concurrency": concurrency,
    "quality": quality,
    "speculative": speculative,
    "serve": serve,
}


class UnknownBenchmark(ValueError):
    """A benchmark name that the suite does not have."""


def select(names: list[str] | None) -> list[str]:
    """The benchmarks to run, in the order given (all, in suite order, when none are named)."""
    unknown = [n for n in names or [] if n not in BENCHMARKS]
    if unknown:
        raise UnknownBenchmark(f"unknown benchmark {', '.join(map(repr, unknown))}; "
                               f"choose from: {', '.join(BENCHMARKS)}")
    return list(dict.fromkeys(names)) if names else list(BENCHMARKS)


def run_bench(args) -> int:
    try:
        names = select(args.names)
    except UnknownBenchmark as e:
        print(f"kvscope bench: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        ctx = load_context(args.model, args.quick, tiny=getattr(args, "tiny", False),
                           weights=getattr(args, "weights", None), kv_dtype=getattr(args, "kv_dtype", None))
    except ModelLoadError as e:
        print(f"kvscope bench: {e}", file=sys.stderr)
        return 1
    if getattr(args, "prefix_reuse", None) == "off":  # the engine's own cache; turns and branches set both
        ctx.engine.set_prefix_reuse(False)
    if getattr(args, "kv_budget", None) is not None:  # the engine's own pool; benchmarks that build theirs size them
        ctx.engine.set_kv_budget(args.kv_budget)
    results = {"machine": machine_info(ctx.engine), "quick": ctx.quick, "tiny": ctx.tiny, "benchmarks_run": names,
               "benchmarks": {}, "seconds": {}, "targets": []}
    started = time.perf_counter()
    for name in bar(names, "benchmarks"):
        results["benchmarks"][name], results["seconds"][name] = run_one(name, ctx)
        write_outputs(out, name, results)
    results["seconds"]["total"] = time.perf_counter() - started
    results["machine"]["load_average_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    write_outputs(out, None, results)
    status(f"wrote {out / 'results.json'}, {out / 'summary.md'} and {len(names)} plot(s) "
           f"in {results['seconds']['total']:.0f} s")
    failed = [n for n, r in results["benchmarks"].items() if "error" in r]
    if failed:
        print(f"kvscope bench: failed: {', '.join(failed)} (see results.json)", file=sys.stderr)
    return 1 if failed else 0


def run_one(name: str, ctx) -> tuple[dict, float]:
    """A benchmark's result, or {"error": traceback} if it raised; and its wall time in seconds."""
    status(f"running {name}{' (quick)' if ctx.quick else ''}")
    start = time.perf_counter()
    try:
        with torch.inference_mode():
            result = BENCHMARKS[name].run(ctx, ctx.quick)
    except Exception:  # noqa: BLE001 - one failing benchmark must not lose the others' results
        result = {"error": traceback.format_exc()}
        print(result["error"], file=sys.stderr)
    return result, time.perf_counter() - start


def write_outputs(out: Path, just_ran: str | None, results: dict) -> None:
    if just_ran and "error" not in results["benchmarks"][just_ran]:
        try:
            BENCHMARKS[just_ran].plot(results["benchmarks"][just_ran], out / f"{just_ran}.png")
        except Exception:  # noqa: BLE001 - a plot that fails must not lose the numbers
            results["benchmarks"][just_ran]["plot_error"] = traceback.format_exc()
    results["targets"] = [t.__dict__ | {"verdict": t.verdict} for t in targets.evaluate(results["benchmarks"])]
    report.write_json(out / "results.json", results)
    (out / "summary.md").write_text(summary(results))


def summary(results: dict) -> str:
    m = results["machine"]
    machine = report.md_table(["", ""], [[k, str(v)] for k, v in m.items()])
    parts = [f"# kvscope benchmarks{' (--quick)' if results['quick'] else ''}",
             f"Model {m['model']} ({m['model_dtype']}) on {m['device']}: {m['cpu']}, {m['cores']} cores, torch "
             f"{m['torch']}. All peers ran in this process, on the same weights and threads.",
             machine,
             targets.summarize(targets.evaluate(results["benchmarks"]))]
    for name, r in results["benchmarks"].items():
        seconds = results["seconds"].get(name, 0)
        if "error" in r:
            parts.append(report.section(name, f"FAILED after {seconds:.0f} s:\n\n```\n{r['error']}\n```"))
        else:
            parts.append(BENCHMARKS[name].summarize(r) + f"\n\n![{name}]({name}.png)\n\n_{seconds:.0f} s_")
    return "\n\n".join(p for p in parts if p) + "\n"
