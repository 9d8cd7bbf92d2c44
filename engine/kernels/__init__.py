"""kvscope's own CPU kernels (cpu_kernels.cpp), built once per machine with torch's extension loader.

They serve a decode step: int4 / int8 projections over the weights' own integers (activations quantized to int16
with one scale a row), an RMS norm, and one attention routine over any KV layout. Each output row
is computed with one fixed order of operations whatever the batch, so the results are batch-invariant.

`ops()` returns the loaded ops, or None when they cannot be built (no C++ compiler, another device, or
KVSCOPE_KERNELS=torch): the engine then runs its pure PyTorch path.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
NAME = "kvscope_cpu_kernels"
TAG = "kvscope kernels 17"  # in the keys of measured choices (weights, KV precision): a new version measures again
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-DNDEBUG"]  # the host's instruction set


def build_dir() -> Path:
    """Where the built kernels live: KVSCOPE_KERNELS_DIR, else kernels/<torch and Python versions> in the cache."""
    from engine.loader import cache_root  # late: the loader imports the weights, which import this module

    tag = f"torch{torch.__version__}-py{sys.version_info.major}{sys.version_info.minor}".replace("+", "_")
    override = os.environ.get("KVSCOPE_KERNELS_DIR")
    path = Path(override) if override else cache_root() / "kernels" / tag
    path.mkdir(parents=True, exist_ok=True)
    return path


_wanted = os.environ.get("KVSCOPE_KERNELS", "auto") != "torch"  # KVSCOPE_KERNELS=torch: the pure PyTorch path


@contextlib.contextmanager
def pure_pytorch() -> Iterator[None]:
    """Run the pure PyTorch path inside the block (tests run both paths; modules built inside keep it)."""
    global _wanted
    before, _wanted = _wanted, False
    try:
        yield
    finally:
        _wanted = before


def _ninja_on_path() -> None:
    """torch's extension builder runs `ninja` from PATH; a venv's own ninja is beside its python."""
    here = str(Path(sys.executable).parent)
    if shutil.which("ninja") is None and here not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = here + os.pathsep + os.environ.get("PATH", "")


@functools.cache
def _load() -> object | None:
    try:
        from torch.utils import cpp_extension

        _ninja_on_path()
        cpp_extension.load(
            NAME, [str(SOURCE)], build_directory=str(build_dir()), is_python_module=False, verbose=False,
            extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"],
        )
        return torch.ops.kvscope
    except Exception as error:  # noqa: BLE001 - any build failure: the pure PyTorch path, said once
        print(f"kvscope: compiled CPU kernels unavailable ({type(error).__name__}: {str(error)[:200]}); "
              "using the pure PyTorch path", file=sys.stderr)
        return None


def ops() -> object | None:
    """The compiled ops (torch.ops.kvscope), or None."""
    return _load() if _wanted else None


def for_activations(x: torch.Tensor) -> object | None:
    """The compiled ops when x holds float32 activations on the CPU (what every kernel of a step takes), else None."""
    return ops() if x.device.type == "cpu" and x.dtype == torch.float32 else None


def available() -> bool:
    return ops() is not None


def kv_tiled(bits: int, head_dim: int, block_size: int, device: torch.device | str) -> bool:
    """Whether a quantized store of these codes keeps them in tiles of 16 tokens (cpu_kernels.cpp, TILE_TOKENS): the
    kernels' choice for this machine, fixed for the process, so the pure PyTorch path writes and reads the codes in
    the same layout (engine.kv.quant.to_tiles) even inside pure_pytorch()."""
    if torch.device(device).type != "cpu" or os.environ.get("KVSCOPE_KERNELS", "auto") == "torch":
        return False
    loaded = _load()
    return bool(loaded is not None and loaded.kv_tiled(bits, head_dim, block_size))
