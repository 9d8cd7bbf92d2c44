"""The menu bar: File, Settings, View, Help. Actions are plain attributes so the window (and tests) reach them."""

from __future__ import annotations

from PySide6.QtGui import QAction, QActionGroup, QKeySequence
from PySide6.QtWidgets import QMainWindow, QMenu

from app import open_model_dialog
from app.dialogs import DraftTokensDialog, KVBudgetDialog, minimum_budget
from app.settings import MENU_BLOCK_SIZES
from engine.config import CACHE_STRATEGIES, KV_DTYPES, WEIGHT_FORMATS

WEIGHT_HINTS = {
    "auto": "the fastest format measured on this machine that meets the quality bounds",
    "float32": "4 bytes per weight: the reference",
    "bfloat16": "2 bytes per weight",
    "int8": "1 byte per weight, one scale per output channel",
    "int4": "half a byte per weight in groups of 32 (a GGUF's own Q4 blocks); embedding and head in int8",
}

STRATEGY_HINTS = {
    "none": "no cache: recompute the whole context every step",
    "contiguous": "one preallocated buffer per sequence",
    "paged": "fixed-size blocks from a shared pool, with prefix caching",
    "paged-int8": "paged, keys and values stored as int8 with scales",
}

KV_DTYPE_HINTS = {
    "auto": "the fastest precision measured on this machine that meets the quality bound",
    "float32": "4 bytes per element: the reference",
    "bfloat16": "2 bytes per element, float32's range",
    "float16": "2 bytes per element, llama.cpp's default cache",
    "int8": "1 byte per element plus float16 scales",
    "int4": "half a byte per element (keys per channel, values per token); the newest 128 tokens in float16, so a "
            "reply can depend on what the cache held before",
}
KV_DTYPE_TIP = " (a new cache: the next turn prefills the history; 'none' keeps no cache)"


def kv_dtype_hint(name: str) -> str:
    return KV_DTYPE_HINTS.get(name, f"keys and values stored as {name}") + KV_DTYPE_TIP


SPECULATIVE_TIP = ("draft tokens by matching the conversation's last words earlier in it, verify them in one "
                   "forward and roll back the rejected: the same reply, faster when it quotes the context")
REMOTE_TIP = ("Applies to the local engine only: the server chooses its own model, cache strategy and block size "
              "(Settings → Backend switches back to the local engine)")


PREFIX_REUSE_TIP = ("prefix reuse: a new turn computes only what follows the history the cache holds; off: "
                    "every turn prefills the whole history again")


class Menus:
    def __init__(self, window: QMainWindow):
        self.window = window
        bar = window.menuBar()
        self._file(bar.addMenu("&File"))
        self._settings(bar.addMenu("&Settings"))
        self._view(bar.addMenu("&View"))
        help_menu = bar.addMenu("&Help")
        self.about = self._action(help_menu, "&About kvscope…")

    def _action(self, menu: QMenu, text: str, shortcut=None, checkable: bool = False, tip: str = "") -> QAction:
        action = QAction(text, self.window, checkable=checkable)
        if shortcut is not None:
            action.setShortcut(QKeySequence(shortcut))
        if tip:
            action.setStatusTip(tip)
            action.setToolTip(tip)
        menu.addAction(action)
        return action

    def _file(self, menu: QMenu) -> None:
        self.new_chat = self._action(menu, "&New chat", QKeySequence.StandardKey.New)
        self.open = self._action(menu, "&Open…", QKeySequence.StandardKey.Open)
        self.save = self._action(menu, "&Save…", QKeySequence.StandardKey.Save)
        self.open_model = self._action(menu, "Open &model…", "Ctrl+Shift+O", tip="the GGUF models on this machine")
        self.open_model.triggered.connect(lambda: open_model_dialog.choose_and_load(self.window))
        menu.addSeparator()
        self.export_png = self._action(menu, "Export plots as &PNG…")
        self.export_csv = self._action(menu, "Export figures as &CSV…")
        menu.addSeparator()
        self.quit = self._action(menu, "&Quit", QKeySequence.StandardKey.Quit)

    def _settings(self, menu: QMenu) -> None:
        strategy_menu = menu.addMenu("Cache &strategy")
        self.strategy_group = QActionGroup(self.window, exclusive=True)
        self.strategies: dict[str, QAction] = {}
        for name in CACHE_STRATEGIES:
            action = self._action(strategy_menu, name, checkable=True, tip=STRATEGY_HINTS.get(name, ""))
            action.setData(name)
            self.strategy_group.addAction(action)
            self.strategies[name] = action
        block_menu = menu.addMenu("&Block size")
        self.block_size_group = QActionGroup(self.window, exclusive=True)
        self.block_sizes: dict[int, QAction] = {}
        for size in MENU_BLOCK_SIZES:
            action = self._action(block_menu, f"{size} tokens", checkable=True)
            action.setData(size)
            self.block_size_group.addAction(action)
            self.block_sizes[size] = action
        weights_menu = menu.addMenu("&Weights")
        weights_menu.setToolTipsVisible(True)
        self.weights_group = QActionGroup(self.window, exclusive=True)
        self.weight_formats: dict[str, QAction] = {}
        for name in WEIGHT_FORMATS:
            action = self._action(weights_menu, name, checkable=True, tip=WEIGHT_HINTS[name] + " (reloads the model)")
            action.setData(name)
            self.weights_group.addAction(action)
            self.weight_formats[name] = action
        self.kv_dtype_menu = self._kv_dtypes(menu.addMenu("KV p&recision"))
        self.prefix_reuse = self._action(menu, "&Keep the cache between turns", checkable=True, tip=PREFIX_REUSE_TIP)
        self.kv_budget = self._action(menu, "KV b&udget…", tip="the most the paged pool grows to, in MiB")
        self.kv_budget.triggered.connect(self._ask_kv_budget)
        menu.addSeparator()
        self.sampling = self._action(menu, "Sa&mpling…")
        self._speculative(menu.addMenu("Speculative &decoding"))
        self.system_prompt = self._action(menu, "System &prompt…")
        menu.addSeparator()
        model_menu = menu.addMenu("Choose &model")
        self.model_gguf = self._action(model_menu, "GGUF file…")
        self.model_folder = self._action(model_menu, "Hugging Face model folder…")
        self.model_default = self._action(model_menu, "Default model (SmolLM2-135M-Instruct)")
        # disabled in remote mode (set_remote)
        self.local_only = (strategy_menu, block_menu, weights_menu, self.kv_dtype_menu, model_menu)
        menu.setToolTipsVisible(True)
        self.backend = self._action(menu, "Bac&kend…", tip="the local engine, or an OpenAI-compatible server")

    def _kv_dtypes(self, menu: QMenu) -> QMenu:
        """One checkable action per KV precision the engine offers (engine.config.KV_DTYPES)."""
        menu.setToolTipsVisible(True)
        self.kv_dtype_group = QActionGroup(self.window, exclusive=True)
        self.kv_dtypes: dict[str, QAction] = {}
        for name in KV_DTYPES:
            action = self._action(menu, name, checkable=True, tip=kv_dtype_hint(name))
            action.setData(name)
            self.kv_dtype_group.addAction(action)
            self.kv_dtypes[name] = action
        return menu

    def check_kv_dtype(self, name: str | None) -> None:
        if name in self.kv_dtypes:
            self.kv_dtypes[name].setChecked(True)

    def _speculative(self, menu: QMenu) -> None:
        """Off / prompt lookup and the most draft tokens per step; saved in the settings, used from the next turn."""
        settings = getattr(self.window, "settings", None)
        self.speculative_group = QActionGroup(self.window, exclusive=True)
        self.speculative_modes: dict[str, QAction] = {}
        for mode, text, tip in (("off", "Off", "one token per forward"),
                                ("lookup", "Prompt lookup", SPECULATIVE_TIP)):
            action = self._action(menu, text, checkable=True, tip=tip)
            action.setData(mode)
            action.setChecked(settings is not None and settings.speculative_mode == mode)
            self.speculative_group.addAction(action)
            self.speculative_modes[mode] = action
        menu.addSeparator()
        self.max_draft_tokens = self._action(menu, "Max draft tokens…")
        if settings is not None:
            self.speculative_group.triggered.connect(lambda a: setattr(settings, "speculative_mode", a.data()))
            self.max_draft_tokens.triggered.connect(self._ask_max_draft_tokens)

    def _ask_max_draft_tokens(self) -> None:
        settings = self.window.settings
        dialog = DraftTokensDialog(settings.max_draft_tokens, self.window)
        if dialog.exec():
            settings.max_draft_tokens = dialog.value()
            self.window.status.set_speculation(settings.speculative)
        self.window.restore_focus()

    def _ask_kv_budget(self) -> None:
        settings = self.window.settings
        minimum = minimum_budget(getattr(self.window, "info", None), settings.system_prompt)
        dialog = KVBudgetDialog(settings.kv_budget_mib, self.window, minimum)
        if dialog.exec():
            self.window.set_kv_budget(dialog.value())
        self.window.restore_focus()

    def _view(self, menu: QMenu) -> None:
        self.show_side_panel = self._action(menu, "Show side &panel", "Ctrl+B", checkable=True)
        self.clear_plots = self._action(menu, "&Clear plots")

    def check(self, strategy: str, block_size: int) -> None:
        self._block_size_now = block_size  # may be one the menu does not offer (--block-size 1)
        strategy = strategy if strategy in self.strategies else strategy.split("-")[0]  # paged-int4: paged + int4
        if strategy in self.strategies:
            self.strategies[strategy].setChecked(True)
        if block_size in self.block_sizes:
            self.block_sizes[block_size].setChecked(True)
        for action in self.block_sizes.values():
            action.setEnabled(strategy.startswith("paged"))

    def chosen_cache(self) -> tuple[str, int]:
        """The strategy and block size checked in the menus (or in use, when the menu offers no such size)."""
        size = self.block_size_group.checkedAction()
        return self.strategy_group.checkedAction().data(), size.data() if size else self._block_size_now

    def set_remote(self, remote: bool) -> None:
        """A server has its own cache and model: the local-only menus are disabled and their tooltip says why."""
        self.kv_budget.setEnabled(not remote)  # the server sizes its own pool
        for submenu in self.local_only:
            submenu.setEnabled(not remote)
            submenu.menuAction().setToolTip(REMOTE_TIP if remote else submenu.title().replace("&", ""))
            submenu.menuAction().setStatusTip(REMOTE_TIP if remote else "")
        self.prefix_reuse.setEnabled(not remote)
        self.prefix_reuse.setToolTip(REMOTE_TIP if remote else PREFIX_REUSE_TIP)

    def set_busy(self, busy: bool) -> None:
        """While a reply streams, actions that replace the conversation or the model wait."""
        for action in (self.new_chat, self.open, self.model_gguf, self.model_folder, self.model_default):
            action.setEnabled(not busy)
