"""Turning weights into the format asked for, one tensor at a time (never a whole float32 model in memory),
and the `auto` choice: the fastest format measured on this machine that meets the quality bounds."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
from torch import nn

from engine import kernels
from engine.machine import cpu_model
from engine.weights.formats import (
    QuantizedWeight,
    bytes_per_parameter,
    check_format,
    quantize_int4,
    quantize_int8,
)
from engine.weights.linear import FloatLinear, Int4Linear, Int8Linear, WeightLinear, build_linear

Weight = torch.Tensor | QuantizedWeight
HEAD_NAMES = ("embed_tokens", "lm_head")
CHOICE_FILE = "weight-format-choice.json"
# the formats that meet the quality bounds (tests/test_weight_quality.py, on the default model): int8 requantized
# per channel from Q4_1 values measured a mean KL of 0.0029 nats against float32, over the 0.002 asked for
AUTO_CANDIDATES = ("float32", "bfloat16", "int4")


def is_head(name: str) -> bool:
    return any(h in name for h in HEAD_NAMES)


def dense(weight: Weight) -> torch.Tensor:
    return weight.dequantize() if isinstance(weight, QuantizedWeight) else weight.float()


def to_format(weight: Weight, fmt: str, name: str = "") -> Weight:
    """One weight in `fmt`. Norms (1-D) stay float32. Tensors the source already holds in the asked format keep
    their integers (GGUF Q4_x stays int4, Q8_0 stays int8). In int4 the embedding and head are int8: they are
    a fifth of a small model's weights and the most sensitive to rounding (llama.cpp keeps them at 6-8 bits)."""
    check_format(fmt)
    if not isinstance(weight, QuantizedWeight) and weight.dim() < 2:
        return weight.float()
    if fmt == "float32":
        return dense(weight)
    if fmt == "bfloat16":
        return dense(weight).to(torch.bfloat16)
    bits = 8 if fmt == "int8" or is_head(name) else 4
    keeps = {bits, 4} if fmt == "int4" and is_head(name) else {bits}
    if isinstance(weight, QuantizedWeight) and weight.bits in keeps:
        return weight  # a file's Q8_0 stays grouped: requantized per channel, the head alone cost 2.5x the KL
    return quantize_int8(dense(weight)) if bits == 8 else quantize_int4(dense(weight))


PRECISION = ("int4", "int8", "bfloat16", "float32")  # least to most precise
# the least precise kvscope format that holds a GGUF type's values without losing what the file has
FILE_FLOOR = {"F32": "float32", "F16": "bfloat16", "BF16": "bfloat16", "Q8_0": "int8", "Q6_K": "int8",
              "Q5_0": "int8", "Q5_1": "int8", "Q5_K": "int8", "Q8_K": "int8"}  # others: int4 (4 bits or fewer)


def at_least_the_file(fmt: str, gguf_type: str | None) -> str:
    """`fmt`, or the file's own precision where fmt is below it (auto never stores a tensor below its file:
    a Q8_0 or Q6_K tensor stays int8 when auto picks int4; F16 stays at least bfloat16)."""
    if gguf_type is None or fmt not in PRECISION:
        return fmt
    floor = FILE_FLOOR.get(gguf_type, "int4")
    return floor if PRECISION.index(floor) > PRECISION.index(fmt) else fmt


def to_auto_format(state: dict[str, Weight], fmt: str, gguf_types: dict[str, str]) -> dict[str, Weight]:
    """Every weight in auto's choice `fmt`, each tensor never below the precision its GGUF file gave it. Converted
    in place, one tensor at a time (each original is freed as its conversion replaces it); returns `state`."""
    for name in list(state):
        state[name] = to_format(state[name], at_least_the_file(fmt, gguf_types.get(name)), name)
    return state


def module_weight(module: WeightLinear) -> Weight:
    """What a projection module holds, as a loader would hand it over."""
    if isinstance(module, FloatLinear):
        return module.weight
    assert isinstance(module, (Int8Linear, Int4Linear))
    return module.quantized()


def apply_format(model: nn.Module, fmt: str) -> None:
    """Convert every projection of a built model to `fmt`, one at a time (a tied head is converted once)."""
    for name, module in model.projections().items():
        current = module_weight(module)
        target = to_format(current, fmt, name)
        if target is not current:  # already in the format: keep the module (no repacking)
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, build_linear(target))
    if model.config.tie_word_embeddings:
        model.embed_tokens.table = model.lm_head
    model.forget_one_call_plans()  # the layers' one-call arguments name the replaced modules' tensors


# ---- auto
STREAM_BYTES = 256 * 2**20  # float32 bytes a measurement streams at most: more than the processor's caches
MEASUREMENT = 2  # in a remembered choice's key: one made by an older measurement is measured again


def resolve_auto(device: torch.device, shape: tuple[int, int], cache_dir: Path | None,
                 stream_bytes: int = STREAM_BYTES) -> str:
    """The format `auto` stands for on this machine: on CUDA bfloat16 (native half precision; the int kernels
    are not verified on a GPU here), on CPU the fastest decode among the formats that pass the quality tests
    (AUTO_CANDIDATES), measured once on the model's largest per-layer projection shape, streaming as many float32
    bytes as the model's projections hold (at most STREAM_BYTES: a small model's weights stay in the caches, a
    big one's do not), and remembered per CPU, torch and threads."""
    if device.type != "cpu":
        return "bfloat16"
    stream_bytes = max(1, min(stream_bytes, STREAM_BYTES))
    key = f"{cpu_model()}|torch {torch.__version__}|threads {torch.get_num_threads()}|{shape[0]}x{shape[1]}" \
          f"|{stream_bytes >> 10} KiB|measurement {MEASUREMENT}" \
          f"|{kernels.TAG if kernels.available() else 'torch kernels'}"  # new kernels: measured again
    remembered = _read_choices(cache_dir)
    if key in remembered:
        return remembered[key]["choice"]
    timings = measure_decode_formats(shape, stream_bytes=stream_bytes)
    choice = fastest_or_smallest(timings)
    remembered[key] = {"choice": choice, "decode_us": timings}
    _write_choices(cache_dir, remembered)
    return choice


TIE = 1.15  # formats within this factor of the fastest count as equally fast: the smaller one wins


def fastest_or_smallest(timings: dict[str, float]) -> str:
    """The fastest candidate; among those within TIE of it, the one with the fewest bytes per weight (a local app's
    memory is the user's, and one layer timed alone flatters the big formats: see measure_decode_formats)."""
    best = min(timings[f] for f in AUTO_CANDIDATES)
    near = [f for f in AUTO_CANDIDATES if timings[f] <= best * TIE]
    return min(near, key=bytes_per_parameter)


def measure_decode_formats(shape: tuple[int, int], repeats: int = 15,
                           stream_bytes: int = STREAM_BYTES) -> dict[str, float]:
    """Microseconds of one decode row through a random [N, K] weight in each format: the fastest of `repeats`
    passes, since other work on a shared machine only ever adds time (a median taken under load once measured
    int4 30x slower than it runs and made `auto` pick float32). The weight is repeated until its float32 copies
    exceed the processor's caches (stream_bytes), and the row goes through every copy, as a step goes through
    every layer: a weight that fits in a cache would time compute alone, not the bytes a real model streams from
    memory."""
    n, k = shape
    w = torch.randn(n, k) * 0.02
    x = torch.randn(1, k)
    copies = max(1, -(-stream_bytes // (n * k * 4)))
    timings = {}
    for fmt in ("float32", "bfloat16", "int8", "int4"):
        modules = weight_copies(w, fmt, copies)
        samples = []
        for i in range(repeats + 2):
            start = time.perf_counter()
            for module in modules:
                module(x)
            if i >= 2:
                samples.append((time.perf_counter() - start) / copies)
        timings[fmt] = round(min(samples) * 1e6, 1)
        del modules
    return timings


def weight_copies(w: torch.Tensor, fmt: str, copies: int) -> list[WeightLinear]:
    """`copies` modules of w in `fmt`, each in memory of its own. (to_format returns a float32 tensor itself: copies
    of one tensor stayed in the caches, so float32 was timed at 84-133 GB/s and `auto` picked it at two threads,
    where the model's step then ran twice as slow as in int4.)"""
    return [build_linear(to_format(w.clone(), fmt)) for _ in range(copies)]


def _read_choices(cache_dir: Path | None) -> dict:
    if cache_dir is None:
        return {}
    try:
        data = json.loads((cache_dir / CHOICE_FILE).read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_choices(cache_dir: Path | None, choices: dict) -> None:
    if cache_dir is None:
        return
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = cache_dir / f".{CHOICE_FILE}.{os.getpid()}.tmp"  # two processes choosing at once never share one
        tmp.write_text(json.dumps(choices, indent=1))
        tmp.replace(cache_dir / CHOICE_FILE)
    except OSError:
        pass  # remembering is an optimisation
