"""Every supported family, read from a GGUF file as llama.cpp's converter writes it, gives transformers' logits.

Each case builds a tiny random transformers model of the family, writes its float32 weights into a GGUF with the
default model's cut tokenizer (tests/gguf_files.py), loads that file through kvscope's loader, and compares our
logits with transformers' own loading of the same file (AutoModelForCausalLM.from_pretrained(gguf_file=...)):
prefill and 32 single-token decode steps through the contiguous and the paged cache, max |diff| at most 1e-3 of
the logit range. Gemma's sliding window is set to 8 tokens so that the window, not the context, decides what a
sliding layer sees. Llama 3's rope scaling and Gemma 2's soft-caps are compared with the model written instead:
llama.cpp stores the first as a rope_freqs tensor and the second as keys, which transformers' GGUF loader does not
read (it assumes Gemma 2's caps of 50 and 30, tested as they are, too).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from engine import loader
from engine.config import ModelConfig
from engine.kv.contiguous import ContiguousCache
from engine.kv.paged import PagedCache
from engine.loader import ModelLoadError
from engine.model import LlamaModel, rope_inv_freq
from tests.engine_helpers import forward_through_cache, one_torch_thread
from tests.gguf_files import TINY_VOCAB, write_model_gguf

MAX_CONTEXT = 64
PREFILL, DECODE = 13, 32
BOUND = 1e-3  # of the reference logits' range
SHAPE = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
             pad_token_id=None)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


@dataclass(frozen=True)
class Case:
    gguf_arch: str
    config_class: str
    shape: dict
    name: str = "tiny"  # general.name (llama.cpp writes Mistral models as 'llama' named mistral)
    in_memory_reference: bool = False  # compare with the model written, not transformers' reading of the file


CASES = {
    "llama3": Case("llama", "LlamaConfig", dict(head_dim=16, tie_word_embeddings=False,
                                                rope_parameters=LLAMA3_ROPE), in_memory_reference=True),
    # soft-caps that bite: transformers' GGUF loader keeps Gemma 2's defaults (50, 30) whatever the file says
    "gemma2-capped": Case("gemma2", "Gemma2Config", dict(head_dim=256, tie_word_embeddings=True, sliding_window=8,
                                                         attn_logit_softcapping=0.5, final_logit_softcapping=2.0),
                          in_memory_reference=True),
    "mistral": Case("llama", "MistralConfig", dict(head_dim=16, tie_word_embeddings=False), "mistral-tiny"),
    "qwen2": Case("qwen2", "Qwen2Config", dict(tie_word_embeddings=True)),
    # transformers' qwen3 GGUF mapping does not read attention.key_length: Qwen3's own head_dim, 128
    "qwen3": Case("qwen3", "Qwen3Config", dict(head_dim=128, tie_word_embeddings=True)),
    # Gemma: head_dim 256 is the query_pre_attn_scalar transformers assumes and llama.cpp derives
    "gemma2": Case("gemma2", "Gemma2Config", dict(head_dim=256, tie_word_embeddings=True, sliding_window=8,
                                                  attn_logit_softcapping=50.0, final_logit_softcapping=30.0)),
    "gemma3": Case("gemma3", "Gemma3TextConfig", dict(head_dim=256, num_hidden_layers=6, tie_word_embeddings=True,
                                                      sliding_window=8, rope_theta=1e6)),
    "phi3": Case("phi3", "Phi3Config", dict(num_key_value_heads=4, tie_word_embeddings=False)),
}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_torch_thread():
        yield


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path / "cache"))


def random_reference(case: Case, seed: int = 0) -> torch.nn.Module:
    """A transformers model of the family whose weights spread the logits over several units."""
    config = getattr(transformers, case.config_class)(**{**SHAPE, **case.shape})
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config).eval()
    g = torch.Generator().manual_seed(seed)
    offset_norms = case.gguf_arch.startswith("gemma")  # Gemma stores w and applies 1 + w
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = 0.1 * torch.randn(p.shape, generator=g)
            p.copy_(noise + 1 if name.endswith("norm.weight") and not offset_norms else noise)
    return model


def llama_cpp_rope_factors(config: dict) -> np.ndarray:
    """What llama.cpp's converter writes as rope_freqs for Llama 3 scaling: default / scaled frequencies."""
    scaled = ModelConfig.from_hf_dict(config)
    plain = dataclasses.replace(scaled, rope_scaling=None)
    return (rope_inv_freq(plain) / rope_inv_freq(scaled)).numpy().astype(np.float32)


def write_case(tmp_path: Path, case: Case, reference: torch.nn.Module, types=None) -> Path:
    config = reference.config.to_dict()
    extra = {"rope_freqs.weight": llama_cpp_rope_factors(config)} if case.shape.get("rope_parameters") else None
    path = write_model_gguf(tmp_path / f"{case.gguf_arch}.gguf", case.gguf_arch, config, reference.state_dict(),
                            types, extra_tensors=extra, name=case.name)
    return path


def ours_from(path: Path) -> LlamaModel:
    weights = loader.load_weights(str(path))
    return LlamaModel.from_hf_state_dict(weights.config, weights.state_dict, max_positions=MAX_CONTEXT)


def logits_of(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids]), use_cache=False).logits[0].float()  # [T, V]


@pytest.fixture(scope="module", params=list(CASES))
def family(request, tmp_path_factory):
    """(case name, our model from the GGUF, token ids, the reference logits [T, V])."""
    case = CASES[request.param]
    tmp = tmp_path_factory.mktemp(request.param)
    reference = random_reference(case)
    path = write_case(tmp, case, reference)
    if case.in_memory_reference:
        expected_model = reference  # what transformers' GGUF loader drops: rope_freqs, Gemma 2's soft-cap keys
    else:
        expected_model = AutoModelForCausalLM.from_pretrained(str(tmp), gguf_file=path.name, dtype=torch.float32)
    ids = torch.randint(TINY_VOCAB, (PREFILL + DECODE,), generator=torch.Generator().manual_seed(1)).tolist()
    expected = logits_of(expected_model.eval(), ids)
    mp = pytest.MonkeyPatch()
    mp.setenv("KVSCOPE_CACHE_DIR", str(tmp / "cache"))
    try:
        ours = ours_from(path)
    finally:
        mp.undo()
    return request.param, ours, ids, expected


def assert_within_bound(got: torch.Tensor, expected: torch.Tensor) -> None:
    spread = (expected.max() - expected.min()).item()
    worst = (got - expected).abs().max().item()
    assert worst <= BOUND * spread, f"max |diff| {worst:.3g} over a logit range of {spread:.3g}"


def test_the_reference_logits_spread_over_several_units(family):
    _, _, _, expected = family
    assert (expected.max() - expected.min()) > 2


def test_prefill_logits_match_transformers_at_every_position(family):
    _, ours, ids, expected = family
    cache = ContiguousCache(ours.config, torch.float32, torch.device("cpu"), MAX_CONTEXT)
    cache.prepare(1, ids)
    got = ours(torch.tensor([ids]), cache.begin_step([1], [ids]), all_logits=True)[0]
    assert_within_bound(got, expected)


@pytest.mark.parametrize("cache", ["contiguous", "paged"])
def test_decode_steps_match_transformers_through_each_cache(family, cache):
    _, ours, ids, expected = family
    args = (ours.config, torch.float32, torch.device("cpu"), MAX_CONTEXT)
    kv = ContiguousCache(*args) if cache == "contiguous" else PagedCache(*args, block_size=8)
    got = forward_through_cache(ours, kv, ids, PREFILL)
    assert_within_bound(got, expected)


# ---- what each family's description says, read from the file -------------------------------------------


def config_of(tmp_path: Path, name: str) -> ModelConfig:
    case = CASES[name]
    return loader.load_weights(str(write_case(tmp_path, case, random_reference(case)))).config


def test_gemma2_reads_its_window_soft_caps_and_scale_from_the_file(tmp_path):
    c = config_of(tmp_path, "gemma2")
    assert c.sliding_layers == (True, False) and c.sliding_window == 8
    assert (c.attn_logit_softcap, c.final_logit_softcap) == (50.0, 30.0)
    assert c.query_scale == pytest.approx(256 ** -0.5)
    assert c.family.sandwich_norms and c.family.embedding_scale and c.activation == "gelu_tanh"


def test_gemma3_slides_five_layers_of_six_with_their_own_rotary_base(tmp_path):
    c = config_of(tmp_path, "gemma3")
    assert c.sliding_layers == (True,) * 5 + (False,)
    assert (c.rope_theta, c.rope_local_theta) == (1e6, 10000.0)
    assert c.family.qk_norm and c.final_logit_softcap == 0.0


def test_qwen2_keeps_its_attention_biases(tmp_path):
    case = CASES["qwen2"]
    reference = random_reference(case)
    ours = ours_from(write_case(tmp_path, case, reference))
    expected = torch.cat([reference.model.layers[0].self_attn.__getattr__(f"{p}_proj").bias for p in "qkv"])
    torch.testing.assert_close(ours.layers[0].self_attn.qkv_bias, expected.detach(), atol=0, rtol=0)


def test_llama3_rope_factors_are_read_from_the_rope_freqs_tensor(tmp_path):
    c = config_of(tmp_path, "llama3")
    assert c.rope_scaling["rope_type"] == "freq_factors"
    expected = rope_inv_freq(ModelConfig.from_hf_dict(random_reference(CASES["llama3"]).config.to_dict()))
    torch.testing.assert_close(rope_inv_freq(c), expected, atol=0, rtol=1e-6)


# ---- what is not supported is refused by name ------------------------------------------------------------


def write_bare_gguf(path: Path, arch: str, keys: dict | None = None) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in {"block_count": 1, "embedding_length": 8, "feed_forward_length": 16,
                       "attention.head_count": 2, **(keys or {})}.items():
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("arch", ["falcon", "gpt2", "mamba"])
def test_an_unsupported_architecture_is_refused_by_name(tmp_path, arch):
    with pytest.raises(ModelLoadError, match=f"unsupported architecture '{arch}'.*supported: .*gemma2"):
        loader.load_weights(str(write_bare_gguf(tmp_path / f"{arch}.gguf", arch)))


def test_partial_rotary_is_refused_by_name(tmp_path):
    path = write_bare_gguf(tmp_path / "phi.gguf", "phi3", {"rope.dimension_count": 2})
    with pytest.raises(ModelLoadError, match="partial rotary embeddings"):
        loader.load_weights(str(path))


def test_a_file_missing_a_shape_key_is_refused_by_name(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "q.gguf"), "qwen2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="qwen2.attention.head_count"):
        loader.load_weights(str(tmp_path / "q.gguf"))


# ---- chat templates ---------------------------------------------------------------------------------------

GEMMA2_TEMPLATE = (  # Gemma 2's own template: no system role
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")


def tiny_tokenizer(tmp_path):
    from tests.gguf_files import write_tiny_gguf

    path, _ = write_tiny_gguf(tmp_path / "tiny.gguf")
    return loader.load_weights(str(path)).tokenizer


def test_a_template_without_a_system_role_gets_the_system_prompt_folded_into_the_first_user_turn(tmp_path):
    from engine.chat import Message, render_chat, system_role_supported

    tokenizer = tiny_tokenizer(tmp_path)
    tokenizer.chat_template = GEMMA2_TEMPLATE
    assert not system_role_supported(tokenizer)
    messages = [Message("user", "Hello"), Message("assistant", "Hi."), Message("user", "Again")]
    text = render_chat(tokenizer, "Be brief.", messages)
    assert text.endswith("<start_of_turn>user\nBe brief.\n\nHello<end_of_turn>\n<start_of_turn>model\nHi."
                         "<end_of_turn>\n<start_of_turn>user\nAgain<end_of_turn>\n<start_of_turn>model\n")


def test_a_template_with_a_system_role_keeps_it_as_a_system_message(tmp_path):
    from engine.chat import Message, render_chat, system_role_supported

    tokenizer = tiny_tokenizer(tmp_path)  # the default model's ChatML template
    assert system_role_supported(tokenizer)
    text = render_chat(tokenizer, "Be brief.", [Message("user", "Hello")])
    assert "<|im_start|>system\nBe brief.<|im_end|>" in text and "Be brief.\n\nHello" not in text
