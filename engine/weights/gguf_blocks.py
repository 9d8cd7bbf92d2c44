"""GGUF tensors -> kvscope weights without a float32 round-trip where the block type maps onto a format:
Q4_0 / Q4_1 -> int4 in groups of 32, Q8_0 -> int8 in groups of 32 (the same integers; scales stay float16).
F32 / F16 / BF16 load as float; any other type gguf-py can read is dequantized one tensor at a time."""

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
    return torch.from_numpy(_dequantize_other(tensor, kind).reshape(shape))


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
