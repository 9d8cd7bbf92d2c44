"""Markdown -> the HTML subset Qt's rich text understands. Raw HTML is disabled and images are never loaded."""

from __future__ import annotations

from markdown_it import MarkdownIt
from markdown_it.common.utils import escapeHtml

from app.style import CODE_BACKGROUND, TEXT_MUTED

_CODE_FONT = "'JetBrains Mono', 'DejaVu Sans Mono', 'Consolas', monospace"


def _fence(self, tokens, idx, options, env) -> str:
    token = tokens[idx]
    language = token.info.strip().split(" ")[0] if token.info else ""
    code = escapeHtml(token.content.rstrip("\n"))
    label = ""
    if language:
        label = f'<p style="color:{TEXT_MUTED}; font-size:small; margin:0 0 4px 0;">{escapeHtml(language)}</p>'
    return (
        f'<table width="100%" cellpadding="8" cellspacing="0" bgcolor="{CODE_BACKGROUND}" '
        f'style="margin-top:4px; margin-bottom:8px;"><tr><td>{label}'
        f'<pre style="font-family:{_CODE_FONT}; white-space:pre-wrap; margin:0;">{code}</pre></td></tr></table>\n'
    )


def _code_inline(self, tokens, idx, options, env) -> str:
    code = escapeHtml(tokens[idx].content)
    return f'<code style="font-family:{_CODE_FONT}; background-color:{CODE_BACKGROUND};">&nbsp;{code}&nbsp;</code>'


def _image(self, tokens, idx, options, env) -> str:
    """Images are shown as their alt text: nothing remote is ever fetched."""
    alt = escapeHtml(self.renderInlineAsText(tokens[idx].children or [], options, env))
    return f'<span style="color:{TEXT_MUTED};">[image: {alt or "no description"}]</span>'


def _table_open(self, tokens, idx, options, env) -> str:
    return '<table border="1" cellspacing="0" cellpadding="4" style="border-collapse:collapse;">\n'


def _make_parser() -> MarkdownIt:
    md = MarkdownIt("commonmark", {"html": False, "linkify": False, "typographer": False})
    md.enable(["table", "strikethrough"])
    md.add_render_rule("fence", _fence)
    md.add_render_rule("code_block", _fence)
    md.add_render_rule("code_inline", _code_inline)
    md.add_render_rule("image", _image)
    md.add_render_rule("table_open", _table_open)
    return md


_PARSER = _make_parser()


def render_markdown(text: str) -> str:
    """HTML for a message; an unclosed code fence (mid-stream) renders as a code block to the end."""
    return _PARSER.render(text)


def render_plain(text: str) -> str:
    """HTML for text shown exactly as typed (the user's own messages keep their line breaks)."""
    return f'<div style="white-space:pre-wrap;">{escapeHtml(text)}</div>'
