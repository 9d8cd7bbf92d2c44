"""Speculative decoding in the app: the setting (menu, dialog, persistence), and what a reply shows: verify steps
in the latency plot sized by the tokens they produced, acceptance in the figures, tokens per step in the footer."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from test_app_support import greedy, make_settings, send

from app.dialogs import DraftTokensDialog
from app.figures import figure_rows
from app.metrics_panel import verify_marker_sizes
from app.step_log import StepLog
from engine.config import SpeculativeConfig
from engine.events import DoneEvent, StepEvent
from engine.kv.base import KVStats

REPEAT = "Repeat after me: the cat sat on the mat, the cat sat on the mat, and the dog lay by the door."
KV = KVStats("paged", 10, 100, 50, 40, 4.0)


def test_the_speculative_setting_persists_and_reaches_the_sampling_parameters(tmp_path):
    settings = make_settings(tmp_path)
    assert (settings.speculative_mode, settings.max_draft_tokens) == ("off", 8)
    settings.speculative_mode, settings.max_draft_tokens = "lookup", 5
    settings.sync()
    again = make_settings(tmp_path)
    assert again.speculative == SpeculativeConfig("lookup", 5)
    assert again.sampling.speculative == SpeculativeConfig("lookup", 5)


def test_bad_saved_speculative_values_fall_back_to_the_defaults(tmp_path):
    settings = make_settings(tmp_path)
    settings.q.setValue("speculative/mode", "medusa")
    settings.q.setValue("speculative/max_draft_tokens", 999)
    assert settings.speculative == SpeculativeConfig("off", 8)


def test_the_menu_switches_prompt_lookup_on_and_off(qtbot, window):
    menus = window.menus
    assert menus.speculative_modes["off"].isChecked()
    menus.speculative_modes["lookup"].trigger()
    assert window.settings.speculative_mode == "lookup" and window.settings.sampling.speculative.enabled
    menus.speculative_modes["off"].trigger()
    assert window.settings.speculative_mode == "off"


def test_the_max_draft_tokens_dialog_offers_1_to_64(qtbot):
    dialog = DraftTokensDialog(8)
    qtbot.addWidget(dialog)
    dialog.spin.setValue(100)
    assert dialog.value() == 64
    dialog.spin.setValue(3)
    assert dialog.value() == 3


def test_a_speculative_reply_shows_its_verify_steps_acceptance_and_tokens_per_step(qtbot, window):
    window.sampling_override = replace(greedy(40), speculative=SpeculativeConfig("lookup", 6, adaptive=False))
    turn = send(qtbot, window, REPEAT)
    assert not turn.errors
    done = turn.done[0]
    assert done.n_drafted > 0 and done.n_generated_tokens == 40
    verify = [e for e in turn.steps if e.n_drafted]
    window.metrics.refresh()
    x, y = window.metrics.curve("paged", "verify")
    assert list(x) == [e.pos for e in verify]
    assert np.allclose(y, [e.latency_ms / e.n_produced for e in verify])
    assert "tokens per decode step" in window.chat.messages[-1].footer.text()
    assert "Speculative decoding, last reply" in window.metrics.figures_text


def test_a_plain_reply_draws_no_verify_markers_and_no_speculation_figure(qtbot, window):
    send(qtbot, window, "Hello")
    window.metrics.refresh()
    assert len(window.metrics.curve("paged", "verify")[0]) == 0
    assert "Speculative" not in window.metrics.figures_text
    assert "tokens per decode step" not in window.chat.messages[-1].footer.text()


def test_the_latency_line_shows_ms_per_produced_token_and_verify_markers_grow_with_tokens():
    log = StepLog()
    log.add(StepEvent("decode", 10, 1, 50.0, KV, 0, "paged", 7))
    log.add(StepEvent("decode", 14, 5, 60.0, KV, 0, "paged", 8, n_drafted=4, n_accepted=3))
    (run,) = log.runs
    assert list(run.values("decode_ms")) == [50.0, 15.0]
    assert (list(run.values("verify_x")), list(run.values("verify_n"))) == ([14.0], [4.0])
    assert list(verify_marker_sizes(np.array([1, 2, 9, 40]))) == [5, 7, 21, 21]


def test_the_figures_report_acceptance_and_tokens_per_forward_of_the_last_reply(window):
    done = DoneEvent("x", 30, 41, 10.0, 20.0, "length", "paged", 0, n_decode_steps=10, n_decode_forwards=12,
                     n_drafted=40, n_accepted=30)
    rows = {title: (value, detail) for title, value, detail in figure_rows(window.info, KV, done)}
    value, detail = rows["Speculative decoding, last reply"]
    assert value == "75% of drafts accepted · 3.33 tokens per forward"
    assert "10 decode steps (12 forwards)" in detail
