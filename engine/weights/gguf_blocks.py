"""GGUF tensors -> kvscope weights without a float32 round-trip where the block type maps onto a format:
Q4_0 / Q4_1 / Q4_K -> int4 in groups of 32, Q8_0 / Q5_0 -> int8 in groups of 32, Q6_K -> int8 in groups of 16
(the same integers; scales and minimums as the file has them: float16, or for Q4_K and Q6_K the exact float32
products of a float16 super-block scale and a 6-/8-bit sub-block scale, so that a float format dequantizes them
exactly as gguf-py does; the projection modules round them to float16 once, engine/weights/linear.py).
Q5_1 / Q5_K (a 5-bit code plus a minimum has no exact int8 form) are requantized to int8 in groups of 32 from
their values. F32 / F16 / BF16 load as float; any other type
gguf-py can read is dequantized one tensor at a time. `outcome` names what happened to each."""

from __future__ import annotations

import numpy as np
import torch

from engine.weights.formats import QuantizedWeight, WeightFormatError

BLOCK = 32


def gguf_tensor(tensor) -> torch.Tensor | QuantizedWeight:
    """One gguf.ReaderTensor -> a float tensor (its shape reversed to PyTorch order) or a QuantizedWeight."""
    from gguf import GGMLQuantizationType as T

    kind = tensor.tensor_type
    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists the fastest dimension first
    raw = np.asarray(tensor.data)
    if kind in (T.F32, T.F16):
        return torch.from_numpy(raw.astype(np.float32).reshape(shape))
    if kind == T.BF16:
        return torch.from_numpy(raw.view(np.int16).reshape(shape).copy()).view(torch.bfloat16).float()
    if len(shape) != 2:
        raise WeightFormatError(f"{tensor.name}: quantized tensors must be 2-D, got shape {shape}")
    if kind in (T.Q4_0, T.Q4_1, T.Q8_0):
        return _blocks(kind, raw, shape, tensor.name)
    if kind == T.Q5_0:
        return _q5_0(raw, shape, tensor.name)
    if kind.name in K_READERS:
        return K_READERS[kind.name](_block_rows(raw, shape, tensor.name, kind))
    values = torch.from_numpy(_dequantize_other(tensor, kind).reshape(shape))
    if kind.name in REQUANTIZED_INT8:
        return quantize_int8_groups(values, BLOCK)
    return values


KEPT_INT4, KEPT_INT8, FLOAT_TYPES = ("Q4_0", "Q4_1", "Q4_K"), ("Q8_0", "Q5_0", "Q6_K"), ("F32", "F16", "BF16")


def outcome(kind_name: str) -> str:
    """What loading does to a tensor of this GGUF type: 'kept as int4' / 'kept as int8' (its integers),
    'requantized to int8', 'float', or 'dequantized'. By name: a start from the cache never imports gguf."""
    if kind_name in FLOAT_TYPES:
        return "float"
    if kind_name in KEPT_INT4:
        return "kept as int4"
    if kind_name in KEPT_INT8:
        return "kept as int8"
    return "requantized to int8" if kind_name in REQUANTIZED_INT8 else "dequantized"


SUPER = 256  # values in a K-quant super-block


def _block_rows(raw: np.ndarray, shape: tuple[int, int], name: str, kind) -> np.ndarray:
    """The tensor's bytes as [N, K / 256, bytes per super-block] uint8, sizes checked."""
    from gguf import GGML_QUANT_SIZES

    n, k = shape
    per_block = GGML_QUANT_SIZES[kind][1]
    if k % SUPER:
        raise WeightFormatError(f"{name}: row length {k} is not a multiple of {SUPER} ({kind.name})")
    blocks = np.ascontiguousarray(raw).view(np.uint8)
    if blocks.size != n * (k // SUPER) * per_block:
        raise WeightFormatError(f"{name}: {blocks.size} bytes do not hold a {n}x{k} {kind.name} tensor")
    return blocks.reshape(n, k // SUPER, per_block)


def _f16(b: np.ndarray) -> np.ndarray:
    """[..., 2] uint8 -> [...] float32 (a float16 field)."""
    return b.copy().view(np.float16)[..., 0].astype(np.float32)


def _q4_k(blocks: np.ndarray) -> QuantizedWeight:
    """Q4_K: per 256 values d, dmin (float16), 8 six-bit (scale, min) pairs, 4-bit codes; value = d*sc*q - dmin*m.
    -> int4 groups of 32: scale = d*sc, minimum = -dmin*m (exact in float32: 11 + 6 bits), the same codes."""
    from gguf.quants import Q4_K

    n, nb, _ = blocks.shape
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])  # [N, B]
    sc, m = Q4_K.get_scale_min(blocks[..., 4:16].reshape(n * nb, 12))  # [N*B, 8] each
    scales = d[..., None] * sc.reshape(n, nb, 8).astype(np.float32)
    minimums = -(dmin[..., None] * m.reshape(n, nb, 8).astype(np.float32))
    qs = blocks[..., 16:].reshape(n, nb, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
    codes = torch.from_numpy((qs & 15).reshape(n, nb * SUPER))  # [N, K], sub-block j = nibbles of chunk j // 2
    return QuantizedWeight.from_codes(codes, _exact(scales.reshape(n, -1)), _exact(minimums.reshape(n, -1)))


def _q6_k(blocks: np.ndarray) -> QuantizedWeight:
    """Q6_K: per 256 values 6-bit codes (4 low bits in ql, 2 high in qh), 16 int8 scales, d (float16);
    value = d * sc * (q - 32). -> int8 groups of 16: codes q - 32, scale d*sc (exact in float32: 11 + 8 bits)."""
    n, nb, _ = blocks.shape
    ql, qh = blocks[..., :128], blocks[..., 128:192]
    sc = blocks[..., 192:208].copy().view(np.int8).astype(np.float32)  # [N, B, 16]
    d = _f16(blocks[..., 208:210])  # [N, B]
    low = ql.reshape(n, nb, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
    low = (low & 15).reshape(n, nb, 2, 4, 32)  # [.., half, k, l]: k = 0..3 of each 128 values
    high = qh.reshape(n, nb, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)
    high = (high & 3).reshape(n, nb, 2, 4, 32)
    codes = (low | (high << 4)).astype(np.int16) - 32  # [N, B, 2, 4, 32] -> value order
    scales = (d[..., None] * sc).reshape(n, nb * 16)
    return QuantizedWeight(8, torch.from_numpy(codes.astype(np.int8).reshape(n, nb * SUPER)), _exact(scales))


def _exact(x: np.ndarray) -> torch.Tensor:
    """Scale products as float32 (a float16 times an integer of up to 8 bits: exact)."""
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))


def _q5_0(raw: np.ndarray, shape: tuple[int, int], name: str) -> QuantizedWeight:
    """Q5_0: per 32 values d (float16), 32 high bits, 16 bytes of low nibbles; value = d * (q - 16).
    -> int8 groups of 32: codes q - 16, the same scale."""
    n, k = shape
    if k % BLOCK:
        raise WeightFormatError(f"{name}: row length {k} is not a multiple of {BLOCK}")
    blocks = np.ascontiguousarray(raw).view(np.uint8)
    if blocks.size != n * (k // BLOCK) * 22:
        raise WeightFormatError(f"{name}: {blocks.size} bytes do not hold a {n}x{k} Q5_0 tensor")
    blocks = blocks.reshape(n, k // BLOCK, 22)
    scales = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0])
    qh = blocks[..., 2:6].copy().view(np.uint32)  # [N, G, 1]
    high = (qh >> np.arange(32, dtype=np.uint32)) & 1  # [N, G, 32]
    qs = blocks[..., 6:]
    low = np.concatenate([qs & 15, qs >> 4], axis=-1)  # [N, G, 32]
    codes = (low.astype(np.int16) | (high.astype(np.int16) << 4)) - 16
    return QuantizedWeight(8, torch.from_numpy(codes.astype(np.int8).reshape(n, k)), scales)


K_READERS = {"Q4_K": _q4_k, "Q6_K": _q6_k}  # type -> reader of its [N, K/256, bytes] super-blocks
REQUANTIZED_INT8 = ("Q5_1", "Q5_K")


def quantize_int8_groups(w: torch.Tensor, group_size: int) -> QuantizedWeight:
    """Symmetric int8 with one float16 scale per group of group_size along K. w: [N, K] float."""
    n, k = w.shape
    groups = w.float().view(n, k // group_size, group_size)
    scale = (groups.abs().amax(-1) / 127).clamp(min=1e-7).half()  # [N, G]
    codes = (groups / scale.float()[..., None]).round().clamp(-127, 127).to(torch.int8)
    return QuantizedWeight(8, codes.reshape(n, k), scale)


def _blocks(kind, raw: np.ndarray, shape: tuple[int, int], name: str) -> QuantizedWeight:
    from gguf import GGMLQuantizationType as T

    n, k = shape
    if k % BLOCK:
        raise WeightFormatError(f"{name}: row length {k} is not a multiple of {BLOCK}")
    block_bytes = {T.Q4_0: 18, T.Q4_1: 20, T.Q8_0: 34}[kind]
    blocks = np.ascontiguousarray(raw).view(np.uint8)
    if blocks.size != n * (k // BLOCK) * block_bytes:
        raise WeightFormatError(f"{name}: {blocks.size} bytes do not hold a {n}x{k} {kind.name} tensor")
    blocks = blocks.reshape(n, k // BLOCK, block_bytes)
    scales = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0])  # [N, G]
    if kind == T.Q8_0:
        codes = torch.from_numpy(blocks[..., 2:].copy().view(np.int8)).reshape(n, k)
        return QuantizedWeight(8, codes, scales)
    if kind == T.Q4_1:
        minimums = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0])
        packed = blocks[..., 4:]
    else:  # Q4_0: w = d * (q - 8), i.e. minimum = -8 d
        minimums = (-8 * scales.float()).half()
        packed = blocks[..., 2:]
    return QuantizedWeight(4, torch.from_numpy(packed.copy()).reshape(n, k // 2), scales, minimums)


def _dequantize_other(tensor, kind) -> np.ndarray:
    from gguf import quants

    try:
        return np.asarray(quants.dequantize(tensor.data, kind), dtype=np.float32)
    except (NotImplementedError, KeyError, ValueError, TypeError) as e:
        raise WeightFormatError(f"{tensor.name}: unsupported GGUF tensor type {kind.name} ({e})") from None


LAYER_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj",
               "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
               "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
               "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
SANDWICH_NAMES = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                  "post_ffw_norm": "post_feedforward_layernorm"}  # Gemma 2/3
FUSED_NAMES = {"ffn_up": "mlp.gate_up_proj"}  # Phi-3: ffn_up holds gate then up


def hf_name(gguf_name: str, sandwich_norms: bool = False, fused: bool = False) -> str | None:
    """GGUF tensor name -> Hugging Face name (None for tensors the model does not use). sandwich_norms: Gemma's
    four norms a layer; fused: Phi-3's attn_qkv and gate-and-up ffn_up."""
    fixed = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
    if gguf_name in fixed:
        return fixed[gguf_name]
    parts = gguf_name.split(".")
    if parts[0] != "blk" or len(parts) != 4:
        return None
    names = {**LAYER_NAMES, **(SANDWICH_NAMES if sandwich_norms else {}), **(FUSED_NAMES if fused else {})}
    layer = names.get(parts[2])
    return f"model.layers.{parts[1]}.{layer}.{parts[3]}" if layer else None


def unpermute_rows(n_rows: int, num_heads: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's q/k permutation (its converter interleaves the two rotary halves
    of each head). Rows only move, so quantized rows are untouched. -> index [n_rows]."""
    head_dim = n_rows // num_heads
    index = torch.arange(n_rows).view(num_heads, head_dim // 2, 2)
    return index.transpose(1, 2).reshape(n_rows)


def take_rows(weight: torch.Tensor | QuantizedWeight, index: torch.Tensor):
    return weight.rows(index) if isinstance(weight, QuantizedWeight) else weight[index]
