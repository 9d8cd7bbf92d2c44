"""Architectures as data: what each model family changes in the one decoder (engine/model.py), and how a GGUF
file's keys become the Hugging Face style config that describes one model.

A `Family` holds what is fixed for every checkpoint of a family (biases, q/k norms, the norm convention, the
activation, Gemma's scaled embedding and sandwich norms, how llama.cpp names and orders its tensors); the numbers
that vary per checkpoint (sliding window, soft-caps, the attention scale, rope bases) travel in the config,
read from the GGUF keys by `hf_config_from_gguf` or from a config.json. No class per family: switches, the way
llama.cpp's llama-arch tables and transformers' configs do it.
"""

from __future__ import annotations

from dataclasses import dataclass


class ArchitectureError(ValueError):
    """A checkpoint asks for an architecture or a feature of one that kvscope does not implement."""


@dataclass(frozen=True)
class Family:
    model_type: str  # Hugging Face model_type
    hf_architecture: str  # config.json "architectures"
    gguf_names: tuple[str, ...]  # general.architecture values read as this family
    attention_bias: bool = False  # q, k and v projections carry biases (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm of q and k before rotary (Qwen3, Gemma 3)
    norm_offset: float = 0.0  # Hugging Face stores w, the model applies (offset + w) (Gemma); llama.cpp adds it
    embedding_scale: bool = False  # embeddings times sqrt(hidden_size) (Gemma)
    activation: str = "silu"  # the gated MLP's activation: silu (SwiGLU) or gelu_tanh (GeGLU)
    sandwich_norms: bool = False  # norms after attention and after the MLP too (Gemma 2/3)
    permuted_qk: bool = False  # llama.cpp interleaves q/k rows (its "normal" rope); the others use NEOX order
    fused_gguf_qkv: bool = False  # llama.cpp stores one attn_qkv and one ffn_up holding gate and up (Phi-3)
    sliding_pattern: int = 0  # every n-th layer is global, the others slide (Gemma 2: 2, Gemma 3: 6; 0: none)
    local_rope_theta: float | None = None  # the sliding layers' own rotary base (Gemma 3)


FAMILIES = {f.model_type: f for f in (
    Family("llama", "LlamaForCausalLM", ("llama",), permuted_qk=True),
    Family("mistral", "MistralForCausalLM", ("mistral",), permuted_qk=True),
    Family("qwen2", "Qwen2ForCausalLM", ("qwen2",), attention_bias=True),
    Family("qwen3", "Qwen3ForCausalLM", ("qwen3",), qk_norm=True),
    Family("gemma2", "Gemma2ForCausalLM", ("gemma2",), norm_offset=1.0, embedding_scale=True,
           activation="gelu_tanh", sandwich_norms=True, sliding_pattern=2),
    Family("gemma3_text", "Gemma3ForCausalLM", ("gemma3",), qk_norm=True, norm_offset=1.0, embedding_scale=True,
           activation="gelu_tanh", sandwich_norms=True, sliding_pattern=6, local_rope_theta=10000.0),
    Family("phi3", "Phi3ForCausalLM", ("phi3",), fused_gguf_qkv=True),
)}
BY_HF_ARCHITECTURE = {f.hf_architecture: f for f in FAMILIES.values()}
BY_GGUF_NAME = {name: f for f in FAMILIES.values() for name in f.gguf_names}
HF_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def family_of(model_type: str) -> Family:
    family = FAMILIES.get(model_type)
    if family is None:
        raise ArchitectureError(f"unsupported architecture {model_type!r}; supported: {', '.join(FAMILIES)}")
    return family


def family_of_gguf(architecture: str) -> Family:
    family = BY_GGUF_NAME.get(architecture)
    if family is None:
        raise ArchitectureError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(sorted(BY_GGUF_NAME))}")
    return family


# ---- GGUF keys -> a Hugging Face style config
def hf_config_from_gguf(metadata: dict, tensor_names: set[str], num_tokens: int) -> dict:
    """The config.json of a GGUF model, from its `{arch}.*` and `tokenizer.ggml.*` keys (engine/gguf_header.py's
    metadata) and its tensor names. Raises ArchitectureError naming what is not supported."""
    arch = metadata.get("general.architecture")
    family = family_of_gguf(str(arch))
    if arch == "llama" and "mistral" in str(metadata.get("general.name", "")).lower():
        family = FAMILIES["mistral"]  # llama.cpp writes Mistral models as llama; transformers reads them so too

    def key(name, default=None):
        return metadata.get(f"{arch}.{name}", default)

    heads = _required(key("attention.head_count"), f"{arch}.attention.head_count")
    hidden = _required(key("embedding_length"), f"{arch}.embedding_length")
    head_dim = key("attention.key_length") or hidden // heads
    _check_rotary(key("rope.dimension_count"), head_dim, tensor_names)
    layers = _required(key("block_count"), f"{arch}.block_count")
    config = {
        "architectures": [family.hf_architecture], "model_type": family.model_type,
        "vocab_size": key("vocab_size") or num_tokens, "hidden_size": hidden,
        "intermediate_size": _required(key("feed_forward_length"), f"{arch}.feed_forward_length"),
        "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": key("attention.head_count_kv") or heads, "head_dim": head_dim,
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon", 1e-5),
        "max_position_embeddings": key("context_length", 2048),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
    }
    config.update(_rope_scaling(key, config["rope_theta"]))
    config.update(_attention_switches(family, key, config))
    return config


def _required(value, name: str):
    if value is None:
        raise ArchitectureError(f"the file has no {name} key; it is not a complete model GGUF")
    return value


def _check_rotary(rotary_dims, head_dim: int, tensor_names: set[str]) -> None:
    if rotary_dims is not None and rotary_dims != head_dim:
        raise ArchitectureError(f"partial rotary embeddings ({rotary_dims} of {head_dim} dimensions per head) are "
                                "not supported")
    if "rope_factors_long.weight" in tensor_names:
        raise ArchitectureError("long-context rope factors (Phi-3 'longrope') are not supported")


def _rope_scaling(key, theta: float) -> dict:
    kind = key("rope.scaling.type")
    if kind in (None, "none"):
        return {}
    if kind == "linear":
        return {"rope_scaling": {"rope_type": "linear", "factor": float(key("rope.scaling.factor", 1.0)),
                                 "rope_theta": theta}}
    raise ArchitectureError(f"unsupported rope scaling {kind!r} in the GGUF; supported: none, linear, and "
                            "llama.cpp's rope_freqs factors (Llama 3)")


def _attention_switches(family: Family, key, config: dict) -> dict:
    """Sliding-window layers, soft-caps and the attention scale, as transformers names them."""
    out = {}
    window = key("attention.sliding_window") or 0
    if family.sliding_pattern and window:
        n = family.sliding_pattern
        out["sliding_window"] = window
        out["layer_types"] = ["full_attention" if (i + 1) % n == 0 else "sliding_attention"
                              for i in range(config["num_hidden_layers"])]
    elif window:
        out["sliding_window"] = window  # every layer slides (Phi-3, Mistral 7B v0.1)
    if family.model_type in ("gemma2", "gemma3_text"):
        out["query_pre_attn_scalar"] = _gemma_query_scalar(config)
        out["attn_logit_softcapping"] = key("attn_logit_softcapping")
        out["final_logit_softcapping"] = key("final_logit_softcapping")
        if family.local_rope_theta:
            out["rope_local_base_freq"] = family.local_rope_theta
    return out


GEMMA_27B_LAYERS = (46, 62)  # Gemma 2 27B, Gemma 3 27B: llama.cpp scales queries by (hidden / heads) ** -0.5


def _gemma_query_scalar(c: dict) -> int:
    """What llama.cpp divides Gemma's queries by (squared): head_dim, except for the 27B models (read, as
    llama.cpp does, from the layer count), where it is hidden_size / heads. The GGUF has no key for it."""
    if c["num_hidden_layers"] in GEMMA_27B_LAYERS:
        return c["hidden_size"] // c["num_attention_heads"]
    return c["head_dim"]


# ---- a config.json -> the per-model switches ModelConfig keeps
def attention_fields(d: dict, family: Family, num_layers: int) -> dict:
    """ModelConfig's per-model switches from a Hugging Face config dict."""
    window = d.get("sliding_window") or 0
    if d.get("use_sliding_window") is False:
        window = 0  # Qwen2 configs name a window they do not use
    types = d.get("layer_types")
    every = (bool(window),) * num_layers  # a window without layer types: every layer slides
    sliding = tuple(t == "sliding_attention" for t in types) if window and types else every
    scalar = d.get("query_pre_attn_scalar")
    local_theta = d.get("rope_local_base_freq", family.local_rope_theta)
    rope = d.get("rope_parameters") or {}
    if isinstance(rope.get("sliding_attention"), dict):
        local_theta = rope["sliding_attention"].get("rope_theta", local_theta)
    return dict(
        sliding_window=window if any(sliding) else 0, sliding_layers=sliding if any(sliding) else (),
        attn_logit_softcap=float(d.get("attn_logit_softcapping") or 0.0),
        final_logit_softcap=float(d.get("final_logit_softcapping") or 0.0),
        query_scale=float(scalar) ** -0.5 if scalar else None,
        rope_local_theta=float(local_theta) if family.local_rope_theta and local_theta else None,
    )


def activation_of(d: dict, family: Family) -> str:
    name = d.get("hidden_activation") or d.get("hidden_act") or family.activation
    if name not in HF_ACTIVATIONS and name not in HF_ACTIVATIONS.values():
        raise ArchitectureError(f"unsupported activation {name!r}; supported: silu, gelu_pytorch_tanh")
    return HF_ACTIVATIONS.get(name, name)
