"""A seeded synthetic chat workload: prompt and reply lengths drawn from long-tailed (log-normal) distributions.

The shape: request lengths of real chat logs are right-skewed, most short and a few very long, and a log-normal
is the usual fit. The parameters match the means reported for ShareGPT conversations in the vLLM paper (Kwon
et al., "Efficient Memory Management for Large Language Model Serving with PagedAttention", SOSP 2023, Fig. 11:
mean input 161 tokens, mean output 338 tokens); LMSYS-Chat-1M (Zheng et al., 2023) reports the same long right
tail (mean prompt 69.5, mean response 214.5 tokens). They are chosen to give those means, not fitted to raw data:
    prompt ~ LogNormal(ln 100, 1.0): median 100, mean 100 * e^(1/2) = 165;
    output ~ LogNormal(ln 250, 0.8): median 250, mean 250 * e^(0.32) = 344 (before clipping at max_new_tokens).
Prompts are clipped to [4, context_limit - max_new_tokens], outputs to [1, max_new_tokens].
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class WorkloadShape:
    prompt_median: float = 100.0
    prompt_sigma: float = 1.0
    output_median: float = 250.0
    output_sigma: float = 0.8
    max_new_tokens: int = 1024  # each request's cap on its reply, as a server would set it
    context_limit: int = 2048

    @property
    def max_prompt(self) -> int:
        return self.context_limit - self.max_new_tokens


@dataclass(frozen=True)
class Request:
    prompt_tokens: int
    output_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens


def lognormal_lengths(rng: np.random.Generator, n: int, median: float, sigma: float, low: int,
                      high: int) -> list[int]:
    draws = rng.lognormal(mean=math.log(median), sigma=sigma, size=n)
    return [int(x) for x in np.clip(np.rint(draws), low, high)]


def make_workload(n: int, seed: int = 0, shape: WorkloadShape | None = None) -> list[Request]:
    """n requests in arrival order; the same seed gives the same requests."""
    shape = shape or WorkloadShape()
    rng = np.random.default_rng(seed)
    prompts = lognormal_lengths(rng, n, shape.prompt_median, shape.prompt_sigma, 4, shape.max_prompt)
    outputs = lognormal_lengths(rng, n, shape.output_median, shape.output_sigma, 1, shape.max_new_tokens)
    return [Request(p, o) for p, o in zip(prompts, outputs)]


def describe(requests: list[Request]) -> dict:
    """Mean, median, 90th and 99th percentiles and maximum of the prompt, output and total lengths."""
    return {
        kind: _quantiles([getattr(r, f"{kind}_tokens") for r in requests])
        for kind in ("prompt", "output", "total")
    }


def _quantiles(values: list[int]) -> dict:
    a = np.asarray(values)
    return {"mean": float(a.mean()), "median": float(np.median(a)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "max": int(a.max())}
