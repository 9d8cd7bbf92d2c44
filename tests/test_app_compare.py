"""Compare in the window: Replay under… picks configurations, the worker replays the conversation's exact tokens
through each (progress, Stop), the Compare window overlays one series per configuration on the same positions
and tabulates them; the result is saved with the conversation and exported as CSV and PNG."""

from __future__ import annotations

import csv

import numpy as np
import pytest
from PySide6.QtGui import QImage
from test_app_support import TURN_TIMEOUT_MS, Catch, send

from app.compare_dialog import MAX_CONFIGURATIONS, CompareDialog, configurations
from engine.replay import ReplayConfig

QUESTIONS = ("What is a KV cache?", "And a paged one?", "Which is faster?")


def three_turns(qtbot, window) -> None:
    for question in QUESTIONS:
        send(qtbot, window, question)


def compare(qtbot, window, configs, start=None):
    """Run a Compare and wait for its result."""
    with Catch(qtbot, window.client.signals.compare_done, timeout=TURN_TIMEOUT_MS) as caught:
        assert window.compare.run(configs)
        if start is not None:
            start()
    qtbot.waitUntil(lambda: not window.compare.running, timeout=TURN_TIMEOUT_MS)
    return caught.args[0]


def test_contiguous_and_paged_replay_a_3_turn_conversation_on_the_same_positions_and_agree(qtbot, window):
    three_turns(qtbot, window)
    view = window.compare.view

    result = compare(qtbot, window, [ReplayConfig("contiguous"), ReplayConfig("paged")])

    assert [run.complete for run in result.runs] == [True, True]
    (x_contiguous, y_contiguous), (x_paged, y_paged) = view.series(0), view.series(1)
    assert len(x_contiguous) == 3 * 12 and list(x_contiguous) == list(x_paged)  # each reply token, once each
    assert np.all(np.asarray(y_contiguous) > 0) and np.all(np.asarray(y_paged) > 0)
    table = view.table_text()
    assert [row[0] for row in table] == [run.config.label for run in result.runs]
    assert table[0][0].startswith("contiguous") and table[1][0].startswith("paged 16")
    assert table[0][-1] == "reference" and table[1][-1] == f"100% of {3 * 13}"  # each reply token and its prompt
    assert len(table[1][4].split(", ")) == 3  # a time to first token per turn
    legend = view.latency_box.legend.text()
    assert "contiguous" in legend and "paged 16" in legend
    assert not window.generating and window.chat.input.isEnabled()  # the window is free again


def test_the_result_is_saved_with_the_conversation_and_comes_back_when_it_is_opened(qtbot, window):
    three_turns(qtbot, window)
    compare(qtbot, window, [ReplayConfig("paged", block_size=8), ReplayConfig("contiguous")])
    conversation_id = window.conversations.current
    saved = window.conversations.store.open(conversation_id).compare
    assert saved is not None and len(saved["runs"]) == 2

    window.new_chat()
    window.compare.view.show_result(None)
    assert window.compare.view.table.rowCount() == 0
    assert window.conversations.open(conversation_id)

    table = window.compare.view.table_text()
    assert [row[0] for row in table] == ["paged 8 · KV float32 · float32 weights",
                                        "contiguous · KV float32 · float32 weights"]
    assert table[1][-1].startswith("100%")


def test_stop_ends_the_replay_and_keeps_what_was_replayed(qtbot, window):
    three_turns(qtbot, window)
    view = window.compare.view
    configs = [ReplayConfig("none"), ReplayConfig("contiguous"), ReplayConfig("paged")]

    def stop_after_a_few_steps():
        qtbot.waitUntil(lambda: len(view.result.runs[0].rows) >= 3, timeout=TURN_TIMEOUT_MS)
        view.stop_button.click()

    result = compare(qtbot, window, configs, stop_after_a_few_steps)

    assert len(result.runs) < 3 or not all(run.complete for run in result.runs)
    assert not result.runs[-1].complete
    assert "incomplete" in view.table_text()[-1][0]
    again = send(qtbot, window, "Still there?")  # the engine and the conversation go on as before
    assert again.done[0].n_generated_tokens == 12


def test_export_writes_every_step_as_csv_and_the_plots_with_the_table_as_png(qtbot, window, tmp_path):
    send(qtbot, window, "Hello")
    result = compare(qtbot, window, [ReplayConfig("contiguous"), ReplayConfig("paged")])

    assert window.compare.export_csv(str(tmp_path / "compare.csv"))
    assert window.compare.export_png(str(tmp_path / "compare.png"))

    with open(tmp_path / "compare.csv", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == sum(len(run.rows) for run in result.runs)
    assert {row["configuration"] for row in rows} == {run.config.label for run in result.runs}
    image = QImage(str(tmp_path / "compare.png"))
    assert image.width() > 300 and image.height() > 300


def test_other_weights_replay_through_a_converted_copy_and_the_live_engine_keeps_its_own(qtbot, window):
    send(qtbot, window, "Hello")
    engine = window.client.worker.engine

    result = compare(qtbot, window, [ReplayConfig("paged", weights="float32"), ReplayConfig("paged", weights="int8")])

    assert [run.error for run in result.runs] == ["", ""]
    assert result.runs[1].config.label.endswith("int8 weights")
    assert engine.weight_format == "float32"
    summary = result.summaries()[1]
    assert summary.agreement is not None and 0 <= summary.agreement <= 1  # measured, whatever it is


def test_nothing_to_compare_before_the_first_reply(qtbot, window):
    assert not window.compare.run([ReplayConfig("paged")])
    assert "send a message first" in window.chat._error_label.text()


def test_the_dialog_offers_every_precision_and_lists_the_configurations_in_order(qtbot, window):
    dialog = CompareDialog(window.info, 16, True, window)
    qtbot.addWidget(dialog)
    from engine.config import KV_DTYPES

    assert set(dialog.kv[1]) == {k for k in KV_DTYPES if k != "auto"}
    assert [c.label for c in dialog.configurations()] == ["contiguous · KV float32 · float32 weights",
                                                          "paged 16 · KV float32 · float32 weights"]
    dialog.check("caches", "none")
    dialog.check("blocks", "8")
    labels = [c.label for c in dialog.configurations()]
    assert labels == ["none · float32 weights", "contiguous · KV float32 · float32 weights",
                      "paged 8 · KV float32 · float32 weights", "paged 16 · KV float32 · float32 weights"]
    assert "(reference)" in dialog.preview.text()


@pytest.mark.parametrize("caches, kv, weights, blocks, reuse, expected", [
    (["none", "paged-int8"], ["float32", "bfloat16"], ["int4"], [16], [True, False], 3),  # no precision for these
    (["contiguous"], ["float32", "bfloat16"], ["int4", "int8"], [8, 16], [True], 4),  # nor blocks for contiguous
    ([], ["float32"], ["int4"], [16], [True], 0),
])
def test_only_combinations_that_mean_something_are_made(caches, kv, weights, blocks, reuse, expected):
    made = configurations(caches, kv, weights, blocks, reuse)

    assert len(made) == expected and len({c.label for c in made}) == expected


def test_too_many_configurations_cannot_be_started(qtbot, window):
    dialog = CompareDialog(window.info, 16, True, window)
    qtbot.addWidget(dialog)
    for name in dialog.weights[1]:
        dialog.check("weights", name)
    for name in dialog.blocks[1]:
        dialog.check("blocks", name)

    assert len(dialog.configurations()) > MAX_CONFIGURATIONS
    assert not dialog.buttons.buttons()[0].isEnabled() or "at most" in dialog.preview.text()
