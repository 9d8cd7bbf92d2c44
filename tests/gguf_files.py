"""Small real GGUF files for tests: the default model's tokenizer and chat template, a tiny Llama's weights in
the block types asked for, quantized by gguf-py exactly as llama.cpp's converter would store them."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from engine import loader
from engine.config import ModelConfig
from engine.gguf_header import read_gguf_header
from engine.model import random_hf_state_dict

TINY_GGUF = dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                 max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-5)
LAYER_TENSORS = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                 "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
                 "post_attention_layernorm": "ffn_norm"}


def tiny_config(vocab_size: int, tied: bool = True) -> ModelConfig:
    return ModelConfig(vocab_size=vocab_size, tie_word_embeddings=tied, **TINY_GGUF)


def llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows (interleaves each head's two rotary halves)."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf: str) -> str:
    hf = hf.removeprefix("model.")
    fixed = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf in fixed:
        return fixed[hf]
    _, layer, *rest = hf.split(".")
    module, leaf = ".".join(rest[:-1]), rest[-1]
    return f"blk.{layer}.{LAYER_TENSORS[module]}.{leaf}"


# every block type kvscope reads in one small file: layer 0 in Q4_1 (the default model's type), layer 1 in
# Q4_0 with its down projection in Q5_0 (a type that is dequantized and requantized), the embedding in Q8_0
MIXED_TYPES = {"layers.0.": T.Q4_1, "layers.1.mlp.down_proj": T.Q5_0, "layers.1.": T.Q4_0, "embed_tokens": T.Q8_0}


def block_type(name: str, types: dict[str, T]) -> T:
    return next((kind for key, kind in types.items() if key in name), T.F32)


def write_tiny_gguf(path: Path, types: dict[str, T] = MIXED_TYPES, tied: bool = True,
                    seed: int = 0) -> tuple[Path, dict[str, torch.Tensor]]:
    """A 2-layer Llama GGUF with the default model's tokenizer cut to TINY_VOCAB tokens; returns the path and the
    float weights written (Hugging Face names and row order) before quantization. Norms are always F32."""
    fields = tokenizer_fields()
    vocab = len(fields["tokenizer.ggml.tokens"][0])
    config = tiny_config(vocab, tied)
    state = random_hf_state_dict(config, seed=seed, std=0.05)
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, (value, kind, sub) in fields.items():
        writer.add_key_value(key, value, kind, sub_type=sub)
    _add_hyperparameters(writer, config)
    for name, tensor in state.items():
        w = tensor.numpy().astype(np.float32)
        if ".q_proj." in name or ".k_proj." in name:
            w = llama_cpp_permute(w, config.num_heads if ".q_proj." in name else config.num_kv_heads)
        kind = T.F32 if w.ndim == 1 else block_type(name, types)
        if kind == T.F32:
            writer.add_tensor(gguf_name(name), w)
        else:
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(w, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, state


TINY_VOCAB = 1024  # the default vocabulary's first tokens: its specials, the bytes and the merges among them


@cache
def tokenizer_fields() -> dict[str, tuple]:
    """The default model's tokenizer.* fields, key -> (value, type, element type), cut to its first TINY_VOCAB
    tokens and the merges that stay inside them: the same BPE and chat template, converted by transformers in
    milliseconds instead of seconds. Parsed once."""
    header = read_gguf_header(loader.default_model_path(), arrays=True)  # gguf.GGUFReader: 13 s here
    fields = {key: (value, gguf.GGUFValueType(header.types[key][0]), element and gguf.GGUFValueType(element))
              for key, value in header.metadata.items() if key.startswith("tokenizer.")
              for element in [header.types[key][1]]}
    tokens = fields["tokenizer.ggml.tokens"][0][:TINY_VOCAB]
    kept = set(tokens)
    merges = [m for m in fields["tokenizer.ggml.merges"][0] if _merge_stays_in(m, kept)]
    for key, value in (("tokenizer.ggml.tokens", tokens), ("tokenizer.ggml.merges", merges),
                       ("tokenizer.ggml.token_type", fields["tokenizer.ggml.token_type"][0][:TINY_VOCAB])):
        fields[key] = (value, *fields[key][1:])
    assert all(v < TINY_VOCAB for k, (v, *_) in fields.items() if k.endswith("_token_id")), "a special token cut"
    return fields


def _merge_stays_in(merge: str, kept: set[str]) -> bool:
    left, right = merge.split(" ")
    return left in kept and right in kept and left + right in kept


def _add_hyperparameters(writer: gguf.GGUFWriter, c: ModelConfig) -> None:
    writer.add_block_count(c.num_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_heads)
    writer.add_head_count_kv(c.num_kv_heads)
    writer.add_rope_dimension_count(c.head_dim)
    writer.add_rope_freq_base(c.rope_theta)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)


# ---- any architecture: a transformers model's weights written as llama.cpp's converter would ----------------

# Hugging Face module -> GGUF tensor, per layer; families listed where they differ from the Llama names
HF_TO_GGUF_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                    "self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output",
                    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
                    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.gate_up_proj": "ffn_up",
                    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
                    "post_attention_layernorm": "ffn_norm", "pre_feedforward_layernorm": "ffn_norm",
                    "post_feedforward_layernorm": "post_ffw_norm"}
SANDWICH_LAYER = {"post_attention_layernorm": "post_attention_norm"}  # Gemma 2/3: a norm after attention
PERMUTED_QK = ("llama", "mistral")  # llama.cpp interleaves q/k rows only for these (the others use NEOX rope)
NORM_PLUS_ONE = ("gemma2", "gemma3")  # llama.cpp stores Gemma's (1 + w) norm weights with the 1 added


def gguf_tensor_name(hf: str, arch: str) -> str | None:
    hf = hf.removeprefix("model.")
    fixed = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf in fixed:
        return fixed[hf]
    if not hf.startswith("layers."):
        return None
    _, layer, *rest = hf.split(".")
    module, leaf = ".".join(rest[:-1]), rest[-1]
    table = {**HF_TO_GGUF_LAYER, **(SANDWICH_LAYER if arch in NORM_PLUS_ONE else {})}
    return f"blk.{layer}.{table[module]}.{leaf}"


def write_model_gguf(path: Path, arch: str, hf_config: dict, state: dict[str, torch.Tensor],
                     types: dict[str, T] | None = None, extra_keys: dict | None = None,
                     extra_tensors: dict[str, np.ndarray] | None = None, name: str = "tiny") -> Path:
    """A GGUF of `arch` holding a transformers model's state dict (names, q/k order and norm convention as
    llama.cpp's converter writes them), the default model's cut tokenizer, and the hyperparameters from
    hf_config. types: HF name fragment -> block type for 2-D tensors (default F32)."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(name)
    for key, (value, kind, sub) in tokenizer_fields().items():
        writer.add_key_value(key, value, kind, sub_type=sub)
    _add_arch_hyperparameters(writer, arch, hf_config)
    for key, value in (extra_keys or {}).items():
        writer.add_key_value(f"{arch}.{key}", value, _value_type(value))
    tied = hf_config.get("tie_word_embeddings", False)
    for name, tensor in state.items():
        target = gguf_tensor_name(name, arch)
        if target is None or (tied and target == "output.weight"):
            continue
        w = tensor.detach().float().numpy().astype(np.float32)
        w = _as_llama_cpp_stores(w, name, arch, hf_config)
        kind = T.F32 if w.ndim == 1 else block_type(name, types or {})
        if kind == T.F32:
            writer.add_tensor(target, w)
        else:
            writer.add_tensor(target, quantize_blocks(w, kind), raw_dtype=kind)
    for target, w in (extra_tensors or {}).items():
        writer.add_tensor(target, w.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _as_llama_cpp_stores(w: np.ndarray, name: str, arch: str, c: dict) -> np.ndarray:
    if arch in PERMUTED_QK and (".q_proj." in name or ".k_proj." in name):
        heads = c["num_attention_heads"] if ".q_proj." in name else c.get("num_key_value_heads")
        return llama_cpp_permute(w, heads or c["num_attention_heads"])
    if arch in NORM_PLUS_ONE and name.endswith("norm.weight"):
        return w + 1
    return w


def _value_type(value) -> gguf.GGUFValueType:
    if isinstance(value, bool):
        return gguf.GGUFValueType.BOOL
    if isinstance(value, int):
        return gguf.GGUFValueType.UINT32
    if isinstance(value, float):
        return gguf.GGUFValueType.FLOAT32
    return gguf.GGUFValueType.STRING


def _add_arch_hyperparameters(writer: gguf.GGUFWriter, arch: str, c: dict) -> None:
    heads = c["num_attention_heads"]
    head_dim = c.get("head_dim") or c["hidden_size"] // heads
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(c["hidden_size"])
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(c.get("num_key_value_heads") or heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(_full_attention_theta(c)))
    writer.add_layer_norm_rms_eps(c.get("rms_norm_eps", 1e-6))
    writer.add_vocab_size(c["vocab_size"])
    if c.get("sliding_window"):
        writer.add_sliding_window(c["sliding_window"])
    if c.get("attn_logit_softcapping"):
        writer.add_attn_logit_softcapping(c["attn_logit_softcapping"])
    if c.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(c["final_logit_softcapping"])


def _full_attention_theta(c: dict) -> float:
    """rope.freq_base: the full-attention layers' base (Gemma 3's sliding layers use 10,000, as llama.cpp
    assumes)."""
    rope = c.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)
    return rope.get("rope_theta", c.get("rope_theta", 10000.0))


# ---- K-quant blocks as llama.cpp lays them out (gguf-py reads them but cannot write them) --------------------


def quantize_blocks(w: np.ndarray, kind: T) -> np.ndarray:
    """[N, K] float32 -> the GGUF bytes of `kind` (Q4_K and Q6_K here, the rest through gguf-py)."""
    if kind == T.Q4_K:
        return quantize_q4_k(w)
    if kind == T.Q6_K:
        return quantize_q6_k(w)
    return gguf.quants.quantize(w, kind)


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)[..., None].view(np.uint8).reshape(*x.shape, 2)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """Q4_K: per 256 values d, dmin (float16), eight 6-bit (scale, min) pairs packed in 12 bytes, 128 bytes of
    nibbles (sub-blocks 2i and 2i+1 in the low and high nibbles of the same 32 bytes). -> [N, K/256*144]."""
    n, k = w.shape
    sub = w.reshape(n, k // 256, 8, 32).astype(np.float32)
    lo = np.minimum(sub.min(-1), 0)  # value = d*sc*q - dmin*m with m >= 0: a sub-block's minimum is <= 0
    step = (sub.max(-1) - lo) / 15
    d = np.maximum(step.max(-1), 1e-8) / 63
    dmin = np.maximum((-lo).max(-1), 1e-8) / 63
    d16, dmin16 = d.astype(np.float16).astype(np.float32), dmin.astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(step / d16[..., None]), 1, 63).astype(np.uint8)
    m = np.clip(np.round(-lo / dmin16[..., None]), 0, 63).astype(np.uint8)
    scale = (d16[..., None] * sc)[..., None]
    q = np.clip(np.round((sub + (dmin16[..., None] * m)[..., None]) / scale), 0, 15).astype(np.uint8)
    packed = np.empty((n, k // 256, 12), dtype=np.uint8)
    packed[..., 0:4] = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    packed[..., 4:8] = m[..., :4] | ((m[..., 4:] >> 4) << 6)
    packed[..., 8:12] = (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4)
    pairs = q.reshape(n, k // 256, 4, 2, 32)
    qs = (pairs[:, :, :, 0] | (pairs[:, :, :, 1] << 4)).reshape(n, k // 256, 128)
    blocks = np.concatenate([_f16_bytes(d), _f16_bytes(dmin), packed, qs], axis=-1)
    return blocks.reshape(n, -1)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """Q6_K: per 256 values 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, d (float16);
    value = d * sc * (q - 32). -> [N, K/256*210]."""
    n, k = w.shape
    groups = w.reshape(n, k // 256, 16, 16).astype(np.float32)
    step = np.abs(groups).max(-1) / 31
    d = np.maximum(np.abs(step).max(-1), 1e-8) / 127
    d16 = d.astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(step / d16[..., None]), 1, 127).astype(np.int8)
    q = np.clip(np.round(groups / (d16[..., None] * sc)[..., None]), -32, 31).astype(np.int16) + 32
    q = q.astype(np.uint8).reshape(n, k // 256, 2, 4, 32)  # [.., half, k, l] in value order
    low, high = q & 15, q >> 4
    ql = np.concatenate([low[:, :, :, 0] | (low[:, :, :, 2] << 4), low[:, :, :, 1] | (low[:, :, :, 3] << 4)],
                        axis=-1)  # [N, B, 2, 64]
    qh = high[:, :, :, 0] | (high[:, :, :, 1] << 2) | (high[:, :, :, 2] << 4) | (high[:, :, :, 3] << 6)
    blocks = np.concatenate([ql.reshape(n, -1, 128), qh.reshape(n, -1, 64), sc.view(np.uint8),
                             _f16_bytes(d)], axis=-1)
    return blocks.reshape(n, -1)
