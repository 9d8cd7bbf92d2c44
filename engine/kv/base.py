"""The KV-cache interface every strategy implements, and the figures it reports.

A step of the model runs through a `StepView`: the strategy is told which sequences advance and by how many
tokens, reserves room for them, and gives the model an `attend(layer, q, k, v)` that writes the new keys and
values where the strategy keeps them and attends over everything the sequence holds, through the one attention
routine of engine/kv/attention.py.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from engine.config import ModelConfig
from engine.kv.attention import TILE, LayerAttention
from engine.kv.window import SlidingLayers, WindowRings, WindowStep


class KVCacheFull(RuntimeError):
    """The cache has no room for the tokens asked for; nothing was changed."""


@dataclass(frozen=True)
class KVStats:
    strategy: str
    tokens: int  # tokens held for the sequence asked about
    bytes_allocated: int  # storage the strategy holds (reserved), all sequences
    bytes_used: int  # storage holding live tokens, all sequences (paged: whole blocks in use)
    bytes_theoretical: int  # the formula for the tokens held, all sequences
    bytes_per_element: float
    block_size: int = 0
    num_blocks: int = 0
    num_blocks_used: int = 0
    num_blocks_free: int = 0
    num_blocks_cached: int = 0
    block_states: bytes = b""  # one byte per physical block, see BLOCK_* below
    bytes_budget: int = 0  # the most the strategy may hold (paged: the pool's budget); 0: no fixed budget
    num_blocks_budget: int = 0  # the most blocks a growing pool may hold (num_blocks: the blocks it holds now)
    bytes_window: int = 0  # of bytes_used: a quantized cache's newest tokens, kept in full precision per sequence
    precision: str = ""  # what keys and values are stored as: float32, bfloat16, float16, int8, int4

FusedKV = tuple[list[torch.Tensor], list[int], list[torch.Tensor], list[int]]  # stores, their groups, where, ints
# every layer's FusedKV flattened, as the kernels' decoder_layers takes them: kv, kv_parts, where, ints, and per
# layer the four counts (its kv tensors, kv parts, where tensors and ints)
FusedStep = tuple[list[torch.Tensor], list[int], list[torch.Tensor], list[int], list[int]]

BLOCK_FREE, BLOCK_OWN, BLOCK_OTHER, BLOCK_CACHED = 0, 1, 2, 3


class StepView(ABC):
    """One forward step over a batch of sequences, each advancing by n_new[i] tokens (right-padded)."""

    window: WindowStep | None = None  # the sliding layers' rings this step, where the model has them
    ids_checked = False  # whether the step's token ids were checked against the vocabulary before it

    def __init__(self, seq_ids: list[int], past: list[int], n_new: list[int], device: torch.device):
        self.seq_ids = seq_ids
        self.past = past
        self.n_new = n_new
        t = max(n_new)
        self.positions = torch.tensor([range(p, p + t) for p in past], device=device)  # [B, T]
        self.kv_len = [p + n for p, n in zip(past, n_new)]

    @abstractmethod
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               spec: LayerAttention | None = None) -> torch.Tensor:
        """q: [B, Hq, T, D]; k, v: [B, Hkv, T, D] for the new tokens -> the attended values [B, T, Hq * D].
        spec: the layer's own scale / sliding window / soft-cap (None: plain causal attention)."""

    def fused_kv(self, layer: int) -> FusedKV | None:
        """What the one-call layer (the kernels' decoder_layer) needs to write and attend at this layer, or None
        where this layout attends only through attend() (then the layer runs op by op)."""
        return None

    def fused_step(self, num_layers: int) -> FusedStep | None:
        """Every layer's fused_kv flattened for the one-call step (the kernels' decoder_layers), or None where a
        layer has none."""
        kv, kv_parts, where, ints, counts = [], [], [], [], []
        for layer in range(num_layers):
            if (fused := self.fused_kv(layer)) is None:
                return None
            stores, groups, at, numbers = fused
            kv += stores
            kv_parts += groups
            where += at
            ints += numbers
            counts += (len(stores), len(groups), len(at), len(numbers))
        return kv, kv_parts, where, ints, counts

    def store_layer(self, layer: int) -> int | None:
        """The layer's index in the cache's own stores (which hold no sliding layer), or None for a sliding layer:
        its keys are in its ring, read through attend()."""
        return None if self.window is not None and self.window.slides(layer) else self.cache.local_layer(layer)


class KVCache(ABC):
    """A KV-cache strategy. Sequences are identified by integer ids chosen by the caller."""

    name: str
    keeps_kv = True  # False for 'none': the caller must feed the whole sequence every step
    shares_computed_blocks = False  # whether a block joins the prefix cache in the step that computes it
    quantization_group = 0  # a quantized cache's tokens per group (a block quantizes when it fills); 0: floats
    window_slack = TILE  # a sliding layer's ring holds the window and this many more tokens (engine/kv/window.py)

    def __init__(self, model_config: ModelConfig, dtype: torch.dtype, device: torch.device, max_context: int):
        self.config = model_config
        self.dtype = dtype
        self.device = device
        self.max_context = max_context
        self.bytes_per_element = torch.tensor([], dtype=dtype).element_size()
        self.sliding = SlidingLayers.of(model_config, max_context, self.window_slack)  # None: all held whole
        self.store_config = self.sliding.global_config(model_config) if self.sliding else model_config
        self.windows = WindowRings(self.sliding, model_config, dtype, device) if self.sliding else None

    @abstractmethod
    def prepare(self, seq_id: int, token_ids: list[int]) -> int:
        """Get ready to run `token_ids` for seq_id; returns how many leading tokens are already held."""

    @abstractmethod
    def begin_step(self, seq_ids: list[int], new_tokens: list[list[int]]) -> StepView:
        """Reserve room for the new tokens of each sequence; raise KVCacheFull with nothing changed."""

    @abstractmethod
    def commit_step(self, view: StepView) -> None:
        """The forward of `view` succeeded: the new tokens are now held."""

    @abstractmethod
    def truncate(self, seq_id: int, keep: int) -> None:
        """Keep the first `keep` tokens of the sequence and drop the rest (rollback of rejected drafts, a
        regenerated reply, an edited message). Raises KVCacheFull with nothing changed when it cannot."""

    def check_truncate(self, seq_id: int, keep: int) -> None:
        held = self.tokens_held(seq_id)
        if not 0 <= keep <= held:
            raise ValueError(f"cannot keep {keep} tokens of sequence {seq_id}: it holds {held}")
        if held and not self.window_holds(seq_id, keep):
            raise KVCacheFull(f"sequence {seq_id} cannot keep {keep} tokens: its sliding layers no longer hold "
                              f"the {self.sliding.window - 1} keys before position {keep} (they keep "
                              f"{self.sliding.slots} positions); keep all of them or none")

    # ---- sliding-window layers (engine/kv/window.py)
    @property
    def rollback_limit(self) -> int:
        """The most tokens a step may add and still be rolled back to its first token (0: any)."""
        return self.sliding.slots - self.sliding.window + 1 if self.sliding else 0

    def window_holds(self, seq_id: int, keep: int) -> bool:
        """Whether the sequence's sliding layers still hold what a prefix of `keep` tokens needs."""
        return self.windows is None or self.windows.holds(seq_id, keep)

    def local_layer(self, layer: int) -> int:
        """A global layer's index in the main store (which holds no sliding layer)."""
        return self.sliding.index[layer] if self.sliding else layer

    def window_bytes(self) -> int:
        return self.windows.nbytes() if self.windows else 0

    def reserve(self, max_bytes: int | None = None) -> int:
        """Hold the cache's memory ahead of its sequences, up to max_bytes (a pool: engine/kv/paged.py) -> the bytes
        held; a cache that reserves per sequence holds nothing ahead."""
        return 0

    @abstractmethod
    def release(self, seq_id: int) -> None:
        """Forget the sequence; its memory is reusable at once."""

    @abstractmethod
    def tokens_held(self, seq_id: int) -> int:
        """Tokens of the sequence whose keys and values are held."""

    @abstractmethod
    def stats(self, seq_id: int | None = None) -> KVStats:
        """Memory figures; block states are seen from seq_id."""

    @property
    def precision(self) -> str:
        """What keys and values are stored as: float32, bfloat16, float16, int8 or int4."""
        codec = getattr(self, "codec", None)
        return codec.name if codec is not None else str(self.dtype).removeprefix("torch.")

    def store_bytes_per_token(self) -> float:
        """The main store's bytes per token: its (global) layers at the stored precision, scales included."""
        return self.store_config.kv_bytes_per_token(self.bytes_per_element)

    def theoretical_bytes(self, tokens: int) -> int:
        """The formula for one sequence of `tokens`, per layer: a global layer holds every token, a sliding layer
        at most its window (in the cache's float dtype)."""
        return int(self.store_bytes_per_token() * tokens + self.sliding_formula_bytes(tokens))

    def sliding_formula_bytes(self, tokens: int) -> float:
        """The formula's bytes of one sequence's sliding layers at `tokens`: at most the window, in the float dtype."""
        if not self.sliding:
            return 0
        per_token = self.sliding.sliding_config(self.config).kv_bytes_per_token(self.dtype.itemsize)
        return per_token * min(tokens, self.sliding.window)

    def theoretical_bytes_of(self, contexts) -> int:
        """The formula summed over sequences of the given lengths."""
        return sum(self.theoretical_bytes(n) for n in contexts)
