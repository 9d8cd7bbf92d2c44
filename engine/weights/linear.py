"""Projection modules, one per weight format. Each picks its kernel per phase:

- decode (a few rows: one token, a speculative verify step, a batch of sequences): kvscope's own kernels
  (engine/kernels) over the weights' own integers, activations quantized to int16 with one scale a
  row, one fixed order of operations per output, so a row's result never depends on the other rows; where the
  kernels cannot be built, torch's weight-only kernels (`_weight_int8pack_mm` / `_weight_int4pack_mm_for_cpu`,
  bfloat16 activations);
- prefill (many rows): int4 and int8 weights in kvscope's 16-row layout (built wherever AVX2 is) go through the
  same kernel, whatever the number of rows (a 512-token prompt 2.2x faster than the float32 matmul below on a
  Zen 4 EPYC with AVX-512, 1.6x on a Zen 3 with AVX2; and a row's result is the same in a prefill as in a decode
  step); other weights are dequantized once to float32 for the call, then a float32 matmul, which on CPU is
  several times faster for many rows than any weight-only kernel of torch's that we measured.

Every module also serves embedding rows (`rows`), so a tied embedding shares the head's storage.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from torch import nn

from engine import kernels
from engine.weights.formats import QuantizedWeight

DECODE_ROWS = 16  # up to this many rows go through the decode kernel
SCRATCH_LIMIT = 16 * 2**20  # elements: a dense weight up to this size is dequantized into one reused buffer
_scratch = threading.local()


def scratch(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A flat buffer of numel that every prefill on this thread reuses. A fresh multi-MiB tensor per projection
    pays its page faults on every call: measured here 4-10x the dequantization itself. -> [numel]"""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
        with torch.inference_mode(False):  # a normal tensor: written in and out of inference mode alike
            buf = _scratch.buf = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel]


def reusable(numel: int, dtype: torch.dtype, device: torch.device) -> bool:
    return device.type == "cpu" and numel <= SCRATCH_LIMIT and dtype.is_floating_point


def compiled_ops(*tensors: torch.Tensor):
    """kvscope's compiled kernels when every tensor is on the CPU and they are built, else None."""
    return kernels.ops() if all(t.device.type == "cpu" for t in tensors) else None


class WeightLinear(nn.Module):
    """y = x W^T for W: [N, K] stored in some format. x: [..., K] -> [..., N] in x's dtype (float32)."""

    format_name = "float32"
    kernel_name = "torch.mm (float32)"

    def __init__(self, out_features: int, in_features: int):
        super().__init__()
        self.out_features, self.in_features = out_features, in_features

    compiled = None  # kvscope's compiled ops where a subclass's decode runs through them: it then defines
    # compiled_decode(x [..., K] float32 contiguous) -> [..., N] over self.kernel_args()
    rows16 = False  # whether compiled_decode reads the 16-row layout, whose kernels take any number of rows

    def decodes(self, rows: int) -> bool:
        """Whether `rows` activation rows go through the decode kernel (else through prefill)."""
        return rows <= DECODE_ROWS or (self.rows16 and self.compiled is not None)

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    def takes_rows16(self) -> bool:
        """Whether the compiled kernels read this weight in their 16-row layout (built for AVX2 and AVX-512; the
        output rows come in 16s)."""
        return self.compiled is not None and self.out_features % ROW_BLOCK == 0 \
            and self.compiled.int4_row_block() == ROW_BLOCK

    def kernel_args(self) -> tuple[torch.Tensor, ...]:
        """The tensors the compiled kernel reads, looked up once (a step calls the kernel hundreds of times;
        nn.Module attribute lookups cost more than the small ones)."""
        args = self.__dict__.get("_kernel_args")
        if args is None:
            args = self.__dict__["_kernel_args"] = self.kernel_tensors()
        return args

    def kernel_tensors(self) -> tuple[torch.Tensor, ...]:
        return ()

    def _apply(self, fn, recurse=True):  # .to() and friends replace the tensors: look them up again
        self.__dict__.pop("_kernel_args", None)
        return super()._apply(fn, recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.compiled is not None and self.decodes(x.numel() // self.in_features) \
                and x.dtype == torch.float32 and x.is_contiguous() and x.device.type == "cpu":
            return self.compiled_decode(x)  # [..., K] -> [..., N] in one call
        flat = x.reshape(-1, self.in_features)  # [M, K]
        out = self.decode(flat) if self.decodes(flat.shape[0]) else self.prefill(flat)
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def decode(self, x: torch.Tensor) -> torch.Tensor:
        return self.prefill(x)

    def prefill(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.transient_dense(x.dtype))

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole weight [N, K] in dtype."""
        raise NotImplementedError

    def transient_dense(self, dtype: torch.dtype) -> torch.Tensor:
        """dense(dtype), the same values, valid only until the next call on this thread (a prefill's matmul):
        quantized formats write it into the thread's scratch buffer. -> [N, K]"""
        return self.dense(dtype)

    def rows(self, index: torch.Tensor, dtype: torch.dtype, checked: bool = False) -> torch.Tensor:
        """Embedding lookup: rows of W. index: [...] -> [..., K]. checked: the caller has checked every index
        (nothing here may read the indices back to the host: a CUDA graph's capture forbids it)."""
        return self.dense(dtype)[index]

    @property
    def resident_bytes(self) -> int:
        return sum(t.nbytes for t in self.buffers())


class FloatLinear(WeightLinear):
    """float32 (or bfloat16) weights; bfloat16 decodes with bfloat16 activations and prefills in float32."""

    def __init__(self, weight: torch.Tensor):
        super().__init__(*weight.shape)
        self.register_buffer("weight", weight)
        self.format_name = str(weight.dtype).removeprefix("torch.")
        self.kernel_name = f"torch.mm ({self.format_name})"
        ops = compiled_ops(weight) if weight.dtype in (torch.float32, torch.bfloat16) else None
        if ops is not None and weight.shape[1] % 8 == 0 and weight.is_contiguous():
            self.compiled = ops
            self.kernel_name = f"kvscope.float_linear ({self.format_name} weights, float32 activations)"

    def kernel_tensors(self):
        return (self.weight,)

    def compiled_decode(self, x):
        return self.compiled.float_linear(x, *self.kernel_args())

    def decode(self, x):
        if self.compiled is not None and x.device.type == "cpu":
            return self.compiled.float_linear(x.float().contiguous(), self.weight)
        return F.linear(x.to(self.weight.dtype), self.weight)

    def dense(self, dtype):
        return self.weight if self.weight.dtype == dtype else self.weight.to(dtype)

    def rows(self, index, dtype, checked=False):
        return self.weight[index].to(dtype)


class Int8Linear(WeightLinear):
    """Symmetric int8 codes with one scale per output channel, or per group of K (GGUF's Q8_0: the same
    integers). kvscope's kernel reads them in one call, in its 16-row layout (`rows16`) where its kernel is built
    (AVX2), else as codes [N, K] and scales [N, G]; torch's fallback kernel takes one call per group of K, summed."""

    format_name = "int8"
    kernel_device: str | None = None  # the device type torch's kernel was picked and checked on (None: not prepared)

    def __init__(self, q: QuantizedWeight):
        super().__init__(*q.shape)
        q = regrouped_for_kernel(q).with_float16_scales()  # a K-quant's exact scales regrouped, then rounded once
        self.group_size = q.group_size
        self.compiled = compiled_ops(q.codes) if self.in_features % 32 == 0 and self.group_size % 32 == 0 else None
        self.rows16 = self.takes_rows16()
        codes, scales = int8_to_rows16(q) if self.rows16 else (q.codes.contiguous(), q.scales.contiguous())
        self.register_buffer("codes", codes)  # [N, K] int8 ([N/16, K/32, 512] in rows16)
        self.register_buffer("scales", scales)  # [N, G] float16 ([N/16, G, 16] in rows16)
        if self.compiled is not None:
            layout = "16 rows a register" if self.rows16 else "a row at a time"
            self.kernel_name = f"kvscope.int8_linear (int16 activations, one scale a row; {layout})"
        else:
            self._prepare_torch_kernel()

    def kernel_tensors(self):
        return self.codes, self.scales

    def compiled_decode(self, x):
        return self.compiled.int8_linear(x, *self.kernel_args())

    def _prepare_torch_kernel(self) -> None:
        n, k = self.out_features, self.in_features
        groups = k // self.group_size
        # grouped: [G, N, g] so that each group is a contiguous [N, g] matrix for torch's kernel
        self.register_buffer("grouped", self.codes.view(n, groups, self.group_size).transpose(0, 1).contiguous())
        # the kernel multiplies by a bfloat16 scale and rounds its output to bfloat16; the float32 scale is applied
        # after it instead, so each channel's scale keeps its float16 precision: [G, N]
        self.register_buffer("kernel_scales", torch.ones(groups, n, dtype=torch.bfloat16))
        self.register_buffer("float_scales", self.scales.t().float().contiguous())
        self.kernel_device = self.codes.device.type
        self.kernel_name = pick_int8_kernel(self)

    def torch_kernel_on(self, device: torch.device) -> bool:
        """Whether torch's weight-only kernel, picked and checked on the device the weight was loaded on, serves
        activations on `device` (a module moved since, e.g. to CUDA, dequantizes for every call instead)."""
        return self.kernel_device == device.type and not self.kernel_name.startswith("dequantize")

    def decode(self, x):
        if self.compiled is not None and x.device.type == "cpu":
            return self.compiled.int8_linear(x.float().contiguous(), self.codes, self.scales)
        if not self.torch_kernel_on(x.device):
            return self.prefill(x)
        xb = x.to(torch.bfloat16)
        out = self._group_product(xb, 0)
        for g in range(1, self.grouped.shape[0]):  # one call per group of K: y = sum_g s_g * (q_g x_g)
            out.add_(self._group_product(xb, g))
        return out

    def _group_product(self, xb: torch.Tensor, g: int) -> torch.Tensor:
        """s_g * (q_g x_g): xb [M, K] bfloat16 -> [M, N] float32."""
        part = xb[:, g * self.group_size:(g + 1) * self.group_size] if self.grouped.shape[0] > 1 else xb
        return torch.ops.aten._weight_int8pack_mm(part, self.grouped[g], self.kernel_scales[g]).float() \
            .mul_(self.float_scales[g])

    def _parts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes [N, K] or, in rows16, a strided view that reshapes to it; scales [N, G])."""
        return int8_rows16_parts(self.codes, self.scales) if self.rows16 else (self.codes, self.scales)

    def dense(self, dtype, out=None):
        return dequantize_codes(*self._parts(), None, dtype, out)

    def transient_dense(self, dtype):
        n, k, device = self.out_features, self.in_features, self.codes.device
        if not reusable(n * k, dtype, device):
            return self.dense(dtype)
        return self.dense(dtype, out=scratch(n * k, dtype, device))

    def rows(self, index, dtype, checked=False):
        if self.compiled is not None and dtype == torch.float32 and index.device.type == "cpu":
            return self.compiled.int8_embed(self.codes, self.scales, index)  # the same products, one call
        codes, scales = self._parts()
        codes = codes.reshape(self.shape)[index].to(dtype)  # [..., K]
        scales = scales[index].to(dtype)[..., None]  # [..., G, 1]
        return (codes.view(*codes.shape[:-1], -1, self.group_size) * scales).flatten(-2)

    def quantized(self) -> QuantizedWeight:
        """The weight in the loaders' form (codes [N, K], scales [N, G]; the held tensors where no layout differs)."""
        codes, scales = self._parts()
        return QuantizedWeight(8, codes.reshape(self.shape).contiguous(), scales)


def regrouped_for_kernel(q: QuantizedWeight) -> QuantizedWeight:
    """Groups the compiled kernel cannot read (GGUF Q6_K's 16) requantized to int8 groups of 32 where the kernel
    runs: 8 bits for the file's 6, each value moved by at most half an int8 step (torch's fallback would take one
    call per group of 16 and round the activations to bfloat16). Elsewhere the weight is kept as it came."""
    n, k = q.shape
    if q.group_size % 32 == 0 or k % 32 or compiled_ops(q.codes) is None:
        return q
    from engine.weights.gguf_blocks import quantize_int8_groups

    return quantize_int8_groups(q.dequantize(), 32)


class Int4Linear(WeightLinear):
    """Asymmetric int4 in groups along K (w = code * scale + minimum), held in the layout its decode kernel reads:
    kvscope's 16-row layout (`rows16`) where its kernel is built (AVX2), else the codes as GGUF packs them
    ([N, K/2]), else torch's CPU int4 packing (prefill reads that packing back when we know its layout, checked
    against the codes at load; otherwise the codes are kept beside it).
    """

    format_name = "int4"

    def __init__(self, q: QuantizedWeight):
        super().__init__(*q.shape)
        q = q.with_float16_scales()
        self.group_size = q.group_size
        self.compiled = compiled_ops(q.codes) if self.in_features % 32 == 0 else None
        self.rows16 = self.takes_rows16()
        codes, scales, minimums = to_rows16(q) if self.rows16 else (q.codes, q.scales, q.minimums)
        self.register_buffer("scales", scales)  # [N, G] float16 ([N/16, G, 16] in rows16)
        self.register_buffer("minimums", minimums)  # the same
        self.register_buffer("kernel_codes", codes)  # [N, K/2] uint8 ([N/16, K/32, 256] in rows16), or None
        self.register_buffer("packed", None)
        self.register_buffer("scale_zero", None)
        self.kernel_name = "dequantize + torch.mm"
        if self.compiled is not None:
            layout = "16 rows a register" if self.rows16 else "a row at a time"
            self.kernel_name = f"kvscope.int4_linear (int16 activations, one scale a row; {layout})"
        elif q.codes.device.type == "cpu":
            self._pack_for_cpu_kernel(q)

    def _pack_for_cpu_kernel(self, q: QuantizedWeight) -> None:
        codes = q.unpacked_codes()  # [N, K] uint8
        try:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
        except (RuntimeError, AttributeError):
            return  # shape or build without the kernel: dequantize for every call
        self.packed = packed
        # the kernel computes (code - 8) * scale + zero in bfloat16, so zero = minimum + 8 * scale; rounding the
        # zero to bfloat16 moves a weight by ~1/60 of a quantization step (adding the minimums in float32 instead
        # measured no better: the bfloat16 activations and outputs dominate). [G, N, 2]
        zero = q.minimums.float() + 8 * q.scales.float()
        self.scale_zero = torch.stack([q.scales.float(), zero], -1).transpose(0, 1).to(torch.bfloat16).contiguous()
        self.kernel_name = "aten._weight_int4pack_mm_for_cpu (bfloat16 activations)"
        if torch.equal(unpack_cpu_int4pack(packed, *self.shape), codes):
            self.kernel_codes = None  # prefill reads the kernel's layout: no second copy

    def kernel_tensors(self):
        return self.kernel_codes, self.scales, self.minimums

    def compiled_decode(self, x):
        return self.compiled.int4_linear(x, *self.kernel_args())

    def decode(self, x):
        if self.compiled is not None and x.device.type == "cpu":
            return self.compiled_decode(x.float().contiguous())
        if self.packed is None or x.device.type != "cpu":  # (torch's packing is the CPU kernel's: moved, dequantize)
            return self.prefill(x)
        xb = x.to(torch.bfloat16)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(xb, self.packed, self.group_size, self.scale_zero).float()

    def quantized(self) -> QuantizedWeight:
        """The weight in the loaders' form (codes [N, K/2] packed as GGUF packs them, scales [N, G])."""
        if self.in_gguf_order:
            return QuantizedWeight(4, self.kernel_codes, self.scales, self.minimums)
        codes, scales, minimums = self._unpacked()
        return QuantizedWeight.from_codes(codes.reshape(self.shape), scales, minimums)

    @property
    def in_gguf_order(self) -> bool:
        """Whether the codes are held as GGUF packs them (not in the 16-row layout or torch's packing)."""
        return self.kernel_codes is not None and not self.rows16

    def _unpacked(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Where the codes are not in GGUF's order: (codes, one a byte, as [N, K] or a view that reshapes to it;
        scales and minimums [N, G])."""
        if self.rows16:
            return rows16_parts(self.kernel_codes, self.scales, self.minimums)
        return unpack_cpu_int4pack(self.packed, *self.shape), self.scales, self.minimums

    def codes(self) -> torch.Tensor:
        """-> [N, K] uint8 codes."""
        if self.in_gguf_order:
            return self.quantized().unpacked_codes()
        return self._unpacked()[0].reshape(self.shape)

    def dense(self, dtype, out=None):
        if self.in_gguf_order:
            return self.quantized().dequantize(dtype, out)
        return dequantize_codes(*self._unpacked(), dtype, out)

    def transient_dense(self, dtype):
        n, k = self.shape
        if not reusable(n * k, dtype, self.scales.device):
            return self.dense(dtype)
        return self.dense(dtype, out=scratch(n * k, dtype, self.scales.device))

    def rows(self, index, dtype, checked=False):
        """Embedding lookup: only the rows asked for are unpacked and dequantized (the whole weight per call took
        89 ms for a 49,152 x 576 table: every decode step of a model whose embedding a GGUF holds in 4 bits)."""
        flat = index.reshape(-1)
        if not checked:
            check_rows(flat, self.out_features)
        if self.in_gguf_order:
            picked = QuantizedWeight(4, self.kernel_codes[flat], self.scales[flat], self.minimums[flat])
            return picked.dequantize(dtype).view(*index.shape, self.in_features)
        return dequantize_codes(*self._unpacked_rows(flat), dtype).view(*index.shape, self.in_features)

    def _unpacked_rows(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """_unpacked's rows `flat` [n] alone: (codes [n, K] one a byte, scales and minimums [n, G])."""
        if self.rows16:
            return rows16_rows(self.kernel_codes, self.scales, self.minimums, flat)
        n, k = self.shape  # torch's packing, in unpack_cpu_int4pack's layout (checked at load)
        block, within = flat // 64, flat % 64
        picked = self.packed.view(n // 64, k, 32)[block, :, within % 32]  # [ids, K] bytes
        codes = torch.where((within < 32)[:, None], picked & 15, picked >> 4)
        return codes, self.scales[flat], self.minimums[flat]


ROW_BLOCK = 16  # weight rows the 16-row layout interleaves (the kernels' int4_row_block())


def to_rows16(q: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int4 weights in kvscope's 16-row decode layout (cpu_kernels.cpp, int4_groups16): codes [N/16, K/32, 256]
    uint8, byte 32j + 2r + e of a block = code 2j + e of row r (low nibble) | code 2j + 16 + e (high); scales
    and minimums [N/16, G, 16] float16."""
    n, k = q.shape
    codes = q.unpacked_codes().view(n // ROW_BLOCK, ROW_BLOCK, k // 32, 2, 8, 2)  # [N/16, r, block, half, j, e]
    codes = codes.permute(0, 2, 4, 1, 5, 3)  # [N/16, block, j, r, e, half]
    packed = (codes[..., 0] | (codes[..., 1] << 4)).reshape(n // ROW_BLOCK, k // 32, 256)
    return packed.contiguous(), params_to_rows16(q.scales), params_to_rows16(q.minimums)


def params_to_rows16(params: torch.Tensor) -> torch.Tensor:
    """Per-group scales or minimums [N, G] -> the 16-row layout's [N/16, G, 16] (a group's 16 rows side by side)."""
    n, groups = params.shape
    return params.view(n // ROW_BLOCK, ROW_BLOCK, groups).transpose(1, 2).contiguous()


def params_from_rows16(params: torch.Tensor) -> torch.Tensor:
    """params_to_rows16 undone: [N/16, G, 16] -> [N, G]."""
    row_groups, groups, _ = params.shape
    return params.transpose(1, 2).reshape(row_groups * ROW_BLOCK, groups)


def check_rows(flat: torch.Tensor, num_rows: int) -> None:
    """Raise IndexError naming the first index that is not a row of a table of num_rows (a negative one would
    silently pick a row from the end)."""
    outside = flat[(flat < 0) | (flat >= num_rows)]
    if outside.numel():
        raise row_outside(int(outside[0]), num_rows)


def row_outside(row: int, num_rows: int) -> IndexError:
    return IndexError(f"embedding row {row} is outside the table's {num_rows} rows")


def rows16_parts(codes: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor):
    """to_rows16 undone, as plain parts: codes [N/16, 16, K/32, 2, 8, 2] (a strided view: [N, K] once reshaped),
    scales and minimums [N, G]."""
    row_groups, blocks, _ = codes.shape
    both = torch.stack([codes & 15, codes >> 4], -1).view(row_groups, blocks, 8, ROW_BLOCK, 2, 2)
    plain = both.permute(0, 3, 1, 5, 2, 4)  # [N/16, block, j, r, e, half] -> [N/16, r, block, half, j, e]
    return plain, params_from_rows16(scales), params_from_rows16(minimums)


def rows16_rows(codes: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor, flat: torch.Tensor):
    """rows16_parts' rows `flat` [n] alone, from the 16-row groups that hold them: codes [n, K], scales and
    minimums [n, G]."""
    group, row, n = flat // ROW_BLOCK, flat % ROW_BLOCK, flat.numel()
    blocks = codes.shape[1]
    picked = codes[group].view(n, blocks, 8, ROW_BLOCK, 2)[torch.arange(n), :, :, row]  # [n, block, j, e]
    unpacked = torch.stack([picked & 15, picked >> 4], 2).reshape(n, blocks * 32)  # [n, block, half, j, e] -> [n, K]
    return unpacked, scales[group, :, row], minimums[group, :, row]


def int8_to_rows16(q: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 weights in kvscope's 16-row decode layout (cpu_kernels.cpp, int8_groups16): codes [N/16, K/32, 512]
    int8, byte 32j + 2r + e of a block = code 2j + e of row r; scales [N/16, G, 16] float16."""
    n, k = q.shape
    codes = q.codes.view(n // ROW_BLOCK, ROW_BLOCK, k // 32, 16, 2).permute(0, 2, 3, 1, 4)  # [N/16, block, j, r, e]
    return codes.reshape(n // ROW_BLOCK, k // 32, 512).contiguous(), params_to_rows16(q.scales)


def int8_rows16_parts(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8_to_rows16 undone: codes [N/16, 16, K/32, 16, 2] (a strided view: [N, K] once reshaped), scales [N, G]."""
    row_groups, blocks, _ = codes.shape
    plain = codes.view(row_groups, blocks, 16, ROW_BLOCK, 2).permute(0, 3, 1, 2, 4)  # -> [N/16, r, block, j, e]
    return plain, params_from_rows16(scales)


def dequantize_codes(codes: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor | None, dtype: torch.dtype,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """QuantizedWeight.dequantize from unpacked codes (one a byte: [N, K], or a view that reshapes to it, written
    once from where it lies) and [N, G] scales and minimums: the same operations, so the same values. -> [N, K]"""
    n, groups = scales.shape
    k = codes.numel() // n
    w = torch.empty(n * k, dtype=dtype, device=codes.device) if out is None else out
    w.view(codes.shape).copy_(codes)
    w = w.view(n, groups, k // groups)
    w.mul_(scales.to(dtype)[..., None])
    if minimums is not None:  # int4 (int8: none)
        w.add_(minimums.to(dtype)[..., None])
    return w.view(n, k)


def unpack_cpu_int4pack(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Codes [N, K] from torch's CPU int4 packing as observed for N a multiple of 64: rows in blocks of 64,
    each block stored K-major with 32 rows a byte-row, low nibble rows 0-31, high nibble rows 32-63.
    Returns a wrong answer (never raises) for other layouts; callers check it against the codes."""
    if n % 64 or packed.numel() * 2 != n * k:
        return torch.empty(0, dtype=torch.uint8)
    blocks = packed.view(n // 64, k, 32)
    both = torch.cat([blocks & 15, blocks >> 4], dim=-1)  # [N/64, K, 64]
    return both.transpose(1, 2).reshape(n, k)


def pick_int8_kernel(module: Int8Linear) -> str:
    """The weight-only int8 kernel when this build and device run it correctly, else dequantize per call."""
    x = torch.randn(1, module.in_features, generator=torch.Generator().manual_seed(0)).to(module.codes.device)
    module.kernel_name = "aten._weight_int8pack_mm (bfloat16 activations)"
    try:
        got = module.decode(x)[:, :64]
    except (RuntimeError, NotImplementedError):
        return "dequantize + torch.mm"
    rows = module.rows(torch.arange(min(64, module.out_features), device=x.device), torch.float32)  # [64, K]
    want = F.linear(x.to(torch.bfloat16).float(), rows)
    close = torch.allclose(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()) + 1e-6)
    return module.kernel_name if close else "dequantize + torch.mm"


def build_linear(weight: torch.Tensor | QuantizedWeight) -> WeightLinear:
    if isinstance(weight, QuantizedWeight):
        return Int8Linear(weight) if weight.bits == 8 else Int4Linear(weight)
    return FloatLinear(weight)
