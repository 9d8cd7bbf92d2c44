"""A decode step of fixed shapes: what engine/graphs.py captures as a CUDA graph.

The eager step (engine/kv/attention.py) builds its tables and masks at every step, in shapes that grow with the
sequences. Here a `Shape` fixes them all: rows R (sequences, a power of two), keys per row S (a multiple of
BUCKET_TOKENS: the length bucket), and per store how many keys are read from it. A step's places (which slot
each key is read from and where it goes, where each new key is written) are index tensors of those sizes,
padded so that the padding does nothing (a padded read copies a store's slot 0 into a spare row past the keys;
a padded write puts a slot's own value back), packed into one int64 buffer that the step's body reads. The
body's ops, shapes and addresses are then a function of the Shape alone: the same kernels with the same
arguments at every replay. A `Planner` makes the indices on the host: from every key's place, or, where a step only
adds one key a sequence to the last one's, by appending those keys (work by sequences, not by context).

Keys are gathered in position order into [R, Hkv, S, D] and attended with the pure PyTorch path's masked softmax
(attention.attend_padded), so every layout hands the body the same tensor and gives the same bits.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from engine.kv.attention import FLOAT_STORES, PLAIN, BlockArrays, LayerAttention, Places, attend_padded
from engine.kv.base import StepView

BUCKET_TOKENS = 256  # keys per row are padded to a multiple of this: one shape (one graph) per 256 tokens


def bucket_rows(n: int) -> int:
    """Sequences of a step -> rows of its shape: the next power of two."""
    return 1 << (n - 1).bit_length()


def bucket_keys(n: int) -> int:
    return -(-n // BUCKET_TOKENS) * BUCKET_TOKENS


@dataclass(frozen=True)
class Shape:
    """Everything a fixed step's ops depend on. stores: per store, the addresses of its first and last layer's keys
    and values and its slots (the stores of the layers between are views of the same tensors, evenly spaced);
    reads: per store, how many key reads its index holds (the keys it holds this step, bucketed as a row's keys: a
    pool's full chunks keep their count, so a growing sequence changes the shape once a bucket, as its length does).

    The packed buffer: ids, positions, q_pos [R] each; every store's read slots, then their destinations
    [sum(reads)] each; write slots, sources and whether each is new, [num_stores, R] each."""

    rows: int
    keys: int
    stores: tuple[tuple[int, ...], ...]
    reads: tuple[int, ...]

    @property
    def num_stores(self) -> int:
        return len(self.reads)

    @functools.cached_property
    def read_offsets(self) -> np.ndarray:
        return np.cumsum((0, *self.reads[:-1]))

    @property
    def size(self) -> int:
        return 3 * self.rows + 2 * sum(self.reads) + 3 * self.num_stores * self.rows

    def parts(self, packed):
        """packed (a numpy array or a tensor) -> its parts by name: ids, positions, q_pos [R]; read_slot, read_dest
        [sum(reads)]; write_slot, write_src, write_new [num_stores, R]."""
        r, total, n = self.rows, sum(self.reads), self.num_stores
        sizes = {"ids": r, "positions": r, "q_pos": r, "read_slot": total, "read_dest": total,
                 "write_slot": n * r, "write_src": n * r, "write_new": n * r}
        out, at = {}, 0
        for name, size in sizes.items():
            out[name] = packed[at:at + size]
            at += size
        for name in ("write_slot", "write_src", "write_new"):
            out[name] = out[name].reshape(n, r)
        return out


def float_layer_stores(view: StepView, num_layers: int) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]] | None:
    """Per model layer, the view's key stores and value stores ([Hkv, slots, D] each), or None where a fixed step
    cannot read them (a layout without a KeyMap, sliding-window rings, quantized codes)."""
    if getattr(view, "keys", None) is None or view.keys.lists is None or view.window is not None \
            or not hasattr(view, "layer_stores"):
        return None
    stores = [view.layer_stores(view.store_layer(layer)) for layer in range(num_layers)]
    keys = stores[0][0]
    if not keys or keys[0].dtype not in FLOAT_STORES:
        return None
    return stores


def shape_of(view: StepView, stores: list[tuple[list[torch.Tensor], list[torch.Tensor]]], counts: np.ndarray) -> Shape:
    """The Shape of a decode step (one new token a sequence) over these stores, `counts` keys held in each."""
    rows, keys = bucket_rows(len(view.seq_ids)), bucket_keys(max(view.kv_len))
    (k0, v0), (k1, v1) = stores[0], stores[-1]
    addresses = tuple((a.data_ptr(), b.data_ptr(), c.data_ptr(), d.data_ptr(), a.shape[1])
                      for a, b, c, d in zip(k0, v0, k1, v1))
    return Shape(rows, keys, addresses, tuple(bucket_keys(max(int(n), 1)) for n in counts))


def new_keys(view: StepView) -> tuple[np.ndarray, np.ndarray]:
    """Each row's new key (a decode step's one token): its store and slot, where KeyMap.build placed it."""
    store_of, slot_of = view.keys.new_lists
    return np.array([s[0] for s in store_of]), np.array([s[0] for s in slot_of])


def pack_places(view: StepView, tokens: list[int], shape: Shape, places: Places) -> np.ndarray:
    """The step's indices in the Shape's packed layout, from every key's place: int64 [shape.size] (host)."""
    s = shape.keys
    packed = np.zeros(shape.size, dtype=np.int64)
    part = shape.parts(packed)
    order = np.argsort(places.store, kind="stable")  # keys grouped by store, in position order within each
    store = places.store[order]
    rank = np.arange(len(order)) - (np.cumsum(places.counts) - places.counts)[store]
    at = shape.read_offsets[store] + rank
    part["read_dest"][:] = shape.rows * s  # padding: the spare row
    part["read_slot"][at] = places.slot[order]
    part["read_dest"][at] = places.row[order] * s + places.position[order]
    last = np.cumsum(view.kv_len) - 1  # each row's new key
    fill_step(part, view, tokens, shape, places.store[last], places.slot[last])
    return packed


def fill_step(part: dict, view: StepView, tokens: list[int], shape: Shape, new_store: np.ndarray,
              new_slot: np.ndarray) -> None:
    """The parts a step rewrites whole: ids, positions, q_pos, and the writes of its new keys."""
    b = len(tokens)
    for name in ("ids", "positions", "write_src", "write_new"):
        part[name][:] = 0
    part["ids"][:b], part["positions"][:b] = tokens, view.past
    part["q_pos"][:] = -1
    part["q_pos"][:b] = view.past
    slot, src, is_new = part["write_slot"], part["write_src"], part["write_new"]
    slot[:] = 0  # padding writes slot 0 back, or another slot where the step writes slot 0 (below)
    written = [[] for _ in range(shape.num_stores)]
    for row, (store, new) in enumerate(zip(new_store.tolist(), new_slot.tolist())):
        at = len(written[store])
        slot[store, at], src[store, at], is_new[store, at] = new, row, 1
        written[store].append(new)
    for store, slots in enumerate(written):
        if 0 in slots:
            slot[store, len(slots):] = spare_slot(slots)


@dataclass
class Planned:
    """The last step a Planner planned: what the next one must match to extend it."""

    shape: Shape
    packed: np.ndarray
    counts: np.ndarray  # keys held in each store
    seq_ids: list[int]
    kv_len: list[int]
    tables: list[list[int]]  # copies: a cache edits its tables in place
    block_map: tuple[list[int], list[int]]  # a paged pool's own lists (the same objects while it is unchanged)


class Planner:
    """A step's Shape and packed indices. Where the last step's sequences each add one key and nothing else moved
    (the same rows, the same blocks under their keys, the same block map and Shape), the last indices with the new
    keys appended: work by sequences, not by keys. Otherwise planned from every key's place (Places)."""

    def __init__(self, incremental: bool = True):
        self.incremental = incremental
        self.blocks = BlockArrays()
        self.last: Planned | None = None
        self.extended = 0  # steps planned by extending the last one

    def plan(self, view: StepView, tokens: list[int], stores) -> tuple[Shape, np.ndarray]:
        if self.incremental and (extended := self.extend(view, tokens, stores)) is not None:
            return extended
        places = Places.of(view.keys, self.blocks, len(stores[0][0]))
        shape = shape_of(view, stores, places.counts)
        packed = pack_places(view, tokens, shape, places)
        tables = [list(t) for t in view.keys.lists[0]]
        self.last = Planned(shape, packed, places.counts, list(view.seq_ids), list(view.kv_len), tables,
                            view.keys.lists[1:])
        return shape, packed

    def extend(self, view: StepView, tokens: list[int], stores) -> tuple[Shape, np.ndarray] | None:
        last = self.last
        if last is None or not self.continues(view, last):
            return None
        new_store, new_slot = new_keys(view)
        counts = last.counts + np.bincount(new_store, minlength=len(last.counts))
        shape = shape_of(view, stores, counts)
        if shape != last.shape:
            return None
        part = shape.parts(last.packed)
        held = last.counts.copy()
        for row, (store, slot) in enumerate(zip(new_store, new_slot)):  # appended after the store's keys
            at = shape.read_offsets[store] + held[store]
            part["read_slot"][at], part["read_dest"][at] = slot, row * shape.keys + view.kv_len[row] - 1
            held[store] += 1
        fill_step(part, view, tokens, shape, new_store, new_slot)
        last.counts, last.kv_len = counts, list(view.kv_len)
        last.tables = [list(t) for t in view.keys.lists[0]]
        self.extended += 1
        return shape, last.packed

    def continues(self, view: StepView, last: Planned) -> bool:
        """Whether the step adds one key to each of the last step's sequences, and nothing else moved."""
        block_map = view.keys.lists[1:]
        return (view.seq_ids == last.seq_ids and all(a is b or a == b for a, b in zip(block_map, last.block_map))
                and all(n == m + 1 for n, m in zip(view.kv_len, last.kv_len)) and self.same_blocks(view, last))

    @staticmethod
    def same_blocks(view: StepView, last: Planned) -> bool:
        """Whether every sequence's old keys still lie in the blocks they lay in (no copy-on-write, no new table)."""
        size = view.keys.block_size
        return all(t[:-(-m // size)] == old[:-(-m // size)]
                   for t, old, m in zip(view.keys.lists[0], last.tables, last.kv_len))


def spare_slot(written) -> int:
    """A slot a store does not write this step: its padded writes put that slot's own value back (duplicates of
    one value, so the result does not depend on their order)."""
    taken, spare = set(int(x) for x in written), 0
    while spare in taken:
        spare += 1
    return spare


class FixedView(StepView):
    """A StepView over a Shape's packed indices: new keys written and all keys read through fixed-size indices.

    stores: per model layer (keys, values), bound by the caller around each run of the body (a captured graph
    keeps only their addresses, which the Shape names)."""

    ids_checked = True  # engine/graphs.py checks the ids on the host: the body never reads them back

    def __init__(self, shape: Shape, packed: torch.Tensor):
        # not StepView.__init__: it builds a step's tensors from lists, and this view's come from `packed`
        self.shape, self.seq_ids, self.past, self.kv_len = shape, [], [], []
        self.n_new = [1] * shape.rows
        part = shape.parts(packed)
        self.ids = part["ids"].view(shape.rows, 1)  # [R, 1]
        self.positions = part["positions"].view(shape.rows, 1)  # [R, 1]
        self.q_pos = part["q_pos"].view(shape.rows, 1)  # [R, 1]
        spans = [slice(int(at), int(at) + n) for at, n in zip(shape.read_offsets, shape.reads)]
        self.read_slot = [part["read_slot"][span] for span in spans]  # per store [reads]
        self.read_dest = [part["read_dest"][span] for span in spans]
        self.write_slot, self.write_src = part["write_slot"], part["write_src"]  # [num_stores, R]
        self.write_new = part["write_new"]  # [num_stores, R]: 1 where a write is a new key
        self.stores: list[tuple[list[torch.Tensor], list[torch.Tensor]]] | None = None

    def fused_step(self, num_layers):
        return None

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               spec: LayerAttention | None = None) -> torch.Tensor:
        """q: [R, Hq, 1, D]; k, v: [R, Hkv, 1, D] -> [R, 1, Hq * D]."""
        keys, values = self.stores[layer]
        k_all, v_all = self.write_and_gather(keys, k, q.dtype), self.write_and_gather(values, v, q.dtype)
        r, hq, t, d = q.shape
        return attend_padded(q, k_all, v_all, self.q_pos, spec or PLAIN).transpose(1, 2).reshape(r, t, hq * d)

    def write_and_gather(self, stores: list[torch.Tensor], new: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """new: [R, Hkv, 1, D] written into the stores, then every held key gathered -> [R, Hkv, S, D]."""
        r, hkv, _, d = new.shape
        s = self.shape.keys
        rows = new[:, :, 0].transpose(0, 1)  # [Hkv, R, D]
        out = torch.zeros(hkv, r * s + 1, d, dtype=dtype, device=new.device)  # the last row takes padded reads
        for i, store in enumerate(stores):
            self.write(store, rows, i)
            out.index_copy_(1, self.read_dest[i], store.index_select(1, self.read_slot[i]).to(dtype))
        return out[:, :r * s].view(hkv, r, s, d).transpose(0, 1)

    def write(self, store: torch.Tensor, rows: torch.Tensor, i: int) -> None:
        """rows [Hkv, R, D] into store i where its write indices say (the padding puts a slot's value back)."""
        slots = self.write_slot[i]
        new = rows.index_select(1, self.write_src[i]).to(store.dtype)  # [Hkv, R, D]
        is_new = (self.write_new[i] != 0)[None, :, None]  # [1, R, 1]
        store.index_copy_(1, slots, torch.where(is_new, new, store.index_select(1, slots)))
