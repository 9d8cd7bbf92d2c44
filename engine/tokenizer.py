"""A converted model's tokenizer without transformers: tokenizer.json through `tokenizers`, the chat template
through jinja2 (engine/chat_template.py), the special tokens and decoding rule from kvscope-tokenizer.json.

transformers is imported once, when a GGUF is converted (or a cache converted before this file existed is first
opened), or when a Hugging Face folder's tokenizer files are first seen: it reads the tokenizer, and
`settings_from` records what its tokenizer object says (special tokens, template, whether decode cleans up spaces)
after checking on probe texts that this class gives the same token ids, text and prompt. A converted folder keeps
them in its own kvscope-tokenizer.json; a Hugging Face folder (the user's files) in the cache, under a digest of
its tokenizer files. A tokenizer that differs on a probe is marked and keeps going through transformers.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from engine import chat_template
from engine.chat_template import SPECIAL_TOKEN_NAMES

SETTINGS_FILE = "kvscope-tokenizer.json"
SETTINGS_VERSION = 1


class TokenizerError(ValueError):
    """The tokenizer files are missing or unreadable."""


@dataclass(frozen=True)
class TokenizerSettings:
    special_tokens: dict[str, str] = field(default_factory=dict)  # bos_token -> "<s>", ... (names as in HF)
    chat_template: str | None = None
    clean_up_spaces: bool = False  # decode joins " ." -> "." etc. (transformers' clean_up_tokenization_spaces)
    matches_transformers: bool = True  # every probe gave transformers' ids, text and prompt
    version: int = SETTINGS_VERSION

    def save(self, folder: Path, name: str = SETTINGS_FILE) -> None:
        tmp = folder / f".{name}.{os.getpid()}.tmp"  # two processes checking one folder at once: each its own
        tmp.write_text(json.dumps(asdict(self), indent=1, ensure_ascii=False))
        tmp.replace(folder / name)

    @staticmethod
    def read(folder: Path, name: str = SETTINGS_FILE) -> TokenizerSettings | None:
        """None when the file is missing, unreadable or of another version."""
        try:
            raw = json.loads((folder / name).read_text())
            if raw.get("version") != SETTINGS_VERSION:
                return None
            return TokenizerSettings(**raw)
        except (OSError, ValueError, TypeError, AttributeError):
            return None


class Tokenizer:
    """The part of transformers' tokenizer interface kvscope uses: encode, decode, get_vocab, len, special token
    ids, chat_template and apply_chat_template (text only)."""

    def __init__(self, backend, settings: TokenizerSettings):
        self.backend = backend  # tokenizers.Tokenizer
        self.settings = settings
        self.chat_template = settings.chat_template  # settable, as on a transformers tokenizer

    @classmethod
    def from_folder(cls, folder: Path, settings: TokenizerSettings) -> Tokenizer:
        from tokenizers import Tokenizer as Backend

        try:
            return cls(Backend.from_file(str(folder / "tokenizer.json")), settings)
        except Exception as e:  # noqa: BLE001 - tokenizers raises its own Exception type
            raise TokenizerError(f"{folder / 'tokenizer.json'}: {e}") from None

    # ---- tokens
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        ids = [ids] if isinstance(ids, int) else list(ids)
        text = self.backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return clean_up_spaces(text) if self.settings.clean_up_spaces else text

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def convert_tokens_to_ids(self, tokens: str | list[str]):
        if isinstance(tokens, str):
            return self.backend.token_to_id(tokens)
        return [self.backend.token_to_id(t) for t in tokens]

    @property
    def special_tokens_map(self) -> dict[str, str]:
        return dict(self.settings.special_tokens)

    def _special_id(self, name: str) -> int | None:
        token = self.settings.special_tokens.get(name)
        return None if token is None else self.backend.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._special_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._special_id("pad_token")

    def save_pretrained(self, folder: str | Path) -> None:
        """tokenizer.json, tokenizer_config.json and chat_template.jinja as transformers reads them, and this
        class's own settings (a test model's folder written from the default tokenizer)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(folder / "tokenizer.json"))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", **self.settings.special_tokens,
                  "clean_up_tokenization_spaces": self.settings.clean_up_spaces}
        if self.chat_template:
            config["chat_template"] = self.chat_template
            (folder / "chat_template.jinja").write_text(self.chat_template)
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1, ensure_ascii=False))
        TokenizerSettings(self.settings.special_tokens, self.chat_template, self.settings.clean_up_spaces).save(folder)

    # ---- chat
    def apply_chat_template(self, conversation: list[dict], add_generation_prompt: bool = False,
                            tokenize: bool = True) -> str | list[int]:
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        text = chat_template.render(self.chat_template, conversation, self.settings.special_tokens,
                                    add_generation_prompt)
        return self.encode(text, add_special_tokens=False) if tokenize else text


# transformers' clean_up_tokenization, for tokenizers whose decode applies it
_CLEAN_UPS = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
              (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


def clean_up_spaces(text: str) -> str:
    for old, new in _CLEAN_UPS:
        text = text.replace(old, new)
    return text


# ---- checking against transformers (at conversion) ---------------------------------------------------------

PROBE_TEXTS = ("Hi", "Hello, world! How are you today?", " leading and trailing spaces ", "a  b\n\n\tc\r\n",
               "Héllo wörld — naïve café, 你好，世界。こんにちは 🤖👍🏽", "don't . , ? ! 's 're n't",
               "def f(x):\n    return x ** 2  # 12345 678.9", "<|im_start|>user<|im_end|> <s></s> <bos><eos>")
PROBE_CHATS = (
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": "4."}, {"role": "user", "content": "And in Japanese? 四"}],
    [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi there! 😀"},
     {"role": "user", "content": " spaced  out "}],
)


def settings_from(reference) -> TokenizerSettings:
    """What a transformers tokenizer says about itself: named special tokens, chat template, and whether its
    decode cleans up spaces (found by asking it, not by reading its flags: the rule moved between versions)."""
    special = {k: str(v) for k, v in (reference.special_tokens_map or {}).items()
               if k in SPECIAL_TOKEN_NAMES and v is not None}
    template = getattr(reference, "chat_template", None)
    if isinstance(template, dict):  # transformers 4's named templates
        template = template.get("default")
    ids = reference.encode("a . b n't", add_special_tokens=False)
    cleans = reference.decode(ids) != reference.backend_tokenizer.decode(ids)
    return TokenizerSettings(special, template, cleans)


def check_and_save(folder: Path, reference, into: Path | None = None, name: str = SETTINGS_FILE) -> TokenizerSettings:
    """Settings for the tokenizer files in folder, from the transformers tokenizer `reference` and checked against
    it on the probes, written to into/name (default: folder/kvscope-tokenizer.json; a read-only place: checked
    again next time)."""
    settings = settings_from(reference)
    found = differences(reference, Tokenizer.from_folder(folder, settings))
    if found:
        settings = TokenizerSettings(settings.special_tokens, settings.chat_template, settings.clean_up_spaces,
                                     matches_transformers=False)
    with contextlib.suppress(OSError):
        (into or folder).mkdir(parents=True, exist_ok=True)
        settings.save(into or folder, name)
    return settings


# what transformers' AutoTokenizer may read from a Hugging Face folder: the settings checked for a folder hold
# while none of these changed (their bytes are the key)
TOKENIZER_INPUTS = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                    "chat_template.jinja", "chat_template.json", "config.json", "vocab.json", "vocab.txt",
                    "merges.txt", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model")


def folder_key(folder: Path) -> str:
    """A digest of the folder's tokenizer inputs (names and bytes, additional chat templates included), of this
    settings version and of the installed transformers: the name its checked settings are kept under."""
    import hashlib
    import importlib.metadata

    digest = hashlib.sha256(f"v{SETTINGS_VERSION} transformers {importlib.metadata.version('transformers')}".encode())
    extra = folder / "additional_chat_templates"
    paths = [folder / n for n in TOKENIZER_INPUTS] + (sorted(extra.glob("*")) if extra.is_dir() else [])
    for path in paths:
        if path.is_file():
            digest.update(f"\0{path.relative_to(folder)}\0{path.stat().st_size}\0".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:32]


def differences(reference, ours: Tokenizer) -> list[str]:
    """Where ours differs from the transformers tokenizer on the probes (empty: none)."""
    found = []
    for text in PROBE_TEXTS:
        for special in (False, True):
            a, b = reference.encode(text, add_special_tokens=special), ours.encode(text, add_special_tokens=special)
            if a != b:
                found.append(f"encode({text!r}, add_special_tokens={special}): {a} vs {b}")
            if reference.decode(a) != ours.decode(a):
                found.append(f"decode({a}): {reference.decode(a)!r} vs {ours.decode(a)!r}")
    if ours.chat_template:
        for chat in PROBE_CHATS:
            found += _template_differences(reference, ours, chat)
    return found


def _template_differences(reference, ours: Tokenizer, chat: list[dict]) -> list[str]:
    def rendered(tok):
        try:
            return tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # noqa: BLE001 - a refusal (no system role) must be refused by both
            return f"raised: {'system' in str(e).lower()}"

    a, b = rendered(reference), rendered(ours)
    return [] if a == b else [f"chat template on {chat}: {a!r} vs {b!r}"]
