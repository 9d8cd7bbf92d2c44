"""One decoder for every supported family (Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3) in plain PyTorch, switched by
the config's architecture description (engine/architectures.py). Attention reads and writes keys and values only
through a StepView."""

from __future__ import annotations

import contextlib
import ctypes
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine import kernels
from engine.config import ConfigError, ModelConfig
from engine.kv.attention import LayerAttention
from engine.kv.base import FusedStep, StepView
from engine.weights.formats import QuantizedWeight
from engine.weights.linear import DECODE_ROWS, FloatLinear, WeightLinear, build_linear

Weight = torch.Tensor | QuantizedWeight
_one_call = True  # decode layers run as one compiled call where they can
_plans_generation = 0  # bumped wherever a layer's one-call plan may change: a model's OneStep is of one generation


def plans_changed() -> None:
    global _plans_generation
    _plans_generation += 1


def plans_generation() -> int:
    """Bumped wherever a layer's tensors may have been replaced (what a captured graph's addresses depend on)."""
    return _plans_generation


@contextlib.contextmanager
def op_by_op() -> Iterator[None]:
    """Inside the block every layer runs op by op (what the one-call layer must equal, bit for bit)."""
    global _one_call
    before, _one_call = _one_call, False
    try:
        yield
    finally:
        _one_call = before


def placeholder(out_features: int, in_features: int) -> WeightLinear:
    """A projection whose weights are assigned at load (built on the meta device)."""
    return FloatLinear(torch.empty(out_features, in_features))


class TokenEmbedding(nn.Module):
    """Embedding rows read from a projection's storage (the head's when tied), in any weight format."""

    def __init__(self, table: WeightLinear, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.table = table
        self.dtype = dtype

    def forward(self, ids: torch.Tensor, checked: bool = False) -> torch.Tensor:
        # ids: [B, T] -> [B, T, H]; checked: every id is a row of the table (engine/graphs.py checks them)
        return self.table.rows(ids, self.dtype, checked)


def rope_inv_freq(config: ModelConfig, local: bool = False) -> torch.Tensor:
    """-> [D/2] float64. local: the sliding layers' own base, unscaled (Gemma 3)."""
    d = config.head_dim
    theta = config.rope_local_theta if local else config.rope_theta
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    scaling = None if local else config.rope_scaling
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if kind == "freq_factors":  # llama.cpp's rope_freqs tensor: each frequency divided by its factor
        factors = torch.tensor(scaling["factors"], dtype=torch.float64)
        if factors.shape != inv_freq.shape:
            raise ConfigError(f"{factors.numel()} rope frequency factors for {inv_freq.numel()} frequencies")
        return inv_freq / factors
    raise ConfigError(f"unsupported rope scaling {kind!r}; supported: default, linear, llama3, freq_factors")


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_context = s.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_context / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    is_medium = (wavelen <= old_context / low) & (wavelen >= old_context / high)
    return torch.where(is_medium, blended, scaled)


class Rotary(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int, local: bool = False):
        super().__init__()
        positions = torch.arange(max_positions, dtype=torch.float64)
        freqs = torch.outer(positions, rope_inv_freq(config, local))  # [P, D/2]
        angles = torch.cat([freqs, freqs], dim=-1)  # [P, D]
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [B, T] -> cos, sin: [B, 1, T, D]
        cos, sin = self.cos[positions], self.sin[positions]
        if cos.dtype != dtype:
            cos, sin = cos.to(dtype), sin.to(dtype)
        return cos[:, None], sin[:, None]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, H, T, D]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = kernels.for_activations(x)
        if ops is not None:
            return ops.rms_norm(x.contiguous(), self.weight, self.eps)
        if x.dtype == torch.float32:
            return F.rms_norm(x, x.shape[-1:], self.weight, self.eps)
        normed = F.rms_norm(x.float(), x.shape[-1:], None, self.eps)
        return self.weight * normed.to(x.dtype)

    def add_and_norm(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """The residual stream x += delta (in place), then its norm."""
        ops = kernels.for_activations(x)
        if ops is not None and x.is_contiguous():
            return ops.add_rms_norm(x, delta.contiguous(), self.weight, self.eps)
        x.add_(delta)
        return self(x)


def layer_attention(c: ModelConfig, layer: int) -> LayerAttention | None:
    """The layer's scale, window and soft-cap; None when it attends plainly (the compiled kernel's case)."""
    spec = LayerAttention(scale=c.query_scale, window=c.sliding_window if c.is_sliding(layer) else 0,
                          softcap=c.attn_logit_softcap)
    return None if spec.is_plain else spec


class Attention(nn.Module):
    def __init__(self, c: ModelConfig, layer: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        qkv_rows = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        self.qkv_proj = placeholder(qkv_rows, c.hidden_size)
        self.o_proj = placeholder(c.hidden_size, c.num_heads * c.head_dim)
        family = c.family
        self.qkv_bias = nn.Parameter(torch.zeros(qkv_rows)) if family.attention_bias else None
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if family.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if family.qk_norm else None
        self.spec = layer_attention(c, layer)

    def forward(self, x, cos, sin, view: StepView, layer: int) -> torch.Tensor:
        qkv = self.qkv_proj.forward(x)  # [B, T, (Hq+2Hkv)*D]
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias
        if self.q_norm is not None:
            qkv = self.normed_qk(qkv)
        q, k, v = self.rotated_qkv(qkv, cos, sin)  # [B, H, T, D] each
        return self.o_proj.forward(view.attend(layer, q, k, v, self.spec))  # attended: [B, T, Hq * D]

    def normed_qk(self, qkv: torch.Tensor) -> torch.Tensor:
        """Each head of q and of k through its RMSNorm over D (Qwen3, Gemma 3), v untouched."""
        b, t, _ = qkv.shape
        hq, hkv = self.num_heads, self.num_kv_heads
        q, k, v = qkv.view(b, t, hq + 2 * hkv, self.head_dim).split([hq, hkv, hkv], dim=2)
        return torch.cat([self.q_norm(q), self.k_norm(k), v], dim=2).view(b, t, -1)

    def rotated_qkv(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> list[torch.Tensor]:
        """qkv: [B, T, (Hq+2Hkv)*D]; cos, sin: [B, 1, T, D] -> q [B, Hq, T, D], k, v [B, Hkv, T, D], rotary on
        q and k (one fused op where the kernels run)."""
        b, t, _ = qkv.shape
        d, hq, hkv = self.head_dim, self.num_heads, self.num_kv_heads
        ops = kernels.for_activations(qkv)
        if ops is not None:
            return ops.rope_qkv(qkv.contiguous(), cos[:, 0], sin[:, 0], hq, hkv)
        q, k, v = qkv.view(b, t, hq + 2 * hkv, d).transpose(1, 2).split([hq, hkv, hkv], dim=1)
        return [apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v.contiguous()]


class MLP(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.intermediate = c.intermediate_size
        self.gelu = c.activation == "gelu_tanh"  # GeGLU (Gemma) instead of SwiGLU
        self.gate_up_proj = placeholder(2 * c.intermediate_size, c.hidden_size)
        self.down_proj = placeholder(c.hidden_size, c.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj.forward(x)
        ops = kernels.for_activations(gate_up)
        if ops is not None and not self.gelu:
            return self.down_proj.forward(ops.silu_mul(gate_up.contiguous()))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        gated = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down_proj.forward(gated * up)


@dataclass
class OneCall:
    """A layer's arguments for the kernels' decoder_layer: the four projections' kernel tensors (qkv, o, gate_up,
    down) and how many each has, the two norms after attention and before the next layer, and the heads."""

    ops: object
    weights: list[torch.Tensor]
    parts: list[int]
    norms: list[torch.Tensor]
    eps: float
    num_heads: int
    num_kv_heads: int

    @classmethod
    def of(cls, layer: DecoderLayer, next_norm: RMSNorm) -> OneCall | None:
        a, m, post = layer.self_attn, layer.mlp, layer.post_attention_layernorm
        projections = [a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj]
        ops = kernels.ops()
        plain = not (layer.sandwich or m.gelu or a.qkv_bias is not None or a.q_norm is not None or a.spec)
        if ops is None or not plain or next_norm.eps != post.eps or any(p.compiled is None for p in projections):
            return None
        tensors = [p.kernel_args() for p in projections]
        return cls(ops, [t for ts in tensors for t in ts], [len(ts) for ts in tensors], [post.weight, next_norm.weight],
                   post.eps, a.num_heads, a.num_kv_heads)


@dataclass
class OneStep:
    """Every layer's OneCall, flattened for the kernels' decoder_layers: a decode step's layers in one call (one
    dispatch and one argument conversion a step instead of one a layer; the same calls inside, the same bits)."""

    plans: tuple[OneCall, ...]
    weights: list[torch.Tensor]
    parts: list[int]
    norms: list[torch.Tensor]
    eps: list[float]
    heads: list[int]

    @classmethod
    def of(cls, plans: tuple[OneCall, ...]) -> OneStep:
        return cls(plans, [w for p in plans for w in p.weights], [n for p in plans for n in p.parts],
                   [t for p in plans for t in p.norms], [p.eps for p in plans],
                   [h for p in plans for h in (p.num_heads, p.num_kv_heads)])

    def run(self, x: torch.Tensor, normed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            fused: FusedStep) -> torch.Tensor:
        """x: the residual stream [B, T, H], updated in place; normed: x through the first layer's input norm;
        fused: the step view's fused_step. Returns the last layer's output through the final norm."""
        return self.plans[0].ops.decoder_layers(x, normed, cos, sin, self.weights, self.parts, self.norms, self.eps,
                                                self.heads, *fused)


def decode_rows(normed: torch.Tensor) -> bool:
    """Whether a step's rows can run through the compiled one-call layer (a decode step's few float32 CPU rows)."""
    return (_one_call and normed.dtype == torch.float32 and normed.device.type == "cpu"
            and normed.numel() <= DECODE_ROWS * normed.shape[-1] and kernels.ops() is not None)


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP; with sandwich norms (Gemma 2/3) each branch's output is normed too, and the
    norm before the MLP is pre_feedforward_layernorm (Hugging Face's names)."""

    def __init__(self, c: ModelConfig, layer: int):
        super().__init__()
        h, eps = c.hidden_size, c.rms_norm_eps
        self.sandwich = c.family.sandwich_norms
        self.local_rotary = c.is_sliding(layer) and c.rope_local_theta is not None
        self.input_layernorm = RMSNorm(h, eps)
        self.self_attn = Attention(c, layer)
        self.post_attention_layernorm = RMSNorm(h, eps)
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(h, eps)
            self.post_feedforward_layernorm = RMSNorm(h, eps)
        self.mlp = MLP(c)

    def forward(self, x, normed, cos, sin, view: StepView, layer: int, next_norm: RMSNorm) -> torch.Tensor:
        """x: the residual stream [B, T, H], updated in place; normed: x through this layer's input norm.
        Returns x through next_norm (the next layer's input norm, or the final norm)."""
        plan = self.one_call_plan(next_norm)
        if plan and decode_rows(normed):
            kv = view.fused_kv(layer)
            if kv is not None:  # the whole layer in one call
                return plan.ops.decoder_layer(x, normed, cos, sin, plan.weights, plan.parts, plan.norms, plan.eps,
                                              plan.num_heads, plan.num_kv_heads, *kv)
        # children called through forward: a step makes hundreds of these calls, nn.Module's hooks add up
        attended = self.self_attn.forward(normed, cos, sin, view, layer)
        if not self.sandwich:
            normed = self.post_attention_layernorm.add_and_norm(x, attended)
            return next_norm.add_and_norm(x, self.mlp.forward(normed))
        normed = self.pre_feedforward_layernorm.add_and_norm(x, self.post_attention_layernorm.forward(attended))
        return next_norm.add_and_norm(x, self.post_feedforward_layernorm.forward(self.mlp.forward(normed)))

    def one_call_plan(self, next_norm: RMSNorm) -> OneCall | None:
        """What the kernels' decoder_layer takes for this layer, looked up once; None where the layer has a part
        the one call does not do (biases, q/k norms, sandwich norms, GeGLU, its own attention, a projection
        without a compiled kernel): then it runs op by op, through the same kernels."""
        plan = self.__dict__.get("_one_call", False)
        if plan is False:
            plan = self.__dict__["_one_call"] = OneCall.of(self, next_norm)
        return plan

    def _apply(self, fn, recurse=True):  # .to() and friends replace the tensors: look them up again
        self.__dict__.pop("_one_call", None)
        plans_changed()
        return super()._apply(fn, recurse)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int | None = None):
        super().__init__()
        self.config = config
        self.lm_head = placeholder(config.vocab_size, config.hidden_size)
        self.embed_tokens = TokenEmbedding(self.lm_head if config.tie_word_embeddings
                                           else placeholder(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.embedding_scale = config.hidden_size ** 0.5 if config.family.embedding_scale else None
        self.final_softcap = config.final_logit_softcap
        if torch.get_default_device().type != "meta":  # from_hf_state_dict builds it once the weights are in
            self.build_rotary(max_positions)

    def build_rotary(self, max_positions: int | None) -> None:
        positions = max_positions or self.config.max_position_embeddings
        self.rotary = Rotary(self.config, positions)
        local = any(layer.local_rotary for layer in self.layers)
        self.local_rotary = Rotary(self.config, positions, local=True) if local else None

    def one_step(self, normed: torch.Tensor) -> OneStep | None:
        """Every layer in one call, where every layer has a one-call plan (no sliding or locally rotated layer)
        and the rows are a decode step's; None otherwise (then each layer is one call, or runs op by op). Planned
        once per generation of the layers' plans, not per step (a step's Python is paid with cold caches)."""
        if not decode_rows(normed):
            return None
        generation, step = self.__dict__.get("_one_step", (None, None))
        if generation != _plans_generation:
            step = self._plan_one_step()
            self.__dict__["_one_step"] = (_plans_generation, step)
        return step

    def _plan_one_step(self) -> OneStep | None:
        layers = list(self.layers)
        if any(layer.local_rotary for layer in layers):
            return None
        norms = [layer.input_layernorm for layer in layers[1:]] + [self.norm]
        plans = tuple(layer.one_call_plan(norm) for layer, norm in zip(layers, norms))
        return None if any(plan is None for plan in plans) else OneStep.of(plans)

    def forget_one_call_plans(self) -> None:
        """Projections were replaced (a weight format changed): each layer looks its tensors up again."""
        for layer in self.layers:
            layer.__dict__.pop("_one_call", None)
        plans_changed()

    def _apply(self, fn, recurse=True):  # .to() and friends replace the tensors: the flattened ones go too
        plans_changed()
        return super()._apply(fn, recurse)

    def projections(self) -> dict[str, WeightLinear]:
        """Every weight matrix by name (a tied embedding is the head, listed once)."""
        return {name: m for name, m in self.named_modules(remove_duplicate=True) if isinstance(m, WeightLinear)}

    @property
    def weight_format(self) -> str:
        """The format of the transformer blocks' projections (the head may differ, e.g. int8 beside int4)."""
        return self.layers[0].mlp.down_proj.format_name

    @property
    def resident_bytes(self) -> int:
        """Bytes of all weights as they sit in memory (norms included, rotary tables excluded)."""
        own = sum(m.resident_bytes for m in self.projections().values())
        return own + sum(p.nbytes for p in self.parameters())

    @property
    def decode_weight_bytes(self) -> int:
        """Bytes of weights a decode step reads: every projection once (an untied embedding: one row)."""
        table = self.embed_tokens.table
        untied_rows = table.resident_bytes * (table.out_features - 1) // table.out_features \
            if table is not self.lm_head else 0
        return self.resident_bytes - untied_rows

    def set_activation_dtype(self, dtype: torch.dtype) -> None:
        """Norms and embeddings produce `dtype`; the projections keep their own storage format."""
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.weight.data = module.weight.data.to(dtype)
            if isinstance(module, Attention) and module.qkv_bias is not None:
                module.qkv_bias.data = module.qkv_bias.data.to(dtype)
        self.embed_tokens.dtype = dtype

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, view: StepView, all_logits: bool = False,
                logits_for: list[int] | None = None) -> torch.Tensor:
        """input_ids: [B, T] (right-padded to view.n_new) -> logits [B, V] of each last token, or [B, T, V].
        logits_for: only these sequences' last tokens go through the head -> [len(logits_for), V]."""
        normed = self.hidden_states(input_ids, view)
        if not all_logits and all(n == normed.shape[1] for n in view.n_new):
            normed = normed[:, -1].contiguous()  # [B, H] (a decode step's rows as they are)
        elif not all_logits:
            last = torch.tensor(view.n_new, device=normed.device) - 1
            normed = normed[torch.arange(normed.shape[0], device=normed.device), last]  # [B, H]
        if logits_for is not None and not all_logits and logits_for != list(range(normed.shape[0])):
            if not logits_for:
                return normed.new_empty(0, self.config.vocab_size, dtype=torch.float32)
            normed = normed[logits_for].contiguous()  # [len(logits_for), H]: each row's head alone, the same bits
        logits = self.lm_head.forward(normed).float()  # children through forward, as DecoderLayer's
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    @torch.inference_mode()
    def hidden_states(self, input_ids: torch.Tensor, view: StepView) -> torch.Tensor:
        """input_ids: [B, T] -> the last layer's output through the final norm, [B, T, H] (the head's input)."""
        x = self.embed_tokens.forward(input_ids, view.ids_checked).contiguous()  # [B, T, H], the residual stream
        if self.embedding_scale is not None:
            x = x * torch.tensor(self.embedding_scale, dtype=x.dtype)  # Gemma: rounded to the activations' dtype
        tables = [self.rotary.forward(view.positions, x.dtype)]  # cos, sin: [B, 1, T, D]
        if self.local_rotary is not None:
            tables.append(self.local_rotary.forward(view.positions, x.dtype))
        normed = self.layers[0].input_layernorm.forward(x)
        step = self.one_step(normed)
        if step is not None and (fused := view.fused_step(len(step.plans))) is not None:
            return step.run(x, normed, *tables[0], fused)
        layers = list(self.layers)  # (a slice of the ModuleList would build a new ModuleList every step)
        norms = [layer.input_layernorm for layer in layers[1:]] + [self.norm]
        for i, (layer, next_norm) in enumerate(zip(layers, norms)):
            cos, sin = tables[1 if layer.local_rotary else 0]
            normed = layer.forward(x, normed, cos, sin, view, i, next_norm)
        return normed

    @classmethod
    def from_hf_state_dict(cls, config: ModelConfig, state: dict[str, Weight],
                           max_positions: int | None = None, consume: bool = False) -> LlamaModel:
        """Build from Hugging Face Llama weight names (float tensors or QuantizedWeight, any mix), fusing q/k/v
        and gate/up projections. consume: empty `state` as its tensors move into the model, so that a load never
        holds a tensor twice (the caller's dict no longer keeps the originals alive)."""
        with torch.device("meta"):
            model = cls(config, max_positions)
        fused = fuse_hf_state_dict(config, state, consume)
        for name in list(model.projections()):
            weight = fused.pop(f"{name}.weight", None)
            if weight is None and name in ("embed_tokens.table", "lm_head"):
                weight = fused.pop("embed_tokens.weight", None)
            if weight is None:
                raise ValueError(f"weights missing from the checkpoint: {name}")
            _set_module(model, name, build_linear(weight))
        if config.tie_word_embeddings:
            model.embed_tokens.table = model.lm_head
        offset = config.family.norm_offset  # Gemma: Hugging Face's w is applied as (1 + w)
        vectors = {k: v.float() + offset if k.endswith("norm.weight") else v.float()
                   for k, v in fused.items() if k.endswith(("norm.weight", "qkv_bias"))}
        model.load_state_dict(vectors, strict=False, assign=True)
        model.build_rotary(max_positions)
        missing = [n for n, p in model.named_parameters() if p.is_meta]
        if missing:
            raise ValueError(f"weights missing from the checkpoint: {', '.join(missing[:5])}")
        return model.eval()

    @classmethod
    def random(cls, config: ModelConfig, seed: int = 0, std: float = 0.02) -> LlamaModel:
        """A randomly initialised model with Hugging Face weight names (for tests and benchmarks)."""
        return cls.from_hf_state_dict(config, random_hf_state_dict(config, seed, std))


def _set_module(model: nn.Module, dotted: str, module: nn.Module) -> None:
    parent, _, leaf = dotted.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def fuse_hf_state_dict(c: ModelConfig, state: dict[str, Weight], consume: bool = False) -> dict[str, Weight]:
    """Hugging Face names -> this model's: q/k/v (weights and biases) and gate/up fused; a checkpoint that
    already fuses them (Phi-3's qkv_proj, gate_up_proj) passes through. consume: each tensor leaves `state` as it
    is taken, so a fused projection's parts are freed once it is built."""
    take = state.pop if consume else state.get
    out = {}
    for name in list(state):
        if name not in state:  # fused into an earlier projection
            continue
        short = name.removeprefix("model.")
        if short.startswith("layers.") and (".q_proj." in short or ".gate_proj." in short):
            attention = "self_attn" in short
            prefix = short.split(".self_attn.")[0] if attention else short.split(".mlp.")[0]
            out.update(_fused_layer(state, take, prefix, attention, short.rpartition(".")[2]))
            if consume:
                trim_heap()
        elif not any(p in short for p in (".k_proj.", ".v_proj.", ".up_proj.", "rotary_emb")):
            out[short] = take(name)
    if c.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def trim_heap() -> None:
    """Hand freed heap back to the system (glibc keeps it otherwise): a fused projection is larger than each of the
    parts just freed, so without this each fusion grows the heap (measured +210 MB over float32 weights' 540 MB)."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _fused_layer(state: dict, take, prefix: str, attention: bool, leaf: str) -> dict[str, Weight]:
    """leaf: weight or bias. take: state.get, or state.pop to consume."""
    def get(suffix):
        key = f"model.{prefix}.{suffix}"
        return take(key if key in state else f"{prefix}.{suffix}", None)

    if attention:
        parts = [get(f"self_attn.{p}_proj.{leaf}") for p in "qkv"]
        name = "qkv_proj.weight" if leaf == "weight" else "qkv_bias"
        return {f"{prefix}.self_attn.{name}": concat(parts)}
    parts = [get(f"mlp.{p}_proj.{leaf}") for p in ("gate", "up")]
    return {f"{prefix}.mlp.gate_up_proj.{leaf}": concat(parts)}


def concat(parts: list[Weight]) -> Weight:
    if any(p is None for p in parts):
        raise ValueError("a projection to fuse is missing from the checkpoint")
    if all(isinstance(p, QuantizedWeight) for p in parts):
        return QuantizedWeight.concat(parts)
    return torch.cat([p.dequantize() if isinstance(p, QuantizedWeight) else p for p in parts])


def random_hf_state_dict(c: ModelConfig, seed: int, std: float) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return torch.randn(*shape, generator=g) * std

    h, d = c.hidden_size, c.head_dim
    state = {"model.embed_tokens.weight": w(c.vocab_size, h), "model.norm.weight": torch.ones(h)}
    for i in range(c.num_layers):
        p = f"model.layers.{i}"
        state[f"{p}.self_attn.q_proj.weight"] = w(c.num_heads * d, h)
        state[f"{p}.self_attn.k_proj.weight"] = w(c.num_kv_heads * d, h)
        state[f"{p}.self_attn.v_proj.weight"] = w(c.num_kv_heads * d, h)
        state[f"{p}.self_attn.o_proj.weight"] = w(h, c.num_heads * d)
        state[f"{p}.mlp.gate_proj.weight"] = w(c.intermediate_size, h)
        state[f"{p}.mlp.up_proj.weight"] = w(c.intermediate_size, h)
        state[f"{p}.mlp.down_proj.weight"] = w(h, c.intermediate_size)
        state[f"{p}.input_layernorm.weight"] = 1 + w(h)
        state[f"{p}.post_attention_layernorm.weight"] = 1 + w(h)
    if not c.tie_word_embeddings:
        state["lm_head.weight"] = w(c.vocab_size, h)
    return state
