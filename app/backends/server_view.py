"""The side panel's figures in remote mode: the server's KV cache as its /metrics publishes it, labelled as the
server's, with whatever it does not publish shown as unavailable."""

from __future__ import annotations

from PySide6.QtWidgets import QFrame, QTextBrowser, QWidget

from app.backends.metrics_parser import ServerKV
from app.figures import figures_html
from app.style import human_bytes

UNAVAILABLE = "unavailable"


def _known(*values) -> bool:
    return all(v is not None for v in values)


def server_rows(kv: ServerKV | None, model: str = "", url: str = "") -> list[tuple[str, str, str]]:
    """(title, value, detail) rows, like app.figures.figure_rows, from the server's latest /metrics."""
    where = f"{model} at {url}" if model else url
    if kv is None:
        return [("Server", where or "–", "no /metrics from the server: its KV figures are unavailable")]
    if not kv.reachable:
        return [("Server", "unreachable", f"no answer from {url or 'the server'}: its KV figures are unavailable")]
    not_published = f"{kv.flavour or 'this server'} does not publish it"
    rows = [("Server", f"{kv.flavour or 'unknown'} server", where)]
    usage = f"{kv.kv_usage:.1%}" if kv.kv_usage is not None else UNAVAILABLE
    tokens = f"{kv.kv_tokens:,.0f} tokens held" if kv.kv_tokens is not None else "share of the server's KV pool in use"
    rows.append(("Server KV-cache usage", usage, tokens if kv.kv_usage is not None else not_published))
    requests = (f"{kv.running:,.0f} running · {kv.waiting:,.0f} waiting" if _known(kv.running, kv.waiting)
                else UNAVAILABLE)
    rows.append(("Server requests", requests, "in the batch, and queued" if requests != UNAVAILABLE else not_published))
    rows.append(_prefix_row(kv, not_published))
    blocks = _known(kv.blocks_total, kv.blocks_used, kv.blocks_free, kv.blocks_cached)
    rows.append(("Server block pool", f"{kv.blocks_used:,.0f} of {kv.blocks_total:,.0f} blocks used" if blocks
                 else UNAVAILABLE, f"{kv.blocks_cached:,.0f} cached, {kv.blocks_free:,.0f} free" if blocks
                 else not_published))
    memory = _known(kv.bytes_allocated, kv.bytes_used)
    theoretical = f", theoretical {human_bytes(kv.bytes_theoretical)}" if kv.bytes_theoretical is not None else ""
    rows.append(("Server KV memory", human_bytes(kv.bytes_allocated) if memory else UNAVAILABLE,
                 f"used {human_bytes(kv.bytes_used)}{theoretical}" if memory else not_published))
    if kv.kv_tokens is not None or kv.longest_sequence is not None:  # llama.cpp's figures; others have none
        rows.append(_context_row(kv, not_published))
    rows.append(_tokens_row(kv, not_published))
    return rows


def _prefix_row(kv: ServerKV, not_published: str) -> tuple[str, str, str]:
    """The prefix cache's hit rate; published counters with no prompt yet say so (a rate of nothing is not 0%)."""
    rate = kv.prefix_hit_rate
    if rate is not None:
        return ("Server prefix cache", f"{rate:.1%} of prompt tokens hit",
                f"{kv.prefix_hits:,.0f} of {kv.prefix_queries:,.0f} tokens")
    if kv.prefix_hits is not None and kv.prefix_queries == 0:
        return ("Server prefix cache", "no prompt tokens yet", "0 of 0 tokens looked up")
    return ("Server prefix cache", UNAVAILABLE, not_published)


def _context_row(kv: ServerKV, not_published: str) -> tuple[str, str, str]:
    """The tokens the server's KV cache holds, and the longest sequence it has held, for a server that publishes
    at least one of them: the other reads unavailable (llama.cpp's recent builds publish only the longest)."""
    held = f"{kv.kv_tokens:,.0f} tokens held" if kv.kv_tokens is not None else UNAVAILABLE
    longest = (f"longest sequence so far {kv.longest_sequence:,.0f} tokens" if kv.longest_sequence is not None
               else f"longest sequence: {UNAVAILABLE}")
    if kv.kv_tokens is None:
        longest += f"; tokens held: {not_published}"
    return ("Server context", held, longest)


def _tokens_row(kv: ServerKV, not_published: str) -> tuple[str, str, str]:
    """Generated and prompt tokens, each shown only as what the server publishes (never a made-up 0)."""
    generated = f"{kv.generation_tokens:,.0f} generated" if kv.generation_tokens is not None else UNAVAILABLE
    if kv.prompt_tokens is not None:
        prompt = f"{kv.prompt_tokens:,.0f} prompt tokens processed"
    else:
        prompt = f"prompt tokens: {UNAVAILABLE} ({not_published})"
    if kv.generation_tokens is None and kv.prompt_tokens is None:
        prompt = not_published
    return ("Server tokens", generated, prompt)


def status_text(kv: ServerKV | None) -> str:
    if kv is not None and not kv.reachable:
        return "server unreachable"
    if kv is None or kv.kv_usage is None:
        return "server KV unavailable"
    return f"server KV {kv.kv_usage:.0%}"


class ServerView(QTextBrowser):
    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent, objectName="serverFigures", openLinks=False)
        self.setFrameShape(QFrame.Shape.NoFrame)
        self.setMinimumWidth(220)
        self.model, self.url = "", ""
        self.kv: ServerKV | None = None
        self.status_label = None  # a status-bar label that shows the server's KV usage too
        self._html = ""
        self.set_kv(None)

    def set_server(self, model: str, url: str) -> None:
        self.model, self.url = model, url
        self.set_kv(self.kv)

    def set_kv(self, kv: ServerKV | None) -> None:
        self.kv = kv
        if self.status_label is not None:
            self.status_label.setText(status_text(kv))
        html = figures_html(server_rows(kv, self.model, self.url))
        if html != self._html:
            self._html = html
            self.setHtml(html)

    @property
    def text(self) -> str:
        return "\n".join(" ".join(row) for row in server_rows(self.kv, self.model, self.url))
