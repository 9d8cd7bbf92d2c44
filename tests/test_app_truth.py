"""What the window says is true (issue 12): prefix reuse is a setting of its own; 'none' is shown holding nothing;
Help → About and the side panel fill the formula from one source, the active strategy's; the status bar is live
during a reply and starts over with the conversation; a saved conversation keeps what each reply's footer showed.
Real windows on the tiny random model, offscreen."""

from __future__ import annotations

import json
import re

import pytest
from PySide6.QtCore import QObject
from test_app_support import Recorder, dispose, make_settings, open_window, send, worker_messages

from app import storage
from app.dialogs import about_html
from app.figures import figure_rows
from app.model_info import kv_bytes
from app.status_bar import StatusBar
from engine.bench.memory import int8_scale_bytes_per_token
from engine.config import CACHE_STRATEGIES


def use_strategy(qtbot, window, strategy: str) -> None:
    window.menus.strategies[strategy].trigger()
    qtbot.waitUntil(lambda: window.info.cache_strategy == strategy, timeout=30_000)


# ---- 1. prefix reuse, its own switch ------------------------------------------------------------------------------


def test_keep_the_cache_between_turns_is_a_setting_that_reaches_the_engine(qtbot, window):
    assert window.menus.prefix_reuse.isChecked() and window.settings.prefix_reuse
    send(qtbot, window, "First turn")
    assert send(qtbot, window, "Second turn").done[0].prefix_hit_tokens > 0

    window.menus.prefix_reuse.trigger()  # off
    qtbot.waitUntil(lambda: not window.info.prefix_reuse, timeout=30_000)
    third = send(qtbot, window, "Third turn")

    assert window.settings.prefix_reuse is False
    assert third.done[0].prefix_hit_tokens == 0
    prefill = [s for s in third.steps if s.phase == "prefill"]
    assert sum(s.n_tokens for s in prefill) == third.done[0].n_prompt_tokens  # the whole history again
    assert "prefilled again every turn" in about_html(window.info)


@pytest.mark.parametrize("strategy", ["contiguous", "paged"])
def test_with_reuse_on_contiguous_and_paged_both_reuse_the_history(qtbot, window, strategy):
    use_strategy(qtbot, window, strategy)
    send(qtbot, window, "First turn")
    second = send(qtbot, window, "Second turn").done[0]
    assert second.prefix_hit_tokens > second.n_prompt_tokens // 2


def test_the_prefix_reuse_setting_persists_and_a_window_starts_with_it(qtbot, tmp_path, tiny_engine_factory):
    settings = make_settings(tmp_path)
    settings.prefix_reuse = False
    window = open_window(qtbot, settings, tiny_engine_factory("contiguous"))
    try:
        assert not window.menus.prefix_reuse.isChecked()
        assert window.info.prefix_reuse is False
        send(qtbot, window, "One")
        assert send(qtbot, window, "Two").done[0].prefix_hit_tokens == 0
    finally:
        dispose(window)


# ---- 2. 'none' holds nothing -----------------------------------------------------------------------------------


def test_under_none_the_block_map_and_figures_say_nothing_is_held(qtbot, window):
    use_strategy(qtbot, window, "none")
    send(qtbot, window, "Hello there")
    qtbot.waitUntil(lambda: "nothing held" in window.block_map.summary.text(), timeout=10_000)

    assert "tokens held" not in window.block_map.summary.text()
    rows = {title: (value, detail) for title, value, detail in figure_rows(window.info, window.metrics.kv)}
    value, detail = rows["KV bytes per token"]
    assert value == "nothing held (none)"
    assert "a cache would need 2 × 4 B/element" in detail and "bytes/token" in detail
    assert rows["KV memory now"][0] == "0 B: nothing held"
    assert "nothing held (none)" in window.metrics.figures_text
    assert "holds nothing" in about_html(window.info)


# ---- 3. one source for About and the side panel ---------------------------------------------------------------


@pytest.mark.parametrize("strategy", CACHE_STRATEGIES)
def test_about_and_the_side_panel_show_the_same_formula_for_every_strategy(qtbot, window, strategy):
    use_strategy(qtbot, window, strategy)
    formula = kv_bytes(window.info).formula
    rows = {title: (value, detail) for title, value, detail in figure_rows(window.info, None)}

    assert formula in rows["KV bytes per token"][1]
    assert formula in about_html(window.info).replace("&#x27;", "'")
    assert f"Cache:</b> {strategy}" in about_html(window.info)


def test_paged_int8_fills_the_formula_with_one_byte_plus_its_scales(qtbot, window, tiny_config):
    use_strategy(qtbot, window, "paged-int8")
    kv = kv_bytes(window.info)
    c, bs = tiny_config, window.info.block_size

    # int8 data plus one float16 scale per key channel per block and one per value token and head
    assert kv.bytes_per_token == pytest.approx(c.kv_bytes_per_token(1) + int8_scale_bytes_per_token(c, bs))
    assert kv.bytes_per_element == pytest.approx(1 + 1 / bs + 1 / c.head_dim)
    assert "B/element (int8 + float16 scales)" in kv.formula
    assert not re.search(r"× 4 B/element", about_html(window.info))  # the float32 figure of the issue is gone


def test_about_names_a_block_size_only_for_paged_strategies(qtbot, window):
    assert "block size 16" in about_html(window.info)
    use_strategy(qtbot, window, "contiguous")
    assert "block size" not in about_html(window.info)


# ---- 5. a live status bar, reset with the conversation ------------------------------------------------------------


class StatusWatcher(QObject):
    """Reads the status bar at each step the window receives (connected after the window: it sees the step's
    update), then refreshes the window as its timer does and reads the bar again."""

    def __init__(self, window):
        super().__init__()
        self.window, self.seen = window, []
        window.client.signals.step.connect(self.on_step)

    def on_step(self, event) -> None:
        status = self.window.status
        before = status.text("speed")
        self.window._refresh_live()
        self.seen.append((event, before, status.text("speed"), status.text("ttft")))


def test_the_status_bar_shows_the_replys_own_speed_and_first_token_time_while_it_streams(qtbot, window):
    """The first-token time as soon as the first token comes; the running speed at the window's refreshes (a few a
    second: a label set anew at every token took the engine's threads a share of a core), over the steps so far."""
    send(qtbot, window, "A first reply")
    previous = (window.status.text("speed"), window.status.text("ttft"))
    watcher = StatusWatcher(window)
    recorder = Recorder(window)
    window.send("A second reply")
    assert (window.status.text("speed"), window.status.text("ttft")) == ("… tok/s", "first token …") != previous
    qtbot.waitUntil(lambda: recorder.ended and not window.generating, timeout=120_000)
    recorder.close()

    prefill_ms, decode_ms, tokens, last_shown = 0.0, 0.0, 0, "… tok/s"
    for event, before_refresh, speed, ttft in watcher.seen:
        assert before_refresh == last_shown  # a step alone leaves the speed as the last refresh showed it
        if event.phase == "prefill":
            prefill_ms += event.latency_ms
            assert ttft == f"first token {prefill_ms:,.0f} ms"
        else:
            decode_ms += event.latency_ms
            tokens += event.n_produced
            assert speed == f"{tokens / (decode_ms / 1000):.1f} tok/s"  # the running figure, not the last reply's
        last_shown = speed
    assert tokens > 0
    done = recorder.done[0]
    assert window.status.text("speed") == f"{done.decode_tok_s:.1f} tok/s"


def test_new_chat_resets_the_status_bar(qtbot, window):
    send(qtbot, window, "Something to count")
    assert not window.status.text("context").startswith("context 0 ")
    window.menus.new_chat.trigger()

    assert window.status.text("context") == f"context 0 / {window.info.max_context:,} (0.0%)"
    assert window.status.text("speed") == "– tok/s" and window.status.text("ttft") == "first token –"


def test_a_status_bar_on_its_own_counts_speculative_tokens_per_step(qtbot):
    from engine.events import StepEvent
    from engine.kv.base import KVStats

    bar = StatusBar()
    qtbot.addWidget(bar)
    kv = KVStats("paged", 1, 0, 0, 0, 4.0)
    bar.start_reply()
    bar.add_step(StepEvent("prefill", 9, 10, 40.0, kv, 0, "paged", token_id=5))
    assert bar.text("ttft") == "first token 40 ms"  # at once
    bar.add_step(StepEvent("decode", 12, 4, 20.0, kv, 0, "paged", token_id=6, n_drafted=3, n_accepted=3))
    assert bar.text("speed") == "… tok/s"  # the speed at the window's next refresh
    bar.show_live()
    assert bar.text("speed") == "200.0 tok/s"  # 4 tokens in 20 ms


# ---- 6. saving what the footer shows ---------------------------------------------------------------------------


def stopped_reply(qtbot, window) -> Recorder:
    recorder = Recorder(window)
    window.send("Please go on for a long time")
    window.stop()  # cancels the generation asked for: after its first step, or before it if the prefill had begun
    qtbot.waitUntil(lambda: recorder.ended and not window.generating, timeout=120_000)
    recorder.close()
    assert recorder.done[0].finish_reason == "cancelled"
    return recorder


def test_save_then_open_brings_back_every_footer_including_the_stopped_tag(qtbot, tmp_path, window,
                                                                           tiny_engine_factory):
    send(qtbot, window, "A complete reply")
    done = stopped_reply(qtbot, window).done[0]
    footers = [m.footer.text() for m in window.chat.messages]
    assert "stopped" in footers[-1]
    path = tmp_path / "chat.json"
    assert window.actions_.save_file(str(path))

    data = json.loads(path.read_text())
    assert data["version"] == storage.VERSION == 4  # version 4: turn starts, block-map states, branches (optional)
    reply = data["messages"][-1]["reply"]
    assert reply["finish_reason"] == "cancelled" and reply["strategy"] == "paged"
    assert (reply["n_generated_tokens"], reply["ttft_ms"]) == (done.n_generated_tokens, done.ttft_ms)

    other = open_window(qtbot, make_settings(tmp_path / "other"), tiny_engine_factory("paged"))
    try:
        assert other.actions_.open_file(str(path))
        assert [m.footer.text() for m in other.chat.messages] == footers
        assert [m.text for m in other.chat.messages] == [m.text for m in window.chat.messages]
    finally:
        dispose(other)


def test_a_file_of_the_old_format_still_opens(qtbot, tmp_path, window):
    old = {"format": "kvscope-conversation", "version": 1, "system_prompt": "Be brief.", "context_start": 0,
           "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))

    assert window.actions_.open_file(str(path))
    assert [(m.role, m.text) for m in window.chat.messages] == [("user", "Hi"), ("assistant", "Hello!")]
    assert window.chat.messages[-1].footer.text() == ""
    qtbot.waitUntil(lambda: worker_messages(window) == [("user", "Hi"), ("assistant", "Hello!")], timeout=10_000)


@pytest.mark.parametrize("reply, reason", [
    ({"n_prompt_tokens": 5}, "lack"),
    ({"n_prompt_tokens": 5, "n_generated_tokens": 2, "ttft_ms": 1.0, "decode_tok_s": 3.0, "finish_reason": "maybe",
      "strategy": "paged", "prefix_hit_tokens": 0}, "finish_reason"),
    ({"n_prompt_tokens": -1, "n_generated_tokens": 2, "ttft_ms": 1.0, "decode_tok_s": 3.0, "finish_reason": "stop",
      "strategy": "paged", "prefix_hit_tokens": 0}, "n_prompt_tokens"),
    ({"n_prompt_tokens": 5, "n_generated_tokens": 2, "ttft_ms": 1.0, "decode_tok_s": 3.0, "finish_reason": "stop",
      "strategy": "paged", "prefix_hit_tokens": 0, "colour": "red"}, "unknown"),
    ("fast", "object"),
])
def test_a_file_with_corrupt_reply_figures_is_refused_and_changes_nothing(qtbot, tmp_path, window, reply, reason):
    send(qtbot, window, "Keep me")
    before = [(m.role, m.text, m.footer.text()) for m in window.chat.messages]
    conversation = worker_messages(window)
    bad = {"format": "kvscope-conversation", "version": 2, "system_prompt": None, "context_start": 0,
           "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo", "reply": reply}]}
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))

    assert not window.actions_.open_file(str(path))
    assert "bad.json is not a kvscope conversation" in window.chat.error_text and reason in window.chat.error_text
    assert [(m.role, m.text, m.footer.text()) for m in window.chat.messages] == before
    assert worker_messages(window) == conversation
