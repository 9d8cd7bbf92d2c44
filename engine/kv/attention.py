"""One attention routine for every cache: a step's query rows over keys and values wherever a layout keeps them.

A layout hands over *stores*, tensors [Hkv, slots, D] per layer (the chunks of a paged pool, the reservations of
a contiguous cache, a step's own keys for `none`), and a `KeyMap` built once per step: for each sequence a table
of blocks, where each block of `block_size` tokens starts (store and slot), and the absolute position of every
query row. Row t of sequence b attends to the keys at positions 0..q_pos[b, t].

Two implementations, the same contract:
- the compiled kernel (engine/kernels) reads the stores in place and sums scores, softmax and weighted values
  in position order, one task per (sequence, KV head, 16 query rows): a row's bits depend on nothing but its
  own keys, whatever the layout, block size, pool growth, batch or thread count;
- the pure PyTorch path gathers each sequence's keys in position order into one padded tensor (tiles of 16
  tokens) and attends over it with a mask: every layout gives it the same tensor, so the same bits, too.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from engine import kernels

TILE = 16  # the pure PyTorch path pads a batch's keys to a multiple of this
FLOAT_STORES = (torch.float32, torch.bfloat16, torch.float16)  # store dtypes the compiled float kernels read


@dataclass(frozen=True)
class LayerAttention:
    """How one layer attends, beyond plain causal attention over everything held (an architecture's switches).

    scale: the scores' factor (None: head_dim ** -0.5); window: a query at position p sees keys at positions
    > p - window (0: all of them; a sliding-window layer); softcap: scores become softcap * tanh(s / softcap)."""

    scale: float | None = None
    window: int = 0
    softcap: float = 0.0

    @property
    def is_plain(self) -> bool:
        return self.scale is None and not self.window and not self.softcap


PLAIN = LayerAttention()


def query_position_lists(past: list[int], n_new: list[int]) -> list[list[int]]:
    """The absolute position of each query row of a step, per sequence, -1 for the padding of a shorter row."""
    t = max(n_new)
    return [[p + j if j < n else -1 for j in range(t)] for p, n in zip(past, n_new)]


def query_positions(past: list[int], n_new: list[int], device: torch.device) -> torch.Tensor:
    """query_position_lists as a tensor: [B, T] int32."""
    return torch.tensor(query_position_lists(past, n_new), dtype=torch.int32, device=device)


@dataclass
class KeyMap:
    """Where every key of a step's sequences is, built once per step.

    table: [B, W] int32 block ids; block_store, block_start: [num_blocks] int32 (the store holding a block and
    the slot of its first token); q_pos: [B, T] int32 absolute positions of the query rows, -1 for padding."""

    table: torch.Tensor
    block_store: torch.Tensor
    block_start: torch.Tensor
    block_size: int
    q_pos: torch.Tensor
    kv_len: list[int]
    store_of: torch.Tensor | None = None  # [B, T] int32: where each new token is written (-1: padding)
    slot_of: torch.Tensor | None = None  # [B, T] int32
    lists: tuple[list[list[int]], list[int], list[int]] | None = None  # the tables, block stores and starts as lists
    new_lists: tuple[list[list[int]], list[list[int]]] | None = None  # store_of and slot_of as lists
    _gather: list | None = None  # the pure PyTorch path's gather plan, made on first use
    _scatter: list | None = None  # the pure PyTorch path's write plan, made on first use

    @classmethod
    def build(cls, tables: list[list[int]], block_store: torch.Tensor, block_start: torch.Tensor, block_size: int,
              past: list[int], n_new: list[int], device: torch.device,
              block_lists: tuple[list[int], list[int]] | None = None) -> KeyMap:
        """tables: per sequence its block ids; block_store, block_start: int32 [num_blocks] (block_lists: the same
        as lists, where the caller keeps them). The new tokens are written where their positions fall in those
        tables. Built from Python lists, one tensor each: a decode step's few ints cost more as tensor ops."""
        stores, starts = block_lists or (block_store.tolist(), block_start.tolist())
        t, width = max(n_new), max(1, max(len(blocks) for blocks in tables))
        q_pos, store_of, slot_of = query_position_lists(past, n_new), [], []
        for blocks, p, n in zip(tables, past, n_new):
            new = [blocks[(p + j) // block_size] for j in range(n)]  # the block each new token falls in
            store_of.append([stores[b] for b in new] + [-1] * (t - n))
            slot_of.append([starts[b] + (p + j) % block_size for j, b in enumerate(new)] + [0] * (t - n))
        table = [blocks + [0] * (width - len(blocks)) for blocks in tables]
        table, q_pos, store_of_tensor, slot_of_tensor = (torch.tensor(x, dtype=torch.int32, device=device)
                                                         for x in (table, q_pos, store_of, slot_of))
        keys = cls(table, block_store, block_start, block_size, q_pos, [p + n for p, n in zip(past, n_new)])
        keys.new_lists = store_of, slot_of
        keys.store_of, keys.slot_of, keys.lists = store_of_tensor, slot_of_tensor, (tables, stores, starts)
        return keys

    @classmethod
    def one_store_each(cls, capacities: list[int], past: list[int], n_new: list[int],
                       device: torch.device) -> KeyMap:
        """Sequence i's keys are the first tokens of store i (a contiguous reservation, a step's own keys)."""
        n = len(capacities)
        stores = torch.arange(n, dtype=torch.int32, device=device)
        return cls.build([[i] for i in range(n)], stores, torch.zeros_like(stores), max(capacities), past, n_new,
                         device, (list(range(n)), [0] * n))

    def fused_kv(self, k_stores: list[torch.Tensor], v_stores: list[torch.Tensor]):
        """A float layout's stores and this map as the one-call layer takes them (engine.kv.base.FusedKV)."""
        if k_stores[0].dtype not in FLOAT_STORES:
            return None
        return [*k_stores, *v_stores], [len(k_stores), len(v_stores)], self.fused_where, [self.block_size]

    @functools.cached_property
    def fused_where(self) -> list[torch.Tensor]:
        """The map's tensors as a float layout's one-call layer takes them (the same list for every layer)."""
        return [self.table, self.block_store, self.block_start, self.q_pos, self.store_of, self.slot_of]

    def gather_plan(self, num_stores: int) -> list:
        """Per store that holds keys: its index, (slots to read, where they go in the padded [B * S_pad] key order),
        each in position order; and S_pad."""
        if self._gather is None:
            s_pad = -(-max(self.kv_len) // TILE) * TILE
            places = Places.of(self, BlockArrays(), num_stores)
            dest = places.row * s_pad + places.position
            index = np.flatnonzero(places.counts).tolist()
            dev = self.q_pos.device
            plan = [(torch.from_numpy(places.slot[mine]).to(dev), torch.from_numpy(dest[mine]).to(dev))
                    for mine in (places.store == i for i in index)]
            self._gather = [index, plan, s_pad]
        return self._gather


class BlockArrays:
    """A block map's lists (a KeyMap's block stores and starts) as numpy arrays, converted once per map: a paged
    pool hands every step the same lists until it changes."""

    def __init__(self):
        self.lists: tuple[list[int], list[int]] | None = None  # held: the identity check needs them alive
        self.arrays: tuple[np.ndarray, np.ndarray] | None = None

    def of(self, stores: list[int], starts: list[int]) -> tuple[np.ndarray, np.ndarray]:
        if self.lists is None or self.lists[0] is not stores or self.lists[1] is not starts:
            self.lists, self.arrays = (stores, starts), (np.asarray(stores), np.asarray(starts))
        return self.arrays


@dataclass
class Places:
    """Where every key of a step lies, one entry per key, sequence after sequence in position order (host arrays):
    its store and slot, its sequence's row and its position; and how many keys each store holds."""

    store: np.ndarray
    slot: np.ndarray
    row: np.ndarray
    position: np.ndarray
    counts: np.ndarray

    @classmethod
    def of(cls, keys: KeyMap, blocks: BlockArrays, num_stores: int) -> Places:
        """keys: a map built from lists (KeyMap.build keeps them)."""
        tables, block_stores, block_starts = keys.lists
        stores, starts = blocks.of(block_stores, block_starts)
        size = keys.block_size
        position = np.concatenate([np.arange(n) for n in keys.kv_len])
        row = np.repeat(np.arange(len(tables)), keys.kv_len)
        block = np.concatenate([np.asarray(t)[np.arange(n) // size] for t, n in zip(tables, keys.kv_len)])
        store = stores[block]
        return cls(store, starts[block] + position % size, row, position, np.bincount(store, minlength=num_stores))


def write(k_stores: list[torch.Tensor], v_stores: list[torch.Tensor], k: torch.Tensor, v: torch.Tensor,
          keys: KeyMap) -> None:
    """The step's new keys and values k, v: [B, Hkv, T, D] into their stores, where keys.store_of/slot_of say."""
    ops = kernels.for_activations(k)
    if ops is not None and k_stores[0].dtype in FLOAT_STORES:
        ops.write_kv(k_stores, v_stores, k.contiguous(), v.contiguous(), keys.store_of, keys.slot_of)
        return
    if keys._scatter is None:
        b, _, t, _ = k.shape
        stores, slots = keys.store_of.flatten().tolist(), keys.slot_of.flatten().tolist()
        plan: dict[int, tuple[list[int], list[int]]] = {}
        for i, (store, slot) in enumerate(zip(stores, slots)):
            if store >= 0:
                plan.setdefault(store, ([], []))[0].append(slot)
                plan[store][1].append(i)
        dev = k.device
        keys._scatter = [(store, torch.tensor(slots, device=dev), torch.tensor(sources, device=dev))
                         for store, (slots, sources) in plan.items()]
    for x, stores in ((k, k_stores), (v, v_stores)):
        rows = x.transpose(0, 1).reshape(x.shape[1], -1, x.shape[3])  # [Hkv, B*T, D]
        for store, slots, sources in keys._scatter:
            stores[store].index_copy_(1, slots, rows.index_select(1, sources).to(stores[store].dtype))


def attend(q: torch.Tensor, k_stores: list[torch.Tensor], v_stores: list[torch.Tensor], keys: KeyMap,
           spec: LayerAttention | None = None) -> torch.Tensor:
    """q: [B, Hq, T, D]; stores: [Hkv, slots, D] each -> [B, T, Hq * D] (zeros for padding rows). A layer with
    its own scale, window or soft-cap runs the pure PyTorch path (the compiled kernel does plain attention)."""
    spec = spec or PLAIN
    ops = kernels.for_activations(q) if spec.is_plain else None
    if ops is not None:
        return ops.attention(q.contiguous(), k_stores, v_stores, keys.table, keys.block_store, keys.block_start,
                             keys.block_size, keys.q_pos)
    b, hq, t, d = q.shape
    return attend_gathered(q, k_stores, v_stores, keys, spec).transpose(1, 2).reshape(b, t, hq * d)


def attend_gathered(q: torch.Tensor, k_stores: list[torch.Tensor], v_stores: list[torch.Tensor],
                    keys: KeyMap, spec: LayerAttention = PLAIN) -> torch.Tensor:
    """The pure PyTorch path: keys and values gathered in position order, padded to tiles, one masked softmax."""
    b, hq, t, d = q.shape
    hkv = k_stores[0].shape[0]
    index, plan, s_pad = keys.gather_plan(len(k_stores))
    k_all = gather(k_stores, index, plan, hkv, b * s_pad, d, q.dtype).view(hkv, b, s_pad, d).transpose(0, 1)
    v_all = gather(v_stores, index, plan, hkv, b * s_pad, d, q.dtype).view(hkv, b, s_pad, d).transpose(0, 1)
    return attend_padded(q, k_all, v_all, keys.q_pos, spec)


def attend_padded(q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, q_pos: torch.Tensor,
                  spec: LayerAttention = PLAIN) -> torch.Tensor:
    """q: [B, Hq, T, D]; k_all, v_all: [B, Hkv, S_pad, D], key p of a sequence at index p (zeros where none is
    held); q_pos: [B, T] int32 (-1: padding) -> [B, Hq, T, D]. One masked softmax per row."""
    b, hq, t, d = q.shape
    hkv, s_pad = k_all.shape[1], k_all.shape[2]
    group = hq // hkv
    scale = d ** -0.5 if spec.scale is None else spec.scale
    queries = q.reshape(b, hkv, group * t, d) * scale  # [B, Hkv, G*T, D]: a group's heads share keys
    scores = torch.matmul(queries, k_all.transpose(-1, -2)).view(b, hkv, group, t, s_pad)
    if spec.softcap:
        scores = torch.tanh(scores / spec.softcap) * spec.softcap
    key_pos = torch.arange(s_pad, device=q.device)[None, None, :]
    hidden = key_pos > q_pos[:, :, None]  # [B, T, S_pad]
    if spec.window:
        hidden |= key_pos <= q_pos[:, :, None] - spec.window
    scores.masked_fill_(hidden[:, None, None], float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype).nan_to_num_(0.0)  # a padding row: all hidden
    out = torch.matmul(probs.view(b, hkv, group * t, s_pad), v_all)  # [B, Hkv, G*T, D]
    return out.view(b, hq, t, d)


def gather(stores: list[torch.Tensor], index: list[int], plan: list, hkv: int, total: int, d: int,
           dtype: torch.dtype) -> torch.Tensor:
    """[Hkv, total, D] with each store's planned slots copied to their places (zeros elsewhere)."""
    out = torch.zeros(hkv, total, d, dtype=dtype, device=stores[0].device)
    for i, (slots, dest) in zip(index, plan):
        out.index_copy_(1, dest, stores[i].index_select(1, slots).to(dtype))
    return out
