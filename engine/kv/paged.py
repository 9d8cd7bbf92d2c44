"""'paged': one pool of fixed-size blocks shared by all sequences, block tables, prefix reuse across turns.

Storage is flat per layer, [Hkv, num_blocks * block_size, D]: a token at position p of a sequence lives in slot
block_table[p // block_size] * block_size + p % block_size. A sequence whose blocks are consecutive is read
as a slice (no copy); otherwise its slots are gathered.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

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


@dataclass
class Sequence:
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
    def __init__(self, cache: PagedCache, seq_ids, past, n_new, tables: list[list[int]]):
        super().__init__(seq_ids, past, n_new, cache.device)
        self.cache = cache
        self.tables = tables
        dev = cache.device
        self.write_slots = torch.tensor(
            [cache.slot(t, p) for t, p0, n in zip(tables, past, n_new) for p in range(p0, p0 + n)], device=dev
        )
        width = max(n_new)
        self.valid_index = torch.tensor([i * width + j for i, n in enumerate(n_new) for j in range(n)], device=dev)
        self.read_slots = [cache.held_slots(t, length) for t, length in zip(tables, self.kv_len)]

    def new_tokens_flat(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, H, T, D] -> [H, N, D] holding only the valid (unpadded) new tokens."""
        b, h, t, d = x.shape
        if b == 1:
            return x[0]
        return x.transpose(0, 1).reshape(h, b * t, d).index_select(1, self.valid_index)

    def attend(self, layer, q, k, v):
        c = self.cache
        c.k[layer].index_copy_(1, self.write_slots, self.new_tokens_flat(k))
        c.v[layer].index_copy_(1, self.write_slots, self.new_tokens_flat(v))
        keys, values = c.k[layer], c.v[layer]  # [Hkv, slots, D]
        return self.attend_each(q, lambda i: (take(keys, self.read_slots[i]), take(values, self.read_slots[i])))


def take(store: torch.Tensor, index: torch.Tensor | slice) -> torch.Tensor:
    """store[:, index] along dim 1: a view for a slice, a gather for an index tensor."""
    return store[:, index] if isinstance(index, slice) else store.index_select(1, index)


class PagedCache(KVCache):
    name = "paged"

    def __init__(self, model_config, dtype, device, max_context, block_size: int = 16,
                 pool_tokens: int | None = None):
        super().__init__(model_config, dtype, device, max_context)
        self.block_size = block_size
        num_blocks = -(-(pool_tokens or max_context) // block_size)
        self.pool = BlockPool(num_blocks, block_size)
        self.seqs: dict[int, Sequence] = {}
        self._allocate_storage(num_blocks * block_size)

    def _allocate_storage(self, num_slots: int) -> None:
        c = self.config
        shape = (c.num_layers, c.num_kv_heads, num_slots, c.head_dim)
        self.k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=self.dtype, device=self.device)

    def storage_tensors(self) -> list[torch.Tensor]:
        return [self.k, self.v]

    def slot(self, table: list[int], position: int) -> int:
        return table[position // self.block_size] * self.block_size + position % self.block_size

    def held_slots(self, table: list[int], length: int) -> torch.Tensor | slice:
        """Slots of the first `length` tokens: a slice when their blocks are consecutive (read without a copy)."""
        bs = self.block_size
        used = table[: -(-length // bs)]
        if all(b == used[0] + i for i, b in enumerate(used)):
            return slice(used[0] * bs, used[0] * bs + length)
        return self.block_slots(torch.tensor(used, device=self.device))[:length]

    def block_slots(self, blocks: torch.Tensor) -> torch.Tensor:
        """Slots of the given physical blocks, in order: [len(blocks) * block_size]."""
        bs = self.block_size
        return (blocks[:, None] * bs + torch.arange(bs, device=self.device)).flatten()

    # ---- preparing a sequence: reuse what is held, or what the prefix cache has
    def prepare(self, seq_id, token_ids):
        seq = self.seqs.get(seq_id)
        if seq is None:
            seq = self.seqs[seq_id] = Sequence()
            self._share_cached_prefix(seq, token_ids)
        else:
            keep = min(common_prefix_length(seq.tokens, token_ids), len(token_ids) - 1)
            self._truncate(seq, keep)
        return len(seq.tokens)

    def _share_cached_prefix(self, seq: Sequence, token_ids: list[int]) -> None:
        bs, parent = self.block_size, None
        for i in range((len(token_ids) - 1) // bs):  # at least one token is left to compute
            chunk = token_ids[i * bs:(i + 1) * bs]
            h = BlockPool.chain_hash(parent, chunk)
            block = self.pool.lookup(h, chunk)
            if block is None:
                return
            self.pool.share(block)
            seq.blocks.append(block)
            seq.hashes.append(h)
            seq.tokens += chunk
            parent = h

    def truncate(self, seq_id, keep):
        self.check_truncate(seq_id, keep)
        seq = self.seqs.get(seq_id)
        if seq is not None and keep < len(seq.tokens):
            self._truncate(seq, keep)

    def _truncate(self, seq: Sequence, keep: int) -> None:
        bs = self.block_size
        n_blocks = -(-keep // bs)
        partial = keep % bs != 0
        if partial and self.pool.refcount(seq.blocks[n_blocks - 1]) > 1 and not self.pool.can_allocate(1):
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
        (copy,) = self.pool.allocate(1)
        self._copy_block(block, copy)
        self.pool.free([block])
        return copy

    def _copy_block(self, src: int, dst: int) -> None:
        bs = self.block_size
        for t in self.storage_tensors():
            t[:, :, dst * bs:(dst + 1) * bs] = t[:, :, src * bs:(src + 1) * bs]

    def _keep_tokens(self, seq: Sequence, keep: int) -> None:
        del seq.tokens[keep:]

    # ---- a step
    def begin_step(self, seq_ids, new_tokens):
        seqs = [self.seqs[s] for s in seq_ids]
        n_new = [len(t) for t in new_tokens]
        needed = [self._blocks_needed(seq, n) for seq, n in zip(seqs, n_new)]
        for seq, n in zip(seqs, n_new):
            if len(seq.tokens) + n > self.max_context:
                raise KVCacheFull(f"{len(seq.tokens) + n} tokens exceed the context limit {self.max_context}")
        if not self.pool.can_allocate(sum(needed)):
            raise KVCacheFull(
                f"the block pool is exhausted: {sum(needed)} blocks needed, {self.pool.num_free} free and "
                f"{self.pool.num_cached} cached of {self.pool.num_blocks}; release a sequence or enlarge the pool"
            )
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
        bs = self.block_size
        for seq_id, tokens in zip(view.seq_ids, view.new_tokens):
            seq = self.seqs[seq_id]
            seq.tokens += tokens
            for i in range(len(seq.hashes), len(seq.tokens) // bs):
                chunk = seq.tokens[i * bs:(i + 1) * bs]
                h = BlockPool.chain_hash(seq.hashes[-1] if seq.hashes else None, chunk)
                self.pool.register(seq.blocks[i], h, chunk)
                seq.hashes.append(h)

    def release(self, seq_id):
        seq = self.seqs.pop(seq_id, None)
        if seq is not None:
            self.pool.free(seq.blocks)

    def tokens_held(self, seq_id):
        seq = self.seqs.get(seq_id)
        return len(seq.tokens) if seq else 0

    # ---- figures
    def bytes_per_block(self) -> int:
        return sum(t.nbytes for t in self.storage_tensors()) // self.pool.num_blocks

    def stats(self, seq_id=None):
        pool = self.pool
        live = sum(len(s.tokens) for s in self.seqs.values())
        return KVStats(
            self.name, tokens=self.tokens_held(seq_id),
            bytes_allocated=self.bytes_allocated(),
            bytes_used=pool.num_used * self.bytes_per_block(),
            bytes_theoretical=self.theoretical_bytes(live),
            bytes_per_element=self.bytes_per_element,
            block_size=self.block_size, num_blocks=pool.num_blocks, num_blocks_used=pool.num_used,
            num_blocks_free=pool.num_free, num_blocks_cached=pool.num_cached,
            block_states=self.block_states(seq_id),
        )

    def bytes_allocated(self) -> int:
        return sum(t.nbytes for t in self.storage_tensors())

    def block_states(self, seq_id: int | None) -> bytes:
        states = [BLOCK_OTHER if s not in (BLOCK_FREE, BLOCK_CACHED) else s for s in self.pool.states()]
        own = self.seqs.get(seq_id)
        for b in own.blocks if own else ():
            states[b] = BLOCK_OWN
        return bytes(states)
