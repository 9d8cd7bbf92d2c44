"""'paged': one pool of fixed-size blocks shared by all sequences, block tables, prefix reuse across turns.

The pool grows with the conversations, up to a budget: its storage is a list of chunks (engine/kv/chunks.py),
each flat per layer, [L, Hkv, chunk_blocks * block_size, D]. Block b lives in chunk c at offset
o = b - start(c), and the token at position p of a sequence in slot o * block_size + p % block_size of that
chunk, for b = block_table[p // block_size]. Growth appends a chunk and never moves a block; trailing chunks
whose blocks are all free are given back when a sequence is released.

Attention reads every sequence of a step in place through its block table, in one call per layer
(engine/kv/attention.py): the keys are summed in position order whatever the block size or the chunks, so a
pool that grew, a block size of 1 or 64 and a contiguous cache give the same bits.

A model's sliding-window layers are not in the pool: each sequence keeps their window in a ring of the window and
one block (engine/kv/window.py), and the blocks hold the global layers only. A released sequence's ring is parked
under the hash of its last full block whose window it holds, and a new sequence's prefix-cache hit is cut to the
longest run of blocks ending at such a parked window: the global layers' blocks alone cannot start a sequence
whose sliding layers would miss their window.
"""

from __future__ import annotations

import functools
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from engine import hugepages
from engine.config import ConfigError
from engine.kv.attention import FLOAT_STORES, KeyMap, attend, write
from engine.kv.base import (
    BLOCK_CACHED,
    BLOCK_FREE,
    BLOCK_OTHER,
    BLOCK_OWN,
    KVCache,
    KVCacheFull,
    KVStats,
    StepView,
)
from engine.kv.block_pool import BlockPool
from engine.kv.chunks import FIRST_CHUNK_TOKENS, MAX_CHUNK_TOKENS, ChunkLayout, Piece

# the pool's per-block states (bytes) as a sequence's map shows them: a block in use is another sequence's
USED_AS_OTHER = bytes(BLOCK_OTHER if s not in (BLOCK_FREE, BLOCK_CACHED) else s for s in range(256))


@dataclass
class Sequence:
    seq_id: int  # the id the cache holds it under
    tokens: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)  # the block table: logical -> physical
    hashes: list[int] = field(default_factory=list)  # chained hash of each full block


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class PagedView(StepView):
    num_tentative: list[int] | None = None  # per sequence: trailing new tokens that are unverified drafts

    def __init__(self, cache: PagedCache, seq_ids, past, n_new, tables: list[list[int]]):
        super().__init__(seq_ids, past, n_new, cache.device)
        self.cache = cache
        self.tables = tables
        block_store, block_start = cache.block_map()
        self.keys = KeyMap.build(tables, block_store, block_start, cache.block_size, past, n_new, cache.device,
                                 cache.block_map_lists())
        self.window = cache.windows.step(seq_ids, past, n_new) if cache.windows else None

    def attend(self, layer, q, k, v, spec=None):
        if (at := self.store_layer(layer)) is None:
            return self.window.attend(layer, q, k, v, spec)
        keys, values = self.layer_stores(at)
        write(keys, values, k, v, self.keys)
        return attend(q, keys, values, self.keys, spec)

    def layer_stores(self, at: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The keys and the values of the cache's layer `at`: [Hkv, chunk slots, D] per chunk."""
        return self.cache.layer_stores(0, at), self.cache.layer_stores(1, at)

    def fused_kv(self, layer):
        if (at := self.store_layer(layer)) is None:
            return None
        return self.keys.fused_kv(*self.layer_stores(at))

    def fused_step(self, num_layers):
        """As StepView's, from the pool's per-layer groups where every layer is the pool's own (no sliding layer)."""
        if self.window is not None or num_layers != len(self.cache.layer_groups) or \
                self.cache.dtype not in FLOAT_STORES:
            return super().fused_step(num_layers)
        return self.cached_step(num_layers, self.keys.fused_where, [self.cache.block_size])

    def cached_step(self, num_layers: int, where: list[torch.Tensor], ints: list[int], windows: list = ()):
        """The flattened step from the pool's per-layer groups (made once per pool change): each layer's groups,
        then for a quantized pool each sequence's key windows and value windows at that layer (windows: per
        sequence, its (keys, values) per layer); where and ints the same for every layer."""
        groups, kinds = self.cache.layer_groups, len(self.cache.stores_by_layer)
        parts = [len(self.cache.layers)] * kinds
        if windows:
            kv = [t for layer in range(num_layers)
                  for t in (*groups[layer], *(w[layer][0] for w in windows), *(w[layer][1] for w in windows))]
            parts += [len(windows)] * 2
        else:
            kv = [t for layer in range(num_layers) for t in groups[layer]]
        count = [len(kv) // num_layers, len(parts), len(where), len(ints)]
        return kv, parts * num_layers, where * num_layers, ints * num_layers, count * num_layers


@dataclass
class ReadPlan:
    """Where a sequence's held tokens are: pieces (one per chunk touched), and the position of each key in
    piece order when that is not 0..S-1 (None otherwise)."""

    pieces: list[tuple[int, slice | torch.Tensor]]  # (chunk, slots in the chunk)
    key_positions: torch.Tensor | None = None  # [S]


@functools.lru_cache(maxsize=16)
def block_map_lists(chunk_sizes: tuple[int, ...], block_size: int) -> tuple[list[int], list[int]]:
    """A pool's block map, a function of its chunk sizes alone (made once per pool shape, not per step):
    chunk of each block id and the slot of the block's first token in that chunk, as lists (what a step's KeyMap
    reads)."""
    chunks = [c for c, n in enumerate(chunk_sizes) for _ in range(n)]
    slots = [i * block_size for n in chunk_sizes for i in range(n)]
    return chunks, slots


@functools.lru_cache(maxsize=16)
def block_map(chunk_sizes: tuple[int, ...], block_size: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """block_map_lists as int32 tensors [num_blocks] each (what the kernels read)."""
    return tuple(torch.tensor(m, dtype=torch.int32, device=device) for m in block_map_lists(chunk_sizes, block_size))


def take(store: torch.Tensor, index: torch.Tensor | slice) -> torch.Tensor:
    """store[:, index] along dim 1: a view for a slice, a gather for an index tensor."""
    return store[:, index] if isinstance(index, slice) else store.index_select(1, index)


class PagedCache(KVCache):
    name = "paged"
    prefix_reuse = True  # False: each turn starts from an empty sequence and ignores the prefix cache

    @property
    def shares_computed_blocks(self) -> bool:  # (a sliding layer's ring is shared only once its sequence ends)
        return self.prefix_reuse and not self.windows

    def __init__(self, model_config, dtype, device, max_context, block_size: int = 16,
                 pool_tokens: int | None = None, budget_bytes: int | None = None,
                 first_chunk_tokens: int = FIRST_CHUNK_TOKENS, max_chunk_tokens: int = MAX_CHUNK_TOKENS):
        """The pool holds at most pool_tokens and at most budget_bytes (default: one context's worth of
        tokens). It starts empty and grows in chunks: first_chunk_tokens, then doubling, at most
        max_chunk_tokens a chunk (first_chunk_tokens >= the budget: one chunk, a single tensor)."""
        self._block_bytes: int | None = None
        self.block_size = block_size
        self.window_slack = max(self.window_slack, block_size)  # a ring holds the window of a full block's end
        super().__init__(model_config, dtype, device, max_context)
        max_blocks = self._max_blocks(pool_tokens, budget_bytes)
        first = min(-(-first_chunk_tokens // block_size), max_blocks)
        self.layout = ChunkLayout(block_size, max_blocks, first, max(first, max_chunk_tokens // block_size))
        self.pool = BlockPool(0, block_size)
        self.seqs: dict[int, Sequence] = {}
        self.chunks: list[list[torch.Tensor]] = []  # per chunk: its storage tensors, see _chunk_tensors
        self.layers: list[list[tuple[torch.Tensor, ...]]] = []  # per chunk and storage tensor: its per-layer views
        self.stores_by_layer: list[list[list[torch.Tensor]]] = []  # per storage tensor and layer: every chunk's view
        self.layer_groups: list[list[torch.Tensor]] = []  # per layer: stores_by_layer's groups, one after another
        self._next_chunk: tuple[int, Future] | None = None  # (its blocks, its tensors): see _prepare_next_chunk
        self.held_chunks = 0  # the chunks reserve made: never given back

    def _max_blocks(self, pool_tokens: int | None, budget_bytes: int | None) -> int:
        """The budget in blocks: pool_tokens and budget_bytes where given, else one context's worth."""
        bs, per_block = self.block_size, self.bytes_per_block()
        if pool_tokens is not None and pool_tokens < 1:
            raise ConfigError(f"a pool needs room for at least one token, got pool_tokens={pool_tokens}")
        if budget_bytes is not None and budget_bytes < per_block:
            raise ConfigError(f"a KV budget of {budget_bytes:,} bytes holds no block: one block of {bs} tokens "
                             f"takes {per_block:,} bytes")
        limits = [] if budget_bytes is None or not per_block else [budget_bytes // per_block]
        if pool_tokens is not None or budget_bytes is None:
            limits.append(-(-(pool_tokens or self.max_context) // bs))
        return min(limits)

    def _chunk_tensors(self, num_blocks: int, device: torch.device | str) -> list[torch.Tensor]:
        """The storage of a chunk of num_blocks blocks: keys and values, [L, Hkv, num_blocks * block_size, D]."""
        c = self.store_config
        shape = (c.num_layers, c.num_kv_heads, num_blocks * self.block_size, c.head_dim)
        return [hugepages.zeros(shape, self.dtype, device) for _ in range(2)]

    def storage_tensors(self) -> list[torch.Tensor]:
        return [t for chunk in self.chunks for t in chunk]

    # ---- growth and give-back
    def can_make_room(self, n: int) -> bool:
        """Whether n blocks can be allocated: free, cached (evicted) or still to grow within the budget."""
        pool, layout = self.pool, self.layout
        return n <= pool.num_free + pool.num_cached + layout.max_blocks - layout.num_blocks

    def make_room(self, n: int) -> None:
        """Grow by whole chunks until n blocks are free, as far as the budget allows; cached blocks are
        evicted only past it (by the allocation that follows). Raises KVCacheFull with nothing changed."""
        if not self.can_make_room(n):
            pool = self.pool
            raise KVCacheFull(
                f"the KV budget is reached: {n} blocks needed, {pool.num_free} free and {pool.num_cached} cached "
                f"of {pool.num_blocks} ({self.layout.max_blocks} at most, {self.budget_bytes() / 2**20:.1f} MiB); "
                f"release a sequence or raise the KV budget"
            )
        while self.pool.num_free < n and self.layout.next_chunk_blocks():
            self._grow()
        self._prepare_next_chunk(n)

    def _grow(self) -> None:
        blocks = self.layout.next_chunk_blocks()
        tensors = self._take_next_chunk(blocks) or self._chunk_tensors(blocks, self.device)  # may raise: unchanged
        self.pool.grow(self.layout.add_chunk())
        self.chunks.append(tensors)
        self.layers.append([t.unbind(0) for t in tensors])
        self._index_stores()

    def _prepare_next_chunk(self, wanted: int) -> None:
        """Once the free blocks, less the `wanted` ones, are fewer than an eighth of the next chunk's, that chunk is
        made here (a huge-page mapping is not touched yet) and its pages faulted in on a background thread
        (hugepages.faulted_ahead): on huge pages the first step that wrote into a new chunk of 2,048 tokens took 0.2 s
        here, of 8,192 tokens 0.9 s. Small chunks, on small pages, fault a page at a time as their blocks fill:
        nothing to do."""
        blocks = self.layout.next_chunk_blocks()
        if self._next_chunk or not blocks or self.pool.num_free - wanted >= max(1, blocks // 8):
            return
        if (blocks * self.bytes_per_block() < hugepages.HUGE or torch.device(self.device).type != "cpu"
                or not hugepages.available()):
            return
        self._next_chunk = (blocks, hugepages.faulted_ahead(self._chunk_tensors(blocks, self.device)))

    def _take_next_chunk(self, blocks: int) -> list[torch.Tensor] | None:
        """The chunk made ahead, when it has that many blocks (waiting for its last pages if need be)."""
        ahead, self._next_chunk = self._next_chunk, None
        if ahead is None or ahead[0] != blocks:
            return None
        try:
            return ahead[1].result()
        except Exception:  # noqa: BLE001 - made here instead, where a failure is reported as a growth's own
            return None

    def reserve(self, max_bytes: int | None = None) -> int:
        """Grow now, chunk by chunk, to the whole budget or as far as max_bytes allows, every page written, and keep
        those chunks: give_back never goes below them (past them the pool grows and gives back as before). `serve`
        does this before its first request, as llama-server holds its context and vLLM its blocks: a pool that grew
        while it served wrote each new chunk's pages beside the decode steps, gave chunks back between requests and
        faulted them in again (4 streams in process on the model-167 Xeon: inter-token p99 11.7-13.2 ms and 27-32
        steps of 920 at over 1.7x the median, against 7.1-7.3 ms and 0-1 with the pool held; 16 streams 24.4 / 89 ms
        p99 / largest gap against 19.9 / 22.9). A pool already holding blocks keeps their keys and values (only the
        chunks grown here are written then). -> the bytes held."""
        per_block, before = self.bytes_per_block(), len(self.chunks)
        while (blocks := self.layout.next_chunk_blocks()) and (
                max_bytes is None or self.bytes_allocated() + blocks * per_block <= max_bytes):
            self._grow()
        empty = self.pool.num_free == self.pool.num_blocks  # no block in use or cached: no keys and values to keep
        for chunk in self.chunks if empty else self.chunks[before:]:
            for t in chunk:
                t.zero_()  # (zeros already: every page written now, not in a decode step)
        self.held_chunks = len(self.chunks)
        return self.bytes_allocated()

    def give_back(self) -> int:
        """Give back trailing chunks whose blocks are all free (not used, not cached), down to those reserve held;
        returns the blocks."""
        returned = 0
        while len(self.chunks) > self.held_chunks and self.pool.can_give_back(self.layout.sizes[-1]):
            self.pool.give_back(self.layout.sizes[-1])
            returned += self.layout.remove_last_chunk()
            self.chunks.pop()
            self.layers.pop()
            self._next_chunk = None  # (made for the pool before: the next chunk's size changes)
        self._index_stores()
        return returned

    def _index_stores(self) -> None:
        """stores_by_layer from the chunks' views, once per change of chunks (a step reads it for every layer)."""
        kinds = range(len(self.layers[0])) if self.layers else ()
        self.stores_by_layer = [[[chunk[which][layer] for chunk in self.layers]
                                 for layer in range(len(self.layers[0][which]))] for which in kinds]
        self.layer_groups = [[t for by_layer in self.stores_by_layer for t in by_layer[layer]]
                             for layer in range(len(self.stores_by_layer[0]) if self.layers else 0)]

    # ---- where the tokens are
    def read_plan(self, table: list[int], length: int, masked: bool = False) -> ReadPlan:
        """The pieces holding the first `length` tokens; masked: the step needs the key positions."""
        pieces = self.layout.pieces(table, length)
        plan = ReadPlan([(p.chunk, self._slots(p)) for p in pieces])
        positions = self.layout.key_positions(pieces, length) if masked else None
        if positions is not None:
            plan.key_positions = torch.tensor(positions, device=self.device)
        return plan

    def _slots(self, piece: Piece) -> slice | torch.Tensor:
        return piece.slots if piece.is_slice else torch.tensor(piece.slots, device=self.device)

    def read_piece(self, layer: int, piece: tuple[int, slice | torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [Hkv, S_p, D] of a piece: a view for a slice, a gather otherwise."""
        chunk, slots = piece
        return take(self.layers[chunk][0][layer], slots), take(self.layers[chunk][1][layer], slots)

    def layer_stores(self, which: int, layer: int) -> list[torch.Tensor]:
        """Storage tensor `which` of every chunk at one layer: [Hkv, chunk slots, D] (or its scales)."""
        return self.stores_by_layer[which][layer] if self.layers else []

    def block_map(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per block id: its chunk and the slot of its first token there, int32 [num_blocks] each."""
        return block_map(tuple(self.layout.sizes), self.block_size, str(self.device))

    def block_map_lists(self) -> tuple[list[int], list[int]]:
        return block_map_lists(tuple(self.layout.sizes), self.block_size)

    # ---- preparing a sequence: reuse what is held, or what the prefix cache has
    def prepare(self, seq_id, token_ids):
        if not self.prefix_reuse:
            PagedCache.release(self, seq_id)  # the blocks only: a subclass keeps its per-sequence state
        seq = self.seqs.get(seq_id)
        if seq is None:
            seq = self.seqs[seq_id] = Sequence(seq_id)
            if self.windows:
                self.windows.start(seq_id)
            if self.prefix_reuse:
                self._share_cached_prefix(seq, token_ids)
        else:
            keep = min(common_prefix_length(seq.tokens, token_ids), len(token_ids) - 1)
            self._truncate(seq, keep if self.window_holds(seq_id, keep) else 0)
        return len(seq.tokens)

    def _share_cached_prefix(self, seq: Sequence, token_ids: list[int]) -> None:
        hits = self._cached_prefix(token_ids)
        if self.windows:  # the sliding layers' window must come with the blocks: cut to one that is parked
            hits = hits[:self.windows.unpark(seq.seq_id, [h for _, h in hits])]
        bs = self.block_size
        for i, (block, h) in enumerate(hits):
            self.pool.share(block)
            seq.blocks.append(block)
            seq.hashes.append(h)
            seq.tokens += token_ids[i * bs:(i + 1) * bs]

    def _cached_prefix(self, token_ids: list[int]) -> list[tuple[int, int]]:
        """(block, chain hash) of the prompt's leading full blocks in the prefix cache, leaving at least one
        token to compute. Changes nothing."""
        bs, parent, hits = self.block_size, None, []
        for i in range((len(token_ids) - 1) // bs):
            chunk = token_ids[i * bs:(i + 1) * bs]
            h = BlockPool.chain_hash(parent, chunk)
            block = self.pool.lookup(h, chunk)
            if block is None:
                break
            hits.append((block, h))
            parent = h
        return hits

    def truncate(self, seq_id, keep):
        self.check_truncate(seq_id, keep)
        seq = self.seqs.get(seq_id)
        surplus = seq is not None and len(seq.blocks) > -(-keep // self.block_size)  # a step that never committed
        if seq is not None and (keep < len(seq.tokens) or surplus):
            self._truncate(seq, keep)
        if seq is not None:
            self._register_full_blocks(seq, keep)  # drafts that survived a rollback are accepted tokens

    def _truncate(self, seq: Sequence, keep: int) -> None:
        bs = self.block_size
        n_blocks = -(-keep // bs)
        partial = keep % bs != 0
        if partial and self.pool.refcount(seq.blocks[n_blocks - 1]) > 1 and not self.can_make_room(1):
            raise KVCacheFull("no free block to copy a shared block before rewriting it")
        self.pool.free(seq.blocks[n_blocks:])
        del seq.blocks[n_blocks:]
        del seq.hashes[keep // bs:]
        if partial:
            seq.blocks[-1] = self._private_block(seq.blocks[-1])
        self._keep_tokens(seq, keep)

    def _private_block(self, block: int) -> int:
        """A block this sequence alone may rewrite: copy-on-write if shared, unhashed otherwise."""
        if self.pool.refcount(block) == 1:
            self.pool.forget(block)
            return block
        self.make_room(1)
        (copy,) = self.pool.allocate(1)
        self._copy_block(block, copy)
        self.pool.free([block])
        return copy

    def _copy_block(self, src: int, dst: int) -> None:
        """Copy a block's storage: each chunk tensor holds a block as `per` entries of its dim 2."""
        (sc, so), (dc, do) = self.layout.locate(src), self.layout.locate(dst)
        for s, d in zip(self.chunks[sc], self.chunks[dc]):
            per = s.shape[2] // self.layout.sizes[sc]  # block_size for tokens, 1 for per-block scales
            d[:, :, do * per:(do + 1) * per] = s[:, :, so * per:(so + 1) * per]

    def _keep_tokens(self, seq: Sequence, keep: int) -> None:
        del seq.tokens[keep:]
        if self.windows:
            self.windows.truncate(seq.seq_id, keep)

    def fork(self, src: int, dst: int) -> None:
        """dst starts holding what src holds by sharing its blocks (one more reference each): a branch of a
        conversation costs no copy of its prefix. The partly filled last block is copied before dst writes into
        it (copy-on-write, in prepare/truncate)."""
        self._fork_blocks(src, dst)

    def _fork_blocks(self, src: int, dst: int) -> None:
        parent = self.seqs[src]
        self.release(dst)
        for block in parent.blocks:
            self.pool.share(block)
        self.seqs[dst] = Sequence(dst, list(parent.tokens), list(parent.blocks), list(parent.hashes))
        if self.windows:
            self.windows.fork(src, dst)

    # ---- a step
    def begin_step(self, seq_ids, new_tokens):
        seqs = [self.seqs[s] for s in seq_ids]
        n_new = [len(t) for t in new_tokens]
        needed = [self._blocks_needed(seq, n) for seq, n in zip(seqs, n_new)]
        for seq, n in zip(seqs, n_new):
            if len(seq.tokens) + n > self.max_context:
                raise KVCacheFull(f"{len(seq.tokens) + n} tokens exceed the context limit {self.max_context}")
        self.make_room(sum(needed))
        for seq, n in zip(seqs, needed):
            seq.blocks += self.pool.allocate(n) if n else []
        past = [len(seq.tokens) for seq in seqs]
        view = self._make_view(seq_ids, past, n_new, [seq.blocks for seq in seqs])
        view.new_tokens = new_tokens
        return view

    def _make_view(self, seq_ids, past, n_new, tables):
        return PagedView(self, seq_ids, past, n_new, tables)

    def _blocks_needed(self, seq: Sequence, n: int) -> int:
        return max(0, -(-(len(seq.tokens) + n) // self.block_size) - len(seq.blocks))

    def commit_step(self, view):
        tentative = view.num_tentative or [0] * len(view.seq_ids)
        for seq_id, tokens, unverified in zip(view.seq_ids, view.new_tokens, tentative):
            seq = self.seqs[seq_id]
            seq.tokens += tokens
            self._register_full_blocks(seq, len(seq.tokens) - unverified)

    # ---- speculative decoding: a full block enters the prefix cache only once all its tokens are accepted
    def _register_full_blocks(self, seq: Sequence, accepted: int) -> None:
        """Hash and register the full blocks within the first `accepted` tokens that are not registered yet.

        Tokens committed as tentative (draft tokens being verified) become accepted when a later step commits
        on top of them or a truncate keeps them; a truncate that drops them leaves their blocks unhashed."""
        bs = self.block_size
        for i in range(len(seq.hashes), accepted // bs):
            chunk = seq.tokens[i * bs:(i + 1) * bs]
            h = BlockPool.chain_hash(seq.hashes[-1] if seq.hashes else None, chunk)
            self.pool.register(seq.blocks[i], h, chunk)
            seq.hashes.append(h)

    def release(self, seq_id):
        seq = self.seqs.pop(seq_id, None)
        if seq is not None:
            self._park_window(seq)
            self.pool.free(seq.blocks)
            self.give_back()

    def _park_window(self, seq: Sequence) -> None:
        """The sliding layers' ring, kept for the prefix cache under the sequence's last registered block."""
        if self.windows and seq.hashes and self.prefix_reuse:
            self.windows.park(seq.seq_id, len(seq.hashes) * self.block_size, seq.hashes[-1])
        elif self.windows:
            self.windows.release(seq.seq_id)

    def tokens_held(self, seq_id):
        seq = self.seqs.get(seq_id)
        return len(seq.tokens) if seq else 0

    # ---- figures
    def bytes_per_block(self) -> int:  # (stats() reads it every step: a chunk of "meta" tensors built once)
        if self._block_bytes is None:
            self._block_bytes = sum(t.nbytes for t in self._chunk_tensors(1, "meta"))
        return self._block_bytes

    def budget_bytes(self) -> int:
        return self.layout.max_blocks * self.bytes_per_block()

    def stats(self, seq_id=None):
        pool = self.pool
        return KVStats(
            self.name, tokens=self.tokens_held(seq_id),
            bytes_allocated=self.bytes_allocated(),
            bytes_used=pool.num_used * self.bytes_per_block() + self._window_bytes_used(),
            bytes_theoretical=self.theoretical_bytes_of(len(s.tokens) for s in self.seqs.values()),
            bytes_per_element=self.bytes_per_element,
            block_size=self.block_size, num_blocks=pool.num_blocks, num_blocks_used=pool.num_used,
            num_blocks_free=pool.num_free, num_blocks_cached=pool.num_cached,
            block_states=self.block_states(seq_id),
            bytes_budget=self.budget_bytes() + self.window_bytes(),  # the rings come beside the pool's budget
            num_blocks_budget=self.layout.max_blocks, precision=self.precision,
        )

    def bytes_allocated(self) -> int:
        """The pool's chunks (and the next one where it is made ahead), and the sliding layers' rings (the
        sequences' and those parked)."""
        ahead = self._next_chunk[0] * self.bytes_per_block() if self._next_chunk else 0  # made, not yet joined
        return sum(t.nbytes for t in self.storage_tensors()) + ahead + self.window_bytes()

    def _window_bytes_used(self) -> int:
        """Of the rings: the rows holding each sequence's live window."""
        return int(sum(self.sliding_formula_bytes(len(s.tokens)) for s in self.seqs.values()))

    def block_states(self, seq_id: int | None) -> bytes:
        states = bytearray(bytes(self.pool.states()).translate(USED_AS_OTHER))
        own = self.seqs.get(seq_id)
        for b in own.blocks if own else ():
            states[b] = BLOCK_OWN
        return bytes(states)
