"""The local backend: today's engine on its worker thread (app.engine_client.EngineClient), under the name the
window uses to pick a backend. Its signals are app.worker.WorkerSignals; the remote backend emits the same."""

from __future__ import annotations

from app.engine_client import EngineClient


class LocalClient(EngineClient):
    kind = "local"
