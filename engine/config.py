"""Configuration dataclasses: the model's shape, the engine's settings, the sampling parameters."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.architectures import (
    BY_HF_ARCHITECTURE,
    FAMILIES,
    ArchitectureError,
    Family,
    activation_of,
    attention_fields,
)

CACHE_STRATEGIES = ("none", "contiguous", "paged", "paged-int8")
CACHE_PRESETS = {"paged-int8": ("paged", "int8")}  # strategy names that fix a layout and its precision
WEIGHT_FORMATS = ("auto", "float32", "bfloat16", "int8", "int4")
BLOCK_SIZES = (1, 8, 16, 32, 64)
SUPPORTED_ARCHITECTURES = tuple(BY_HF_ARCHITECTURE)  # engine/architectures.py: one row per family


def cache_preset(strategy: str) -> tuple[str, str | None]:
    """(its layout, the precision it fixes): ('paged', 'int8') for 'paged-int8', (strategy, None) for a layout."""
    return CACHE_PRESETS.get(strategy, (strategy, None))


class ConfigError(ValueError):
    """A configuration value is out of range or of the wrong kind."""


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "LlamaForCausalLM"
    # per-model attention switches (engine/architectures.py reads them from the checkpoint)
    activation: str = "silu"  # silu (SwiGLU) or gelu_tanh (GeGLU)
    sliding_window: int = 0  # the sliding layers' window in tokens (0: no layer slides)
    sliding_layers: tuple[bool, ...] = ()  # per layer: does it slide (empty: none does)
    attn_logit_softcap: float = 0.0  # scores -> cap * tanh(scores / cap) (0: off)
    final_logit_softcap: float = 0.0  # logits -> cap * tanh(logits / cap) (0: off)
    query_scale: float | None = None  # the attention scores' factor (None: head_dim ** -0.5)
    rope_local_theta: float | None = None  # the sliding layers' own rotary base (Gemma 3)

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.architecture not in BY_HF_ARCHITECTURE:
            raise ConfigError(f"unsupported architecture {self.architecture!r}; supported: "
                              f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        if self.sliding_layers and len(self.sliding_layers) != self.num_layers:
            raise ConfigError(f"{len(self.sliding_layers)} sliding-layer flags for {self.num_layers} layers")

    @property
    def family(self) -> Family:
        """The switches fixed for the whole family (engine/architectures.py)."""
        return BY_HF_ARCHITECTURE[self.architecture]

    def is_sliding(self, layer: int) -> bool:
        return bool(self.sliding_layers) and self.sliding_layers[layer]

    @classmethod
    def from_hf_dict(cls, d: dict) -> ModelConfig:
        """Build from a Hugging Face config.json dictionary (any family in engine/architectures.py)."""
        architectures = d.get("architectures") or [_architecture_from_model_type(d.get("model_type"))]
        arch = architectures[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        family = BY_HF_ARCHITECTURE[arch]
        num_heads = d["num_attention_heads"]
        rope = _full_attention_rope(d)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        if d.get("attention_bias") and not family.attention_bias:
            raise ConfigError(f"{arch} with attention_bias (biases on every projection) is not supported")
        try:
            switches = attention_fields(d, family, d["num_hidden_layers"])
            activation = activation_of(d, family)
        except ArchitectureError as e:
            raise ConfigError(str(e)) from None
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // num_heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-5),
            rope_theta=rope.get("rope_theta", d.get("rope_theta", 10000.0)),
            rope_scaling=dict(rope) if rope_type != "default" else None,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            architecture=arch,
            activation=activation,
            **switches,
        )

    def kv_bytes_per_token(self, bytes_per_element: float) -> float:
        """The article's formula: 2 (K and V) x bytes/element x layers x KV heads x head_dim."""
        return 2 * bytes_per_element * self.num_layers * self.num_kv_heads * self.head_dim

    @property
    def num_params(self) -> int:
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        per_layer = attn + 3 * h * i + 2 * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_layers * per_layer + h + head


def _full_attention_rope(d: dict) -> dict:
    """The rotary parameters of the full-attention layers (Gemma 3 keeps one set per layer type)."""
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if isinstance(rope.get("full_attention"), dict):
        rope = rope["full_attention"]
    return rope


def _architecture_from_model_type(model_type: str | None) -> str:
    family = FAMILIES.get(model_type or "")
    return family.hf_architecture if family else str(model_type)


KV_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "int4")  # what contiguous and paged store K, V in


@dataclass
class EngineConfig:
    cache: str = "paged"
    block_size: int = 16
    pool_tokens: int | None = None  # paged pool capacity in tokens; default: the context limit
    kv_budget_mib: float | None = None  # the most a paged pool grows to; default: one context's worth
    max_context: int | None = None  # default: the model's max_position_embeddings
    device: str | None = None  # default: cuda, then mps, then cpu
    dtype: str | None = None  # default: float16 on cuda/mps, float32 on cpu (measured fastest there)
    num_threads: int | None = None
    weights: str | None = None  # weight format: auto, float32, bfloat16, int8, int4 (None: as the model holds them)
    prefix_reuse: bool = True  # keep a conversation's cache between turns and reuse the common prefix
    kv_dtype: str | None = None  # K/V storage of contiguous and paged: KV_DTYPES (None: the activations' dtype)
    kv_residual: int | None = None  # quantized KV: newest tokens kept in full precision (None: the precision's own)
    kv_sink: int | None = None  # quantized KV: first tokens kept in full precision (None: the precision's own)
    cuda_graphs: bool = True  # on CUDA, decode steps replay a graph per shape bucket (engine/graphs.py)

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        if self.cache not in CACHE_STRATEGIES:
            raise ConfigError(f"unknown cache strategy {self.cache!r}; choose one of {', '.join(CACHE_STRATEGIES)}")
        if self.block_size not in BLOCK_SIZES:
            raise ConfigError(f"block size must be one of {BLOCK_SIZES}, got {self.block_size}")
        for name in ("pool_tokens", "max_context"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be positive, got {value}")
        if self.kv_budget_mib is not None and not self.kv_budget_mib > 0:
            raise ConfigError(f"the KV budget must be a positive number of MiB, got {self.kv_budget_mib}")
        for name in ("prefix_reuse", "cuda_graphs"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.dtype not in (None, "float32", "float16", "bfloat16"):
            raise ConfigError(f"dtype must be float32, float16 or bfloat16, got {self.dtype!r}")
        for name in ("kv_residual", "kv_sink"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ConfigError(f"{name} must be a whole number of tokens >= 0, got {value!r}")
        if self.kv_dtype not in (None, *KV_DTYPES):
            raise ConfigError(f"unknown KV precision {self.kv_dtype!r}; choose one of {', '.join(KV_DTYPES)}")
        if self.weights not in (None, *WEIGHT_FORMATS):
            raise ConfigError(f"unknown weight format {self.weights!r}; choose one of {', '.join(WEIGHT_FORMATS)}")


SPECULATIVE_MODES = ("off", "lookup", "draft")  # draft: a second model set as engine.draft_engine


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding of a generation: draft up to max_draft_tokens, verify them in one forward."""

    mode: str = "off"
    max_draft_tokens: int = 8
    max_ngram: int = 3  # prompt lookup matches the last n tokens, n from max_ngram down to min_ngram
    min_ngram: int = 1
    adaptive: bool = True  # k follows the recent acceptance rate; speculation stands down when it does not pay

    def __post_init__(self):
        if self.mode not in SPECULATIVE_MODES:
            raise ConfigError(f"unknown speculative mode {self.mode!r}; choose one of {', '.join(SPECULATIVE_MODES)}")
        if not 1 <= self.max_draft_tokens <= 64:
            raise ConfigError(f"max_draft_tokens must be in 1..64, got {self.max_draft_tokens}")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ConfigError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram} and {self.max_ngram}")

    @property
    def enabled(self) -> bool:
        return self.mode != "off"


@dataclass
class SamplingParams:
    temperature: float = 0.7
    top_k: int = 40
    top_p: float = 0.95
    repetition_penalty: float = 1.1
    max_new_tokens: int = 512
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default=())
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    def __post_init__(self):
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.repetition_penalty <= 0:
            raise ConfigError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
