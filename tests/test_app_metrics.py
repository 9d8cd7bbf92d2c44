"""The metrics panel: one point per step, a colour-coded series per strategy, runs that restart on going back,
figures filled in from the engine's numbers, CSV and PNG export, and tens of thousands of points."""

from __future__ import annotations

import csv

import pytest
from test_app_support import HANG_GUARD_MS

from app.figures import figure_rows
from app.metrics_panel import MetricsPanel
from app.model_info import ModelInfo
from app.step_log import CSV_COLUMNS
from engine.events import DoneEvent, StepEvent
from engine.kv.base import KVStats

SMOL = ModelInfo("SmolLM2-135M", "cpu", "float32", 8192, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                 cache_strategy="paged", block_size=16)


def kv(tokens: int, strategy="paged", bpe=4.0) -> KVStats:
    per_token = int(2 * bpe * 30 * 3 * 64)
    blocks = -(-tokens // 16)
    return KVStats(strategy, tokens, bytes_allocated=1024 * 16 * per_token, bytes_used=blocks * 16 * per_token,
                   bytes_theoretical=tokens * per_token, bytes_per_element=bpe, block_size=16, num_blocks=1024,
                   num_blocks_used=blocks, num_blocks_free=1024 - blocks)


def step(phase: str, pos: int, n_tokens: int = 1, ms: float = 10.0, strategy="paged", hit=0) -> StepEvent:
    return StepEvent(phase, pos, n_tokens, ms, kv(pos + 1, strategy), hit, strategy, 5, "x")


def turn(start: int, prompt: int, replies: int, strategy="paged", hit=0) -> list[StepEvent]:
    end = start + prompt - 1
    events = [step("prefill", end, prompt - hit, 40.0, strategy, hit)]
    return events + [step("decode", end + i, 1, 12.0 + i % 3, strategy) for i in range(1, replies + 1)]


@pytest.fixture
def panel(qtbot):
    panel = MetricsPanel()
    qtbot.addWidget(panel)
    panel.set_model_info(SMOL)
    return panel


def test_each_step_becomes_one_point_with_the_engines_figures(panel):
    events = turn(0, 30, 20)
    for event in events:
        panel.add_step(event)
    panel.refresh()

    assert len(panel.log.rows) == len(events)
    x, y = panel.curve("paged", "decode")
    assert list(x) == [e.pos for e in events[1:]] and list(y) == [e.latency_ms for e in events[1:]]
    x, y = panel.curve("paged", "prefill")  # one bar across the prefill's tokens at its per-token cost
    assert list(x) == [-0.5, 29.5] and list(y) == [40.0 / 30] * 2
    x, y = panel.curve("paged", "theoretical")
    assert list(y) == pytest.approx([e.kv.bytes_theoretical / 2**20 for e in events])


def test_a_new_strategy_gets_its_own_series_beside_the_old_one(panel):
    for event in turn(0, 30, 10) + turn(0, 45, 10, strategy="contiguous"):
        panel.add_step(event)
    panel.refresh()

    assert {run.strategy for run in panel.log.runs} == {"paged", "contiguous"}
    assert len(panel.curve("paged", "decode")[0]) == 10 and len(panel.curve("contiguous", "decode")[0]) == 10
    legend = [label.text for _, label in panel.latency_plot.getPlotItem().legend.items]
    assert "paged" in legend and "contiguous" in legend


def test_going_back_in_position_starts_a_new_run_so_every_curve_keeps_increasing(panel):
    events = turn(0, 30, 10) + turn(0, 30, 10, hit=16)  # a regeneration
    for event in events:
        panel.add_step(event)
    panel.refresh()

    runs = [run for run in panel.log.runs if run.strategy == "paged"]
    assert len(runs) == 2
    for run in runs:
        assert all(a < b for a, b in zip(run.values("mem_x"), run.values("mem_x")[1:]))


def test_clear_plots_removes_every_point_and_series(panel):
    for event in turn(0, 30, 10):
        panel.add_step(event)
    panel.refresh()

    panel.clear()

    assert panel.log.rows == [] and len(panel.curve("paged", "decode")[0]) == 0
    assert not [item for item in panel.latency_plot.getPlotItem().listDataItems()]


def test_the_csv_has_one_row_per_step_with_every_column(panel, tmp_path):
    events = turn(0, 30, 5) + turn(35, 10, 5, strategy="paged-int8")
    for event in events:
        panel.add_step(event)

    panel.export_csv(tmp_path / "steps.csv")

    with open(tmp_path / "steps.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert tuple(rows[0]) == CSV_COLUMNS
    assert len(rows) == len(events)
    assert rows[0]["phase"] == "prefill" and rows[-1]["strategy"] == "paged-int8"
    assert float(rows[0]["per_token_ms"]) == pytest.approx(40.0 / 30)
    assert int(rows[3]["kv_bytes_theoretical"]) == events[3].kv.bytes_theoretical


def test_the_plots_export_as_a_png(panel, tmp_path):
    for event in turn(0, 30, 5):
        panel.add_step(event)

    assert panel.export_png(str(tmp_path / "plots.png"))
    assert (tmp_path / "plots.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_figures_fill_in_the_bytes_per_token_formula_and_the_savings(panel):
    panel.add_step(step("decode", 99))
    panel.turn_finished(DoneEvent("hi", 100, 5, 50.0, 20.0, "stop", "paged", 64))
    text = panel.figures_text

    assert "2 × 4 B/element × 30 layers × 3 KV heads × 64 head_dim = 46,080 bytes/token" in text
    assert "3× smaller than multi-head" in text and "138,240 bytes/token" in text
    assert "64 of 100 prompt tokens reused" in text
    assert "Pool utilisation" in text


def test_the_int8_figure_shows_the_measured_compression():
    int8 = ModelInfo(**{**SMOL.__dict__, "cache_strategy": "paged-int8", "kv_bytes_per_element": 1.125})
    rows = dict((title, value) for title, value, _ in figure_rows(int8, kv(10, "paged-int8", bpe=1)))

    assert rows["int8 compression"] == "3.56× smaller"


def drawn_points(plot) -> list[tuple[int, int]]:
    """(points held, points drawn) of every line of a plot (drawn: after clipping and downsampling)."""
    return [(len(item.xData), len(item.curve.xData)) for item in plot.getPlotItem().listDataItems()
            if item.xData is not None and item.curve.xData is not None and len(item.xData) > 2]


def test_tens_of_thousands_of_points_are_kept_and_drawn_downsampled_to_the_plots_width(qtbot, panel):
    """What keeps the plots fluid is the number of points drawn, bounded by the width in pixels, not by the steps
    (peak downsampling draws at most 2 points per 1/autoDownsampleFactor of a pixel column)."""
    panel.resize(700, 600)
    panel.show()
    for event in turn(0, 500, 40_000):
        panel.add_step(event)
    panel.refresh()
    panel.grab()
    bound = 2 * 5 * panel.latency_plot.getViewBox().width() + 4

    assert len(panel.curve("paged", "decode")[0]) == 40_000
    for plot in (panel.latency_plot, panel.memory_plot):
        qtbot.waitUntil(lambda plot=plot: all(drawn <= bound for _, drawn in drawn_points(plot)),
                        timeout=HANG_GUARD_MS)
        assert [held for held, _ in drawn_points(plot)] == ([40_000] if plot is panel.latency_plot else [40_001] * 3)
    panel.add_step(step("decode", 40_600))
    panel.refresh()
    panel.grab()
    assert len(panel.curve("paged", "decode")[0]) == 40_001
    assert all(drawn <= bound for _, drawn in drawn_points(panel.latency_plot))  # one more point: still downsampled


def test_the_decode_line_breaks_at_each_new_turns_prefill(panel):
    for event in turn(0, 30, 10) + turn(41, 12, 10):
        panel.add_step(event)
    panel.refresh()

    run = panel.log.runs[0]
    y = run.values("decode_ms")
    assert len(panel.log.runs) == 1 and len(y) == 21 and sum(v != v for v in y) == 1  # one NaN: one gap
