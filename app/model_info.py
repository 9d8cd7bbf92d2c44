"""What the app shows about the loaded model: a plain frozen record built on the worker thread."""

from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class ModelInfo:
    model_name: str
    device: str
    dtype_name: str
    max_context: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    cache_strategy: str
    block_size: int

    @classmethod
    def from_engine(cls, engine) -> ModelInfo:
        mc = engine.model_config
        return cls(
            model_name=engine.model_name, device=str(engine.device), dtype_name=engine.dtype_name,
            max_context=engine.max_context, num_layers=mc.num_layers, num_heads=mc.num_heads,
            num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim, cache_strategy=engine.cache_strategy,
            block_size=engine.block_size,
        )

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES.get(self.dtype_name, 4)

    def bytes_per_token(self, bytes_per_element: float | None = None) -> float:
        """The article's formula: 2 (K and V) x bytes/element x layers x KV heads x head_dim."""
        bpe = self.dtype_bytes if bytes_per_element is None else bytes_per_element
        return 2 * bpe * self.num_layers * self.num_kv_heads * self.head_dim

    def formula(self, bytes_per_element: float | None = None) -> str:
        bpe = self.dtype_bytes if bytes_per_element is None else bytes_per_element
        bpe_text = f"{bpe:g}"
        total = self.bytes_per_token(bpe)
        return (f"2 × {bpe_text} B/element × {self.num_layers} layers × {self.num_kv_heads} KV heads × "
                f"{self.head_dim} head_dim = {total:,.0f} bytes/token")

    @property
    def gqa_ratio(self) -> float:
        return self.num_heads / self.num_kv_heads
