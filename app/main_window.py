"""The main window: chat on the left, the KV-cache side panel on the right; menus and status bar; the wiring.

Entry point for main.py:

    run_gui(args) -> int
        args.model: str | None        a .gguf file or a Hugging Face folder; None: the saved choice or the default
        args.cache: str | None        cache strategy for this session (none, contiguous, paged, paged-int8)
        args.block_size: int | None   block size of the paged strategies for this session
        args.demo: list[str] | None   prompts to send one turn each, then exit (see app.demo.run_demo)
        args.screenshot: str | None   with demo: save a PNG of the whole window after the last reply

The engine runs on a worker thread (app.engine_client); this window only reacts to its signals.
"""

from __future__ import annotations

import sys

from PySide6.QtCore import QSize, Qt, QTimer
from PySide6.QtGui import QIcon
from PySide6.QtWidgets import QApplication, QMainWindow, QMessageBox, QSplitter

from app.backends.switch import Backends
from app.block_map import BlockMap
from app.branch_controller import BranchController
from app.chat_view import ChatView
from app.compare_controller import CompareController
from app.conversation_list import ConversationList, Conversations
from app.dialogs import about_html
from app.file_dialogs import fitting_size
from app.menus import Menus
from app.message_widget import speculation_footer
from app.metrics_panel import MetricsPanel
from app.settings import AppSettings
from app.status_bar import StatusBar
from app.status_fit import StatusFit
from app.storage import reply_record
from app.style import RESOURCES, apply_theme
from app.window_actions import WindowActions

STATUS_REFRESH_MS = 200
START_SIZE = (1440, 900)  # on a screen with room for it; else 90% of the screen's free area
MIN_SIZE = (740, 480)  # the chat's and the side panel's minimum widths side by side; fits half of a 1920 screen


class MainWindow(QMainWindow):
    def __init__(self, settings: AppSettings | None = None, engine=None, model: str | None = None,
                 cache: str | None = None, block_size: int | None = None, prefix_reuse: bool | None = None,
                 kv_budget: float | None = None, weights: str | None = None, kv_dtype: str | None = None):
        super().__init__()
        self.settings = settings or AppSettings()
        self.prefix_reuse = self.settings.prefix_reuse if prefix_reuse is None else prefix_reuse
        self.kv_budget = self.settings.kv_budget_mib if kv_budget is None else kv_budget  # MiB; None: one context
        self.weights = weights or self.settings.weights  # the weight format (Settings → Weights)
        # the KV precision (Settings → KV precision); an engine handed over ready-made keeps its own unless asked
        self.kv_dtype = kv_dtype or (self.settings.kv_dtype if engine is None else None)
        self.info = None
        self.generating = False
        self.loading = False
        self.snapshot: dict = {}
        self._resync = False
        self._last_step = None
        self._pending_model: str | None = None
        self._sent_text = ""
        self.sampling_override = None  # SamplingParams used instead of the saved ones (scripts, tests)
        self.setWindowTitle("kvscope")
        self.resize(fitting_size(None, QSize(*START_SIZE)))  # a laptop's screen holds it whole
        self._build()
        self.backends = Backends(self)  # the local engine (app.backends.local) or a server (app.backends.remote)
        self.client = self.backends.make_client(cache, block_size, engine)
        self._connect_worker()
        self.conversations = Conversations(self, self.conversation_list)  # saved conversations (the sidebar)
        self.compare = CompareController(self)  # Compare → Replay under…
        self.branching = BranchController(self)  # an edit keeps the version it replaces: "‹ 1/2 ›"
        self.menus.check(cache or self.settings.cache_strategy, block_size or self.settings.block_size)
        self.backends.start()
        if engine is not None:
            self.client.use_engine(engine)
        elif not self.backends.remote:
            self.load_model(model or self.settings.model_path, remember=False)

    # --- layout ----------------------------------------------------------------------------------------------------
    def _build(self) -> None:
        self.actions_ = WindowActions(self)
        self.chat = ChatView(self)
        self.block_map = BlockMap()
        self.metrics = self.side = MetricsPanel(self, companion=self.block_map)
        self.block_map.turn_shown.connect(self.metrics.highlight)  # a saved turn's positions, shaded in the plots
        self.splitter = QSplitter(Qt.Orientation.Horizontal, self)
        self.splitter.addWidget(self.chat)
        self.splitter.addWidget(self.side)
        self.conversation_list = ConversationList(self)
        self.splitter.insertWidget(0, self.conversation_list)
        self.splitter.setSizes([210, 680, 550])
        for index, stretch in enumerate((0, 3, 2)):  # a wider window widens the chat and the plots, not the list
            self.splitter.setStretchFactor(index, stretch)
        self.splitter.setChildrenCollapsible(False)
        self.setCentralWidget(self.splitter)
        self.setMinimumSize(*MIN_SIZE)
        self.status = StatusBar(self)
        self.setStatusBar(self.status)
        self.status_fit = StatusFit(self.status, self.status.labels)  # labels fold away instead of widening
        self.menus = Menus(self)
        self._connect_ui()
        geometry, splitter = self.settings.window_state()
        if geometry is not None:
            self.restoreGeometry(geometry)
        if splitter is not None:
            self.splitter.restoreState(splitter)
        self._set_side_panel(self.settings.show_side_panel)
        self._refresh_timer = QTimer(self, interval=STATUS_REFRESH_MS)
        self._refresh_timer.timeout.connect(self._refresh_live)
        self._refresh_timer.start()

    def _connect_ui(self) -> None:
        c, m = self.chat, self.menus
        c.send_requested.connect(self.send)
        c.stop_requested.connect(self.stop)
        c.regenerate_requested.connect(self.regenerate)
        c.edit_requested.connect(self.edit_and_resend)
        m.new_chat.triggered.connect(self.new_chat)
        a = self.actions_
        m.open.triggered.connect(lambda: a.ask_path(a.open_file, save=False))
        m.save.triggered.connect(lambda: a.ask_path(a.save_file, save=True))
        m.export_png.triggered.connect(lambda: a.ask_path(a.export_png, True, "PNG image (*.png)"))
        m.export_csv.triggered.connect(lambda: a.ask_path(a.export_csv, True, "CSV (*.csv)"))
        m.quit.triggered.connect(self.close)
        m.strategy_group.triggered.connect(lambda _action: self.set_cache(*m.chosen_cache()))
        m.block_size_group.triggered.connect(lambda _action: self.set_cache(*m.chosen_cache()))
        m.weight_formats[self.weights].setChecked(True)
        m.weights_group.triggered.connect(lambda action: self.set_weights(action.data()))
        m.check_kv_dtype(self.kv_dtype)
        m.kv_dtype_group.triggered.connect(lambda action: self.set_kv_dtype(action.data()))
        m.prefix_reuse.setChecked(self.prefix_reuse)
        m.prefix_reuse.triggered.connect(self.set_prefix_reuse)
        m.sampling.triggered.connect(a.edit_sampling)
        m.system_prompt.triggered.connect(a.edit_system_prompt)
        m.backend.triggered.connect(lambda: self.backends.edit())
        m.model_gguf.triggered.connect(a.choose_gguf)
        m.model_folder.triggered.connect(a.choose_folder)
        m.model_default.triggered.connect(lambda: self.load_model(None))
        m.show_side_panel.toggled.connect(self._set_side_panel)
        m.clear_plots.triggered.connect(self.metrics.clear)
        m.about.triggered.connect(self._show_about)
        m.speculative_group.triggered.connect(lambda _a: self.status.set_speculation(self.settings.speculative))
        QApplication.instance().focusWindowChanged.connect(self._on_focus_window)
        self.status.set_speculation(self.settings.speculative)

    def _connect_worker(self) -> None:
        s = self.client.signals
        s.loaded.connect(self._on_loaded)
        s.progress.connect(self.status.show_progress)
        s.token.connect(self.chat.append_to_last)
        s.step.connect(self._on_step)
        s.trim.connect(self._on_trim)
        s.finished.connect(self._on_finished)
        s.error.connect(self._on_error)
        s.stats.connect(self._on_stats)
        s.conversation.connect(self._on_conversation)
        self.client.set_prefix_reuse(self.prefix_reuse)  # before the model loads: its cache starts that way
        self.client.set_kv_budget(self.kv_budget)
        self.client.set_kv_dtype(self.kv_dtype)  # before the model loads: its cache starts in this precision
        self.client.set_weights(self.weights)  # before the model loads: it loads in this format

    # --- chat actions ---------------------------------------------------------------------------------------------
    def send(self, text: str) -> None:
        self._sent_text = text
        self.chat.add_message("user", text)
        self.metrics.begin_turn()
        self._start_reply()
        self.client.generate(text, self.sampling_params())

    def regenerate(self) -> None:
        self._sent_text = ""
        if self.chat.messages and self.chat.messages[-1].role == "assistant":
            self.chat.remove_last()
        self.metrics.begin_turn(replaces_last=True)  # the old reply's points leave the plots
        self._start_reply()
        self.client.regenerate(self.sampling_params())

    def edit_and_resend(self, text: str, index: int | None = None) -> None:
        """A new version of the user message at `index` (None: the last), answered: the chat continues from it, and
        the version shown until now is kept (with the turns after it and their points), to be shown again with
        the message's "‹ 1/2 ›" switcher; the history before it keeps its cache."""
        messages = self.chat.messages
        if index is None:
            index = max((i for i, m in enumerate(messages) if m.role == "user"), default=None)
        if index is None or messages[index].role != "user":
            return
        self.branching.edit(index)
        self._sent_text = text
        replaced = sum(1 for m in messages[index:] if m.role == "user")  # this turn and the ones after it
        while len(messages) > index + 1:
            self.chat.remove_last()
        messages[index].set_text(text)
        self.metrics.begin_turn(replaces=replaced)  # their points leave the plots
        self._start_reply()
        self.client.edit_and_resend(text, self.sampling_params(), index)

    def sampling_params(self):
        """The SamplingParams for the next turn: the Sampling dialog's saved values unless overridden."""
        return self.sampling_override or self.settings.sampling

    def stop(self) -> None:
        if not self.generating:
            return
        self.client.stop()
        self.status.showMessage("Stopping…")  # until the reply has ended (_on_finished, _on_error)

    def _show_about(self) -> None:
        QMessageBox.about(self, "About kvscope", about_html(self.info))
        self.restore_focus()

    def restore_focus(self) -> None:
        """After a dialog: this window is active again (its shortcuts work) and the input has the focus."""
        self.activateWindow()
        if self.chat.input.isEnabled():
            self.chat.input.setFocus(Qt.FocusReason.OtherFocusReason)

    def _on_focus_window(self, window) -> None:
        """Any dialog (or file dialog) closed and the focus came back to this window without a widget: the
        input takes it, so typing and shortcuts go on working without a click."""
        if window is not None and window is self.windowHandle():
            focused = QApplication.focusWidget()
            if focused is None or not self.isAncestorOf(focused):
                self.restore_focus()

    def _start_reply(self) -> None:
        self.block_map.show_live()  # a saved pool state gives way to the live one
        self.status.start_reply()
        self.status.set_speculation(self.sampling_params().speculative)
        self.chat.clear_error()
        self.chat.add_message("assistant", "")
        self._set_generating(True)

    def show_saved_pools(self, what: str = "conversation") -> None:
        """The block map shows the step log's saved states, one per turn (the last first), until the next turn;
        the live pool where there are none."""
        num_turns = sum(1 for m in self.chat.messages if m.role == "user")
        self.block_map.show_history(self.metrics.saved_turns(num_turns), num_turns, what)

    def show_last_reply(self, done) -> None:
        """The status bar shows a shown conversation's last reply: its speed, first token and context."""
        self.status.new_conversation()
        if done is not None:
            self.status.set_done(done)
            self.status.set_context(done.n_prompt_tokens + done.n_generated_tokens)

    def _set_generating(self, generating: bool) -> None:
        self.generating = generating
        self.chat.set_generating(generating)
        self.menus.set_busy(generating or self.loading)

    # --- file, model and settings actions ------------------------------------------------------------------------
    def new_chat(self) -> None:
        self.metrics.clear()  # a new chat starts with empty plots (the old one's are saved with it)
        self.block_map.show_live()
        self.branching.reset()
        self.conversations.new_chat_started()
        self.chat.clear()
        self.chat.clear_error()
        self.metrics.new_conversation()
        self.status.new_conversation()
        self.client.new_conversation(self.settings.system_prompt)

    def load_model(self, model: str | None, remember: bool = True) -> None:
        self.loading = True
        self._pending_model = model if remember else "keep"
        self.chat.set_input_enabled(False, "Loading the model…")
        self.menus.set_busy(True)
        self.status.show_progress(f"Loading {model or 'the default model'}…", -1)
        self.client.load(model)

    def set_cache(self, strategy: str, block_size: int) -> None:
        self.settings.cache_strategy, self.settings.block_size = strategy, block_size
        self.client.set_cache(strategy, block_size)
        when = "from the next turn" if self.generating else "now"
        blocks = f", block size {block_size}" if strategy.startswith("paged") else ""  # only blocks have a size
        self.status.showMessage(f"Cache: {strategy}{blocks} (applies {when})", 5000)

    def set_kv_budget(self, mib: float | None) -> None:
        self.kv_budget = self.settings.kv_budget_mib = mib
        self.client.set_kv_budget(mib)
        what = f"{mib:g} MiB" if mib else "one context's worth"
        self.status.showMessage(f"KV budget: {what} (a new pool; the next turn prefills the history)", 5000)

    def set_kv_dtype(self, name: str) -> None:
        """Store keys and values in `name` (engine.config.KV_DTYPES) from the next turn: a new cache, into which
        the conversation re-prefills."""
        self.kv_dtype = self.settings.kv_dtype = name
        self.client.set_kv_dtype(name)
        when = "from the next turn" if self.generating else "now"
        self.status.showMessage(f"KV precision: {name} (a new cache; applies {when})", 5000)

    def set_weights(self, fmt: str) -> None:
        """Reload the model with its weights in `fmt`; the conversation stays and re-prefills on the next turn."""
        self.weights = self.settings.weights = fmt
        if self.info is None or self.info.weight_format == fmt:
            self.client.set_weights(fmt)  # applies to the load under way, or changes nothing
            return
        self.loading, self._pending_model = True, "keep"
        self.chat.set_input_enabled(False, f"Loading the weights as {fmt}…")
        self.menus.set_busy(True)
        self.status.show_progress(f"Loading the weights as {fmt}…", -1)
        self.client.set_weights(fmt)

    def set_prefix_reuse(self, on: bool) -> None:
        self.prefix_reuse = self.settings.prefix_reuse = on
        self.client.set_prefix_reuse(on)
        what = "kept between turns" if on else "prefilled again every turn"
        when = "from the next turn" if self.generating else "now"
        self.status.showMessage(f"The history is {what} (applies {when})", 5000)

    def _set_side_panel(self, visible: bool) -> None:
        self.side.setVisible(visible)
        self.settings.show_side_panel = visible
        if self.menus.show_side_panel.isChecked() != visible:
            self.menus.show_side_panel.setChecked(visible)

    # --- worker signals ------------------------------------------------------------------------------------------
    def _on_loaded(self, info) -> None:
        if getattr(info, "remote", False):
            return self.backends.on_loaded(info)
        if self.loading and self._pending_model not in (None, "keep"):
            self.settings.model_path = self._pending_model
        elif self.loading and self._pending_model is None:
            self.settings.model_path = None
        was_loading, self.loading = self.loading, False
        self.info = info
        self.setWindowTitle(f"kvscope — {info.model_name}")
        if was_loading:  # a strategy switch reports "loaded" too: its status message stays
            self.status.hide_progress()
        self.status.set_model(info)
        self.metrics.set_model_info(info)
        self.menus.check(info.cache_strategy, info.block_size)
        self.menus.check_kv_dtype(info.kv_dtype_setting or info.kv_dtype)
        self.block_map.set_precision(info.kv_dtype)
        self.menus.set_busy(self.generating)
        self.chat.set_input_enabled(True)
        self._count_with(info)

    def _count_with(self, info) -> None:
        """The input box counts the message's tokens with this model, and warns before a message that would fill
        more than half of the context left."""
        count = getattr(info, "count_prompt", None)
        if count is None:
            self.chat.count_tokens = self.chat.send_warning = None
            return
        empty = count(None, [("user", "")])  # the template's own tokens around a message
        self.chat.count_tokens = lambda text: count(None, [("user", text)]) - empty
        self.chat.send_warning = self.send_warning
        self.chat.update_token_count()

    def send_warning(self, text: str, tokens: int) -> str:
        """'' when the message takes at most half of the context left; else what it takes and which old turns
        would leave the model's view to make room."""
        info = self.info
        left = info.max_context - self.status.context_used
        if 2 * tokens <= left:
            return ""
        leaving = self._turns_that_would_leave(text)
        which = ""
        if leaving:
            first = leaving[0][:40] + ("…" if len(leaving[0]) > 40 else "")
            which = f" To make room, the {len(leaving)} oldest turns (from \"{first}\") would leave the model's view."
        return (f"This message is {tokens:,} tokens: {tokens / max(left, 1):.0%} of the {left:,} tokens left in the "
                f"context.{which} Press Enter again to send it anyway.")

    def _turns_that_would_leave(self, text: str) -> list[str]:
        """The first user message of each old turn the engine would drop to fit this message and a reply (the
        same rule as engine.chat.fit_to_context, counted here with the model's tokenizer)."""
        info, snapshot = self.info, self.snapshot or {}
        messages = [(m["role"], m["content"]) for m in snapshot.get("messages", [])]
        visible = messages[int(snapshot.get("context_start", 0)):] + [("user", text)]
        reserve = min(self.sampling_params().max_new_tokens, info.max_context // 4)
        system, leaving = snapshot.get("system_prompt"), []
        while len(visible) > 1 and info.count_prompt(system, visible) + reserve > info.max_context:
            step = 2 if len(visible) >= 3 and visible[0][0] == "user" and visible[1][0] == "assistant" else 1
            leaving.append(visible[0][1])
            visible = visible[step:]
        return leaving

    def _on_step(self, event) -> None:
        self.metrics.add_step(event)
        self.status.add_step(event)
        self._last_step = event

    def _on_finished(self, done) -> None:
        if self.chat.messages and self.chat.messages[-1].role == "assistant":
            message = self.chat.messages[-1]
            message.set_text(done.text)
            message.set_footer(_footer(done, self.configuration_footer()))
            message.reply = reply_record(done)  # what File → Save keeps of it
        self._refresh_live()
        self._end_stopping("Stopped: the reply so far is kept" if done.finish_reason == "cancelled" else "")
        self.status.set_done(done)
        self.status.set_context(done.n_prompt_tokens + done.n_generated_tokens)
        self.metrics.record_pool()
        self.metrics.turn_finished(done)
        self.branching.turn_ended(failed=False)
        self._set_generating(False)

    def _end_stopping(self, message: str) -> None:
        if self.status.currentMessage().startswith("Stopping"):
            self.status.set_idle(message)

    def _on_error(self, message: str) -> None:
        self.chat.show_error(message)
        self._end_stopping("")
        if self.loading:
            self.loading = False
            self.status.hide_progress()
            self.chat.set_input_enabled(self.info is not None, "" if self.info else "No model loaded: choose one "
                                        "in Settings → Choose model")
        if self.generating:
            self._resync = True
            self.metrics.abandon_turn()  # the worker keeps the conversation as before the turn: so do the plots
            self.branching.turn_ended(failed=True)  # a failed edit shows the version it replaced again
            self._set_generating(False)
        self.menus.set_busy(self.generating)

    def _on_conversation(self, data: dict) -> None:
        self.snapshot = data
        if self._resync:  # a turn failed: show the conversation as the worker kept it, and give the text back
            self._resync = False
            self.chat.keep_messages([(m["role"], m["content"]) for m in data.get("messages", [])])
            if self._sent_text and not self.chat.input.toPlainText():
                self.chat.input.setPlainText(self._sent_text)

    def _on_stats(self, kv) -> None:
        self.block_map.set_stats(kv)
        self.metrics.set_stats(kv)
        self.status.set_kv(kv)

    def _on_trim(self, trim) -> None:
        self.status.showMessage(trim_message(trim, self.snapshot, self.chat.message_texts()), 12000)

    def _refresh_live(self) -> None:
        self.status.show_live()
        event, self._last_step = self._last_step, None
        if event is not None and not self.backends.remote:  # remote: the server's /metrics feed these instead
            self.block_map.set_stats(event.kv)
            self.status.set_kv(event.kv)
            self.status.set_context(event.pos + 1)

    @staticmethod
    def reply_footer(done) -> str:
        return _footer(done)

    def configuration_footer(self) -> list[str]:
        """What the reply was computed with: the weights and the KV precision, each as asked → as chosen."""
        info = self.info
        if info is None or getattr(info, "remote", False):
            return []
        asked = self.weights
        weights = f"{asked} → {info.weight_format}" if asked and asked != info.weight_format else info.weight_format
        parts = [f"weights {weights}"]
        if info.kv_dtype_text:
            parts.append(f"KV {info.kv_dtype_text}")
        return parts

    # --- closing --------------------------------------------------------------------------------------------------
    def closeEvent(self, event) -> None:  # noqa: N802 (Qt override)
        self.settings.save_window_state(self.saveGeometry(), self.splitter.saveState())
        self.settings.sync()
        self._refresh_timer.stop()
        self.hide()  # gone at once, even while the worker finishes its current step
        self.client.shutdown()
        super().closeEvent(event)


FINISH_TAGS = {"cancelled": "stopped", "length": "length limit",
               "budget": "KV budget reached (Settings → KV budget raises it)"}


def trim_message(trim, before: dict, texts: list[tuple[str, str]]) -> str:
    """Which old messages left the model's view, and why; they stay in the chat."""
    start = int(before.get("context_start", 0)) if before else 0
    gone = texts[start:start + trim.dropped_messages]
    first = next((text for role, text in gone if role == "user"), gone[0][1] if gone else "")
    which = f' (from "{first[:40]}…")' if len(first) > 40 else (f' (from "{first}")' if first else "")
    why = (f"the KV budget holds {trim.context_limit:,} tokens" if getattr(trim, "reason", "context") == "budget"
           else f"the context ({trim.context_limit:,} tokens) was full")
    return (f"{why[0].upper()}{why[1:]}: the {trim.dropped_messages} oldest messages{which} left the model's view; "
            "they stay in the chat")


def _footer(done, configuration: list[str] | None = None) -> str:
    parts = [f"{done.n_generated_tokens} tokens", f"{done.decode_tok_s:.1f} tok/s",
             f"first token {done.ttft_ms:,.0f} ms", f"prefix reused {done.prefix_hit_tokens}/{done.n_prompt_tokens}",
             done.strategy]
    if done.strategy == "server" and not done.prefix_hit_tokens:  # a server that does not say what it reused
        parts.remove(f"prefix reused 0/{done.n_prompt_tokens}")
    parts[2:2] = speculation_footer(done)
    parts += configuration or []
    if done.finish_reason != "stop":
        parts.append(FINISH_TAGS.get(done.finish_reason, done.finish_reason))
    return " · ".join(parts)


def run_gui(args) -> int:
    app = QApplication.instance() or QApplication(sys.argv[:1])
    app.setOrganizationName("kvscope")
    app.setApplicationName("kvscope")
    apply_theme(app)
    app.setWindowIcon(QIcon(str(RESOURCES / "icon.svg")))
    window = MainWindow(model=getattr(args, "model", None), cache=getattr(args, "cache", None),
                        block_size=getattr(args, "block_size", None),
                        prefix_reuse={"on": True, "off": False}.get(getattr(args, "prefix_reuse", None)),
                        kv_budget=getattr(args, "kv_budget", None), weights=getattr(args, "weights", None),
                        kv_dtype=getattr(args, "kv_dtype", None))
    window.show()
    prompts = getattr(args, "demo", None)
    if prompts:
        from app.demo import run_demo

        return run_demo(window, prompts, getattr(args, "screenshot", None))
    return app.exec()

