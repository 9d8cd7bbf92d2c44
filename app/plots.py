"""The side panel's plot furniture: axes with readable ticks, headroom above the data, and a legend outside the plot.

A legend drawn inside a plot hides whatever runs under it, so the plots keep pyqtgraph's legend only as the list of
named series (hidden) and show it as a line of text above the plot area, where it cannot cover a curve.
"""

from __future__ import annotations

import math
from html import escape

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtGui import QColor
from PySide6.QtWidgets import QGraphicsItem, QLabel, QVBoxLayout, QWidget

from app.style import PLOT_BACKGROUND, PLOT_FOREGROUND, strategy_color

MIN_PLOT_HEIGHT = 150
LEFT_AXIS_WIDTH = 58  # the same on every plot, so that linked x axes line up pixel for pixel
MAX_LABELLED_SPAN = 2.5  # decades: up to this span a log axis labels 1, 2 and 5 of every decade, beyond it decades
HEADROOM = 1.08  # the highest point stays at least this factor below the top of a log axis
STEPS_125 = (1.0, 2.0, 5.0)
GLYPHS = {Qt.PenStyle.SolidLine: "━━", Qt.PenStyle.DashLine: "╸ ╸", Qt.PenStyle.DotLine: "┄┄"}


VARIANT_SHIFTS = ((0, 0), (40, 35), (-40, -30), (80, 0), (-80, 25), (120, -20))  # (hue degrees, lightness %)


def series_color(strategy: str, variant: int = 0) -> str:
    """The strategy's colour for its first configuration; its later configurations (other weights, another KV
    precision) turn the hue and shift the lightness, so each series has a colour of its own yet stays near the
    strategy's."""
    if variant == 0:
        return strategy_color(strategy)
    hue_shift, light_shift = VARIANT_SHIFTS[variant % len(VARIANT_SHIFTS)]
    color = QColor(strategy_color(strategy))
    h, s, lightness, _ = color.getHsl()
    lightness = min(max(lightness + light_shift * 255 // 100, 90), 220)  # stays readable on the dark background
    return QColor.fromHsl((max(h, 0) + hue_shift * (1 + variant // len(VARIANT_SHIFTS))) % 360, s, lightness).name()


def labelled_multipliers(span_decades: float) -> tuple[float, ...]:
    """Which multiples of each decade a log axis labels for a view this many decades high."""
    return (1.0, 2.0, 5.0) if span_decades <= MAX_LABELLED_SPAN else (1.0,)


def _tick_above(value: float, steps: tuple[float, ...]) -> float:
    decade = 10.0 ** math.floor(math.log10(value))
    return next(decade * m for m in steps + (10.0,) if decade * m >= value * (1 - 1e-9))


def _tick_below(value: float, steps: tuple[float, ...]) -> float:
    decade = 10.0 ** math.floor(math.log10(value))
    return max(decade * m for m in steps if decade * m <= value * (1 + 1e-9))


def log_headroom(low: float, high: float) -> tuple[float, float]:
    """A y range (data units) for positive data in [low, high] whose both ends are labelled ticks of a LogAxis,
    with the data at least HEADROOM inside them: the highest line never sits on the top border."""
    top, bottom = _tick_above(high * HEADROOM, STEPS_125), _tick_below(low / HEADROOM, STEPS_125)
    if math.log10(top / bottom) > MAX_LABELLED_SPAN / 1.1:  # decades only, with room for the view's padding
        top, bottom = _tick_above(high * HEADROOM, (1.0,)), _tick_below(low / HEADROOM, (1.0,))
    return bottom, top


def token_headroom(last: float) -> float:
    """The x axis' end for data up to context position `last`: the first multiple of a 1-2-5 step (about a fifth of
    `last`) beyond it. The axis then moves once a step's worth of tokens, not with every token: new ticks and labels
    were most of a plot's repaint (the GUI thread's CPU during a 200-token reply 0.33 s with the x axis held against
    0.41-0.45 s moving)."""
    step = _tick_above(max(last, 5.0) / 5, STEPS_125)
    return (math.floor(last / step + 1e-9) + 1) * step


class LogAxis(pg.AxisItem):
    """A log-scale axis labelled at decades, and at 2 and 5 when the range is short: labels never crowd."""

    def logTickValues(self, minVal, maxVal, size, stdTicks):  # noqa: N802, N803 (pyqtgraph override)
        decades = range(math.floor(minVal), math.ceil(maxVal) + 1)

        def at(multipliers):
            return [v for d in decades for m in multipliers if minVal <= (v := d + math.log10(m)) <= maxVal]

        labelled = labelled_multipliers(maxVal - minVal)
        minor = [m for m in range(2, 10) if m not in labelled]
        return [(1.0, at((1,))), (None, at(labelled[1:])), (None, at(minor))]

    def logTickStrings(self, values, scale, spacing):  # noqa: N802 (pyqtgraph override)
        """Plain numbers (0.05, 1, 20, 1,000), not powers of ten."""
        return [plain_number(10.0 ** v) for v in values]


def plain_number(value: float) -> str:
    return f"{value:,.0f}" if value >= 1 else f"{value:.2g}"


class TokenAxis(pg.AxisItem):
    """Context positions: whole tokens only, never 0.1 … 0.9 on an empty or short plot."""

    def tickValues(self, minVal, maxVal, size):  # noqa: N802, N803 (pyqtgraph override)
        levels = [(spacing, [v for v in values if float(v).is_integer()])
                  for spacing, values in super().tickValues(minVal, maxVal, size) if spacing >= 1]
        levels = [(spacing, values) for spacing, values in levels if values]
        if levels:
            return levels
        return [(1.0, [float(v) for v in range(math.ceil(minVal), math.floor(maxVal) + 1)])]


def make_plot(y_label: str) -> pg.PlotWidget:
    """A plot of context position (x) against a log-scale y, gridded, with a hidden legend as its series list."""
    plot = pg.PlotWidget(background=PLOT_BACKGROUND, axisItems={"left": LogAxis("left"), "bottom": TokenAxis("bottom")})
    item = plot.getPlotItem()
    item.setLabel("bottom", "context position (tokens)", color=PLOT_FOREGROUND)
    item.setLabel("left", y_label, color=PLOT_FOREGROUND)
    item.showGrid(x=True, y=True, alpha=0.15)
    item.setLogMode(y=True)
    for name in ("left", "bottom"):
        item.getAxis(name).enableAutoSIPrefix(False)
        item.getAxis(name).setTextPen(PLOT_FOREGROUND)
        # drawn once per range, then reused: its grid lines cross the plot, so every redrawn curve redrew the
        # axis' labels too (a 600-token reply: the axes 0.18 s of the plots' 0.36 s of painting, 0.10 s cached)
        item.getAxis(name).setCacheMode(QGraphicsItem.CacheMode.DeviceCoordinateCache)
    item.getAxis("left").setStyle(maxTextLevel=1)  # no labels on minor ticks
    item.getAxis("left").setWidth(LEFT_AXIS_WIDTH)
    plot.setMinimumHeight(MIN_PLOT_HEIGHT)
    item.setRange(xRange=(0, 32), yRange=(0, 1), padding=0.03, disableAutoRange=False)  # until the first point
    # the list of named series, which SeriesLegend shows outside the plot; not placed inside it (addLegend anchors
    # it to the ViewBox, and a window torn down mid-layout then had the anchor ask a deleted ViewBox its geometry)
    item.legend = pg.LegendItem()
    item.legend.hide()
    # two invisible points, not a data item of the plot: the autoranged y keeps headroom above the highest line
    item.headroom = pg.PlotDataItem(pen=pg.mkPen(None))
    item.headroom.setLogMode(False, True)
    item.vb.addItem(item.headroom)
    return plot


def update_headroom(plot: pg.PlotWidget) -> None:
    """Place the invisible anchor at labelled ticks just beyond the lowest and highest finite data points
    (and horizontal reference lines), and at the x axis' stepped end (token_headroom) beyond the last position."""
    item = plot.getPlotItem()
    low, high, x, last = math.inf, -math.inf, None, -math.inf
    for data in item.listDataItems():
        if data.yData is None or not len(data.yData):
            continue
        y = data.yData[np.isfinite(data.yData) & (data.yData > 0)]
        if len(y):
            low, high = min(low, float(y.min())), max(high, float(y.max()))
            x = float(data.xData[0]) if x is None else min(x, float(data.xData[0]))
            last = max(last, float(np.nanmax(data.xData)))
    if x is None:
        item.headroom.setData([], [])
        return
    for level in _levels(item):  # horizontal reference lines (the weights' size) get headroom too
        low, high = min(low, level), max(high, level)
    bottom, top = log_headroom(low, high)
    item.headroom.setData([x, token_headroom(last)], [bottom, top])


def _levels(item) -> list[float]:
    """The y values (data units) of the plot's visible horizontal InfiniteLines (their value is in log10 units)."""
    return [10.0 ** line.value() for line in item.items
            if isinstance(line, pg.InfiniteLine) and line.isVisible() and line.angle % 180 == 0]


def _glyph(pen) -> tuple[str, str]:
    pen = pg.mkPen(pen)
    return pen.color().name(), GLYPHS.get(pen.style(), "━━")


class SeriesLegend(QLabel):
    """One wrapped line of "glyph name" entries, built from the plot's named series (its hidden legend)."""

    def __init__(self, plot: pg.PlotWidget, parent: QWidget | None = None):
        super().__init__(parent, objectName="plotLegend", wordWrap=True, textFormat=Qt.TextFormat.RichText)
        self.plot = plot
        self._shown: tuple = ()
        self.sync()

    def entries(self) -> list[tuple[str, str, str]]:
        """(colour, glyph, name) per named series in the order they were added, then the keys to line styles
        (series whose item has legend_key set). An item's series_label() (when it has one) gives its name now:
        a name can grow when a later series differs from it in a new way."""
        legend = self.plot.getPlotItem().legend
        series, keys = [], []
        for sample, label in legend.items:
            pen = sample.item.opts.get("pen") if hasattr(sample.item, "opts") else None
            color, glyph = _glyph(pen if pen is not None else PLOT_FOREGROUND)
            name = sample.item.series_label() if hasattr(sample.item, "series_label") else label.text
            if name != label.text:
                label.setText(name)
            entry = (color, getattr(sample.item, "legend_glyph", glyph), name)
            (keys if getattr(sample.item, "legend_key", False) else series).append(entry)
        return series + keys

    def sync(self) -> None:
        entries = tuple(self.entries())
        if entries == self._shown:
            return
        self._shown = entries
        self.setText("&nbsp;&nbsp; ".join(
            f'<span style="white-space:nowrap;"><span style="color:{color};">{escape(glyph)}</span>&nbsp;'
            f'{escape(name)}</span>' for color, glyph, name in entries))
        if getattr(self.parent(), "legend", None) is self:  # in a PlotBox that is built
            self.parent().fit_height()


class PlotBox(QWidget):
    """A heading, the legend line, then the plot: text that wraps instead of being clipped, and never over data."""

    def __init__(self, title: str, plot: pg.PlotWidget, parent: QWidget | None = None):
        super().__init__(parent, objectName="plotBox")
        self.setAttribute(Qt.WidgetAttribute.WA_StyledBackground)
        self.plot = plot
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 4, 0, 0)
        layout.setSpacing(2)
        self.title = QLabel(title, self, objectName="plotTitle", wordWrap=True,
                            alignment=Qt.AlignmentFlag.AlignCenter)
        self.legend = SeriesLegend(plot, self)
        layout.addWidget(self.title)
        layout.addWidget(self.legend)
        layout.addWidget(plot, 1)

    def resizeEvent(self, event) -> None:  # noqa: N802 (Qt override)
        super().resizeEvent(event)
        self.fit_height()

    def fit_height(self) -> None:
        """Room for the wrapped heading and legend at this width plus the plot's minimum: layouts size a wrapping
        label for some other width, and the plot would be squeezed below its minimum (its x axis cut off)."""
        width = max(self.width(), 1)
        margins = self.layout().contentsMargins()
        text = sum(label.heightForWidth(width) for label in (self.title, self.legend) if label.text())
        height = text + self.plot.minimumHeight() + 2 * self.layout().spacing() + margins.top() + margins.bottom()
        if height != self.minimumHeight():
            self.setMinimumHeight(height)
