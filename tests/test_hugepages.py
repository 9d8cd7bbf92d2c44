"""The weights on huge pages: an engine's parameters and buffers live in one arena advised for transparent huge
pages, with the same values, tied tensors still tied, and the same logits as before the move."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine import hugepages
from engine.config import EngineConfig
from engine.engine import Engine

needs_thp = pytest.mark.skipif(not hugepages.available(), reason="no transparent huge pages on request here")


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(3000, 256)  # 3 MiB of float32: more than a huge page
        self.head = nn.Linear(256, 3000, bias=False)
        self.head.weight = self.embed.weight
        self.norm = nn.LayerNorm(256)
        self.register_buffer("codes", torch.randint(0, 255, (1000, 96), dtype=torch.uint8))
        self.register_buffer("strided", torch.randn(64, 32).t())  # not contiguous: left where it is


def arena_span(module: nn.Module) -> tuple[int, int]:
    tensors = [t for t in (*module.parameters(), *module.buffers()) if t.is_contiguous()]
    return min(t.data_ptr() for t in tensors), max(t.data_ptr() + t.numel() * t.element_size() for t in tensors)


def anon_huge_kib(start: int, end: int) -> int:
    """AnonHugePages of the mappings of this process that overlap [start, end) (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo < end and start < hi
            elif inside and line.startswith("AnonHugePages:"):
                total += int(line.split()[1])
    return total


@needs_thp
def test_packing_keeps_every_value_and_keeps_tied_tensors_one_tensor():
    torch.manual_seed(0)
    m = Tied()
    before = {name: t.clone() for name, t in (*m.named_parameters(), *m.named_buffers())}
    strided = m.strided
    packed = hugepages.pack_buffers(m)
    assert packed >= 3000 * 256 * 4
    for name, t in (*m.named_parameters(), *m.named_buffers()):
        assert torch.equal(t, before[name]), name
    assert m.head.weight is m.embed.weight and isinstance(m.embed.weight, nn.Parameter)
    assert m.strided is strided  # a non-contiguous buffer keeps its storage
    start, end = arena_span(m)
    assert end - start <= packed  # every contiguous tensor inside one arena
    assert anon_huge_kib(start, end) >= 2048


def test_a_module_smaller_than_a_huge_page_is_left_alone():
    m = nn.Linear(16, 16)
    ptr = m.weight.data_ptr()
    assert hugepages.pack_buffers(m) == 0
    assert m.weight.data_ptr() == ptr


@needs_thp
def test_the_engines_weights_sit_in_one_arena_and_compute_what_they_did(tiny_config, tokenizer):
    from engine.model import LlamaModel

    ids = [[5, 17, 99, 3]]
    logits = []
    for pack in (True, False):
        with pytest.MonkeyPatch.context() as patch:
            if not pack:
                patch.setattr(hugepages, "available", lambda: False)
            engine = Engine(LlamaModel.random(tiny_config, seed=1, std=0.1), tokenizer,
                            EngineConfig(cache="paged", weights="float32"))
        engine.cache.prepare(0, ids[0])
        logits.append(engine.step([0], ids))
        if pack:
            packed = engine
    assert torch.equal(*logits)
    tensors = {t.data_ptr(): t.numel() * t.element_size()
               for t in (*packed.model.parameters(), *packed.model.buffers()) if t.is_contiguous()}
    start, end = arena_span(packed.model)
    assert end - start <= sum(tensors.values()) + 64 * len(tensors)  # one arena, each tensor once
    assert anon_huge_kib(start, end) >= 2048


# ---- the KV cache's stores


@needs_thp
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8, torch.float32])
def test_a_store_of_a_huge_page_or_more_is_zeros_on_huge_pages(dtype):
    shape = (2, 3, 8192, 64)  # 3-12 MiB
    store = hugepages.zeros(shape, dtype, "cpu")
    assert store.shape == shape and store.dtype == dtype and store.is_contiguous()
    assert not store.any()
    store.fill_(1)  # touched: the kernel backs the advised range with huge pages
    nbytes = store.numel() * store.element_size()
    assert anon_huge_kib(store.data_ptr(), store.data_ptr() + nbytes) >= 2048


def test_a_small_store_or_no_huge_pages_gives_plain_zeros(monkeypatch):
    small = hugepages.zeros((4, 16, 64), torch.float16, "cpu")
    assert small.shape == (4, 16, 64) and not small.any()
    monkeypatch.setattr(hugepages, "available", lambda: False)
    assert not hugepages.zeros((2, 3, 4096, 64), torch.bfloat16, "cpu").any()


@needs_thp
@pytest.mark.parametrize("kv", ["bfloat16", "int8", "int4"])
def test_a_grown_paged_pools_large_chunks_sit_on_huge_pages(kv):
    from engine.bench.common import make_cache, using_cache

    engine = Engine.load(config=EngineConfig(cache="paged", weights="int4"))
    cache = make_cache(engine, "paged", pool_tokens=4096, kv=kv)
    ids = list(range(100, 1600))
    cache.prepare(0, ids)
    with using_cache(engine, cache):
        engine.step([0], [ids])
    largest = max(cache.storage_tensors(), key=lambda t: t.numel() * t.element_size())
    nbytes = largest.numel() * largest.element_size()
    assert nbytes >= 2 << 20
    assert anon_huge_kib(largest.data_ptr(), largest.data_ptr() + nbytes) >= 2048


@needs_thp
def test_a_contiguous_reservation_is_not_advised_so_only_what_was_written_is_resident():
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        if "[always]" in f.read():
            pytest.skip("every mapping may get huge pages here, advised or not")
    from engine.bench.common import make_cache, using_cache

    engine = Engine.load(config=EngineConfig(cache="contiguous", weights="int4"))
    for kv in ("bfloat16", "int8"):
        cache = make_cache(engine, "contiguous", kv=kv)
        ids = list(range(100, 140))
        cache.prepare(0, ids)
        with using_cache(engine, cache):
            engine.step([0], [ids])
        held = cache.reservations[0]
        stores = getattr(held, "tensors", None) or (held.k, held.v)
        large = [t for t in stores if t.numel() * t.element_size() >= 2 << 20]
        assert large  # the codes or rows: large enough to be advised, had they been
        for t in large:
            assert anon_huge_kib(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) == 0, kv
