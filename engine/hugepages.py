"""The model's weights and a paged KV pool's chunks on transparent huge pages (2 MiB), where Linux offers them.

A decode step streams every weight once. On 4 KiB pages that stream crosses a page every 64 cache lines, and
under a virtual machine every TLB miss walks two page tables. Many distributions (Debian and Ubuntu among them)
give huge pages only to memory that asks for them (`/sys/kernel/mm/transparent_hugepage/enabled` = madvise), and
torch's allocator asks only when THP_MEM_ALLOC_ENABLE is set, and only for a tensor of 2 MiB or more: a model's
projections are far smaller, one mapping each, which the kernel never backs with huge pages. `pack_buffers`
moves every parameter and buffer of a model into one advised arena, a fresh private mapping, each tensor a view
of it at a 64-byte offset (measured on a 2-core EPYC VM, the default model in int4, two engines alternating in
one process: a step 8% faster at 512 tokens on one thread, 6% on two, 7% at 4,096). A paged pool's chunks of
2 MiB or more come from `zeros`, advised the same way (a contiguous reservation does not: its first row in each
layer and head would make the whole reservation resident, where small pages hold what was written): attention
reads a store's rows (128 bytes for a bfloat16 head of 64) a page every 32 rows on small pages (the same VM, one
thread, a paged pool at 4,096 tokens, pools on either kind of pages alternating in one process: the bfloat16
attention alone 0.86x the time, whole steps 0.94x with a bfloat16 cache, 0.97x int8, 1.00x int4). Elsewhere (no
such Linux, another device, a refused call) nothing moves or changes.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import mmap
import warnings
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import nn

HUGE = 2 << 20  # bytes in a transparent huge page (x86-64, arm64 with 4 KiB base pages)
ALIGN = 64  # a tensor's offset in an arena: a cache line


def available() -> bool:
    """Whether this process can ask for huge pages (Linux's madvise, THP not 'never')."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read()
    except OSError:
        return False
    return hasattr(mmap, "MADV_HUGEPAGE") and "[never]" not in mode


def _aligned_arena(nbytes: int) -> torch.Tensor:
    """An uint8 buffer of nbytes (zeros) starting on a huge page boundary, in a fresh anonymous mapping advised
    before any page is touched (memory from the heap may already sit on small pages); the up to 2 MiB before the
    boundary are never touched, so never resident. The tensor keeps the mapping alive."""
    pages = -(-nbytes // HUGE) * HUGE
    region = mmap.mmap(-1, pages + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # (shared: no THP)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (frombuffer's note on buffers it cannot resize)
        whole = torch.frombuffer(region, dtype=torch.uint8)
    skip = -whole.data_ptr() % HUGE
    with contextlib.suppress(OSError):  # refused: ordinary pages, the same values
        region.madvise(mmap.MADV_HUGEPAGE, skip, pages)
    return whole[skip:skip + nbytes]


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """torch.zeros(shape), on huge pages where it is CPU memory of at least one and Linux offers them: a paged KV
    pool's chunks, which attention reads row by row, a page every 32 rows of 128 bytes on small pages."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if torch.device(device).type != "cpu" or nbytes < HUGE or not available():
        return torch.zeros(shape, dtype=dtype, device=device)
    return _aligned_arena(nbytes).view(dtype).view(shape)


_FAULTING: ThreadPoolExecutor | None = None  # one background thread, made on first use


def faulted_ahead(tensors: list[torch.Tensor]) -> Future:
    """Write every page of `tensors` (contiguous CPU tensors of zeros, made by the caller) on a background thread
    (zeros over zeros: the values do not change), so that their page faults are taken there instead of in the first
    step that writes them. A fresh huge page is zeroed by the kernel on its first write, and on this 2-core VM a pool
    chunk's first write took 0.2 s (2,048 tokens of bfloat16 keys and values) to 0.9 s (8,192): a decode step that
    long. Only memset runs there, without the GIL and without torch: a torch operation on a second thread that stays
    (a quantized pool's scales zeroed in parallel) started a second OpenMP team, and libgomp then stopped spinning
    between parallel regions in the whole process (more threads than cores): llama.cpp, on the same OpenMP in
    `bench`, took 35 ms a step at 512 tokens on two threads instead of 15 from then on. -> a Future of the tensors."""
    global _FAULTING
    if _FAULTING is None:
        _FAULTING = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvscope-fault-ahead")
    spans = [(t.data_ptr(), t.nbytes) for t in tensors]

    def run() -> list[torch.Tensor]:
        for address, size in spans:
            ctypes.memset(address, 0, size)
        return tensors

    return _FAULTING.submit(run)


def pack_buffers(module: nn.Module) -> int:
    """Move the module's contiguous CPU parameters and buffers into one arena on huge pages (values unchanged;
    a tensor held twice, as tied embeddings are, stays one tensor). Returns the bytes packed (0: nothing done)."""
    if not available():
        return 0
    tensors = {_key(t): t for t in _packable(module)}
    offsets, total = {}, 0
    for key, t in tensors.items():
        offsets[key] = total
        total += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    if total < HUGE:  # less than a huge page: not worth one of its own
        return 0
    arena = _aligned_arena(total)
    views = {}
    with torch.no_grad():
        for key, t in tensors.items():
            nbytes = t.numel() * t.element_size()
            views[key] = arena[offsets[key]:offsets[key] + nbytes].view(t.dtype).view(t.shape).copy_(t)
        module._apply(lambda t: views.get(_key(t), t) if _is_packable(t) else t)
    return total


def _is_packable(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.is_contiguous() and t.numel() > 0 and not t.is_quantized


def _key(t: torch.Tensor) -> tuple:
    return t.data_ptr(), t.dtype, tuple(t.shape)


def _packable(module: nn.Module) -> list[torch.Tensor]:
    return [t for t in (*module.parameters(), *module.buffers()) if _is_packable(t)]
