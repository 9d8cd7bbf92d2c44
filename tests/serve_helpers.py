"""A real, small Hugging Face model folder for server tests: random tiny Llama weights (safetensors), its
config.json, and the default model's tokenizer files. The loader reads it like any downloaded model."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
from conftest import TINY
from safetensors.torch import save_file

from engine.config import ModelConfig
from engine.model import random_hf_state_dict


def write_tiny_model(folder: Path, tokenizer, max_positions: int = 1024) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    t = {**TINY, "max_position_embeddings": max_positions}
    config = ModelConfig(vocab_size=len(tokenizer), eos_token_ids=(2,), **t)
    hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": config.vocab_size,
          "hidden_size": t["hidden_size"], "intermediate_size": t["intermediate_size"],
          "num_hidden_layers": t["num_layers"], "num_attention_heads": t["num_heads"],
          "num_key_value_heads": t["num_kv_heads"], "head_dim": t["head_dim"], "rope_theta": t["rope_theta"],
          "max_position_embeddings": max_positions, "tie_word_embeddings": True, "eos_token_id": 2,
          "rms_norm_eps": 1e-5, "torch_dtype": "float32"}
    (folder / "config.json").write_text(json.dumps(hf, indent=2))
    state = random_hf_state_dict(config, seed=0, std=0.1)
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    tokenizer.save_pretrained(str(folder))
    return folder


def metric(url: str, name: str, headers: dict | None = None) -> float:
    """The value of one unlabelled-or-single-series metric from the server's /metrics."""
    from app.backends.metrics_parser import parse_exposition

    samples = parse_exposition(httpx.get(url + "/metrics", headers=headers or {}, timeout=10).text)
    values = [s.value for s in samples if s.name == name]
    assert values, f"{name} is not in /metrics"
    return sum(values)
