"""The window's file, model and settings actions: each asks for a path or a value, then does one thing.

Every failure is shown in the window (the chat's error banner) and changes nothing else.
"""

from __future__ import annotations

from pathlib import Path

from app import file_dialogs, storage
from app.conversation_list import record_of, show_saved
from app.dialogs import SamplingDialog, SystemPromptDialog

CONVERSATION_FILTER = "kvscope conversation (*.json);;All files (*)"


class WindowActions:
    def __init__(self, window):
        self.window = window

    # --- files ------------------------------------------------------------------------------------------------------
    def open_file(self, path: str) -> bool:
        """Show the file's conversation (chat, footers, plots, block map as saved, versions); it joins the
        conversation list as a new entry."""
        w = self.window
        try:
            saved = storage.open_chat(path)
        except storage.StorageError as e:
            w.chat.show_error(str(e))
            return False
        show_saved(w, saved)
        w.conversations.new_chat_started()
        w.status.showMessage(f"Opened {path}", 4000)
        return True

    def save_file(self, path: str) -> bool:
        w = self.window
        data = w.snapshot  # a reply still streaming is not in it yet
        replies, extras = record_of(w, data) if data.get("messages") else ([], {})
        try:
            storage.save_conversation(path, data, replies, extras)
        except storage.StorageError as e:
            self.window.chat.show_error(str(e))
            return False
        self.window.status.showMessage(f"Saved {path}", 4000)
        return True

    def export_png(self, path: str) -> bool:
        ok = self.window.metrics.export_png(path)
        if not ok:
            self.window.chat.show_error(f"Could not write {path}")
        return ok

    def export_csv(self, path: str) -> bool:
        try:
            self.window.metrics.export_csv(path)
        except OSError as e:
            self.window.chat.show_error(f"Could not write {path}: {e.strerror or e}")
            return False
        return True

    def ask_path(self, action, save: bool, file_filter: str = CONVERSATION_FILTER) -> None:
        """Ask for a file (starting in the folder last used), then act on it; the input has the focus after."""
        settings = self.window.settings
        path = file_dialogs.ask(self.window, "Save" if save else "Open", settings.last_folder, file_filter,
                                "save" if save else "open")
        self.window.restore_focus()
        if path:
            settings.last_folder = str(Path(path).parent)
            action(path)

    # --- model ------------------------------------------------------------------------------------------------------
    def choose_gguf(self) -> None:
        path = file_dialogs.ask(self.window, "Choose a GGUF model", "", "GGUF model (*.gguf)")
        self.window.restore_focus()
        if path:
            self.window.load_model(path)

    def choose_folder(self) -> None:
        path = file_dialogs.ask(self.window, "Choose a Hugging Face model folder", mode="folder")
        self.window.restore_focus()
        if path:
            self.window.load_model(path)

    # --- settings dialogs ---------------------------------------------------------------------------------------
    def edit_sampling(self) -> None:
        settings = self.window.settings
        dialog = SamplingDialog(settings.sampling, self.window)
        if dialog.exec():
            settings.sampling = dialog.params()
        self.window.restore_focus()

    def edit_system_prompt(self) -> None:
        dialog = SystemPromptDialog(self.window.settings.system_prompt, self.window)
        if dialog.exec():
            self.set_system_prompt(dialog.prompt())
        self.window.restore_focus()

    def set_system_prompt(self, prompt: str) -> None:
        self.window.settings.system_prompt = prompt
        self.window.client.set_system_prompt(prompt or None)
