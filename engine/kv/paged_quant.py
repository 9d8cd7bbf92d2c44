"""The paged layout over quantized keys and values: 'paged-int8' (symmetric int8) and 'paged-int4' (KIVI-style
asymmetric int4), with float16 scales (int4's key scales two-level: 8 bits a channel under float16 supers;
engine/kv/quant.py).

Keys are quantized per channel over the tokens of one block, values per token, when a block leaves the
sequence's full-precision window (engine/kv/quantized.py): int8 when the block fills, int4 once `residual`
newer tokens follow it. A block enters the prefix cache only once it holds its codes.

A model's sliding-window layers are kept as the float pool keeps them, in a ring of their window per sequence
(engine/kv/window.py), unquantized: the pool's codes and the full-precision window hold the global layers only.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from engine import kernels
from engine.kv import quant
from engine.kv.attention import KeyMap, attend
from engine.kv.base import StepView
from engine.kv.paged import PagedCache, PagedView, Sequence
from engine.kv.precision import bytes_per_token
from engine.kv.quantized import RESIDUAL, SINK, QuantState, locator

SINK_CACHE_BLOCKS = 16  # sink rows of prefix-cached blocks kept (as held: exact), most recently used first


class QuantView(PagedView):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.upto = self.cache.state.upto_tensor(self.seq_ids)  # before this step's writes
        self.fused_where = self.cache.state.fused_where(self.keys, self.upto)  # every layer's, in one call
        self._locators = None

    def attend(self, layer, q, k, v, spec=None):
        if (at := self.store_layer(layer)) is None:
            return self.window.attend(layer, q, k, v, spec)
        c, layer = self.cache, at  # from here on, the layer as the cache's stores number it
        stores = [c.layer_stores(i, layer) for i in range(4)]  # key codes, value codes, key scales, value scales
        ops = kernels.for_activations(q)
        if ops is not None and (spec is None or spec.is_plain):
            return c.state.attend_compiled(ops, q, k, v, stores, self.seq_ids, layer, self.keys, self.upto)
        if self._locators is None:
            self._locators = [locator(self.keys, b) for b in range(len(self.seq_ids))]
        held = []
        for b, seq_id in enumerate(self.seq_ids):
            c.state.write(layer, stores, seq_id, self._locators[b], self.past[b], k[b, :, : self.n_new[b]],
                          v[b, :, : self.n_new[b]])
            held.append(c.state.read(layer, stores, seq_id, self._locators[b], self.kv_len[b]))
        dequantized = KeyMap.one_store_each(self.kv_len, self.past, self.n_new, c.device)
        return attend(q, [k for k, _ in held], [v for _, v in held], dequantized, spec)

    def fused_kv(self, layer):
        if (at := self.store_layer(layer)) is None:
            return None
        stores = [self.cache.layer_stores(i, at) for i in range(4)]
        return self.cache.state.fused_kv(stores, self.seq_ids, at, self.fused_where)

    def fused_step(self, num_layers):
        """As fused_kv for every layer, from the pool's per-layer groups and each sequence's windows."""
        if self.window is not None or num_layers != len(self.cache.layer_groups):
            return StepView.fused_step(self, num_layers)
        state = self.cache.state
        return self.cached_step(num_layers, self.fused_where, state.fused_ints(),
                                [state.seqs[s].layers for s in self.seq_ids])


class PagedQuantCache(PagedCache):
    """codec: quant.INT8 or quant.INT4 (the cache's name says which: paged-int8, paged-int4); residual: tokens
    kept in full precision after the last quantized block, sink: the first tokens kept so (None: the precision's
    defaults, quantized.RESIDUAL and SINK)."""

    def __init__(self, *args, codec: quant.KVCodec = quant.INT8, residual: int | None = None,
                 sink: int | None = None, **kwargs):
        self.codec = codec
        self.name = f"paged-{codec.name}"
        super().__init__(*args, **kwargs)
        self.bytes_per_element = codec.bits / 8
        self.quantization_group = self.block_size
        residual = RESIDUAL[codec.name] if residual is None else residual
        sink = SINK[codec.name] if sink is None else sink
        self.state = QuantState(codec, self.block_size, residual, sink, self.store_config, self.dtype, self.device)
        self.sink_rows: OrderedDict[int, torch.Tensor] = OrderedDict()  # block hash -> its sink rows

    @property
    def shares_computed_blocks(self) -> bool:  # a block joins the prefix cache once it holds codes: `residual` later
        return super().shares_computed_blocks and self.state.residual == 0

    def _chunk_tensors(self, num_blocks: int, device) -> list[torch.Tensor]:
        """Key and value codes [L, Hkv, slots, W]; key scales [L, Hkv, blocks, (2,) D]; value scales
        [L, Hkv, slots, (2)] (quant.KVCodec.storage)."""
        c = self.store_config
        return self.codec.storage(c.num_layers, c.num_kv_heads, num_blocks, self.block_size, c.head_dim, device)

    def _make_view(self, seq_ids, past, n_new, tables):
        return QuantView(self, seq_ids, past, n_new, tables)

    # ---- per sequence: the window and its boundary follow the blocks
    def prepare(self, seq_id, token_ids):
        fresh = seq_id not in self.seqs or not self.prefix_reuse
        held = super().prepare(seq_id, token_ids)
        if fresh:
            self.state.start(seq_id, upto=held)  # blocks shared from the prefix cache hold their codes
            self._restore_sink(seq_id, self.seqs[seq_id])
        return held

    def _restore_sink(self, seq_id: int, seq: Sequence) -> None:
        """The sink rows of the blocks a new sequence shares: as their first holder kept them, else decoded."""
        bs, window = self.block_size, self.state.seqs[seq_id].window  # [2, L, Hkv, rows, D]
        for i, h in enumerate(seq.hashes):
            end = min((i + 1) * bs, self.state.sink)
            if i * bs >= end:
                break
            rows = self.sink_rows.get(h)
            if rows is None:
                rows = torch.stack([torch.stack(self._block_codes(layer, seq.blocks[i]))
                                    for layer in range(self.store_config.num_layers)], dim=1)[:, :, :, : end - i * bs]
            else:
                self.sink_rows.move_to_end(h)
            window[:, :, :, i * bs:end] = rows.to(window.dtype)

    def commit_step(self, view):
        for seq_id, end in zip(view.seq_ids, view.kv_len):
            self.state.commit(seq_id, end)
        super().commit_step(view)

    def _register_full_blocks(self, seq: Sequence, accepted: int) -> None:
        """Only blocks that hold their codes are shared: one still in the window has none yet."""
        state = self.state.seqs.get(seq.seq_id)
        before = len(seq.hashes)
        super()._register_full_blocks(seq, min(accepted, state.upto if state else 0))
        bs = self.block_size
        for i in range(before, len(seq.hashes)):  # newly shareable blocks below the sink: keep their rows
            end = min((i + 1) * bs, self.state.sink)
            if i * bs < end:
                self.sink_rows[seq.hashes[i]] = state.window[:, :, :, i * bs:end].clone()
                self.sink_rows.move_to_end(seq.hashes[i])
        while len(self.sink_rows) > SINK_CACHE_BLOCKS:
            self.sink_rows.popitem(last=False)

    def _keep_tokens(self, seq: Sequence, keep: int) -> None:
        seq_id = seq.seq_id
        if seq_id in self.state.seqs:
            block_of = lambda layer, p: self._block_codes(layer, seq.blocks[p // self.block_size])  # noqa: E731
            self.state.truncate(seq_id, keep, block_of)
        super()._keep_tokens(seq, keep)

    def _block_codes(self, layer: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk, offset = self.layout.locate(block)
        stores = [[by_layer[layer]] for by_layer in self.layers[chunk]]  # this chunk's tensors at the layer
        return self.state.block(stores, 0, offset * self.block_size)

    def release(self, seq_id):
        self.state.release(seq_id)
        super().release(seq_id)

    def fork(self, src: int, dst: int) -> None:
        """As the float pool: dst shares src's blocks; its full-precision window is copied."""
        self._fork_blocks(src, dst)
        self.state.fork(src, dst)

    # ---- figures
    def store_bytes_per_token(self) -> float:
        return bytes_per_token(self.store_config, self.codec.name, self.block_size)

    def bytes_allocated(self) -> int:
        """The pool, the sequences' windows and the sink rows kept for the prefix cache."""
        kept = sum(t.nbytes for t in self.sink_rows.values())
        return super().bytes_allocated() + self.state.window_bytes() + kept

    def stats(self, seq_id=None):
        stats = super().stats(seq_id)
        windows = self.state.window_bytes()
        return type(stats)(**{**stats.__dict__, "bytes_used": stats.bytes_used + windows, "bytes_window": windows,
                              "precision": self.codec.name})


class PagedInt8Cache(PagedQuantCache):
    """paged + int8: the name the cache menu has always had."""
