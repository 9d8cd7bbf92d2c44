"""'paged-int8': the paged layout with int8 keys and values plus float16 scales.

Keys are quantized per channel over the tokens of one block, values per token, when a block fills. Until
then the sequence's newest tokens (its partly filled last block) stay in full precision in a small window.
"""

from __future__ import annotations

import torch

from engine.kv import quant
from engine.kv.paged import PagedCache, PagedView, Sequence, take


class Int8View(PagedView):
    def attend(self, layer, q, k, v):
        c = self.cache
        for i, seq_id in enumerate(self.seq_ids):
            c.store(layer, self.tables[i], c.windows[seq_id], self.past[i], k[i, :, : self.n_new[i]],
                    v[i, :, : self.n_new[i]])
        return self.attend_each(q, lambda i: self._dequantized(layer, i))

    def _dequantized(self, layer: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        c, length = self.cache, self.kv_len[i]
        keys, values = c.workspace(length)  # [Hkv, S, D] each, full precision
        c.dequantize_into(layer, self.tables[i], c.windows[self.seq_ids[i]], length, keys, values)
        return keys, values


class PagedInt8Cache(PagedCache):
    name = "paged-int8"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.bytes_per_element = 1

    def _allocate_storage(self, num_slots: int) -> None:
        c = self.config
        shape = (c.num_layers, c.num_kv_heads, num_slots, c.head_dim)
        num_blocks = num_slots // self.block_size
        self.k = torch.zeros(shape, dtype=torch.int8, device=self.device)
        self.v = torch.zeros(shape, dtype=torch.int8, device=self.device)
        self.k_scale = torch.zeros(shape[:2] + (num_blocks, c.head_dim), dtype=quant.SCALE_DTYPE, device=self.device)
        self.v_scale = torch.zeros(shape[:3], dtype=quant.SCALE_DTYPE, device=self.device)
        self.windows: dict[int, torch.Tensor] = {}
        self._workspace = torch.zeros((), dtype=self.dtype, device=self.device)

    def workspace(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Scratch buffers, reused across sequences, layers and steps, that held keys and values are
        dequantized into: [Hkv, length, D] each. Scratch for one attention call, not cache storage."""
        if self._workspace.dim() == 0 or self._workspace.shape[2] < length:
            c = self.config
            capacity = max(length, min(max(length, 256) * 2, self.max_context))
            shape = (2, c.num_kv_heads, capacity, c.head_dim)
            self._workspace = torch.zeros(shape, dtype=self.dtype, device=self.device)
        return self._workspace[0, :, :length], self._workspace[1, :, :length]

    def storage_tensors(self):
        return [self.k, self.v, self.k_scale, self.v_scale]

    def _new_window(self) -> torch.Tensor:
        c = self.config
        # window: [2 (K, V), L, Hkv, block_size, D] in full precision
        shape = (2, c.num_layers, c.num_kv_heads, self.block_size, c.head_dim)
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def prepare(self, seq_id, token_ids):
        if seq_id not in self.windows:
            self.windows[seq_id] = self._new_window()
        return super().prepare(seq_id, token_ids)

    def release(self, seq_id):
        self.windows.pop(seq_id, None)
        super().release(seq_id)

    def _make_view(self, seq_ids, past, n_new, tables):
        return Int8View(self, seq_ids, past, n_new, tables)

    # ---- writing and reading one sequence
    def store(self, layer: int, table: list[int], window: torch.Tensor, past: int, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """k, v: [Hkv, N, D] new tokens at positions past..past+N-1; full blocks are quantized."""
        bs = self.block_size
        held = past % bs
        keys = torch.cat([window[0, layer, :, :held], k], dim=1)  # [Hkv, held + N, D]
        values = torch.cat([window[1, layer, :, :held], v], dim=1)
        full = keys.shape[1] // bs
        if full:
            blocks = torch.tensor(table[past // bs: past // bs + full], device=self.device)
            self._store_blocks(layer, blocks, keys[:, : full * bs], values[:, : full * bs])
        rest = keys.shape[1] - full * bs
        window[0, layer, :, :rest] = keys[:, full * bs:]
        window[1, layer, :, :rest] = values[:, full * bs:]

    def _store_blocks(self, layer: int, blocks: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        h, n, d = k.shape
        slots = self.block_slots(blocks)
        k_q, k_scale = quant.quantize_keys(k.view(h, n // self.block_size, self.block_size, d))
        v_q, v_scale = quant.quantize_values(v)
        self.k[layer].index_copy_(1, slots, k_q.view(h, n, d))
        self.k_scale[layer].index_copy_(1, blocks, k_scale)
        self.v[layer].index_copy_(1, slots, v_q)
        self.v_scale[layer].index_copy_(1, slots, v_scale)

    def _held_blocks(self, table: list[int], full: int) -> tuple[torch.Tensor | slice, torch.Tensor | slice]:
        """Indices of the first `full` blocks and of their slots: slices when the blocks are consecutive."""
        slots = self.held_slots(table, full * self.block_size) if full else slice(0, 0)
        if isinstance(slots, slice):
            return slice(slots.start // self.block_size, slots.stop // self.block_size), slots
        return torch.tensor(table[:full], device=self.device), slots

    def dequantize_into(self, layer: int, table: list[int], window: torch.Tensor, length: int,
                        keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write the sequence's `length` keys and values, full precision, into keys/values [Hkv, >=length, D]."""
        bs, h, d = self.block_size, self.k.shape[1], self.k.shape[3]
        full = length // bs
        n = full * bs
        blocks, slots = self._held_blocks(table, full)
        k_q, v_q = take(self.k[layer], slots), take(self.v[layer], slots)  # [Hkv, n, D] int8
        quant.dequantize_keys(k_q.view(h, full, bs, d), take(self.k_scale[layer], blocks), self.dtype, keys[:, :n])
        quant.dequantize_values(v_q, take(self.v_scale[layer], slots), self.dtype, values[:, :n])
        keys[:, n:length] = window[0, layer, :, : length - n]
        values[:, n:length] = window[1, layer, :, : length - n]

    def read_keys_values(self, layer, table, window, length) -> tuple[torch.Tensor, torch.Tensor]:
        """-> keys, values [Hkv, length, D] of the sequence, dequantized (fresh tensors)."""
        c = self.config
        keys = torch.empty(c.num_kv_heads, length, c.head_dim, dtype=self.dtype, device=self.device)
        values = torch.empty_like(keys)
        self.dequantize_into(layer, table, window, length, keys, values)
        return keys, values

    # ---- keeping the prefix cache consistent
    def _copy_block(self, src: int, dst: int) -> None:
        bs = self.block_size
        for t in (self.k, self.v, self.v_scale):
            t[:, :, dst * bs:(dst + 1) * bs] = t[:, :, src * bs:(src + 1) * bs]
        self.k_scale[:, :, dst] = self.k_scale[:, :, src]

    def _keep_tokens(self, seq: Sequence, keep: int) -> None:
        """Truncating into a block that was full: its kept tokens go back to the full-precision window."""
        bs = self.block_size
        was_full = keep // bs < len(seq.tokens) // bs
        rest = keep % bs
        if rest and was_full:
            window = self.windows[self._seq_id(seq)]
            block = [seq.blocks[keep // bs]]  # dequantize just that block (it is full: no window part)
            for layer in range(self.config.num_layers):
                k, v = self.read_keys_values(layer, block, window, bs)
                window[0, layer, :, :rest] = k[:, :rest]
                window[1, layer, :, :rest] = v[:, :rest]
        super()._keep_tokens(seq, keep)

    def _seq_id(self, seq: Sequence) -> int:
        return next(s for s, candidate in self.seqs.items() if candidate is seq)

    def bytes_allocated(self) -> int:
        windows = sum(w.nbytes for w in self.windows.values())
        return super().bytes_allocated() + windows + self._workspace.nbytes

    def stats(self, seq_id=None):
        stats = super().stats(seq_id)
        windows = sum(w.nbytes for w in self.windows.values())
        return type(stats)(**{**stats.__dict__, "bytes_used": stats.bytes_used + windows})

