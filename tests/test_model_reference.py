"""The forward pass matches transformers' LlamaForCausalLM on the same weights, through every KV strategy."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine import loader
from engine.chat import Message, prompt_ids
from engine.config import ModelConfig
from engine.kv.contiguous import ContiguousCache
from engine.kv.paged import PagedCache
from engine.kv.paged_quant import PagedInt8Cache
from engine.kv.recompute import RecomputeCache
from engine.model import LlamaModel, rope_inv_freq
from tests.engine_helpers import forward_through_cache, one_torch_thread

MAX_CONTEXT = 128
SEQ_LEN, PREFILL = 40, 13  # 13 prompt tokens, then 27 single-token decode steps
TIGHT = dict(atol=2e-5, rtol=1e-5)  # float32, the same weights: only summation order differs

SMALL = dict(vocab_size=160, hidden_size=64, intermediate_size=160, num_hidden_layers=2, head_dim=16,
             max_position_embeddings=256, rms_norm_eps=1e-5)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
VARIANTS = {
    "gqa-untied": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    "mha-tied": dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),
    "mqa-tied": dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True),
    "gqa-llama3-rope": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                            rope_parameters=LLAMA3_ROPE),
    "gqa-linear-rope": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                            rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
}

# (strategy, block size): every strategy, paged at both extremes; paged-int8 with a block larger than the
# sequence keeps everything in its full-precision window, so it too must match tightly
EXACT_CACHES = [("none", 0), ("contiguous", 0), ("paged", 1), ("paged", 8), ("paged-int8", 64)]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_torch_thread():
        yield


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that attention is far from uniform and the logits spread over several units."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * noise if name.endswith("norm.weight") else 0.1 * noise)


def reference_pair(variant: str, seed: int = 0) -> tuple[LlamaForCausalLM, LlamaModel]:
    hf_config = LlamaConfig(**SMALL, **VARIANTS[variant])
    hf_config._attn_implementation = "eager"
    hf = LlamaForCausalLM(hf_config).eval()
    randomize(hf, seed)
    ours = LlamaModel.from_hf_state_dict(ModelConfig.from_hf_dict(hf_config.to_dict()), hf.state_dict(),
                                         max_positions=MAX_CONTEXT)
    return hf, ours


def make_cache(strategy: str, config: ModelConfig, block_size: int, max_context: int = MAX_CONTEXT):
    args = (config, torch.float32, torch.device("cpu"), max_context)
    if strategy == "none":
        return RecomputeCache(*args)
    if strategy == "contiguous":
        return ContiguousCache(*args)
    cls = PagedCache if strategy == "paged" else PagedInt8Cache
    return cls(*args, block_size=block_size)


def hf_logits(hf: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids]), use_cache=False).logits[0].float()  # [T, V]


def random_ids(vocab_size: int, n: int, seed: int = 1) -> list[int]:
    return torch.randint(vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request):
    hf, ours = reference_pair(request.param)
    ids = random_ids(hf.config.vocab_size, SEQ_LEN)
    return hf, ours, ids, hf_logits(hf, ids)


def test_the_reference_logits_are_not_trivial(pair):
    _, _, _, expected = pair
    assert expected.std() > 0.5  # a tolerance of 1e-5 means something against logits of this spread


def test_prefill_logits_match_at_every_position(pair):
    _, ours, ids, expected = pair
    view_cache = make_cache("contiguous", ours.config, 0)
    view_cache.prepare(1, ids)
    view = view_cache.begin_step([1], [ids])
    got = ours(torch.tensor([ids]), view, all_logits=True)[0]  # [T, V]
    torch.testing.assert_close(got, expected, **TIGHT)


@pytest.mark.parametrize(("strategy", "block_size"), EXACT_CACHES)
def test_decode_logits_match_step_by_step_through_each_cache(pair, strategy, block_size):
    _, ours, ids, expected = pair
    got = forward_through_cache(ours, make_cache(strategy, ours.config, block_size), ids, PREFILL)
    torch.testing.assert_close(got, expected, **TIGHT)


def test_paged_int8_decode_logits_stay_close_once_blocks_are_quantized(pair):
    _, ours, ids, expected = pair
    got = forward_through_cache(ours, make_cache("paged-int8", ours.config, 8), ids, PREFILL)
    assert (got - expected).abs().max() < 0.05 * expected.abs().max()
    # a lossy cache may break a near tie of this random model (measured: 1 of 40 positions, top-2 apart by 0.007)
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.95


def test_the_config_round_trips_the_fields_that_shape_the_model():
    hf_config = LlamaConfig(**SMALL, **VARIANTS["gqa-llama3-rope"])
    c = ModelConfig.from_hf_dict(hf_config.to_dict())
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.num_layers) == (4, 2, 16, 2)
    assert c.rope_theta == 500000.0
    assert c.rope_scaling is not None and c.rope_scaling["rope_type"] == "llama3"
    assert not c.tie_word_embeddings


@pytest.mark.parametrize("variant", ["gqa-llama3-rope", "gqa-linear-rope", "gqa-untied"])
def test_rotary_frequencies_match_transformers(variant):
    hf_config = LlamaConfig(**SMALL, **VARIANTS[variant])
    hf = LlamaForCausalLM(hf_config)
    ours = rope_inv_freq(ModelConfig.from_hf_dict(hf_config.to_dict())).float()
    torch.testing.assert_close(ours, hf.model.rotary_emb.inv_freq.float(), atol=0, rtol=1e-6)


def test_tied_embeddings_share_one_tensor():
    _, ours = reference_pair("mha-tied")
    assert ours.embed_tokens.table is ours.lm_head
    _, untied = reference_pair("gqa-untied")
    assert untied.embed_tokens.table is not untied.lm_head


@pytest.mark.default_model
def test_the_default_model_matches_transformers_on_the_same_gguf(default_engine, tokenizer):
    gguf = loader.default_model_path()
    hf = LlamaForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    ids = prompt_ids(tokenizer, None, [Message("user", "What is the capital of France?")])
    ids = ids + [tokenizer.convert_tokens_to_ids("The")]
    expected = hf_logits(hf, ids)
    del hf
    model = default_engine.model
    cache = make_cache("paged", model.config, 16, max_context=64)
    got = forward_through_cache(model, cache, ids, prefill=len(ids) - 6)
    # 30 layers in float32: measured max |diff| 7e-5 against logits of max |x| 38 and std 8
    torch.testing.assert_close(got, expected, atol=5e-4, rtol=1e-5)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
