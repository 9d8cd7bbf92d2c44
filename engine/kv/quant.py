"""Symmetric int8 quantization for the KV cache.

Keys have a few outlier channels, so each key channel gets its own scale within a group of tokens (a block).
Values are quantized per token. Scales are float16: one per (head, group, channel) for keys, one per
(head, token) for values.
"""

from __future__ import annotations

import torch

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
