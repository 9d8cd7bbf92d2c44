"""'paged-int8': the paged layout with int8 keys and values plus float16 scales.

Keys are quantized per channel over the tokens of one block, values per token, when a block fills. Until
then the sequence's newest tokens (its partly filled last block) stay in full precision in a small window.
"""

from __future__ import annotations

import torch

from engine.kv import quant
from engine.kv.base import attention, pad_to
from engine.kv.paged import PagedCache, PagedView, Sequence


class Int8View(PagedView):
    def attend(self, layer, q, k, v):
        c = self.cache
        keys, values = [], []
        for i, seq_id in enumerate(self.seq_ids):
            window = c.windows[seq_id]
            c.store(layer, self.tables[i], window, self.past[i], k[i, :, : self.n_new[i]], v[i, :, : self.n_new[i]])
            keys.append(c.read_keys(layer, self.tables[i], window, self.kv_len[i]))
            values.append(c.read_values(layer, self.tables[i], window, self.kv_len[i]))
        s = max(self.kv_len)
        return attention(q, pad_to(keys, s, 1), pad_to(values, s, 1), self.positions, self.kv_len)


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
        bs = self.block_size
        slots = (blocks[:, None] * bs + torch.arange(bs, device=self.device)).flatten()
        k_q, k_scale = quant.quantize_keys(k.view(h, n // bs, bs, d))
        v_q, v_scale = quant.quantize_values(v)
        self.k[layer].index_copy_(1, slots, k_q.view(h, n, d))
        self.k_scale[layer].index_copy_(1, blocks, k_scale)
        self.v[layer].index_copy_(1, slots, v_q)
        self.v_scale[layer].index_copy_(1, slots, v_scale)

    def _full_slots(self, table: list[int], full: int) -> tuple[torch.Tensor, torch.Tensor]:
        blocks = torch.tensor(table[:full], device=self.device, dtype=torch.long)
        slots = (blocks[:, None] * self.block_size + torch.arange(self.block_size, device=self.device)).flatten()
        return blocks, slots

    def read_keys(self, layer, table, window, length) -> torch.Tensor:
        """-> [Hkv, length, D] keys of the sequence, dequantized."""
        full = length // self.block_size
        blocks, slots = self._full_slots(table, full)
        h, d = self.k.shape[1], self.k.shape[3]
        q = self.k[layer].index_select(1, slots).view(h, full, self.block_size, d)
        keys = quant.dequantize_keys(q, self.k_scale[layer].index_select(1, blocks), self.dtype)
        return torch.cat([keys, window[0, layer, :, : length - full * self.block_size]], dim=1)

    def read_values(self, layer, table, window, length) -> torch.Tensor:
        full = length // self.block_size
        _, slots = self._full_slots(table, full)
        values = quant.dequantize_values(
            self.v[layer].index_select(1, slots), self.v_scale[layer].index_select(1, slots), self.dtype
        )
        return torch.cat([values, window[1, layer, :, : length - full * self.block_size]], dim=1)

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
            table = seq.blocks[: keep // bs + 1]
            for layer in range(self.config.num_layers):
                k = self.read_keys(layer, table, window, len(table) * bs)
                v = self.read_values(layer, table, window, len(table) * bs)
                window[0, layer, :, :rest] = k[:, (len(table) - 1) * bs:][:, :rest]
                window[1, layer, :, :rest] = v[:, (len(table) - 1) * bs:][:, :rest]
        super()._keep_tokens(seq, keep)

    def _seq_id(self, seq: Sequence) -> int:
        return next(s for s, candidate in self.seqs.items() if candidate is seq)

    def bytes_allocated(self) -> int:
        return super().bytes_allocated() + sum(w.nbytes for w in self.windows.values())

    def stats(self, seq_id=None):
        stats = super().stats(seq_id)
        windows = sum(w.nbytes for w in self.windows.values())
        return type(stats)(**{**stats.__dict__, "bytes_used": stats.bytes_used + windows})
