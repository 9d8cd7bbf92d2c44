"""Sliding-window layers (Gemma 2/3; Mistral, Phi-3 where every layer slides): their keys and values are held
only for the window.

A sliding layer's query at position p sees the keys at positions > p - window (engine/kv/attention.py masks the
rest), so what such a layer needs before a step is the window - 1 keys before the step's first query.
`SlidingLayers` says which layers slide and where each layer's keys live: a cache's main store (contiguous
reservations, a paged pool, their quantized kinds) holds the global layers only, and `WindowRings` holds, per
sequence, the sliding layers' keys and values in a ring of `slots` = window + slack rows (position p in row
p % slots), in the cache's float dtype (a quantized cache's full-precision dtype: the window is bounded, so it is
not quantized). The slack (one tile, or one block of a paged pool) lets a sequence roll back up to slack + 1
tokens (rejected drafts, a re-tokenized end of turn) and still hold every key its next query sees.

A step reads a sequence's older keys from its ring and the step's own keys from the step itself (a prefill longer
than the ring would overwrite the keys its first rows see), places them in the same padded tensor the full cache
builds, zeros where a full cache holds keys the mask hides, and runs the same masked softmax: the same bits as a
cache that keeps every token. Then it writes its newest keys (at most `slots`) into the ring.

What a ring no longer holds cannot be reused. A sequence keeps a prefix of `keep` tokens only while its ring
holds the keys at keep - window + 1 .. keep - 1 (`holds`); a prepare that would keep more than that starts the
sequence again from its first token, and a truncate that cannot raises KVCacheFull. A paged pool's prefix cache
shares a block with a new sequence only up to a block end whose window a released sequence left parked here
(`park`, `unpark`, at most PARKED rings, least recently used first out): the global layers' blocks alone do not
make a hit.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass

import torch

from engine.config import ModelConfig
from engine.kv.attention import PLAIN, TILE, LayerAttention, attend_padded, gather, query_positions, write

PARKED = 16  # windows of released sequences kept for the prefix cache


@dataclass(frozen=True)
class SlidingLayers:
    """Which layers slide, their window, and each layer's index among the layers of its kind."""

    window: int
    slots: int  # ring rows per sequence: the window and the slack, at most the context
    sliding: tuple[bool, ...]  # per model layer
    index: tuple[int, ...]  # per model layer: its index in the ring (sliding) or in the main store (global)

    @classmethod
    def of(cls, config: ModelConfig, max_context: int, slack: int = TILE) -> SlidingLayers | None:
        """None when no layer slides or the window is no shorter than the context (nothing to drop)."""
        window, sliding = config.sliding_window, tuple(config.is_sliding(i) for i in range(config.num_layers))
        if not window or not any(sliding) or window >= max_context:
            return None
        counts = {True: 0, False: 0}
        index = []
        for s in sliding:
            index.append(counts[s])
            counts[s] += 1
        return cls(window, min(window + slack, max_context), sliding, tuple(index))

    @property
    def num_sliding(self) -> int:
        return sum(self.sliding)

    @property
    def num_global(self) -> int:
        return len(self.sliding) - self.num_sliding

    def global_config(self, config: ModelConfig) -> ModelConfig:
        """The config a main store is shaped by: the global layers only."""
        return dataclasses.replace(config, num_layers=self.num_global, sliding_layers=(), sliding_window=0)

    def sliding_config(self, config: ModelConfig) -> ModelConfig:
        return dataclasses.replace(config, num_layers=self.num_sliding, sliding_layers=(), sliding_window=0)

    def describe(self) -> str:
        """'5 of 6 layers slide with a window of 512 tokens and hold only it'."""
        n = len(self.sliding)
        return (f"{self.num_sliding} of {n} layers slide with a window of {self.window:,} tokens and hold only it "
                f"({self.slots:,} rows a sequence)")


@dataclass
class Ring:
    k: torch.Tensor  # [L_sliding, Hkv, slots, D]
    v: torch.Tensor  # [L_sliding, Hkv, slots, D]
    high: int = 0  # one past the highest position ever written: rows hold positions >= high - slots

    def clone(self) -> Ring:
        return Ring(self.k.clone(), self.v.clone(), self.high)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


@dataclass
class WriteMap:
    """Where each of a step's new tokens goes, as engine.kv.attention.write reads it (-1: not written)."""

    store_of: torch.Tensor  # [B, T] int32
    slot_of: torch.Tensor  # [B, T] int32
    _scatter: list | None = None


class WindowRings:
    """Per sequence, the sliding layers' keys and values of its last `slots` positions."""

    def __init__(self, layers: SlidingLayers, config: ModelConfig, dtype: torch.dtype, device: torch.device):
        self.layers = layers
        self.shape = (layers.num_sliding, config.num_kv_heads, layers.slots, config.head_dim)
        self.dtype, self.device = dtype, device
        self.rings: dict[int, Ring] = {}
        self.parked: OrderedDict[int, Ring] = OrderedDict()  # block chain hash -> the window ending at that block

    # ---- per sequence
    def start(self, seq_id: int) -> None:
        """The sequence holds nothing (a new ring, or its old ring's rows forgotten)."""
        ring = self.rings.get(seq_id)
        if ring is None:
            self.rings[seq_id] = Ring(*(torch.zeros(self.shape, dtype=self.dtype, device=self.device)
                                        for _ in range(2)))
        else:
            ring.high = 0

    def holds(self, seq_id: int, keep: int) -> bool:
        """Whether the ring holds every key a query at position `keep` sees before it (keep - window + 1 ..
        keep - 1): a prefix of `keep` tokens can then be kept."""
        ring = self.rings.get(seq_id)
        first = max(0, keep - self.layers.window + 1)
        return keep == 0 or (ring is not None and first >= ring.high - self.layers.slots)

    def truncate(self, seq_id: int, keep: int) -> None:
        if keep == 0 and seq_id in self.rings:
            self.start(seq_id)

    def fork(self, src: int, dst: int) -> None:
        self.rings[dst] = self.rings[src].clone()

    def release(self, seq_id: int) -> None:
        self.rings.pop(seq_id, None)

    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.rings.values()) + sum(r.nbytes for r in self.parked.values())

    # ---- the prefix cache's windows (a paged pool)
    def park(self, seq_id: int, end: int, block_hash: int) -> None:
        """A released sequence's ring, kept under the chain hash of the block ending at `end` when it holds the
        window a query at `end` sees; otherwise dropped."""
        ring = self.rings.pop(seq_id, None)
        if ring is None or not end or max(0, end - self.layers.window + 1) < ring.high - self.layers.slots:
            return
        self.parked[block_hash] = ring
        self.parked.move_to_end(block_hash)
        while len(self.parked) > PARKED:
            self.parked.popitem(last=False)

    def unpark(self, seq_id: int, hashes: list[int]) -> int:
        """The most leading blocks (of a new sequence's hits, by chain hash) whose window is parked: the ring is
        copied to the sequence, which may keep that many blocks (0: none, the sequence starts empty)."""
        for n in range(len(hashes), 0, -1):
            ring = self.parked.get(hashes[n - 1])
            if ring is not None:
                self.parked.move_to_end(hashes[n - 1])
                self.rings[seq_id] = ring.clone()
                return n
        self.start(seq_id)
        return 0

    # ---- a step
    def step(self, seq_ids: list[int], past: list[int], n_new: list[int]) -> WindowStep:
        return WindowStep(self, [self.rings[s] for s in seq_ids], past, n_new)


class WindowStep:
    """One step's reads and writes of the rings, planned once and used by every sliding layer."""

    def __init__(self, rings: WindowRings, held: list[Ring], past: list[int], n_new: list[int]):
        self.layers, self.held = rings.layers, held
        dev, t, slots = rings.device, max(n_new), rings.layers.slots
        kv_len = [p + n for p, n in zip(past, n_new)]
        self.s_pad = -(-max(kv_len) // TILE) * TILE  # as the full cache's gather plan pads
        self.q_pos = query_positions(past, n_new, dev)  # [B, T]
        self.plan = self._read_plan(past, n_new, dev)
        store = [[b if n - slots <= j < n else -1 for j in range(t)] for b, n in enumerate(n_new)]  # the newest
        slot = [[(p + j) % slots for j in range(t)] for p in past]
        self.writes = WriteMap(torch.tensor(store, dtype=torch.int32, device=dev),
                               torch.tensor(slot, dtype=torch.int32, device=dev))
        for ring, end in zip(held, kv_len):
            ring.high = max(ring.high, end)  # the rows the step overwrites are gone, committed or not

    def _read_plan(self, past: list[int], n_new: list[int], dev: torch.device) -> list:
        """Stores 0..B-1 are the rings (older keys in the window), B..2B-1 the step's own keys."""
        slots, window, b = self.layers.slots, self.layers.window, len(past)
        index, plan = [], []
        for i, p in enumerate(past):
            older = torch.arange(max(0, p - window + 1), p, device=dev)  # the positions the step's rows see
            if len(older):
                index.append(i)
                plan.append((older % slots, i * self.s_pad + older))
        for i, (p, n) in enumerate(zip(past, n_new)):
            index.append(b + i)
            plan.append((torch.arange(n, device=dev), i * self.s_pad + p + torch.arange(n, device=dev)))
        return [index, plan]

    def slides(self, layer: int) -> bool:
        return self.layers.sliding[layer]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               spec: LayerAttention | None) -> torch.Tensor:
        """As StepView.attend for a sliding layer: q [B, Hq, T, D]; k, v [B, Hkv, T, D] -> [B, T, Hq * D]."""
        b, hq, t, d = q.shape
        hkv, i = k.shape[1], self.layers.index[layer]
        k_rings, v_rings = [r.k[i] for r in self.held], [r.v[i] for r in self.held]  # [Hkv, slots, D] each
        dtype = k_rings[0].dtype  # the step's keys as the ring stores them, then read back, as a full cache does
        k_stores = k_rings + [x.to(dtype) for x in k.unbind(0)]
        v_stores = v_rings + [x.to(dtype) for x in v.unbind(0)]
        index, plan = self.plan
        k_all = gather(k_stores, index, plan, hkv, b * self.s_pad, d, q.dtype).view(hkv, b, self.s_pad, d)
        v_all = gather(v_stores, index, plan, hkv, b * self.s_pad, d, q.dtype).view(hkv, b, self.s_pad, d)
        out = attend_padded(q, k_all.transpose(0, 1), v_all.transpose(0, 1), self.q_pos, spec or PLAIN)
        write(k_rings, v_rings, k, v, self.writes)  # after the reads: the newest keys may overwrite the oldest
        return out.transpose(1, 2).reshape(b, t, hq * d)
