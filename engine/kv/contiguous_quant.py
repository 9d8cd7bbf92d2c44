"""The contiguous layout over quantized keys and values: 'contiguous-int8' and 'contiguous-int4'.

Each sequence reserves codes and scales for the whole context when it starts, as 'contiguous' reserves floats.
The reservation is quantized in groups of `group` tokens (precision.CONTIGUOUS_GROUP), the way a paged pool
quantizes its blocks: keys per channel over a group, values per token; the group being filled stays in a
full-precision window. A group is read like a paged block of that size, by the same attention routine, so a
contiguous int4 cache gives the same bits as a paged int4 pool whose blocks are as large as the group.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine import kernels
from engine.kv import quant
from engine.kv.attention import KeyMap, attend
from engine.kv.base import KVCacheFull, KVStats, StepView
from engine.kv.contiguous import ContiguousCache
from engine.kv.paged import common_prefix_length
from engine.kv.paged_quant import attend_quantized
from engine.kv.precision import CONTIGUOUS_GROUP, bytes_per_token


@dataclass
class QuantReservation:
    tensors: list[torch.Tensor]  # quant.KVCodec.storage: key codes, value codes, key scales, value scales
    window: torch.Tensor  # [2 (K, V), L, Hkv, group, D] full precision: the group being filled
    group: int
    length: int = 0
    tokens: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.layers = [t.unbind(0) for t in self.tensors]  # per tensor, per layer views

    @property
    def capacity(self) -> int:
        return self.tensors[0].shape[2]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors) + self.window.nbytes


class ContiguousQuantView(StepView):
    def __init__(self, cache: ContiguousQuantCache, seq_ids, past, n_new):
        super().__init__(seq_ids, past, n_new, cache.device)
        self.cache = cache
        self.buffers = [cache.reservations[s] for s in seq_ids]
        g = cache.group
        groups = [buf.capacity // g for buf in self.buffers]
        firsts = [sum(groups[:i]) for i in range(len(groups))]
        tables = [list(range(f, f + n)) for f, n in zip(firsts, groups)]
        stores = torch.tensor([i for i, n in enumerate(groups) for _ in range(n)], dtype=torch.int32)
        starts = torch.tensor([j * g for n in groups for j in range(n)], dtype=torch.int32)
        self.keys = KeyMap.build(tables, stores.to(cache.device), starts.to(cache.device), g, past, n_new,
                                 cache.device)

    def attend(self, layer, q, k, v, spec=None):
        c = self.cache
        ops = kernels.for_activations(q)
        if ops is None or not (spec is None or spec.is_plain):
            held = []
            for i, buf in enumerate(self.buffers):
                c.store(layer, buf, self.past[i], k[i, :, : self.n_new[i]], v[i, :, : self.n_new[i]])
                held.append(c.read_keys_values(layer, buf, self.kv_len[i]))
            keys = KeyMap.one_store_each(self.kv_len, self.past, self.n_new, c.device)
            return attend(q, [k for k, _ in held], [v for _, v in held], keys, spec)
        stores = [[buf.layers[t][layer] for buf in self.buffers] for t in range(4)]
        windows = [buf.window[:, layer] for buf in self.buffers]
        return attend_quantized(ops, q, k, v, stores, windows, self.keys, c.group, c.codec.bits)


class ContiguousQuantCache(ContiguousCache):
    """codec: quant.INT8 or quant.INT4 (named contiguous-int8, contiguous-int4)."""

    def __init__(self, *args, codec: quant.KVCodec = quant.INT8, group: int = CONTIGUOUS_GROUP, **kwargs):
        super().__init__(*args, **kwargs)
        self.codec, self.group = codec, group
        self.name = f"contiguous-{codec.name}"
        self.bytes_per_element = codec.bits / 8
        self.quantization_group = group

    def prepare(self, seq_id, token_ids, reserve_tokens: int | None = None):
        capacity = min(reserve_tokens or self.max_context, self.max_context)
        capacity = -(-capacity // self.group) * self.group
        if len(token_ids) > capacity:
            raise KVCacheFull(f"{len(token_ids)} tokens do not fit a reservation of {capacity}")
        held = self.reservations.get(seq_id)
        if self.prefix_reuse and held is not None and held.capacity >= len(token_ids):
            keep = min(common_prefix_length(held.tokens, token_ids), len(token_ids) - 1)
            self.truncate(seq_id, keep)
            return keep
        self.release(seq_id)
        c = self.config
        tensors = self.codec.storage(c.num_layers, c.num_kv_heads, capacity // self.group, self.group, c.head_dim,
                                     self.device)
        window = torch.zeros(2, c.num_layers, c.num_kv_heads, self.group, c.head_dim, dtype=self.dtype,
                             device=self.device)
        self.reservations[seq_id] = QuantReservation(tensors, window, self.group)
        return 0

    def begin_step(self, seq_ids, new_tokens):
        past = [self.reservations[s].length for s in seq_ids]
        n_new = [len(t) for t in new_tokens]
        for s, p, n in zip(seq_ids, past, n_new):
            if p + n > self.reservations[s].capacity:
                raise KVCacheFull(f"sequence {s} reserved {self.reservations[s].capacity} tokens, needs {p + n}")
        view = ContiguousQuantView(self, seq_ids, past, n_new)
        view.new_tokens = new_tokens
        return view

    # ---- the pure PyTorch path: quantize full groups, read a sequence back in full precision
    def store(self, layer: int, buf: QuantReservation, past: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [Hkv, N, D] new tokens at positions past..past+N-1; the groups they fill are quantized."""
        g, held = self.group, past % self.group
        window = buf.window[:, layer]
        keys = torch.cat([window[0, :, :held], k], dim=1)  # [Hkv, held + N, D]
        values = torch.cat([window[1, :, :held], v], dim=1)
        h, n, d = keys.shape
        full, first = n // g, past // g
        if full:
            k_codes, v_codes, k_params, v_params = (t[layer] for t in buf.layers)
            k_q, k_s = self.codec.quantize_keys(keys[:, : full * g].reshape(h, full, g, d))
            v_q, v_s = self.codec.quantize_values(values[:, : full * g])
            k_codes[:, first * g:(first + full) * g] = k_q.reshape(h, full * g, -1)
            k_params[:, first:first + full] = k_s
            v_codes[:, first * g:(first + full) * g] = v_q
            v_params[:, first * g:(first + full) * g] = v_s
        window[0, :, : n - full * g] = keys[:, full * g:]
        window[1, :, : n - full * g] = values[:, full * g:]

    def read_keys_values(self, layer: int, buf: QuantReservation, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """-> keys, values [Hkv, length, D] of the sequence in position order, dequantized."""
        full = length // self.group
        keys, values = self.dequantize_groups(layer, buf, 0, full)
        window = buf.window[:, layer, :, : length - full * self.group]
        return torch.cat([keys, window[0]], dim=1), torch.cat([values, window[1]], dim=1)

    def dequantize_groups(self, layer: int, buf: QuantReservation, first: int, end: int):
        """Groups first..end-1 in full precision: keys, values [Hkv, (end - first) * group, D]."""
        g = self.group
        k_codes, v_codes, k_params, v_params = (t[layer] for t in buf.layers)
        slots = slice(first * g, end * g)
        keys = self.codec.dequantize_keys(k_codes[:, slots].reshape(k_codes.shape[0], end - first, g, -1),
                                          k_params[:, first:end], self.dtype)
        return keys, self.codec.dequantize_values(v_codes[:, slots], v_params[:, slots], self.dtype)

    # ---- keeping the window consistent
    def truncate(self, seq_id, keep):
        self.check_truncate(seq_id, keep)
        buf = self.reservations.get(seq_id)
        if buf is None:
            return
        g, rest = self.group, keep % self.group
        if rest and keep // g < buf.length // g:  # back into a group that was full: it returns to the window
            for layer in range(self.config.num_layers):
                k, v = self.dequantize_groups(layer, buf, keep // g, keep // g + 1)
                buf.window[0, layer, :, :rest] = k[:, :rest]
                buf.window[1, layer, :, :rest] = v[:, :rest]
        buf.length = keep
        del buf.tokens[keep:]

    def fork(self, src: int, dst: int) -> None:
        buf = self.reservations[src]
        self.release(dst)
        copy = QuantReservation([t.clone() for t in buf.tensors], buf.window.clone(), buf.group, buf.length,
                                list(buf.tokens))
        self.reservations[dst] = copy

    # ---- figures
    def theoretical_bytes(self, tokens: int) -> int:
        return int(bytes_per_token(self.config, self.codec.name, self.group) * tokens)

    def stats(self, seq_id=None):
        reserved = sum(r.nbytes for r in self.reservations.values())
        windows = sum(r.window.nbytes for r in self.reservations.values())
        live = sum(r.length for r in self.reservations.values())
        formula = self.theoretical_bytes(live)
        return KVStats(self.name, tokens=self.tokens_held(seq_id), bytes_allocated=reserved,
                       bytes_used=formula + windows, bytes_theoretical=formula,
                       bytes_per_element=self.bytes_per_element, bytes_window=windows, precision=self.codec.name)
