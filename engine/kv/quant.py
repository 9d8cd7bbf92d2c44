"""Quantization for the KV cache: symmetric int8, asymmetric int4 (KIVI-style), as codecs.

Keys have a few outlier channels, so each key channel gets its own scale within a group of tokens (a block).
Values are quantized per token. int8's scales are float16: one per (head, group, channel) for keys, one per
(head, token) for values; int4's key scales and minimums are two-level (8 bits a channel under float16 supers).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine import hugepages

SCALE_DTYPE = torch.float16
_MIN_SCALE = 1e-5


def _scale(absmax: torch.Tensor) -> torch.Tensor:
    return (absmax.float() / 127.0).clamp_min(_MIN_SCALE)


def quantize_keys(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k: [H, G, T, D] (G groups of T tokens) -> int8 [H, G, T, D], scales [H, G, D]."""
    scale = _scale(k.abs().amax(dim=2)).to(SCALE_DTYPE)
    q = torch.round(k.float() / scale.float()[:, :, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_keys(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """int8 [H, G, T, D], scales [H, G, D] -> [H, G * T, D], in one pass (into `out` when given)."""
    h, g, t, d = q.shape
    out = torch.empty(h, g * t, d, dtype=dtype, device=q.device) if out is None else out
    torch.mul(q, scale.to(dtype)[:, :, None], out=out.view(h, g, t, d))
    return out


def quantize_values(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """v: [H, N, D] -> int8 [H, N, D], scales [H, N]."""
    scale = _scale(v.abs().amax(dim=-1)).to(SCALE_DTYPE)
    q = torch.round(v.float() / scale.float()[..., None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_values(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """int8 [H, N, D], scales [H, N] -> [H, N, D], in one pass (into `out` when given)."""
    out = torch.empty(q.shape, dtype=dtype, device=q.device) if out is None else out
    return torch.mul(q, scale.to(dtype)[..., None], out=out)


# ---- int4 (asymmetric, two codes a byte: byte j holds channel j low and channel j + D/2 high), KIVI's layout:
# keys a scale and minimum per channel over a group of tokens, values per token. x = code * scale + min.
# The keys' scales and minimums are two-level, as llama.cpp's K-quants keep theirs: per channel an 8-bit scale
# (1..255) and an 8-bit minimum (-127..127) under two float16 super scales per group and head, 2 + 4 / D bytes a
# channel instead of 4. The minimum is rounded down and the scale up, so every value of the group stays in the
# 16 codes of its channel: the rounding of the parameters costs range, not clipping.
MIN_SUPER = 2.0**-24  # the smallest float16 (subnormal): a super scale is never 0


def _asymmetric(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x -> codes 0..15 (uint8, unpacked), float16 scales and minimums reduced over `dim` (kept as size 1)."""
    minimum = x.float().amin(dim=dim, keepdim=True).to(SCALE_DTYPE)
    top = x.float().amax(dim=dim, keepdim=True)
    scale = ((top - minimum.float()) / 15.0).clamp_min(_MIN_SCALE).to(SCALE_DTYPE)
    codes = torch.round((x.float() - minimum.float()) / scale.float()).clamp_(0, 15).to(torch.uint8)
    return codes, scale, minimum


def _half_up(x: torch.Tensor) -> torch.Tensor:
    """The float16 value nearest x that is >= x (x >= 0), as float32."""
    h = x.to(torch.float16)
    up = (h.view(torch.int16) + 1).view(torch.float16)
    return torch.where(h.float() < x, up, h).float().clamp_min(MIN_SUPER)


def two_level_params(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                   torch.Tensor]:
    """Per-channel minimums lo and maxima hi [..., D] (float32) -> 8-bit scales (1..255) and minimums (-127..127)
    [..., D] and their float16 super scales [..., 1] (as float32): scale = s_super * code, min = m_super * code."""
    m_super = _half_up(lo.abs().amax(-1, keepdim=True) / 127.0)
    m_codes = torch.floor(lo / m_super).clamp_(-127, 127)
    need = (hi - m_codes * m_super) / 15.0
    s_super = _half_up(need.amax(-1, keepdim=True).clamp_min(_MIN_SCALE) / 255.0)
    s_codes = torch.ceil(need / s_super).clamp_(1, 255)
    return s_codes, m_codes, s_super, m_super


def pack4(codes: torch.Tensor) -> torch.Tensor:
    """[..., D] codes 0..15 -> [..., D/2] bytes (channel j low, channel j + D/2 high)."""
    half = codes.shape[-1] // 2
    return codes[..., :half] | (codes[..., half:] << 4)


def unpack4(packed: torch.Tensor) -> torch.Tensor:
    """[..., D/2] bytes -> [..., D] codes 0..15."""
    return torch.cat([packed & 0x0F, packed >> 4], dim=-1)


def key_params_bytes(head_dim: int) -> int:
    """Bytes of one group's int4 key parameters per head: D 8-bit scales, D 8-bit minimums, two float16 supers."""
    return 2 * head_dim + 4


def _pack_key_params(s_codes, m_codes, s_super, m_super) -> torch.Tensor:
    """[..., D] codes and [..., 1] supers -> uint8 [..., 2D + 4]: scales, minimums (int8), the supers (float16)."""
    supers = torch.cat([s_super, m_super], dim=-1).to(SCALE_DTYPE).view(torch.uint8)
    return torch.cat([s_codes.to(torch.uint8), m_codes.to(torch.int8).view(torch.uint8), supers], dim=-1)


def key_scales_int4(params: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 [..., 2D + 4] -> the per-channel scales and minimums [..., D] as float32."""
    d = (params.shape[-1] - 4) // 2
    supers = params[..., 2 * d:].contiguous().view(SCALE_DTYPE).float()  # [..., 2]
    scale = params[..., :d].float() * supers[..., 0:1]
    minimum = params[..., d:2 * d].view(torch.int8).float() * supers[..., 1:2]
    return scale, minimum


def quantize_keys_int4(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k: [H, G, T, D] -> packed codes [H, G, T, D/2], params uint8 [H, G, 2D + 4] (two-level, see above)."""
    x = k.float()
    s_codes, m_codes, s_super, m_super = two_level_params(x.amin(dim=2), x.amax(dim=2))
    scale, minimum = s_codes * s_super, m_codes * m_super  # [H, G, D]
    codes = torch.round((x - minimum[:, :, None]) / scale[:, :, None]).clamp_(0, 15).to(torch.uint8)
    return pack4(codes), _pack_key_params(s_codes, m_codes, s_super, m_super)


def dequantize_keys_int4(q: torch.Tensor, params: torch.Tensor, dtype: torch.dtype,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """packed [H, G, T, D/2], params uint8 [H, G, 2D + 4] -> [H, G * T, D]."""
    h, g, t, _ = q.shape
    scale, minimum = key_scales_int4(params)
    x = unpack4(q).to(dtype) * scale[:, :, None].to(dtype) + minimum[:, :, None].to(dtype)
    x = x.view(h, g * t, -1)
    if out is None:
        return x
    out.copy_(x)
    return out


def quantize_values_int4(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """v: [H, N, D] -> packed codes [H, N, D/2], params [H, N, 2] (scale, minimum per token)."""
    codes, scale, minimum = _asymmetric(v, dim=-1)
    return pack4(codes), torch.cat([scale, minimum], dim=-1)


def dequantize_values_int4(q: torch.Tensor, params: torch.Tensor, dtype: torch.dtype,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """packed [H, N, D/2], params [H, N, 2] -> [H, N, D]."""
    x = unpack4(q).to(dtype) * params[..., 0:1].to(dtype) + params[..., 1:2].to(dtype)
    if out is None:
        return x
    out.copy_(x)
    return out


# ---- tiles: where the compiled kernels read codes in tiles of 16 tokens (engine.kernels.kv_tiled), a block's
# rows [..., T, W] (T a multiple of 16) are stored so: keys [T / 16, W / 4, 16, 4] (a dword of 16 tokens together),
# values [T / 4, W, 4] (a byte of four tokens together)
TILE = 16


def to_tiles(codes: torch.Tensor, keys: bool) -> torch.Tensor:
    """Rows of codes [..., T, W] -> the same bytes in the tiled layout, shaped [..., T, W]."""
    *lead, t, w = codes.shape
    if keys:
        tiled = codes.reshape(*lead, t // TILE, TILE, w // 4, 4).transpose(-3, -2)
    else:
        tiled = codes.reshape(*lead, t // 4, 4, w).transpose(-2, -1)
    return tiled.reshape(*lead, t, w)


def from_tiles(tiled: torch.Tensor, keys: bool) -> torch.Tensor:
    """to_tiles' inverse: tiled codes [..., T, W] -> rows [..., T, W]."""
    *lead, t, w = tiled.shape
    if keys:
        rows = tiled.reshape(*lead, t // TILE, w // 4, TILE, 4).transpose(-3, -2)
    else:
        rows = tiled.reshape(*lead, t // 4, w, 4).transpose(-2, -1)
    return rows.reshape(*lead, t, w)


@dataclass(frozen=True)
class KVCodec:
    """A quantized KV precision: its codes, scales and the functions between them and floats."""

    name: str
    bits: int
    quantize_keys: Callable  # [H, G, T, D] -> codes [H, G, T, W], params [H, G, ...]
    dequantize_keys: Callable
    quantize_values: Callable  # [H, N, D] -> codes [H, N, W], params [H, N, ...]
    dequantize_values: Callable

    def storage(self, layers: int, heads: int, blocks: int, block_size: int, head_dim: int,
                device: torch.device | str, huge_pages: bool = True) -> list[torch.Tensor]:
        """Zeroed key codes, value codes [L, H, slots, W]; key params [L, H, blocks, D] (int8: float16 scales; int4:
        uint8, 2D + 4 bytes); value params [L, H, slots, (2)]. huge_pages: on huge pages where offered (a paged
        pool's chunk, filled as it is used; not a contiguous reservation, which they would make resident whole)."""
        slots = blocks * block_size
        if self.bits == 8:
            codes = (layers, heads, slots, head_dim)
            shapes = [codes, codes, (layers, heads, blocks, head_dim), (layers, heads, slots)]
            dtypes = [torch.int8, torch.int8, SCALE_DTYPE, SCALE_DTYPE]
        else:
            codes = (layers, heads, slots, head_dim // 2)
            shapes = [codes, codes, (layers, heads, blocks, key_params_bytes(head_dim)), (layers, heads, slots, 2)]
            dtypes = [torch.uint8, torch.uint8, torch.uint8, SCALE_DTYPE]
        zeros = hugepages.zeros if huge_pages else lambda s, d, device: torch.zeros(s, dtype=d, device=device)
        return [zeros(s, d, device) for s, d in zip(shapes, dtypes)]


INT8 = KVCodec("int8", 8, quantize_keys, dequantize_keys, quantize_values, dequantize_values)
INT4 = KVCodec("int4", 4, quantize_keys_int4, dequantize_keys_int4, quantize_values_int4, dequantize_values_int4)
CODECS = {"int8": INT8, "int4": INT4}
