"""Plot series keyed by the whole configuration (cache, KV precision, weights): turns under other weights or another
precision get their own curve, colour and legend entry; the step log's rows rebuild the same series."""

from __future__ import annotations

from dataclasses import replace

import pytest
from test_app_metrics import SMOL, turn

from app.metrics_panel import MetricsPanel
from app.plots import series_color
from app.step_log import CSV_COLUMNS, StepLog
from app.style import strategy_color


@pytest.fixture
def panel(qtbot):
    panel = MetricsPanel()
    qtbot.addWidget(panel)
    panel.set_model_info(replace(SMOL, kv_dtype="float32", weight_format="float32"))
    return panel


def legend_names(panel) -> list[str]:
    return [name for _, _, name in panel.latency_box.legend.entries()][:-3]  # less the three line-style keys


def decode_colors(panel) -> list[str]:
    return [panel._items[id(run)]["decode"].opts["pen"].color().name() for run in panel.log.runs]


def test_one_configuration_is_named_by_its_strategy_alone(panel):
    for event in turn(0, 30, 10):
        panel.add_step(event)
    panel.refresh()

    assert legend_names(panel) == ["paged"]
    assert decode_colors(panel) == [strategy_color("paged")]


def test_turns_under_other_weights_get_their_own_series_colour_and_legend_entry(panel):
    for event in turn(0, 30, 10):
        panel.add_step(event)
    panel.set_model_info(replace(SMOL, kv_dtype="float32", weight_format="int4"))  # a weights switch
    for event in turn(0, 41, 10):  # the switch re-prefills the history: same strategy, same positions
        panel.add_step(event)
    panel.refresh()

    assert len(panel.log.runs) == 2
    assert legend_names(panel) == ["paged · float32 weights", "paged · int4 weights"]
    first, second = decode_colors(panel)
    assert first == strategy_color("paged") and second != first
    assert len(panel.curve("paged", "decode")[0]) == 20  # both are still the paged strategy's points


def test_another_kv_precision_is_told_apart_and_the_legend_names_only_what_differs(panel):
    for event in turn(0, 30, 5) + turn(0, 30, 5, strategy="contiguous"):
        panel.add_step(event)
    panel.set_model_info(replace(SMOL, kv_dtype="bfloat16", weight_format="float32"))
    for event in turn(0, 41, 5):
        panel.add_step(event)
    panel.refresh()

    assert legend_names(panel) == ["paged · KV float32", "contiguous · KV float32", "paged · KV bfloat16"]
    assert len(set(decode_colors(panel))) == 3


def test_the_rows_carry_the_configuration_and_rebuild_the_same_series(panel):
    for event in turn(0, 30, 5):
        panel.add_step(event)
    panel.set_model_info(replace(SMOL, kv_dtype="float32", weight_format="int8"))
    for event in turn(0, 41, 5):
        panel.add_step(event)

    again = StepLog.from_rows(panel.log.rows)

    assert CSV_COLUMNS[-2:] == ("kv_precision", "weights") and panel.log.rows[-1][-1] == "int8"
    assert again.rows == panel.log.rows
    assert [again.label(run) for run in again.runs] == [panel.log.label(run) for run in panel.log.runs]
    for mine, theirs in zip(again.runs, panel.log.runs):
        for name in ("decode_x", "decode_ms", "prefill_x", "mem_x", "allocated"):
            assert list(mine.values(name)) == pytest.approx(list(theirs.values(name)), nan_ok=True)


def test_rows_saved_before_the_configuration_columns_still_rebuild():
    old_row = ("paged", "decode", 30, 1, 12.0, 12.0, 1024, 512, 400, 0)

    log = StepLog.from_rows([old_row])

    assert log.runs[0].key.weights == "" and log.label(log.runs[0]) == "paged"


@pytest.mark.parametrize("row", [("paged", "think", 3, 1, 1.0, 1.0, 1, 1, 1, 0), ("paged",),
                                 ("paged", "decode", -3, 1, 1.0, 1.0, 1, 1, 1, 0)])
def test_a_malformed_row_is_refused(row):
    with pytest.raises(ValueError):
        StepLog.from_rows([row])


def test_each_variant_of_a_strategy_has_a_colour_of_its_own():
    colors = [series_color("paged", i) for i in range(6)]

    assert len(set(colors)) == 6 and colors[0] == strategy_color("paged")
