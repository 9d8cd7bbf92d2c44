"""Compare in the window: the Compare menu, the job on the worker (progress, Stop), the Compare window, and the
result saved with the conversation (app.conversation_list) and exported as CSV and PNG.

While a Compare runs the window is busy as during a reply: the input and the settings menus wait, Stop (the
window's or the Compare window's) ends the replay within a step.
"""

from __future__ import annotations

from PySide6.QtGui import QAction, QKeySequence
from PySide6.QtWidgets import QMenu

from app import file_dialogs
from app.compare_dialog import CompareDialog
from app.compare_view import CompareView
from engine.replay_result import CompareResult


class CompareController:
    def __init__(self, window):
        self.window = window
        self.running = False
        self.view = CompareView(window)
        menu = self._add_menu(window.menuBar())
        self.replay_action = QAction("&Replay under…", window, shortcut=QKeySequence("Ctrl+Shift+R"),
                                     statusTip="Replay this conversation's exact tokens under other configurations")
        self.show_action = QAction("Show the &last Compare", window, statusTip="The Compare window")
        menu.addAction(self.replay_action)
        menu.addAction(self.show_action)
        self.replay_action.triggered.connect(self.ask)
        self.show_action.triggered.connect(self.show_view)
        v = self.view
        v.replay_requested.connect(self.ask)
        v.stop_requested.connect(self.stop)
        v.export_csv_requested.connect(lambda: self._ask_path("CSV (*.csv)", self.export_csv))
        v.export_png_requested.connect(lambda: self._ask_path("PNG image (*.png)", self.export_png))
        signals = window.client.signals
        if hasattr(signals, "compare_step"):  # the local engine; a server replays nothing
            signals.compare_step.connect(v.add_step)
            signals.compare_done.connect(self._on_done)
            signals.progress.connect(self._on_progress)

    # --- actions ------------------------------------------------------------------------------------------------------
    def ask(self) -> None:
        w = self.window
        from_view = self.view.isVisible()
        dialog = CompareDialog(w.info, w.settings.block_size, w.prefix_reuse, self.view if from_view else w)
        accepted = dialog.exec()
        if not from_view:  # asked from the main window: its input has the focus again (the Compare window keeps its)
            w.restore_focus()
        if accepted:
            self.run(dialog.configurations())

    def run(self, configs) -> bool:
        w = self.window
        why = self._why_not()
        if why:
            w.status.showMessage(why, 6000)
            w.chat.show_error(why)
            return False
        self.running = True
        w.generating = True  # busy as during a reply: the conversation list and the menus wait; Stop stops it
        w.chat.set_generating(True)
        w.chat.set_input_enabled(False, "Comparing… (Stop ends the replay)")
        w.menus.set_busy(True)
        self.view.start(configs, sum(1 for m in w.snapshot.get("messages", []) if m["role"] == "assistant"))
        self.show_view()
        w.client.compare(configs)
        return True

    def stop(self) -> None:
        if self.running:
            self.window.client.stop()
            self.window.status.showMessage("Stopping the Compare…", 2000)

    def show_view(self) -> None:
        self.view.show()
        self.view.raise_()

    def show_saved(self, saved: dict | None) -> None:
        """The opened conversation's last Compare (None: none) in the Compare window."""
        try:
            result = CompareResult.from_dict(saved) if saved else None
        except (ValueError, KeyError, TypeError):
            result = None
        self.view.show_result(result)

    def export_csv(self, path: str) -> bool:
        try:
            self.view.result.write_csv(path)
        except OSError as e:
            self.window.chat.show_error(f"Could not write {path}: {e.strerror or e}")
            return False
        return True

    def export_png(self, path: str) -> bool:
        ok = self.view.export_png_to(path)
        if not ok:
            self.window.chat.show_error(f"Could not write {path}")
        return ok

    # --- worker signals -------------------------------------------------------------------------------------------
    def _on_progress(self, message: str, fraction: float) -> None:
        if self.running:
            self.view.set_progress(fraction)
            self.window.status.showMessage(message, 3000)

    def _on_done(self, result: CompareResult) -> None:
        self._end()
        self.view.finish(result)
        if result.error:
            self.window.chat.show_error(f"Compare: {result.error}")
            return
        stopped = any(not run.complete for run in result.runs)
        self.window.status.showMessage("Compare stopped: the configurations replayed so far are shown" if stopped
                                       else "Compare done", 6000)
        conversations = getattr(self.window, "conversations", None)
        if conversations is not None:
            conversations.set_compare(result.to_dict())

    def _end(self) -> None:
        w = self.window
        self.running = False
        w.generating = False
        w.chat.set_generating(False)
        w.chat.set_input_enabled(w.info is not None)
        w.menus.set_busy(w.loading)
        w.status.hide_progress()

    def _why_not(self) -> str:
        w = self.window
        if w.backends.remote:
            return "Compare replays on the local engine: switch Settings → Backend to local first"
        if w.generating or w.loading or self.running:
            return "Wait for the reply or the load to finish (or Stop it) before a Compare"
        if not any(m["role"] == "assistant" for m in w.snapshot.get("messages", [])):
            return "Nothing to compare yet: send a message first, then replay its tokens under other caches"
        return ""

    @staticmethod
    def _add_menu(bar) -> QMenu:
        """Compare, just before Help (which stays last)."""
        menu = QMenu("&Compare", bar)
        help_menu = next((a for a in bar.actions() if a.text() == "&Help"), None)
        if help_menu is None:
            bar.addMenu(menu)
        else:
            bar.insertMenu(help_menu, menu)
        return menu

    def _ask_path(self, file_filter: str, action) -> None:
        path = file_dialogs.ask(self.view, "Export", self.window.settings.last_folder, file_filter, "save")
        if path:
            action(path)
