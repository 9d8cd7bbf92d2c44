"""The app's remote mode tells an unreachable server from one that publishes no /metrics: "unreachable" in the
panel and the status bar, and every figure unavailable, never zero."""

from __future__ import annotations

import httpx

from app.backends.http import fetch_server_kv
from app.backends.metrics_parser import ServerKV
from app.backends.server_view import server_rows, status_text
from server.process import free_port


def test_a_server_that_does_not_answer_reads_unreachable():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with httpx.Client() as client:
        kv = fetch_server_kv(client, url, None)
    assert kv is not None and not kv.reachable
    (title, value, detail), = server_rows(kv, "m", url)
    assert value == "unreachable" and url in detail and "unavailable" in detail
    assert status_text(kv) == "server unreachable"


def test_a_server_without_metrics_still_reads_unavailable_not_unreachable():
    rows = server_rows(None, "m", "http://x")
    assert "no /metrics" in rows[0][2] and "unreachable" not in rows[0][1]
    assert status_text(None) == "server KV unavailable" and status_text(ServerKV()) == "server KV unavailable"
