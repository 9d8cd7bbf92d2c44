"""What the window shows is readable: checked on what is on the screen (geometry of what was drawn, pixels of grabbed
screenshots), in the app's real theme, at the smallest window we promise (900×600) and at full width.

Issue 12, items 4 and 7–12: replaced replies leave the plots; a log latency axis and prefills that cover nothing;
legends outside the plot area; linked x axes, headroom and whole-token ticks; a chat that follows the reply;
dialogs readable in the theme; a window that works at 900×600 with nothing clipped.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from PySide6.QtCore import QPoint, QPointF, QRect, Qt
from PySide6.QtGui import QColor, QImage
from PySide6.QtWidgets import (
    QApplication,
    QDialogButtonBox,
    QFileDialog,
    QLabel,
    QMessageBox,
    QStyle,
    QStyleOptionButton,
    QTreeView,
)
from test_app_metrics import SMOL, step, turn
from test_app_support import HANG_GUARD_MS, greedy, run_turn, send

from app.backends.dialog import BackendChoice, BackendDialog
from app.chat_view import SAMPLE_TEXT
from app.dialogs import DraftTokensDialog, KVBudgetDialog, SamplingDialog, SystemPromptDialog, about_html
from app.metrics_panel import MetricsPanel
from app.plots import MIN_PLOT_HEIGHT, TokenAxis, log_headroom, token_headroom
from app.style import PLOT_BACKGROUND, PLOT_FOREGROUND, STRATEGY_COLORS, apply_theme
from engine.config import SamplingParams

SMALLEST = (900, 600)  # half of a 1920-pixel screen, a laptop's height
READABLE_CHARS = 110  # a message line at most this many characters (~100 asked, the font's own average varies)


# --- screen helpers -------------------------------------------------------------------------------------------------
def luminance(color: QColor) -> float:
    def channel(c: float) -> float:
        c /= 255
        return c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4

    return 0.2126 * channel(color.red()) + 0.7152 * channel(color.green()) + 0.0722 * channel(color.blue())


def contrast(a: QColor, b: QColor) -> float:
    """WCAG contrast ratio: 1 (none) to 21 (black on white); 4.5 is readable text, 3 a readable graphic."""
    hi, lo = sorted((luminance(a), luminance(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


def pixels(image: QImage) -> np.ndarray:
    """[height, width, 3] RGB of a grabbed image."""
    image = image.convertToFormat(QImage.Format.Format_RGB32)
    data = np.frombuffer(image.constBits(), np.uint8, count=image.sizeInBytes())
    bgra = data.reshape(image.height(), image.bytesPerLine() // 4, 4)[:, :image.width()]
    return bgra[..., 2::-1]


def background_and_ink(image: QImage, min_pixels: int = 8) -> tuple[QColor, QColor]:
    """The most common colour (the background), and the ink: the colour by which at least min_pixels pixels stand
    out from it (the min_pixels-th most contrasting pixel's colour, so antialiased strokes count whole)."""
    rgb = pixels(image).reshape(-1, 3)
    colors, counts = np.unique(rgb, axis=0, return_counts=True)
    background = QColor(*map(int, colors[counts.argmax()]))
    ranked = sorted(((contrast(QColor(*map(int, c)), background), QColor(*map(int, c)), n)
                     for c, n in zip(colors, counts)), key=lambda entry: entry[0], reverse=True)
    seen = 0
    for _, color, n in ranked:
        seen += n
        if seen >= min_pixels:
            return background, color
    return background, background


def rect_in(widget, ancestor) -> QRect:
    return QRect(widget.mapTo(ancestor, QPoint(0, 0)), widget.size())


def plot_area(plot, ancestor) -> QRect:
    """The plot's data area (its view box) in the ancestor's coordinates."""
    box = plot.getViewBox().sceneBoundingRect().toAlignedRect()
    return QRect(plot.mapTo(ancestor, plot.mapFromScene(box.topLeft())), box.size())


def data_rect(plot, item, ancestor) -> QRect:
    """Where an item's finite points are drawn, in the ancestor's coordinates."""
    x, y = np.asarray(item.xData, float), np.asarray(item.yData, float)
    keep = np.isfinite(x) & np.isfinite(y) & (y > 0)
    x, y = x[keep], np.log10(y[keep]) if plot.getPlotItem().getAxis("left").logMode else y[keep]
    view = plot.getViewBox()
    corners = [view.mapViewToScene(QPointF(float(a), float(b))) for a, b in ((x.min(), y.max()), (x.max(), y.min()))]
    top_left, bottom_right = (plot.mapTo(ancestor, plot.mapFromScene(c)) for c in corners)
    return QRect(top_left, bottom_right)


def curve_rects(plot, ancestor) -> list[QRect]:
    return [data_rect(plot, item, ancestor) for item in plot.getPlotItem().listDataItems()
            if item.yData is not None and np.isfinite(item.yData).any()]


def item_rect(panel, plot, run, name: str) -> QRect:
    return data_rect(plot, panel._items[id(run)][name], panel)


def clipped_labels(root) -> list[str]:
    """Visible labels narrower than their text, or (wrapping labels) shorter than their wrapped text."""
    def clipped(label: QLabel) -> bool:
        if label.wordWrap():
            return label.height() < label.heightForWidth(label.width())
        return label.width() < label.sizeHint().width() and label.maximumWidth() > 0

    return [label.text() for label in root.findChildren(QLabel)
            if label.isVisibleTo(root) and label.text() and clipped(label)]


def settle(qtbot, ms: int = 250) -> None:
    qtbot.wait(ms)
    QApplication.processEvents()


@pytest.fixture
def themed(qapp):
    """The app's theme (Fusion, dark palette, style sheet) for one test, then the previous look back."""
    style, palette, sheet = qapp.style().name(), qapp.palette(), qapp.styleSheet()
    apply_theme(qapp)
    yield qapp
    qapp.setStyleSheet(sheet)
    qapp.setPalette(palette)
    qapp.setStyle(style or "Fusion")


@pytest.fixture
def panel(qtbot, themed):
    panel = MetricsPanel()
    qtbot.addWidget(panel)
    panel.set_model_info(SMOL)
    panel.resize(640, 760)
    panel.show()
    return panel


def play(panel, *turns, replaces_last: bool = False) -> None:
    for i, events in enumerate(turns):
        panel.begin_turn(replaces_last=replaces_last and i == 0)
        for event in events:
            panel.add_step(event)
    panel.refresh()


# --- item 4: a replaced reply leaves the plots ------------------------------------------------------------------------
def test_a_regenerated_reply_replaces_the_old_replys_points_in_the_same_curve(panel):
    play(panel, turn(0, 30, 10), turn(41, 12, 10))
    play(panel, turn(41, 12, 25, hit=48), replaces_last=True)  # Regenerate: same prompt, a longer reply

    x, _ = panel.curve("paged", "decode")
    assert list(x) == list(range(30, 40)) + list(range(53, 78))  # the first reply, then only the new one
    assert len(panel.log.runs) == 1 and all(np.diff(panel.log.runs[0].values("mem_x")) > 0)
    assert len(panel.log.rows) == 11 + 26  # the CSV holds what the plots show


def test_a_replaced_reply_that_had_started_a_new_curve_takes_that_curve_with_it(panel):
    play(panel, turn(0, 30, 10))
    play(panel, turn(0, 41, 10, strategy="contiguous"))  # a strategy switch re-prefills: a new curve
    play(panel, turn(0, 41, 5, strategy="paged", hit=32), replaces_last=True)

    assert {run.strategy for run in panel.log.runs} == {"paged"}
    assert len(panel.curve("contiguous", "decode")[0]) == 0
    assert "contiguous" not in panel.latency_box.legend.text()
    paged_items = list(panel._items[id(panel.log.runs[0])].values())
    assert all(item in paged_items for item in panel.latency_plot.getPlotItem().listDataItems())  # none left over


def test_regenerate_and_edit_in_the_window_replace_the_replys_points(qtbot, window):
    first = send(qtbot, window, "First question")
    send(qtbot, window, "Second question")
    regenerated = run_turn(qtbot, window, window.chat.messages[-1].regenerate_button.click)
    user = window.chat.messages[-2]
    user.start_editing()
    user.editor.setPlainText("Second question, edited")
    edited = run_turn(qtbot, window, user.resend_button.click)
    window.metrics.refresh()

    shown = [s for t in (first, edited) for s in t.steps]  # what the conversation holds now
    x, _ = window.metrics.curve("paged", "decode")
    assert list(x) == [s.pos for s in shown if s.phase == "decode"]
    assert len(window.metrics.log.rows) == len(shown)
    assert regenerated.done and len(window.metrics.log.runs) == 1


def test_a_turn_that_fails_mid_reply_takes_its_points_out_of_the_plots_and_the_csv(qtbot, window):
    first = send(qtbot, window, "First question")
    window.metrics.refresh()
    plotted = list(window.metrics.curve("paged", "decode")[0])
    forwards = []

    def fail_on_the_fifth_forward(_module, _args):
        forwards.append(1)
        if len(forwards) == 5:
            raise RuntimeError("injected fault")

    hook = window.client.worker.engine.model.register_forward_pre_hook(fail_on_the_fifth_forward)
    try:
        failed = send(qtbot, window, "Second question", expect_error=True)
    finally:
        hook.remove()
    window.metrics.refresh()

    assert failed.errors and not failed.done and len(failed.steps) == 4  # a prefill and three decode steps
    assert list(window.metrics.curve("paged", "decode")[0]) == plotted
    assert len(window.metrics.log.rows) == len(first.steps)
    again = send(qtbot, window, "Second question")
    window.metrics.refresh()
    x, _ = window.metrics.curve("paged", "decode")
    assert list(x) == plotted + [s.pos for s in again.steps if s.phase == "decode"]


# --- item 7: log latency axis; prefills cover nothing --------------------------------------------------------------
def test_a_slow_series_does_not_squeeze_a_fast_one_flat(qtbot, panel):
    none_steps = [step("decode", p, ms=1000.0 + 5 * (p % 100), strategy="none") for p in range(30, 130)]
    paged_steps = [step("decode", p, ms=10.0 + p % 3, strategy="paged") for p in range(30, 130)]
    play(panel, none_steps, paged_steps)
    settle(qtbot)

    area = plot_area(panel.latency_plot, panel)
    slow, fast = (item_rect(panel, panel.latency_plot, run, "decode") for run in panel.log.runs)
    assert panel.latency_plot.getPlotItem().getAxis("left").logMode
    assert area.bottom() - fast.bottom() > 0.15 * area.height()  # the 10 ms line sits well off the floor...
    assert slow.bottom() < fast.top() - 0.25 * area.height()  # ...and well apart from the 1 s line


def test_a_prefill_is_a_thin_step_drawn_behind_the_decode_lines(qtbot, panel):
    play(panel, turn(0, 300, 40))
    settle(qtbot)

    items = panel._items[id(panel.log.runs[0])]
    prefill, decode = items["prefill"], items["decode"]
    assert prefill.zValue() < decode.zValue()
    assert prefill.opts["pen"].widthF() <= 1.5 and prefill.opts["pen"].style() == Qt.PenStyle.DashLine
    area = plot_area(panel.latency_plot, panel)
    bar = curve_rects(panel.latency_plot, panel)
    assert all(r.bottom() < area.bottom() - 4 for r in bar)  # on a log axis nothing lies on the floor


# --- item 8: legends outside the data, readable ----------------------------------------------------------------------
@pytest.mark.parametrize("size", [(640, 760), (380, 560)])
def test_legends_never_cover_a_curve(qtbot, panel, size):
    play(panel, turn(0, 45, 250), turn(0, 45, 250, strategy="paged-int8"), turn(0, 45, 250, strategy="contiguous"))
    panel.resize(*size)
    settle(qtbot)

    for box in (panel.latency_box, panel.memory_box):
        assert not box.plot.getPlotItem().legend.isVisible()  # pyqtgraph's in-plot legend is never drawn
        legend = rect_in(box.legend, panel)
        assert not legend.intersects(plot_area(box.plot, panel))
        assert not any(legend.intersects(curve) for curve in curve_rects(box.plot, panel))
        for name in ("paged", "paged-int8", "contiguous"):
            assert name in box.legend.text()


def test_legend_names_and_colours_are_readable_on_the_dark_background(panel):
    background = QColor(PLOT_BACKGROUND)

    assert contrast(QColor(PLOT_FOREGROUND), background) >= 4.5
    for color in STRATEGY_COLORS.values():
        assert contrast(QColor(color), background) >= 3.0  # a line or swatch, WCAG's bar for graphics
    play(panel, turn(0, 45, 20))
    image = panel.latency_box.legend.grab().toImage()
    ground, ink = background_and_ink(image)
    assert contrast(ink, ground) >= 4.5


# --- item 9: linked x axes, headroom, whole-token ticks ---------------------------------------------------------------
def test_both_plots_show_the_same_positions_in_the_same_pixel_columns(qtbot, panel):
    play(panel, turn(0, 45, 250))
    settle(qtbot)

    latency, memory = panel.latency_plot.getViewBox(), panel.memory_plot.getViewBox()
    assert latency.viewRange()[0] == pytest.approx(memory.viewRange()[0])
    for position in (0, 100, 290):
        a = panel.latency_plot.mapTo(panel, panel.latency_plot.mapFromScene(latency.mapViewToScene(
            QPointF(position, 0))))
        b = panel.memory_plot.mapTo(panel, panel.memory_plot.mapFromScene(memory.mapViewToScene(QPointF(position, 0))))
        assert abs(a.x() - b.x()) <= 1


def test_the_two_linked_plots_redraw_in_the_same_tick(panel):
    """Their x axes are linked: a new range for one repaints both, so the timer draws them together, never one a tick
    behind the other."""
    play(panel, turn(0, 45, 20))
    panel.begin_turn()
    for event in turn(65, 10, 30)[1:]:
        panel.add_step(event)

    def last(plot):
        return max(np.nanmax(item.xData) for item in plot.getPlotItem().listDataItems()
                   if item.xData is not None and len(item.xData))

    before = last(panel.latency_plot), last(panel.memory_plot)
    for _ in range(4):  # the timer's ticks: each draws one part of the panel
        panel._timer.timeout.emit()
        now = last(panel.latency_plot), last(panel.memory_plot)
        assert now[0] == now[1]
    assert now[0] > before[0]


def test_new_points_inside_the_axes_ranges_repaint_the_curves_but_no_axis(qtbot, monkeypatch):
    """An axis (its ticks, labels and grid lines across the plot) is drawn once per range and then reused: its
    grid overlaps every curve, so without that every redraw of a curve redrew the axes' text too (about half of a
    plot's paint time while a reply streams)."""
    import pyqtgraph as pg

    painted = {"axes": 0, "curves": 0}

    def counting(cls, key):  # before the panel is built: Qt's calls into Python paint() are bound then
        original = cls.paint

        def paint(self, *args):
            painted[key] += 1
            return original(self, *args)

        monkeypatch.setattr(cls, "paint", paint)

    counting(pg.AxisItem, "axes")
    counting(pg.PlotCurveItem, "curves")
    panel = MetricsPanel()
    qtbot.addWidget(panel)
    panel.set_model_info(SMOL)
    play(panel, turn(0, 45, 20))
    panel.resize(700, 700)
    settle(qtbot)
    panel.plots.grab()
    assert painted["axes"] > 0  # drawn once
    ranges = [plot.getViewBox().viewRange() for plot in (panel.latency_plot, panel.memory_plot)]
    painted.update(axes=0, curves=0)
    for event in turn(0, 45, 24)[21:]:  # three more tokens: within both plots' x and y ranges
        panel.add_step(event)
    panel.refresh()
    panel.plots.grab()

    assert [plot.getViewBox().viewRange() for plot in (panel.latency_plot, panel.memory_plot)] == ranges
    assert painted["curves"] > 0 and painted["axes"] == 0


def test_the_highest_line_has_headroom_and_a_labelled_tick_above_it(qtbot, panel):
    play(panel, turn(0, 45, 250, strategy="contiguous"), turn(0, 45, 250))
    settle(qtbot)

    for plot in (panel.latency_plot, panel.memory_plot):
        highest = max(np.nanmax(item.yData) for item in plot.getPlotItem().listDataItems()
                      if item.yData is not None and np.isfinite(item.yData).any())
        (_, _), (_, top) = plot.getViewBox().viewRange()
        axis = plot.getPlotItem().getAxis("left")
        low, high = plot.getViewBox().viewRange()[1]
        levels = axis.logTickValues(low, high, 100, None)
        labelled = [v for level in levels[:axis.style["maxTextLevel"] + 1] for v in level[1]]
        assert 10 ** top >= 1.05 * highest  # headroom
        assert any(10 ** v >= highest for v in labelled)  # and a labelled tick above the highest line


def test_a_horizontal_reference_line_gets_headroom_too(qtbot, panel):
    import pyqtgraph as pg

    line = pg.InfiniteLine(pos=math.log10(110.0), angle=0)  # e.g. the weights' 110 MiB, over a few MiB of KV
    panel.memory_plot.addItem(line)
    play(panel, turn(0, 45, 100))
    settle(qtbot)

    low, high = panel.memory_plot.getViewBox().viewRange()[1]
    axis = panel.memory_plot.getPlotItem().getAxis("left")
    labelled = [v for level in axis.logTickValues(low, high, 100, None)[:2] for v in level[1]]
    assert 10 ** high >= 1.05 * 110 and any(10 ** v >= 110 for v in labelled)


@pytest.mark.parametrize("low, high", [(0.5, 40.0), (0.02, 1800.0), (0.1, 0.11), (200.0, 360.0)])
def test_log_headroom_ends_on_ticks_beyond_the_data(low, high):
    bottom, top = log_headroom(low, high)

    assert bottom < low and top >= 1.05 * high
    for end in (bottom, top):
        mantissa = end / 10 ** math.floor(math.log10(end) + 1e-9)
        assert round(mantissa, 6) in (1.0, 2.0, 5.0)


@pytest.mark.parametrize("last", [0.0, 3.0, 9.0, 45.0, 100.0, 399.0, 400.0, 2047.0, 30000.0])
def test_the_x_axis_ends_on_a_1_2_5_step_beyond_the_last_position(last):
    end = token_headroom(last)
    step = max(last, 5.0) / 5

    assert end > last and end <= last + 2 * step + 1e-9  # beyond the data, by at most about two fifths of it
    assert float(end).is_integer()  # a whole token, on the axis' ticks


def test_the_x_axis_moves_once_a_step_not_with_every_token():
    ends = [token_headroom(float(p)) for p in range(100, 1100)]

    assert all(end > p for end, p in zip(ends, range(100, 1100)))
    assert len(set(ends)) <= 12  # 1,000 tokens, ~10 ends, where autorange moved at each of them


def test_the_plots_end_where_token_headroom_says(qtbot, panel):
    play(panel, turn(0, 45, 250))
    settle(qtbot)

    last = max(np.nanmax(item.xData) for item in panel.latency_plot.getPlotItem().listDataItems()
               if item.xData is not None and len(item.xData))
    low, high = panel.latency_plot.getViewBox().viewRange()[0]
    assert last < token_headroom(last) <= high <= token_headroom(last) * 1.1  # the end, and the view's padding


@pytest.mark.parametrize("low, high", [(0.0, 1.0), (-0.2, 1.2), (0.0, 5.0), (30.0, 33.0), (0.0, 4000.0)])
def test_token_ticks_are_whole_numbers(low, high):
    levels = TokenAxis("bottom").tickValues(low, high, 400)

    values = [v for _, level in levels for v in level]
    assert values and all(float(v).is_integer() for v in values)


def test_an_empty_plot_shows_whole_token_ticks(qtbot, panel):
    settle(qtbot)

    for plot in (panel.latency_plot, panel.memory_plot):
        low, high = plot.getViewBox().viewRange()[0]
        values = [v for _, level in plot.getPlotItem().getAxis("bottom").tickValues(low, high, 300) for v in level]
        assert len(values) >= 2 and all(float(v).is_integer() for v in values)


# --- item 10: the chat follows the reply ----------------------------------------------------------------------------
def at_bottom(window) -> bool:
    bar = window.chat.scroll.verticalScrollBar()
    return bar.maximum() > 0 and bar.value() == bar.maximum()


@pytest.fixture
def small_window(qtbot, themed, window):
    window.resize(*SMALLEST)
    window.sampling_override = greedy(60)
    settle(qtbot)
    return window


def test_the_chat_shows_each_new_reply_after_send(qtbot, small_window):
    for i in range(4):
        send(qtbot, small_window, f"Question number {i}: what does the cache hold now?")
        settle(qtbot)
        assert small_window.chat.following and not small_window.chat.jump_button.isVisible()
    assert at_bottom(small_window)


def test_the_chat_shows_the_new_reply_after_edit_and_send(qtbot, small_window):
    for i in range(3):
        send(qtbot, small_window, f"Question number {i}")
    small_window.chat.scroll.verticalScrollBar().setValue(0)  # the user scrolled up to read
    user = small_window.chat.messages[-2]
    user.start_editing()
    user.editor.setPlainText("Question number 2, asked differently")

    run_turn(qtbot, small_window, user.resend_button.click)
    settle(qtbot)

    assert at_bottom(small_window)


def test_the_chat_stays_at_the_latest_reply_when_the_side_panel_is_shown(qtbot, small_window):
    small_window.menus.show_side_panel.setChecked(False)
    for i in range(3):
        send(qtbot, small_window, f"Question number {i}")
    settle(qtbot)

    small_window.menus.show_side_panel.setChecked(True)  # the chat narrows: its messages grow taller
    settle(qtbot)

    assert at_bottom(small_window)


def test_scrolling_up_during_a_reply_stops_following_until_jump_to_latest(qtbot, small_window):
    for i in range(2):
        send(qtbot, small_window, f"Question number {i}")
    small_window.sampling_override = greedy(400)
    chat = small_window.chat
    bar = chat.scroll.verticalScrollBar()

    def send_then_scroll_up():
        small_window.send("Tell me a long story")
        qtbot.waitUntil(lambda: len(chat.messages[-1].text) > 40, timeout=60_000)
        bar.setValue(0)

    run_turn(qtbot, small_window, send_then_scroll_up)
    settle(qtbot)

    assert bar.value() == 0 and bar.maximum() > 0  # the reply did not pull the view back down
    assert not chat.following and chat.jump_button.isVisible()
    qtbot.mouseClick(chat.jump_button, Qt.MouseButton.LeftButton)
    settle(qtbot)
    assert at_bottom(small_window) and chat.following and not chat.jump_button.isVisible()


# --- item 11: dialogs readable in the theme ------------------------------------------------------------------------
def test_the_non_native_file_dialog_shows_dark_text_areas_with_readable_text(qtbot, themed, tmp_path):
    for name in ("chat.json", "notes.json", "older chat.json"):
        (tmp_path / name).write_text("{}")
    dialog = QFileDialog(None, "Save", str(tmp_path), "kvscope conversation (*.json);;All files (*)")
    dialog.setOption(QFileDialog.Option.DontUseNativeDialog)
    qtbot.addWidget(dialog)
    dialog.resize(720, 460)
    dialog.show()
    view = dialog.findChild(QTreeView)
    qtbot.waitUntil(lambda: view.model().rowCount(view.rootIndex()) >= 3, timeout=HANG_GUARD_MS)
    settle(qtbot)
    dialog.grab().save(str(tmp_path / "file-dialog.png"))

    ground, ink = background_and_ink(view.viewport().grab().toImage())
    assert luminance(ground) < 0.1  # a dark list, not white
    assert contrast(ink, ground) >= 4.5


def test_the_sampling_dialog_has_visible_spin_arrows_and_no_foreign_button_icons(qtbot, themed, tmp_path):
    dialog = SamplingDialog(SamplingParams())
    qtbot.addWidget(dialog)
    dialog.show()
    settle(qtbot)
    dialog.grab().save(str(tmp_path / "sampling.png"))

    box = dialog.temperature
    arrows = box.grab().copy(QRect(box.width() - 20, 2, 18, box.height() - 4)).toImage()
    ground, ink = background_and_ink(arrows)
    assert contrast(ink, ground) >= 3.0
    buttons = dialog.findChild(QDialogButtonBox).buttons()
    assert buttons and all(button.icon().isNull() for button in buttons)


@pytest.mark.parametrize("make", [lambda: SamplingDialog(SamplingParams()), lambda: SystemPromptDialog("Be brief."),
                                  lambda: DraftTokensDialog(4), lambda: KVBudgetDialog(None),
                                  lambda: BackendDialog(BackendChoice("local")),
                                  lambda: QMessageBox(QMessageBox.Icon.NoIcon, "About kvscope", about_html(SMOL))])
def test_every_dialog_is_dark_with_readable_text(qtbot, themed, make):
    dialog = make()
    qtbot.addWidget(dialog)
    dialog.show()
    settle(qtbot)

    ground, ink = background_and_ink(dialog.grab().toImage())
    assert luminance(ground) < 0.1 and contrast(ink, ground) >= 7


def test_radio_buttons_show_their_circle_on_the_dark_background(qtbot, themed):
    dialog = BackendDialog(BackendChoice("local"))
    qtbot.addWidget(dialog)
    dialog.show()
    settle(qtbot)

    ground, _ = background_and_ink(dialog.grab().toImage())  # the dialog's own background
    for button in (dialog.local, dialog.remote):  # one checked, one not: both circles stand out from it
        option = QStyleOptionButton()
        button.initStyleOption(option)
        indicator = button.style().subElementRect(QStyle.SubElement.SE_RadioButtonIndicator, option, button)
        ring = pixels(button.grab().copy(indicator).toImage()).reshape(-1, 3)
        standing_out = [c for c in ring if contrast(QColor(*map(int, c)), ground) >= 3.0]
        assert len(standing_out) >= 12  # a ring of pixels, not a speck


# --- item 12: 900×600 works; nothing clipped; readable lines without the side panel ----------------------------------
def test_the_window_fits_half_a_1920_screen_and_600_pixels(qtbot, themed, window):
    window.status.labels["model"].setText("SmolLM2-135M-Instruct")  # the default model's long name
    settle(qtbot)

    assert window.minimumSize().width() <= SMALLEST[0] and window.minimumSize().height() <= SMALLEST[1]
    assert window.minimumSizeHint().width() <= SMALLEST[0] and window.minimumSizeHint().height() <= SMALLEST[1]
    window.resize(*SMALLEST)
    settle(qtbot)
    assert (window.width(), window.height()) == SMALLEST


def test_at_900_by_600_nothing_is_clipped(qtbot, small_window, tmp_path):
    send(qtbot, small_window, "What does the block map show?")
    small_window.metrics.refresh()
    settle(qtbot, 400)
    small_window.grab().save(str(tmp_path / "900x600.png"))

    assert clipped_labels(small_window.side) == []
    assert clipped_labels(small_window.block_map) == []
    assert clipped_labels(small_window.chat) == []
    scroll = small_window.metrics.scroll
    assert scroll.widget().height() >= scroll.widget().minimumSizeHint().height()  # scrolls rather than squeezes
    assert small_window.chat.scroll.horizontalScrollBar().maximum() == 0  # messages wrap, never run off the side
    shown = small_window.status_fit.shown
    assert all(label.width() >= label.sizeHint().width() for label in shown)
    for box in (small_window.metrics.latency_box, small_window.metrics.memory_box):  # axes not cut off
        assert box.plot.height() >= MIN_PLOT_HEIGHT
    box = small_window.chat.input  # the hint fits on its one line
    assert box.fontMetrics().horizontalAdvance(box.placeholderText()) <= box.viewport().width()


def test_a_status_message_is_whole_and_names_no_block_size_for_contiguous(qtbot, small_window):
    small_window.status.labels["model"].setText("SmolLM2-135M-Instruct")
    small_window.set_cache("contiguous", 16)
    settle(qtbot, 400)

    status = small_window.status
    message = status.currentMessage()
    assert message.startswith("Cache: contiguous") and "block" not in message
    room = status.width() - sum(label.width() + 8 for label in small_window.status_fit.shown)
    assert status.fontMetrics().horizontalAdvance(message) <= room
    small_window.set_cache("paged", 32)
    assert "block size 32" in status.currentMessage()


def test_without_the_side_panel_message_lines_stay_readable(qtbot, themed, window):
    window.menus.show_side_panel.setChecked(False)
    window.resize(1920, 1000)
    send(qtbot, window, "A question whose answer fills the width")
    settle(qtbot)

    browser = window.chat.messages[-1].browser
    metrics = browser.fontMetrics()
    chars_per_line = browser.viewport().width() / (metrics.horizontalAdvance(SAMPLE_TEXT) / len(SAMPLE_TEXT))
    assert 60 <= chars_per_line <= READABLE_CHARS
    column = rect_in(window.chat.column, window.chat)
    assert abs(column.center().x() - window.chat.width() / 2) <= 8  # centred, not pushed to one side
