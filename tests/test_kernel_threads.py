"""The compiled kernels' own threads: a job's chunks run on the calling thread and the pool's workers, and each
worker is named `kvscope-pool`, so that `top -H`, `perf` and the scheduler's tracing tell it from Python's own
threads (the interpreter, the server's event loop and OpenMP's workers are all called `python`)."""

import os
import sys

import pytest
import torch

from engine import kernels
from tests.engine_helpers import torch_threads

pytestmark = [pytest.mark.skipif(kernels.ops() is None, reason="the compiled kernels are not built here"),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread names are read from /proc")]


def thread_names() -> list[str]:
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except FileNotFoundError:  # a thread that ended meanwhile
            pass
    return names


def test_a_job_on_two_threads_starts_a_worker_named_kvscope_pool():
    x, w = torch.randn(4, 256), torch.randn(1024, 256)
    with torch_threads(2):
        y = kernels.ops().float_linear(x, w)  # 1,024 weight rows: chunks for both threads
    torch.testing.assert_close(y, x @ w.T, rtol=1e-4, atol=1e-4)
    assert "kvscope-pool" in thread_names()  # named by the thread that starts it, before it runs
