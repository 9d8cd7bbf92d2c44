"""The contiguous layout over quantized keys and values: 'contiguous-int8' and 'contiguous-int4'.

Each sequence reserves codes and scales for the whole context when it starts, as 'contiguous' reserves floats.
The reservation is quantized in groups of `group` tokens (precision.CONTIGUOUS_GROUP), the way a paged pool
quantizes its blocks, with the same full-precision window (engine/kv/quantized.py). A group is read like a paged
block of that size, by the same attention routine, so a contiguous int4 cache gives the same bits as a paged int4
pool whose blocks are as large as the group. A model's sliding-window layers are kept in a ring of their window
per sequence, unquantized (engine/kv/window.py); a reservation holds the global layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine import kernels
from engine.kv import quant
from engine.kv.attention import KeyMap, attend
from engine.kv.base import KVCacheFull, KVStats, StepView
from engine.kv.contiguous import ContiguousCache
from engine.kv.precision import CONTIGUOUS_GROUP, bytes_per_token
from engine.kv.quantized import RESIDUAL, SINK, QuantState


@dataclass
class QuantReservation:
    tensors: list[torch.Tensor]  # quant.KVCodec.storage: key codes, value codes, key scales, value scales
    length: int = 0
    tokens: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.layers = [t.unbind(0) for t in self.tensors]  # per tensor, per layer views

    @property
    def capacity(self) -> int:
        return self.tensors[0].shape[2]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


class ContiguousQuantView(StepView):
    def __init__(self, cache: ContiguousQuantCache, seq_ids, past, n_new):
        super().__init__(seq_ids, past, n_new, cache.device)
        self.cache = cache
        self.buffers = [cache.reservations[s] for s in seq_ids]
        g = cache.group
        groups = [buf.capacity // g for buf in self.buffers]
        firsts = [sum(groups[:i]) for i in range(len(groups))]
        tables = [list(range(f, f + n)) for f, n in zip(firsts, groups)]
        stores = [i for i, n in enumerate(groups) for _ in range(n)]
        starts = [j * g for n in groups for j in range(n)]
        self.keys = KeyMap.build(tables, *(torch.tensor(m, dtype=torch.int32, device=cache.device)
                                           for m in (stores, starts)), g, past, n_new, cache.device, (stores, starts))
        self.upto = cache.state.upto_tensor(seq_ids)
        self.fused_where = self.cache.state.fused_where(self.keys, self.upto)  # every layer's, in one call
        self.window = cache.windows.step(seq_ids, past, n_new) if cache.windows else None

    def attend(self, layer, q, k, v, spec=None):
        if (at := self.store_layer(layer)) is None:
            return self.window.attend(layer, q, k, v, spec)
        c, layer = self.cache, at  # from here on, the layer as the cache's stores number it
        stores = [[buf.layers[t][layer] for buf in self.buffers] for t in range(4)]
        ops = kernels.for_activations(q)
        if ops is not None and (spec is None or spec.is_plain):
            return c.state.attend_compiled(ops, q, k, v, stores, self.seq_ids, layer, self.keys, self.upto)
        held = []
        for b, seq_id in enumerate(self.seq_ids):
            own = [[s[b]] for s in stores]  # this sequence's reservation: store 0, groups at slot j * group

            def locate(p, g=c.group):
                return 0, p // g * g

            c.state.write(layer, own, seq_id, locate, self.past[b], k[b, :, : self.n_new[b]], v[b, :, : self.n_new[b]])
            held.append(c.state.read(layer, own, seq_id, locate, self.kv_len[b]))
        dequantized = KeyMap.one_store_each(self.kv_len, self.past, self.n_new, c.device)
        return attend(q, [k for k, _ in held], [v for _, v in held], dequantized, spec)

    def fused_kv(self, layer):
        if (at := self.store_layer(layer)) is None:
            return None
        stores = [[buf.layers[t][at] for buf in self.buffers] for t in range(4)]
        return self.cache.state.fused_kv(stores, self.seq_ids, at, self.fused_where)


class ContiguousQuantCache(ContiguousCache):
    """codec: quant.INT8 or quant.INT4 (named contiguous-int8, contiguous-int4); residual, sink as PagedQuantCache."""

    def __init__(self, *args, codec: quant.KVCodec = quant.INT8, group: int = CONTIGUOUS_GROUP,
                 residual: int | None = None, sink: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.codec, self.group = codec, group
        self.name = f"contiguous-{codec.name}"
        self.bytes_per_element = codec.bits / 8
        self.quantization_group = group
        residual = RESIDUAL[codec.name] if residual is None else residual
        sink = SINK[codec.name] if sink is None else sink
        self.state = QuantState(codec, group, residual, sink, self.store_config, self.dtype, self.device)

    def prepare(self, seq_id, token_ids, reserve_tokens: int | None = None):
        capacity = min(reserve_tokens or self.max_context, self.max_context)
        capacity = -(-capacity // self.group) * self.group
        if len(token_ids) > capacity:
            raise KVCacheFull(f"{len(token_ids)} tokens do not fit a reservation of {capacity}")
        held = self.reservations.get(seq_id)
        if self.prefix_reuse and held is not None and held.capacity >= len(token_ids):
            keep = self.reusable(seq_id, held.tokens, token_ids)
            self.truncate(seq_id, keep)
            return keep
        self.release(seq_id)
        c = self.store_config
        tensors = self.codec.storage(c.num_layers, c.num_kv_heads, capacity // self.group, self.group, c.head_dim,
                                     self.device, huge_pages=False)
        self.reservations[seq_id] = QuantReservation(tensors)
        self.state.start(seq_id, upto=0)
        self._start_window(seq_id)
        return 0

    def _make_view(self, seq_ids, past, n_new):
        return ContiguousQuantView(self, seq_ids, past, n_new)

    def commit_step(self, view):
        for seq_id, end in zip(view.seq_ids, view.kv_len):
            self.state.commit(seq_id, end)
        super().commit_step(view)

    def truncate(self, seq_id, keep):
        self.check_truncate(seq_id, keep)
        buf = self.reservations.get(seq_id)
        if buf is None:
            return
        g = self.group

        def block_of(layer, p):
            return self.state.block([[t[layer]] for t in buf.layers], 0, p // g * g)

        self.state.truncate(seq_id, keep, block_of)
        buf.length = keep
        del buf.tokens[keep:]
        if self.windows:
            self.windows.truncate(seq_id, keep)

    def release(self, seq_id):
        self.state.release(seq_id)
        super().release(seq_id)

    def fork(self, src: int, dst: int) -> None:
        buf = self.reservations[src]
        self.release(dst)
        self.reservations[dst] = QuantReservation([t.clone() for t in buf.tensors], buf.length, list(buf.tokens))
        self.state.fork(src, dst)
        if self.windows:
            self.windows.fork(src, dst)

    # ---- figures
    def store_bytes_per_token(self) -> float:
        return bytes_per_token(self.store_config, self.codec.name, self.group)

    def stats(self, seq_id=None):
        windows = self.state.window_bytes()
        reserved = sum(r.nbytes for r in self.reservations.values()) + windows + self.window_bytes()
        formula = self.theoretical_bytes_of(r.length for r in self.reservations.values())
        return KVStats(self.name, tokens=self.tokens_held(seq_id), bytes_allocated=reserved,
                       bytes_used=formula + windows, bytes_theoretical=formula,
                       bytes_per_element=self.bytes_per_element, bytes_window=windows, precision=self.codec.name)
