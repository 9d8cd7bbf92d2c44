"""The paged layout over quantized keys and values: 'paged-int8' (symmetric int8) and 'paged-int4' (KIVI-style
asymmetric int4), each with float16 scales (engine/kv/quant.py).

Keys are quantized per channel over the tokens of one block, values per token, when a block fills. Until
then the sequence's newest tokens (its partly filled last block) stay in full precision in a small window.
"""

from __future__ import annotations

import torch

from engine import kernels
from engine.kv import quant
from engine.kv.attention import KeyMap, attend
from engine.kv.paged import PagedCache, PagedView, ReadPlan, Sequence, take
from engine.kv.precision import bytes_per_token


def pick(x: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """x, or x[:, index] along dim 1."""
    return x if index is None else x.index_select(1, index)


class QuantView(PagedView):
    _dequantized_keys: KeyMap | None = None  # the pure PyTorch path's map: one store per sequence

    def attend(self, layer, q, k, v, spec=None):
        c = self.cache
        ops = kernels.for_activations(q)
        if ops is None or not (spec is None or spec.is_plain):
            for i, seq_id in enumerate(self.seq_ids):
                c.store(layer, self.tables[i], c.windows[seq_id], self.past[i], k[i, :, : self.n_new[i]],
                        v[i, :, : self.n_new[i]])
            return self._attend_dequantized(layer, q, spec)
        stores = [c.layer_stores(i, layer) for i in range(4)]  # key codes, value codes, key scales, value scales
        windows = [c.windows[s][:, layer] for s in self.seq_ids]  # [2, Hkv, block_size, D] each
        return attend_quantized(ops, q, k, v, stores, windows, self.keys, c.block_size, c.codec.bits)

    def _attend_dequantized(self, layer: int, q: torch.Tensor, spec=None) -> torch.Tensor:
        """The pure PyTorch path: each sequence's keys and values dequantized in position order, then the one
        attention routine over them (one store per sequence)."""
        c = self.cache
        held = [c.read_keys_values(layer, table, c.windows[s], n)
                for s, table, n in zip(self.seq_ids, self.tables, self.kv_len)]
        if self._dequantized_keys is None:
            self._dequantized_keys = KeyMap.one_store_each(self.kv_len, self.past, self.n_new, c.device)
        return attend(q, [k for k, _ in held], [v for _, v in held], self._dequantized_keys, spec)


def attend_quantized(ops, q, k, v, stores: list[list[torch.Tensor]], windows: list[torch.Tensor], keys: KeyMap,
                     block_size: int, bits: int) -> torch.Tensor:
    """The compiled path of a quantized cache, any layout: write the step's keys and values (q, k, v as
    StepView.attend takes them) into the windows, quantizing the blocks they fill, then attend over the codes.
    stores: per storage tensor (key codes, value codes, key scales, value scales) its [Hkv, ...] store per
    store index of `keys`; windows: per sequence [2, Hkv, block_size, D]."""
    k_windows, v_windows = [w[0] for w in windows], [w[1] for w in windows]
    ops.write_kv_quant(*stores, k_windows, v_windows, k.contiguous(), v.contiguous(), keys.store_of, keys.slot_of,
                       block_size, bits)
    return ops.attention_quant(q.contiguous(), *stores, k_windows, v_windows, keys.table, keys.block_store,
                               keys.block_start, block_size, keys.q_pos, bits)


class PagedQuantCache(PagedCache):
    """codec: quant.INT8 or quant.INT4 (the cache's name says which: paged-int8, paged-int4)."""

    def __init__(self, *args, codec: quant.KVCodec = quant.INT8, **kwargs):
        self.codec = codec
        self.name = f"paged-{codec.name}"
        super().__init__(*args, **kwargs)
        self.bytes_per_element = codec.bits / 8
        self.quantization_group = self.block_size
        self.windows: dict[int, torch.Tensor] = {}

    def _chunk_tensors(self, num_blocks: int, device) -> list[torch.Tensor]:
        """Key and value codes [L, Hkv, slots, W]; key scales [L, Hkv, blocks, (2,) D]; value scales
        [L, Hkv, slots, (2)] (quant.KVCodec.storage)."""
        c = self.config
        return self.codec.storage(c.num_layers, c.num_kv_heads, num_blocks, self.block_size, c.head_dim, device)

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
        return QuantView(self, seq_ids, past, n_new, tables)

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
            blocks = table[past // bs: past // bs + full]
            self._store_blocks(layer, blocks, keys[:, : full * bs], values[:, : full * bs])
        rest = keys.shape[1] - full * bs
        window[0, layer, :, :rest] = keys[:, full * bs:]
        window[1, layer, :, :rest] = values[:, full * bs:]

    def _store_blocks(self, layer: int, blocks: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [Hkv, len(blocks) * block_size, D] full precision -> codes and scales in those blocks."""
        h, n, d = k.shape
        bs = self.block_size
        k_q, k_scale = self.codec.quantize_keys(k.view(h, n // bs, bs, d))  # [Hkv, blocks, bs, W], [Hkv, blocks, ..]
        v_q, v_scale = self.codec.quantize_values(v)  # [Hkv, n, W], [Hkv, n, ..]
        k_q = k_q.view(h, n, -1)
        for chunk, offsets, sources in self._blocks_by_chunk(blocks):
            k_c, v_c, k_scale_c, v_scale_c = (by_layer[layer] for by_layer in self.layers[chunk])
            slots = self.block_slots(offsets)
            source_slots = None if sources is None else self.block_slots(sources)
            k_c.index_copy_(1, slots, pick(k_q, source_slots))
            k_scale_c.index_copy_(1, offsets, pick(k_scale, sources))
            v_c.index_copy_(1, slots, pick(v_q, source_slots))
            v_scale_c.index_copy_(1, slots, pick(v_scale, source_slots))

    def _blocks_by_chunk(self, blocks: list[int]) -> list[tuple[int, torch.Tensor, torch.Tensor | None]]:
        """(chunk, offsets of the blocks in it, their indices in `blocks` or None for all of them, in order)."""
        by_chunk: dict[int, list[int]] = {}
        for j, block in enumerate(blocks):
            by_chunk.setdefault(self.layout.chunk_of[block], []).append(j)
        dev = self.device
        return [(chunk, torch.tensor([self.layout.locate(blocks[j])[1] for j in js], device=dev),
                 None if len(by_chunk) == 1 else torch.tensor(js, device=dev)) for chunk, js in by_chunk.items()]

    def block_slots(self, blocks: torch.Tensor) -> torch.Tensor:
        """Slots of the given blocks (of one chunk, or of a run of new blocks), in order: [len(blocks) * bs]."""
        bs = self.block_size
        return (blocks[:, None] * bs + torch.arange(bs, device=self.device)).flatten()

    def read_plan(self, table: list[int], length: int, masked: bool = False) -> ReadPlan:
        """The pieces of the full blocks (quantized); the partly filled last block is in the window, after them."""
        full = length // self.block_size * self.block_size
        plan = super().read_plan(table, full, masked) if full else ReadPlan([])
        if plan.key_positions is not None:
            window = torch.arange(full, length, device=self.device)
            plan.key_positions = torch.cat([plan.key_positions, window])
        return plan

    def dequantize_into(self, layer: int, plan: ReadPlan, window: torch.Tensor, length: int,
                        keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write the sequence's `length` keys and values, full precision and in the plan's order (the window
        last), into keys/values [Hkv, >=length, D]."""
        bs, start = self.block_size, 0
        for chunk, slots in plan.pieces:
            k_c, v_c, k_scale_c, v_scale_c = (by_layer[layer] for by_layer in self.layers[chunk])
            k_q, v_q = take(k_c, slots), take(v_c, slots)  # [Hkv, S_p, W] codes
            h, n, w = k_q.shape
            blocks = slice(slots.start // bs, slots.stop // bs) if isinstance(slots, slice) else slots[::bs] // bs
            out = slice(start, start + n)
            self.codec.dequantize_keys(k_q.view(h, n // bs, bs, w), take(k_scale_c, blocks), self.dtype, keys[:, out])
            self.codec.dequantize_values(v_q, take(v_scale_c, slots), self.dtype, values[:, out])
            start += n
        keys[:, start:length] = window[0, layer, :, : length - start]
        values[:, start:length] = window[1, layer, :, : length - start]

    def read_keys_values(self, layer, table, window, length) -> tuple[torch.Tensor, torch.Tensor]:
        """-> keys, values [Hkv, length, D] of the sequence in position order, dequantized (fresh tensors)."""
        c = self.config
        keys = torch.empty(c.num_kv_heads, length, c.head_dim, dtype=self.dtype, device=self.device)
        values = torch.empty_like(keys)
        plan = self.read_plan(table, length, masked=True)
        self.dequantize_into(layer, plan, window, length, keys, values)
        if plan.key_positions is not None:  # pieces out of position order: put the keys back in order
            order = torch.argsort(plan.key_positions)
            keys, values = keys.index_select(1, order), values.index_select(1, order)
        return keys, values

    # ---- keeping the prefix cache consistent

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
        return super().bytes_allocated() + windows

    def theoretical_bytes(self, tokens: int) -> int:
        return int(bytes_per_token(self.config, self.codec.name, self.block_size) * tokens)

    def stats(self, seq_id=None):
        stats = super().stats(seq_id)
        windows = sum(w.nbytes for w in self.windows.values())
        return type(stats)(**{**stats.__dict__, "bytes_used": stats.bytes_used + windows, "bytes_window": windows,
                              "precision": self.codec.name})

    def fork(self, src: int, dst: int) -> None:
        """As the float pool: dst shares src's blocks; its full-precision window is copied."""
        self._fork_blocks(src, dst)
        self.windows[dst] = self.windows[src].clone()



class PagedInt8Cache(PagedQuantCache):
    """paged + int8: the name the cache menu has always had."""
