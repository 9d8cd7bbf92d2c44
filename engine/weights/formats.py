"""Weight formats: how a projection's weights are stored, what a parameter costs, and which format `auto` picks.

A quantized weight travels between the loader, the disk cache and the model as a `QuantizedWeight`: the
integer codes, one scale per group (and, for int4, one additive minimum per group). Dequantized:
int8: w = code * scale; int4: w = code * scale + minimum (codes 0..15, GGUF's Q4_1 convention).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import WEIGHT_FORMATS

INT4_GROUP_SIZES = (32, 64)


class WeightFormatError(ValueError):
    """A weight tensor or a format request that kvscope cannot use."""


@dataclass(frozen=True)
class QuantizedWeight:
    """A [N, K] weight in int8 (codes int8 [N, K]) or int4 (codes uint8 [N, K/2], two codes a byte).

    scales: [N, G] float16, G = K / group_size (int8 per output channel: G = 1). minimums: [N, G] float16 for
    int4, None for int8. A GGUF K-quant's scales and minimums travel as float32 (its exact products) from the file
    to the projection module, which keeps them as float16 (`with_float16_scales`). In int4 each group of g codes
    packs byte j = code j (low nibble) | code j + g/2 (high), which is the byte order of GGUF's Q4_0 / Q4_1 blocks
    for g = 32.
    """

    bits: int
    codes: torch.Tensor
    scales: torch.Tensor
    minimums: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        n, width = self.codes.shape
        return n, width * (8 // self.bits)

    @property
    def group_size(self) -> int:
        return self.shape[1] // self.scales.shape[1]

    @property
    def nbytes(self) -> int:
        extra = self.minimums.nbytes if self.minimums is not None else 0
        return self.codes.nbytes + self.scales.nbytes + extra

    def with_float16_scales(self) -> QuantizedWeight:
        """The same codes with scales and minimums rounded to float16 once (what the modules and kernels keep)."""
        if self.scales.dtype == torch.float16 and (self.minimums is None or self.minimums.dtype == torch.float16):
            return self
        mins = self.minimums.half() if self.minimums is not None else None
        return QuantizedWeight(self.bits, self.codes, self.scales.half(), mins)

    def unpacked_codes(self) -> torch.Tensor:
        """-> [N, K] codes as uint8 (int4) or int8 (int8)."""
        if self.bits == 8:
            return self.codes
        n, k = self.shape
        g = self.group_size
        packed = self.codes.view(n, k // g, g // 2)
        return torch.cat([packed & 15, packed >> 4], dim=-1).view(n, k)

    def dequantize(self, dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
        """-> [N, K] in dtype: code * scale, then + minimum (two roundings in dtype), written in place into one
        tensor (`out`, [N * K], if given: a reused buffer) with no float intermediates."""
        n, k = self.shape
        g = self.group_size
        w = torch.empty(n * k, dtype=dtype, device=self.codes.device) if out is None else out
        w = w.view(n, k // g, g)
        if self.bits == 8:
            w.copy_(self.codes.view(n, k // g, g))
        else:
            packed = self.codes.view(n, k // g, g // 2)  # byte j: code j (low nibble), code j + g/2 (high)
            w[..., : g // 2].copy_(packed & 15)
            w[..., g // 2:].copy_(packed >> 4)
        w.mul_(self.scales.to(dtype)[..., None])
        if self.minimums is not None:
            w.add_(self.minimums.to(dtype)[..., None])
        return w.view(n, k)

    @staticmethod
    def from_codes(codes: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor) -> QuantizedWeight:
        """int4 from unpacked codes [N, K] (0..15) and [N, G] scales and minimums."""
        n, k = codes.shape
        g = k // scales.shape[1]
        groups = codes.to(torch.uint8).view(n, k // g, g)
        packed = groups[..., : g // 2] | (groups[..., g // 2:] << 4)
        return QuantizedWeight(4, packed.reshape(n, k // 2), scales, minimums)

    def rows(self, index: torch.Tensor) -> QuantizedWeight:
        """The weight of the given output rows (e.g. to undo a row permutation, or to split fused rows)."""
        mins = self.minimums[index] if self.minimums is not None else None
        return QuantizedWeight(self.bits, self.codes[index], self.scales[index], mins)

    @staticmethod
    def concat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Stack weights along the output dimension (fused q/k/v, gate/up)."""
        first = parts[0]
        if any(p.bits != first.bits or p.group_size != first.group_size for p in parts):
            raise WeightFormatError("cannot fuse weights of different formats or group sizes")
        mins = torch.cat([p.minimums for p in parts]) if first.minimums is not None else None
        return QuantizedWeight(first.bits, torch.cat([p.codes for p in parts]),
                               torch.cat([p.scales for p in parts]), mins)


def quantize_int8(w: torch.Tensor) -> QuantizedWeight:
    """Symmetric int8, one scale per output channel. w: [N, K] float."""
    w = w.float()
    scale = (w.abs().amax(dim=1, keepdim=True) / 127).clamp(min=1e-7).half()  # [N, 1], as stored
    codes = (w / scale.float()).round().clamp(-127, 127).to(torch.int8)
    return QuantizedWeight(8, codes, scale)


def quantize_int4(w: torch.Tensor, group_size: int = 32) -> QuantizedWeight:
    """Asymmetric int4 in groups of group_size along K: code = round((w - min) / scale), 0..15. w: [N, K]."""
    n, k = w.shape
    if k % group_size:
        raise WeightFormatError(f"int4 needs the input size ({k}) to be a multiple of the group size {group_size}")
    groups = w.float().view(n, k // group_size, group_size)
    lo, hi = groups.amin(-1), groups.amax(-1)  # [N, G]
    scale = ((hi - lo) / 15).clamp(min=1e-8).half()
    lo = lo.half()
    codes = ((groups - lo.float()[..., None]) / scale.float()[..., None]).round().clamp(0, 15).to(torch.uint8)
    half = group_size // 2
    packed = codes[..., :half] | (codes[..., half:] << 4)  # [N, G, g/2]
    return QuantizedWeight(4, packed.reshape(n, k // 2), scale, lo)


def bytes_per_parameter(fmt: str, group_size: int = 32) -> float:
    """Storage per weight, scales included (int4: a float16 scale and minimum per group)."""
    return {"float32": 4.0, "bfloat16": 2.0, "int8": 1.0, "int4": 0.5 + 4 / group_size}[fmt]


def check_format(fmt: str) -> str:
    if fmt not in WEIGHT_FORMATS:
        raise WeightFormatError(f"unknown weight format {fmt!r}; choose one of {', '.join(WEIGHT_FORMATS)}")
    return fmt
