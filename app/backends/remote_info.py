"""What the window knows about a server: its model (RemoteInfo) and the signals the remote backend emits."""

from __future__ import annotations

from dataclasses import dataclass

from PySide6.QtCore import Signal

from app.worker import WorkerSignals

STRATEGY = "server"  # the name the remote backend's steps carry (plots, CSV, footer)


@dataclass(frozen=True)
class RemoteInfo:
    """What the window shows about a server's model (what ModelInfo is for the local engine)."""

    model_name: str
    url: str
    max_context: int  # 0 when the server does not say
    remote = True
    device = "server"
    dtype_name = "remote"
    weights_text = "the server's weights"  # a server does not say how it stores them
    weight_format = ""
    weights_bytes = 0
    cache_strategy = STRATEGY
    block_size = 0


class RemoteSignals(WorkerSignals):
    server_kv = Signal(object)  # ServerKV, or None when the server publishes no metrics
