"""The window's side of the backends: which client to make, what changes on screen in remote mode, and switching
between the local engine and a server from Settings → Backend.

Remote mode, on screen: the figures and the block map under the plots give way to the server's figures
(ServerView, polled from its /metrics); the status bar's KV field shows the server's KV usage; the local-only
menus (cache strategy, block size, model) are disabled with a tooltip that says why.
"""

from __future__ import annotations

from app.backends.dialog import BackendChoice, BackendDialog
from app.backends.local import LocalClient
from app.backends.remote import RemoteClient
from app.backends.server_view import ServerView


class Backends:
    def __init__(self, window):
        self.window = window
        self.view: ServerView | None = None

    @property
    def remote(self) -> bool:
        return isinstance(self.window.client, RemoteClient)

    def make_client(self, cache: str | None = None, block_size: int | None = None, engine=None):
        w, s = self.window, self.window.settings
        if engine is None and s.backend == "remote":
            return RemoteClient(s.server_url, s.server_api_key, s.server_model, s.system_prompt, parent=w)
        return LocalClient(cache or s.cache_strategy, block_size or s.block_size, s.system_prompt, parent=w)

    def start(self) -> None:
        """After the client is made and connected: set up the screen for it, and connect to the server."""
        w = self.window
        self._show_server_figures(self.remote)
        w.menus.set_remote(self.remote)
        if self.remote:
            self.view.status_label = w.status.labels["kv"]
            w.client.signals.server_kv.connect(self.view.set_kv)  # a QObject slot: gone with the window
            w.loading = True
            w.chat.set_input_enabled(False, f"Connecting to {w.settings.server_url}…")
            w.status.show_progress(f"Connecting to {w.settings.server_url}…", -1)
            w.client.load(None)

    def on_loaded(self, info) -> None:
        """The server answered /v1/models: chat with the model it serves."""
        w = self.window
        w.loading, w.info = False, info
        w.settings.server_model = info.model_name
        w.setWindowTitle(f"kvscope — {info.model_name} (server)")
        w.status.hide_progress()
        w.status.set_model(info)
        self.view.set_server(info.model_name, info.url)
        w.menus.set_busy(w.generating)
        w.chat.set_input_enabled(True)

    def _show_server_figures(self, remote: bool) -> None:
        metrics, block_map = self.window.metrics, self.window.block_map
        if not remote and self.view is None:
            return  # local from the start: the panel stays as the window built it
        if remote and self.view is None:
            self.view = ServerView()
            metrics.bottom.insertWidget(0, self.view)
        if self.view is not None:
            self.view.setVisible(remote)
        metrics.figures.setVisible(not remote)
        block_map.setVisible(not remote)

    # --- Settings → Backend --------------------------------------------------------------------------------------
    def edit(self) -> None:
        s = self.window.settings
        dialog = BackendDialog(BackendChoice(s.backend, s.server_url, s.server_api_key, s.server_model), self.window)
        accepted = dialog.exec()
        self.window.restore_focus()
        if accepted:
            self.apply(dialog.choice())

    def apply(self, choice: BackendChoice) -> None:
        """Save the choice and switch now: the chat starts over with the new backend."""
        w, s = self.window, self.window.settings
        s.backend, s.server_url, s.server_api_key, s.server_model = choice.kind, choice.url, choice.api_key, \
            choice.model
        if w.generating:
            w.stop()
        w.client.shutdown()
        w.client.deleteLater()
        w.info = None
        w.chat.clear()
        w.chat.clear_error()
        w.metrics.new_conversation()
        w.branching.reset()  # the chat starts over: no versions, the live pool
        w.block_map.show_live()
        w.conversations.new_chat_started()
        w.client = self.make_client()
        w._connect_worker()
        w.client.signals.conversation.connect(w.conversation_list.relay)  # the new backend's chats are saved too
        self.start()
        if not self.remote:
            w.menus.check(s.cache_strategy, s.block_size)
            w.load_model(s.model_path, remember=False)
