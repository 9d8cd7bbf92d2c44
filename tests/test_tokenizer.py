"""A converted model's tokenizer without transformers (engine/tokenizer.py, engine/chat_template.py): the same
token ids, text and prompts as transformers' tokenizer of the same files, on the default model, on the tiny GGUF
fixtures and under the chat templates of the families kvscope opens; a start from the cache never imports
transformers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine import loader
from engine.chat import Message, prompt_ids, render_chat
from engine.chat_template import ChatTemplateError
from engine.tokenizer import SETTINGS_FILE, Tokenizer, TokenizerSettings, clean_up_spaces
from tests.gguf_files import write_tiny_gguf
from tests.test_architectures import GEMMA2_TEMPLATE

ROOT = Path(__file__).resolve().parents[1]

# (system prompt, messages): several turns, unicode, code, odd spacing, a special token typed as text
CONVERSATIONS = [
    (None, [("user", "Hi")]),
    ("You are a terse assistant.", [("user", "What is 2+2?"), ("assistant", "4."), ("user", "And 3+3?")]),
    ("Réponds en français, s'il te plaît.",
     [("user", "Qu'est-ce qu'un cache KV ? — réponse courte"), ("assistant", "Une mémoire des clés/valeurs."),
      ("user", "日本語で説明してください。🙂👍🏽"), ("assistant", "キャッシュです。"), ("user", "Ελληνικά; Ünïcödé!")]),
    (None, [("user", "def f(x):\n    return x ** 2\n\n\tprint(f(3))  # tabs, newlines")]),
    ("  spaced system  ", [("user", "  leading and trailing  "), ("assistant", " "), ("user", "<|im_end|> typed")]),
]
TEXTS = ["Hi", " Hello", "a  b\n\n\tc\r\n", "naïve café — 你好，世界 🤖", "don't . , ? ! 's", "x" * 300,
         "<|im_start|>assistant\nhey<|im_end|>"]

LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
QWEN25_TEMPLATE = (  # Qwen2.5's structure: a tools branch (tojson), a default system prompt, namespace, loop controls
    "{%- if tools %}{{- '<|im_start|>system\n' }}{%- for tool in tools %}{{- tool | tojson }}{%- endfor %}"
    "{%- else %}{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}{%- else %}"
    "{{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}"
    "{%- endif %}{%- endif %}{%- set ns = namespace(turns=0) %}"
    "{%- for message in messages %}{%- if message.role == 'system' and loop.first %}{%- continue %}{%- endif %}"
    "{%- set ns.turns = ns.turns + 1 %}{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}")
PHI3_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\n' + message['content'] + "
    "'<|end|>\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}")
LLAMA32_DATED = (  # Llama 3.2's date line: strftime_now and a dict() literal
    "{%- set date_string = strftime_now('%d %b %Y') %}{%- set meta = dict(date=date_string) %}"
    "{{- bos_token + 'Today Date: ' + meta.date + '\n' }}{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + "
    "'<|eot_id|>' }}{%- endfor %}{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}")
ZEPHYR_MULTILINE = """{% for message in messages %}
  {% if message['role'] == 'user' %}
{{ '<|user|>\n' + message['content'] + eos_token }}
  {% elif message['role'] == 'system' %}
{{ '<|system|>\n' + message['content'] + eos_token }}
  {% elif message['role'] == 'assistant' %}
{{ '<|assistant|>\n'  + message['content'] + eos_token }}
  {% endif %}
  {% if loop.last and add_generation_prompt %}
{{ '<|assistant|>' }}
  {% endif %}
{% endfor %}"""  # a template written over lines and indented: trim_blocks and lstrip_blocks decide its whitespace
TEMPLATES = {"default (ChatML)": None, "gemma2 (no system role)": GEMMA2_TEMPLATE, "llama3": LLAMA3_TEMPLATE,
             "qwen2.5": QWEN25_TEMPLATE, "phi3": PHI3_TEMPLATE, "llama3.2 dated": LLAMA32_DATED,
             "zephyr (multi-line)": ZEPHYR_MULTILINE}


def transformers_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


@pytest.fixture(scope="module")
def default_pair(default_weights):
    """(ours, transformers') for the default model's converted folder."""
    folder = loader.gguf_cache_folder(loader.default_model_path())
    return default_weights.tokenizer, transformers_tokenizer(folder)


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory, default_weights):
    """(ours, transformers') for the tiny GGUF fixture (the default tokenizer cut to 1,024 tokens)."""
    cache = tmp_path_factory.mktemp("cache")
    before = os.environ.get("KVSCOPE_CACHE_DIR")
    os.environ["KVSCOPE_CACHE_DIR"] = str(cache)
    try:
        path, _ = write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")
        ours = loader.load_weights(str(path)).tokenizer
        folder = loader.gguf_cache_folder(path)
    finally:
        if before is None:
            del os.environ["KVSCOPE_CACHE_DIR"]
        else:
            os.environ["KVSCOPE_CACHE_DIR"] = before
    return ours, transformers_tokenizer(folder)


def messages(turns) -> list[Message]:
    return [Message(role, content) for role, content in turns]


def with_template(pair, template: str | None):
    ours, theirs = pair
    if template is not None:
        ours.chat_template = theirs.chat_template = template
    return ours, theirs


@pytest.fixture
def restore_templates(default_pair, tiny_pair):
    saved = [(t, t.chat_template) for pair in (default_pair, tiny_pair) for t in pair]
    yield
    for tokenizer, template in saved:
        tokenizer.chat_template = template


# ---- the same ids, text and prompts as transformers ---------------------------------------------------------

def test_a_converted_model_loads_its_tokenizer_without_transformers(default_weights, tiny_pair):
    assert type(default_weights.tokenizer) is Tokenizer
    assert type(tiny_pair[0]) is Tokenizer


@pytest.mark.parametrize("which", ["default_pair", "tiny_pair"])
def test_texts_encode_and_decode_as_transformers_does(which, request):
    ours, theirs = request.getfixturevalue(which)
    for text in TEXTS:
        for special in (False, True):
            ids = theirs.encode(text, add_special_tokens=special)
            assert ours.encode(text, add_special_tokens=special) == ids
            assert ours.decode(ids) == theirs.decode(ids)
            assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("which", ["default_pair", "tiny_pair"])
def test_special_tokens_and_vocabulary_are_transformers_own(which, request):
    ours, theirs = request.getfixturevalue(which)
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == \
        (theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id)
    assert ours.get_vocab() == theirs.get_vocab() and len(ours) == len(theirs)
    assert ours.chat_template == theirs.chat_template


@pytest.mark.usefixtures("restore_templates")
@pytest.mark.parametrize("template", TEMPLATES.values(), ids=TEMPLATES.keys())
@pytest.mark.parametrize("which", ["default_pair", "tiny_pair"])
def test_chat_prompts_give_the_token_ids_transformers_gives(which, template, request):
    ours, theirs = with_template(request.getfixturevalue(which), template)
    for system, turns in CONVERSATIONS:
        text = render_chat(theirs, system, messages(turns))
        assert render_chat(ours, system, messages(turns)) == text
        assert prompt_ids(ours, system, messages(turns)) == prompt_ids(theirs, system, messages(turns))


@pytest.mark.usefixtures("restore_templates")
def test_a_template_refusing_the_system_role_refuses_it_for_both(default_pair):
    for tokenizer in with_template(default_pair, GEMMA2_TEMPLATE):
        with pytest.raises(Exception, match="System role not supported"):
            tokenizer.apply_chat_template([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
                                          tokenize=False)


def test_a_template_cannot_reach_python_internals(default_pair):
    ours = default_pair[0]
    ours_template = Tokenizer(ours.backend, TokenizerSettings(chat_template="{{ messages.__class__.__mro__ }}"))
    with pytest.raises(ChatTemplateError):
        ours_template.apply_chat_template([{"role": "user", "content": "u"}], tokenize=False)


def test_decoding_cleans_up_spaces_only_where_transformers_did():
    assert clean_up_spaces("Hello , world . It 's done !") == "Hello, world. It's done!"


# ---- the converted folder ------------------------------------------------------------------------------------

@pytest.fixture
def private_cache(tmp_path, monkeypatch, default_weights) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(cache))
    return cache


def test_a_conversion_records_the_tokenizer_checked_against_transformers(tmp_path, private_cache):
    path, _ = write_tiny_gguf(tmp_path / "tiny.gguf")
    loader.load_weights(str(path))
    settings = json.loads((loader.gguf_cache_folder(path) / SETTINGS_FILE).read_text())
    assert settings["matches_transformers"] is True
    assert settings["special_tokens"]["eos_token"] == "<|im_end|>" and "<|im_start|>" in settings["chat_template"]


def test_a_start_from_the_cache_never_imports_transformers(tmp_path, private_cache):
    path, _ = write_tiny_gguf(tmp_path / "tiny.gguf")
    loader.load_weights(str(path))  # the conversion (transformers reads the GGUF's tokenizer)
    script = ("import sys; from engine import loader; w = loader.load_weights(sys.argv[1]); "
              "print(type(w.tokenizer).__name__, sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))")
    out = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "KVSCOPE_CACHE_DIR": str(private_cache)}, timeout=300)
    assert out.stdout.split() == ["Tokenizer", "[]"], out.stderr[-2000:]


def test_a_cache_converted_before_the_settings_file_is_checked_once_and_then_starts_without_transformers(
        tmp_path, private_cache):
    path, _ = write_tiny_gguf(tmp_path / "tiny.gguf")
    loader.load_weights(str(path))
    settings = loader.gguf_cache_folder(path) / SETTINGS_FILE
    settings.unlink()
    assert type(loader.load_weights(str(path)).tokenizer) is Tokenizer
    assert json.loads(settings.read_text())["matches_transformers"] is True


def test_a_tokenizer_that_differs_from_transformers_on_a_probe_keeps_going_through_transformers(
        tmp_path, private_cache, monkeypatch):
    import engine.tokenizer

    monkeypatch.setattr(engine.tokenizer, "differences", lambda reference, ours: ["encode('x'): [1] vs [2]"])
    path, _ = write_tiny_gguf(tmp_path / "tiny.gguf")
    tokenizer = loader.load_weights(str(path)).tokenizer
    assert type(tokenizer) is not Tokenizer and "transformers" in type(tokenizer).__module__
    assert json.loads((loader.gguf_cache_folder(path) / SETTINGS_FILE).read_text())["matches_transformers"] is False


def test_a_saved_tokenizer_loads_in_transformers_with_the_same_ids(tmp_path, default_pair):
    ours = default_pair[0]
    ours.save_pretrained(tmp_path / "saved")
    theirs = transformers_tokenizer(tmp_path / "saved")
    for system, turns in CONVERSATIONS:
        assert prompt_ids(theirs, system, messages(turns)) == prompt_ids(ours, system, messages(turns))


# ---- a Hugging Face folder -----------------------------------------------------------------------------------

def hf_folder(tmp_path: Path, tokenizer) -> Path:
    from serve_helpers import write_tiny_model

    folder = write_tiny_model(tmp_path / "hf-model", tokenizer)
    (folder / SETTINGS_FILE).unlink()  # a downloaded folder has none; kvscope never writes into it
    return folder


def loaded_in_a_new_process(folder: Path, cache: Path) -> list[str]:
    script = ("import sys; from engine import loader; w = loader.load_weights(sys.argv[1]); "
              "print(type(w.tokenizer).__name__, sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))")
    out = subprocess.run([sys.executable, "-c", script, str(folder)], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "KVSCOPE_CACHE_DIR": str(cache)}, timeout=300)
    return out.stdout.split() or [out.stderr[-2000:]]


def test_a_hugging_face_folder_is_checked_once_and_later_starts_never_import_transformers(
        tmp_path, private_cache, tokenizer):
    folder = hf_folder(tmp_path, tokenizer)
    files = sorted(p.name for p in folder.iterdir())
    assert type(loader.load_weights(str(folder)).tokenizer) is Tokenizer  # checked against transformers
    (kept,) = (private_cache / "tokenizers").iterdir()
    assert json.loads(kept.read_text())["matches_transformers"] is True
    assert sorted(p.name for p in folder.iterdir()) == files  # the user's folder is left as it was
    assert loaded_in_a_new_process(folder, private_cache) == ["Tokenizer", "[]"]


def test_a_changed_tokenizer_file_is_checked_again(tmp_path, private_cache, tokenizer):
    folder = hf_folder(tmp_path, tokenizer)
    loader.load_weights(str(folder))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    (folder / "chat_template.jinja").write_text(template)
    reloaded = loader.load_weights(str(folder)).tokenizer
    assert type(reloaded) is Tokenizer and reloaded.chat_template == template
    assert len(list((private_cache / "tokenizers").iterdir())) == 2


def test_a_hugging_face_tokenizer_that_differs_on_a_probe_keeps_going_through_transformers(
        tmp_path, private_cache, tokenizer, monkeypatch):
    import engine.tokenizer

    monkeypatch.setattr(engine.tokenizer, "differences", lambda reference, ours: ["encode('x'): [1] vs [2]"])
    folder = hf_folder(tmp_path, tokenizer)
    for _ in range(2):  # checked, then remembered
        assert "transformers" in type(loader.load_weights(str(folder)).tokenizer).__module__
    (kept,) = (private_cache / "tokenizers").iterdir()
    assert json.loads(kept.read_text())["matches_transformers"] is False
