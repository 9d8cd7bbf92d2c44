"""A decode step of fixed shapes: what engine/graphs.py captures as a CUDA graph.

The eager step (engine/kv/attention.py) builds its tables and masks at every step, in shapes that grow with the
sequences. Here a `Shape` fixes them all: rows R (sequences, a power of two), keys per row S (a multiple of
BUCKET_TOKENS: the length bucket), and per store how many keys are read from it. A step's places (which slot
each key is read from and where it goes, where each new key is written) are index tensors of those sizes,
padded so that the padding does nothing (a padded read copies a store's slot 0 into a spare row past the keys;
a padded write puts a slot's own value back), packed into one int64 buffer that the step's body reads. The
body's ops, shapes and addresses are then a function of the Shape alone: the same kernels with the same
arguments at every replay.

Keys are gathered in position order into [R, Hkv, S, D] and attended with the pure PyTorch path's masked softmax
(attention.attend_padded), so every layout hands the body the same tensor and gives the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kv.attention import FLOAT_STORES, PLAIN, LayerAttention, attend_padded
from engine.kv.base import StepView

BUCKET_TOKENS = 256  # keys per row are padded to a multiple of this: one shape (one graph) per 256 tokens


def bucket_rows(n: int) -> int:
    """Sequences of a step -> rows of its shape: the next power of two."""
    return 1 << (n - 1).bit_length()


def bucket_keys(n: int) -> int:
    return -(-n // BUCKET_TOKENS) * BUCKET_TOKENS


@dataclass(frozen=True)
class Shape:
    """Everything a fixed step's ops depend on. stores: per layer, the (address, slots) of each key store and
    then of each value store; reads: per store, how many key reads its index holds (a multiple of keys)."""

    rows: int
    keys: int
    stores: tuple[tuple[tuple[int, int], ...], ...]
    reads: tuple[int, ...]

    @property
    def num_stores(self) -> int:
        return len(self.reads)

    def fields(self) -> dict[str, tuple[int, int]]:
        """Where each index lies in the packed buffer: name -> (offset, length)."""
        r, at, out = self.rows, 0, {}
        sizes = [("ids", r), ("positions", r), ("q_pos", r)]
        for s, reads in enumerate(self.reads):
            sizes += [(f"read_slot{s}", reads), (f"read_dest{s}", reads), (f"write_slot{s}", r),
                      (f"write_src{s}", r), (f"write_new{s}", r)]
        for name, n in sizes:
            out[name] = (at, n)
            at += n
        return out

    @property
    def size(self) -> int:
        return sum(n for _, n in self.fields().values())


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


def shape_of(view: StepView, stores: list[tuple[list[torch.Tensor], list[torch.Tensor]]]) -> Shape:
    """The Shape of a decode step (one new token a sequence) over these stores."""
    rows, keys = bucket_rows(len(view.seq_ids)), bucket_keys(max(view.kv_len))
    addresses = tuple(tuple((t.data_ptr(), t.shape[1]) for t in (*k, *v)) for k, v in stores)
    counts = reads_per_store(view, len(stores[0][0]))
    return Shape(rows, keys, addresses, tuple(-(-max(n, 1) // keys) * keys for n in counts))


def reads_per_store(view: StepView, num_stores: int) -> list[int]:
    """How many of the step's keys each store holds (a block a sequence reads once; shared blocks once each)."""
    tables, block_stores, _ = view.keys.lists
    size, counts = view.keys.block_size, [0] * num_stores
    for blocks, length in zip(tables, view.kv_len):
        full, rest = divmod(length, size)
        for b in blocks[:full]:
            counts[block_stores[b]] += size
        if rest:
            counts[block_stores[blocks[full]]] += rest
    return counts


def key_places(view: StepView, shape: Shape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where key p of each sequence lies: store [B, S], slot [B, S] (int64), held [B, S] (p < its length)."""
    tables, block_stores, block_starts = view.keys.lists
    size, width = view.keys.block_size, max(len(t) for t in tables)
    table = torch.tensor([t + [t[-1]] * (width - len(t)) for t in tables])  # [B, W] block ids
    blocks = torch.tensor(block_stores), torch.tensor(block_starts)  # [num_blocks] each
    p = torch.arange(shape.keys)
    block = table[:, (p // size).clamp(max=width - 1)]  # [B, S]
    held = p[None] < torch.tensor(view.kv_len)[:, None]
    return blocks[0][block], blocks[1][block] + p % size, held


def pack_places(view: StepView, tokens: list[int], shape: Shape) -> torch.Tensor:
    """The step's indices in the Shape's packed layout: int64 [shape.size] on the host."""
    b, r, s = len(tokens), shape.rows, shape.keys
    packed = torch.zeros(shape.size, dtype=torch.int64)
    fields = shape.fields()

    def put(name: str, values: torch.Tensor) -> None:
        at, _ = fields[name]
        packed[at:at + len(values)] = values

    put("ids", torch.tensor(tokens))
    put("positions", torch.tensor(view.past))
    put("q_pos", torch.tensor(view.past + [-1] * (r - b)))
    store, slot, held = key_places(view, shape)
    dest = torch.arange(b * s).view(b, s)
    last = torch.tensor(view.kv_len) - 1  # the new key of each row
    new_store, new_slot = store[torch.arange(b), last], slot[torch.arange(b), last]
    for i in range(shape.num_stores):
        mine = held & (store == i)
        reads = fields[f"read_slot{i}"][1]
        put(f"read_slot{i}", slot[mine])
        put(f"read_dest{i}", torch.cat([dest[mine], torch.full((reads - int(mine.sum()),), r * s)]))
        writes = (new_store == i).nonzero().flatten()
        put(f"write_slot{i}", padded_writes(new_slot[writes], r))
        put(f"write_src{i}", writes)
        put(f"write_new{i}", torch.ones(len(writes), dtype=torch.int64))
    return packed


def padded_writes(slots: torch.Tensor, rows: int) -> torch.Tensor:
    """A store's write slots padded to `rows` with one slot it does not write this step (the padding writes that
    slot's own value back: duplicates of one value, so the result does not depend on their order)."""
    spare = 0
    taken = set(slots.tolist())
    while spare in taken:
        spare += 1
    return torch.cat([slots, torch.full((rows - len(slots),), spare)])


class FixedView(StepView):
    """A StepView over a Shape's packed indices: new keys written and all keys read through fixed-size indices.

    stores: per model layer (keys, values), bound by the caller around each run of the body (a captured graph
    keeps only their addresses, which the Shape names)."""

    ids_checked = True  # engine/graphs.py checks the ids on the host: the body never reads them back

    def __init__(self, shape: Shape, packed: torch.Tensor):
        # not StepView.__init__: it builds a step's tensors from lists, and this view's come from `packed`
        self.shape, self.seq_ids, self.past, self.kv_len = shape, [], [], []
        self.n_new = [1] * shape.rows
        self.index = {name: packed[at:at + n] for name, (at, n) in shape.fields().items()}
        self.ids = self.index["ids"].view(shape.rows, 1)  # [R, 1]
        self.positions = self.index["positions"].view(shape.rows, 1)  # [R, 1]
        self.q_pos = self.index["q_pos"].view(shape.rows, 1)  # [R, 1]
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
            out.index_copy_(1, self.index[f"read_dest{i}"], store.index_select(1, self.index[f"read_slot{i}"])
                            .to(dtype))
        return out[:, :r * s].view(hkv, r, s, d).transpose(0, 1)

    def write(self, store: torch.Tensor, rows: torch.Tensor, i: int) -> None:
        """rows [Hkv, R, D] into store i where its write indices say (the padding puts a slot's value back)."""
        slots = self.index[f"write_slot{i}"]
        new = rows.index_select(1, self.index[f"write_src{i}"]).to(store.dtype)  # [Hkv, R, D]
        keep = self.index[f"write_new{i}"].bool()[None, :, None]
        store.index_copy_(1, slots, torch.where(keep, new, store.index_select(1, slots)))
