"""What the quantized caches share (paged_quant.py, contiguous_quant.py): per sequence a full-precision window
and the boundary below which its blocks hold codes; the compiled path's two calls; the pure PyTorch path.

A sequence's newest tokens stay in full precision in its window, a ring of residual + block_size rows (position
p in row p % rows). A block is quantized once the sequence holds `residual` more tokens after it (KIVI's
full-precision residual: the tokens a query attends to most are the recent ones; 0 quantizes a block when it
fills), and only from the sequence's boundary `upto` on: blocks below it hold their codes already, perhaps
shared with other sequences through the prefix cache. Positions [0, full) are read from codes, with
full = max(upto, floor((kv_len - residual) / block_size) * block_size); the window holds [full, kv_len).

The first `sink` positions are kept in full precision too, in rows of their own before the ring, and read from
there: the first tokens draw much of every query's attention (an attention sink, as StreamingLLM calls them),
and measured on real text keeping 32 of them halves int4's KL divergence (README, KV precision). A sequence that
shares its first blocks from the prefix cache takes their sink rows from `SinkCache`, kept by chain hash.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine import kernels
from engine.config import ConfigError
from engine.kv import quant
from engine.kv.attention import KeyMap

RESIDUAL = {"int8": 0, "int4": 128}  # tokens kept in full precision after the last quantized block
SINK = {"int8": 0, "int4": 32}  # the first tokens, kept in full precision
# the window's and the sink's rows: int4's 160 in float16, as KIVI keeps its residual (half the bytes a step reads);
# int8's part block in the activations' dtype (exact until the block fills)
WINDOW_DTYPE = {"int8": None, "int4": torch.float16}


@dataclass
class Held:
    window: torch.Tensor  # [2 (K, V), L, Hkv, sink + residual + block_size, D]: the sink's rows, then the ring
    upto: int = 0  # positions below it are held as codes
    layers: list[tuple[torch.Tensor, torch.Tensor]] = field(init=False)  # views of the window: (K, V) per layer

    def __post_init__(self):
        self.layers = list(zip(self.window[0].unbind(0), self.window[1].unbind(0)))  # [Hkv, rows, D] each


class QuantState:
    def __init__(self, codec: quant.KVCodec, block_size: int, residual: int, sink: int, config,
                 dtype: torch.dtype, device: torch.device):
        if residual < 0 or residual % block_size:
            raise ConfigError(f"the full-precision residual of {residual} tokens must be a multiple of the block "
                              f"({block_size} tokens)")
        if sink < 0:
            raise ConfigError(f"the attention sink must be a number of tokens >= 0, got {sink}")
        self.codec, self.block_size, self.residual, self.sink = codec, block_size, residual, sink
        self.rows = residual + block_size  # the ring's
        self.shape = (2, config.num_layers, config.num_kv_heads, sink + self.rows, config.head_dim)
        self.dtype, self.device = dtype, device
        self.window_dtype = WINDOW_DTYPE[codec.name] or dtype
        self.tiled = kernels.kv_tiled(codec.bits, config.head_dim, block_size, device)  # the codes' layout
        self.seqs: dict[int, Held] = {}

    # ---- per sequence
    def start(self, seq_id: int, upto: int) -> None:
        """A sequence that holds `upto` tokens as codes (shared from the prefix cache) and nothing else."""
        held = self.seqs.get(seq_id)
        if held is None:
            held = self.seqs[seq_id] = Held(torch.zeros(self.shape, dtype=self.window_dtype, device=self.device))
        held.upto = upto

    def release(self, seq_id: int) -> None:
        self.seqs.pop(seq_id, None)

    def fork(self, src: int, dst: int) -> None:
        self.seqs[dst] = Held(self.seqs[src].window.clone(), self.seqs[src].upto)

    def quantized_end(self, seq_id: int, kv_len: int) -> int:
        bs, upto = self.block_size, self.seqs[seq_id].upto
        return max(upto, (kv_len - self.residual) // bs * bs if kv_len >= self.residual else 0)

    def commit(self, seq_id: int, kv_len: int) -> None:
        """The step that brought the sequence to kv_len ran: the blocks it moved out of the window are codes."""
        self.seqs[seq_id].upto = self.quantized_end(seq_id, kv_len)

    def truncate(self, seq_id: int, keep: int, block_of) -> None:
        """Keep `keep` tokens: a kept part of a block that held codes goes back to the window (block_of(layer,
        position) -> the codes' keys and values [Hkv, block_size, D] of the block holding that position)."""
        held, bs = self.seqs[seq_id], self.block_size
        if keep >= held.upto:
            return
        first = keep // bs * bs
        for layer in range(self.shape[1]) if keep > first else ():
            k, v = block_of(layer, first)
            rows = self.ring_rows(first, keep)
            held.window[0, layer].index_copy_(1, rows, k[:, : keep - first].to(self.window_dtype))
            held.window[1, layer].index_copy_(1, rows, v[:, : keep - first].to(self.window_dtype))
        held.upto = first

    def upto_tensor(self, seq_ids: list[int]) -> torch.Tensor:
        return torch.tensor([self.seqs[s].upto for s in seq_ids], dtype=torch.int32, device=self.device)

    def window_bytes(self) -> int:
        return sum(h.window.nbytes for h in self.seqs.values())

    # ---- the compiled path
    def attend_compiled(self, ops, q, k, v, stores: list[list[torch.Tensor]], seq_ids: list[int], layer: int,
                        keys: KeyMap, upto: torch.Tensor) -> torch.Tensor:
        """Write the step's keys and values (as StepView.attend takes them), quantizing the blocks that leave
        the windows, then attend over codes and windows. stores: per storage tensor (key codes, value codes,
        key scales, value scales) the [Hkv, ...] store of each store index of `keys`; upto: int32 [B]."""
        k_windows, v_windows = self.windows(seq_ids, layer)
        where = (keys.table, keys.block_store, keys.block_start, self.block_size, keys.q_pos, upto, self.residual)
        ops.write_kv_quant(*stores, k_windows, v_windows, k.contiguous(), v.contiguous(), *where, self.sink,
                           self.codec.bits)
        return ops.attention_quant(q.contiguous(), *stores, k_windows, v_windows, *where, self.sink, self.codec.bits)

    def windows(self, seq_ids: list[int], layer: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each sequence's full-precision rows at one layer: keys, values [Hkv, rows, D] per sequence."""
        windows = [self.seqs[s].layers[layer] for s in seq_ids]
        return [k for k, _ in windows], [v for _, v in windows]

    def fused_kv(self, stores: list[list[torch.Tensor]], seq_ids: list[int], layer: int,
                 where: list[torch.Tensor]):
        """attend_compiled's arguments as the one-call layer takes them (engine.kv.base.FusedKV); where: the step's
        fused_where (the same list for every layer)."""
        k_windows, v_windows = self.windows(seq_ids, layer)
        return ([*stores[0], *stores[1], *stores[2], *stores[3], *k_windows, *v_windows],
                [*map(len, stores), len(k_windows), len(v_windows)], where, self.fused_ints())

    def fused_ints(self) -> list[int]:
        return [self.block_size, self.residual, self.sink, self.codec.bits]

    @staticmethod
    def fused_where(keys: KeyMap, upto: torch.Tensor) -> list[torch.Tensor]:
        return [keys.table, keys.block_store, keys.block_start, keys.q_pos, upto]

    # ---- the pure PyTorch path (the same codes, in tensors)
    def write(self, layer: int, stores: list[list[torch.Tensor]], seq_id: int, locate, past: int,
              k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [Hkv, N, D] at positions past..past+N-1 into the window, quantizing each block that leaves it;
        locate(position) -> (store, slot) of the position's block's first token."""
        held, bs, window = self.seqs[seq_id], self.block_size, self.seqs[seq_id].window[:, layer]
        n, start = k.shape[1], past
        sunk = max(0, min(self.sink, past + n) - past)  # new tokens below the sink: its rows as well
        window[0, :, past:past + sunk] = k[:, :sunk].to(self.window_dtype)
        window[1, :, past:past + sunk] = v[:, :sunk].to(self.window_dtype)
        for p in range(past, past + n):
            first = p + 1 - self.residual - bs
            leaves = first >= 0 and (p + 1 - self.residual) % bs == 0 and first >= held.upto
            if not leaves and p < past + n - 1:
                continue
            rows = self.ring_rows(start, p + 1)
            window[0].index_copy_(1, rows, k[:, start - past:p + 1 - past].to(self.window_dtype))
            window[1].index_copy_(1, rows, v[:, start - past:p + 1 - past].to(self.window_dtype))
            start = p + 1
            if leaves:
                self._quantize_block(layer, stores, window, first, *locate(first))

    def _quantize_block(self, layer, stores, window, first: int, store: int, slot: int) -> None:
        bs = self.block_size
        rows = self.ring_rows(first, first + bs)
        keys, values = window[0].index_select(1, rows), window[1].index_select(1, rows)  # [Hkv, bs, D]
        k_q, k_s = self.codec.quantize_keys(keys[:, None])  # [Hkv, 1, bs, W], [Hkv, 1, ...]
        v_q, v_s = self.codec.quantize_values(values)
        k_codes, v_codes, k_params, v_params = (s[store] for s in stores)
        k_codes[:, slot:slot + bs] = quant.to_tiles(k_q[:, 0], keys=True) if self.tiled else k_q[:, 0]
        k_params[:, slot // bs] = k_s[:, 0]
        v_codes[:, slot:slot + bs] = quant.to_tiles(v_q, keys=False) if self.tiled else v_q
        v_params[:, slot:slot + bs] = v_s

    def read(self, layer: int, stores: list[list[torch.Tensor]], seq_id: int, locate,
             kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """-> keys, values [Hkv, kv_len, D] of the sequence in position order (codes dequantized)."""
        bs, full = self.block_size, self.quantized_end(seq_id, kv_len)
        sunk, window = min(self.sink, kv_len), self.seqs[seq_id].window[:, layer].to(self.dtype)
        parts = [(window[0, :, :sunk], window[1, :, :sunk])]
        coded = [self.block(stores, *locate(p)) for p in range(sunk // bs * bs, full, bs)]
        if coded:  # from the sink's end to full
            skip = sunk - sunk // bs * bs
            parts.append((torch.cat([k for k, _ in coded], dim=1)[:, skip:],
                          torch.cat([v for _, v in coded], dim=1)[:, skip:]))
        rows = self.ring_rows(max(sunk, full), kv_len)
        parts.append((window[0].index_select(1, rows), window[1].index_select(1, rows)))
        return torch.cat([k for k, _ in parts], dim=1), torch.cat([v for _, v in parts], dim=1)

    def ring_rows(self, start: int, end: int) -> torch.Tensor:
        """The window rows of positions start..end-1 (the ring follows the sink's rows)."""
        return self.sink + torch.arange(start, end, device=self.device) % self.rows

    def block(self, stores: list[list[torch.Tensor]], store: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One block's codes in full precision: keys, values [Hkv, block_size, D]."""
        bs = self.block_size
        k_codes, v_codes, k_params, v_params = (s[store] for s in stores)
        codes, v_rows = k_codes[:, slot:slot + bs], v_codes[:, slot:slot + bs]
        if self.tiled:
            codes, v_rows = quant.from_tiles(codes, keys=True), quant.from_tiles(v_rows, keys=False)
        keys = self.codec.dequantize_keys(codes[:, None], k_params[:, slot // bs:slot // bs + 1], self.dtype)
        return keys, self.codec.dequantize_values(v_rows, v_params[:, slot:slot + bs], self.dtype)


def locator(keys: KeyMap, b: int):
    """position -> (store, slot of its block's first token) for sequence b of a step's KeyMap."""
    table, stores, starts = keys.table[b].tolist(), keys.block_store.tolist(), keys.block_start.tolist()
    bs = keys.block_size
    return lambda p: (stores[table[p // bs]], starts[table[p // bs]])
