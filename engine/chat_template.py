"""Chat templates rendered with jinja2 alone, in the environment transformers' `apply_chat_template` uses (a
sandbox, trim_blocks and lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, a `tojson` that keeps
non-ASCII text), so a converted model renders its prompt without importing transformers. The text must equal
transformers' for the same messages: tests/test_tokenizer.py compares them."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

# the named special tokens a template sees as variables (transformers' SPECIAL_TOKENS_ATTRIBUTES)
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """The template raised (e.g. "System role not supported") or could not be compiled."""


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (templates that mark the assistant's tokens): the body as is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Dict:
    """`dict(...)` and `dict.fromkeys(...)` for templates, without handing them the type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """jinja's namespace without underscore-named attributes (no way into CPython's internals)."""

    def __init__(*args, **kwargs):  # noqa: N805 - jinja's Namespace takes self this way too
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template cannot set the attribute {name!r}")


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, namespace=_Namespace,
                       dict=_Dict())
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"the chat template does not compile: {e}") from None


def render(source: str, messages: list[dict], special_tokens: dict[str, str],
           add_generation_prompt: bool = False) -> str:
    """The template's text for these messages ({"role", "content"} dicts; keys whose value is None dropped, as
    transformers drops them). Raises ChatTemplateError with the template's own message when it refuses."""
    chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
    try:
        return compile_template(source).render(messages=chat, tools=None, documents=None,
                                               add_generation_prompt=add_generation_prompt, **special_tokens)
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(str(e)) from None
