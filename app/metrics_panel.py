"""Latency and KV-memory plots against context position, one colour per strategy, and the figures beside them.

Steps are buffered in a StepLog and drawn by a timer a few times per second, one plot per tick so that no tick
holds the event loop for long; each curve downsamples automatically and clips to the view, so tens of thousands
of points stay fluid.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections import Counter

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt, QTimer
from PySide6.QtGui import QColor
from PySide6.QtWidgets import QFrame, QScrollArea, QSplitter, QTextBrowser, QVBoxLayout, QWidget

from app.figures import figure_rows, figures_html
from app.model_info import ModelInfo
from app.plots import PlotBox, make_plot, series_color, update_headroom
from app.pool_snapshot import SavedPool, SavedTurn, pool_record
from app.step_log import MIB, Run, SavedStep, StepLog

REFRESH_MS = 160  # one part per tick: the plots, then the figures, each about three times per second
MIN_WIDTH = 380  # with a 340-pixel chat the window fits half of a 1920-pixel screen
SIDE_BY_SIDE_WIDTH = 560  # narrower than this, the block map goes under the figures instead of beside them
MIN_FIGURES_HEIGHT = 120
# the two plots redraw in one tick: their x axes are linked, so a new range for one repaints both (drawn in
# turns, every tick repainted both: ~14 paints a second at ~5.6 ms each on the GUI thread while a reply streams)
PARTS = ("plots", "figures")
PLOTS = ("latency", "memory")
LATENCY_ITEMS = ("decode", "prefill", "verify")
STYLE_GREY = "#8b93a1"
RIGHT_MARGIN = 14  # pixels between a plot's right end and the panel's edge
# where the weights' label may sit on its line: (position along the line, anchors) - below, then above it
WEIGHTS_ROOM = 2.2  # the view reaches this factor above the weights' line: room for its label above it
LABEL_PLACES = tuple((position, anchors) for position in (0.02, 0.35, 0.65)
                     for anchors in ([(0, 0), (0, 0)], [(0, 1), (0, 1)]))


def _pen(color: str, width: float = 1.5, style=Qt.PenStyle.SolidLine, alpha: int = 255):
    qcolor = QColor(color)
    qcolor.setAlpha(alpha)
    return pg.mkPen(qcolor, width=width, style=style)


def _key(pen, glyph: str | None = None) -> pg.PlotDataItem:
    """A legend entry for a line style (listed after the strategies' colours)."""
    item = pg.PlotDataItem(pen=pen)
    item.legend_key = True
    if glyph:
        item.legend_glyph = glyph
    return item


def verify_marker_sizes(tokens_produced: np.ndarray) -> np.ndarray:
    """A verify step's marker grows with the tokens it produced: 5 px for one, +2 px per extra, at most 21."""
    return np.minimum(3 + 2 * tokens_produced, 21)


def _verify_brush(color: str):
    qcolor = QColor(color)
    qcolor.setAlpha(230)
    return pg.mkBrush(qcolor)


def verify_tip(x: float, y: float, data=None) -> str:
    """The tooltip of a verify step's marker (y: log10 of its milliseconds per token produced)."""
    return (f"speculative verify step at token {x:,.0f}: {10 ** y:,.1f} ms per token it produced\n"
            "one forward checked the drafted tokens; the bigger the marker, the more it kept")


def _make_hoverable(item: pg.PlotDataItem) -> None:
    item.scatter.opts.update(hoverable=True, tip=verify_tip)
    item.scatter.setAcceptHoverEvents(True)


def _prefill_pen(color: str):
    """A prefill is a thin dashed step with end ticks across the tokens it ran, drawn behind the decode lines."""
    return _pen(color, 1.2, Qt.PenStyle.DashLine, alpha=200)


def _turn_region(plot) -> pg.LinearRegionItem:
    """A shade behind a plot's curves over the positions of the saved turn the block map shows (hidden)."""
    color = QColor(STYLE_GREY)
    color.setAlpha(40)
    region = pg.LinearRegionItem(movable=False, brush=pg.mkBrush(color), pen=pg.mkPen(None))
    region.setZValue(-20)
    region.hide()
    plot.addItem(region, ignoreBounds=True)
    return region


def _crosses(x: np.ndarray, y: np.ndarray, rect) -> bool:
    """Whether the polyline through (x, y) (view coordinates; NaN breaks it) passes through rect."""
    if x is None or not len(x):
        return False
    left, right = min(rect.left(), rect.right()), max(rect.left(), rect.right())
    low, high = min(rect.top(), rect.bottom()), max(rect.top(), rect.bottom())
    finite = np.isfinite(x) & np.isfinite(y)
    x, y = x[finite], y[finite]
    inside = (x >= left) & (x <= right) & (y >= low) & (y <= high)
    if inside.any():
        return True
    if len(x) < 2:
        return False
    xs = np.linspace(left, right, 32)  # a line through the rectangle between two points outside it
    order = np.argsort(x)
    through = np.interp(xs, x[order], y[order], left=np.nan, right=np.nan)
    return bool(np.any((through >= low) & (through <= high)))


class MetricsPanel(QWidget):
    """add_step() for every StepEvent; turn_finished() for every DoneEvent; set_model_info() on load."""

    def __init__(self, parent: QWidget | None = None, companion: QWidget | None = None):
        """companion: a widget shown beside the figures, under the plots (the block map)."""
        super().__init__(parent)
        self.setObjectName("metricsPanel")
        self.log = StepLog()
        self.info: ModelInfo | None = None
        self.kv = None
        self.last_done = None
        self._items: dict[int, dict[str, pg.PlotDataItem]] = {}
        self._turn_marks: list = []  # StepLog marks, one per turn begun (see begin_turn)
        self._build(companion)
        self._timer = QTimer(self, interval=REFRESH_MS)
        self._tick_count = 0
        self._timer.timeout.connect(self._tick)
        self._timer.start()
        self._update_figures()

    # --- inputs -------------------------------------------------------------------------------------------------
    def set_model_info(self, info: ModelInfo) -> None:
        self.info = info
        self.log.set_configuration(getattr(info, "kv_dtype", ""), info.weight_format)  # keys the next steps' series
        self._show_weights(info)
        self._update_figures()

    def _show_weights(self, info: ModelInfo) -> None:
        """The weights' resident bytes as a flat line beside the KV lines: where KV crosses it, the cache holds
        more than the model itself."""
        if not info.weights_bytes:
            self.weights_line.hide()
            self.weights_room.setData([], [])
            return
        self.weights_line.show()  # first: a hidden label ignores new text
        self.weights_line.setValue(math.log10(info.weights_bytes / MIB))  # the plot's y is log10(MiB)
        self.weights_room.setData([0, 0], [info.weights_bytes / MIB, info.weights_bytes / MIB * WEIGHTS_ROOM])
        self.weights_line.label.setFormat(f"weights ({info.weight_format}) {info.weights_bytes / MIB:,.0f} MiB")
        self.place_weights_label()

    def place_weights_label(self) -> None:
        """Put the weights' label on its line where no memory curve crosses it: the first free place of
        LABEL_PLACES (the first one when none is free)."""
        label = self.weights_line.label
        if not self.weights_line.isVisible():
            return
        curves = [item.getData() for item in self.memory_plot.getPlotItem().listDataItems()
                  if item.getData()[0] is not None and not getattr(item, "legend_key", False)]
        view = self.memory_plot.getPlotItem().vb.viewRect()
        for position, anchors in LABEL_PLACES:
            label.anchors = anchors
            label.setPosition(position)
            rect = label.mapRectToView(label.boundingRect())
            inside = view.top() <= min(rect.top(), rect.bottom()) and max(rect.top(), rect.bottom()) <= view.bottom()
            if inside and not any(_crosses(x, y, rect) for x, y in curves):
                return
        label.anchors = LABEL_PLACES[0][1]
        label.setPosition(LABEL_PLACES[0][0])

    def add_step(self, event) -> None:
        self.log.add(event)
        self.kv = event.kv
        self._figures_dirty = True

    def set_stats(self, kv) -> None:
        self.kv = kv
        self._update_figures()

    def record_pool(self) -> None:
        """Keep the block map's state at the end of the turn that just finished (when it added steps), with the
        step log: a reopened conversation shows its pool as it was."""
        if self.kv is not None and self._turn_marks and len(self.log.rows) > self._turn_marks[-1].num_rows:
            self.log.add_pool(pool_record(self.kv))

    def turn_finished(self, done) -> None:
        self.last_done = done
        self.refresh()

    def begin_turn(self, replaces_last: bool = False, replaces: int = 0) -> None:
        """Call as each turn starts. replaces_last: this turn replaces the last reply (Regenerate, Edit and send),
        whose points then leave the plots and the CSV; the new reply is drawn in their place, in the same curve.
        replaces: this turn replaces that many of the latest turns (an earlier message edited: the chat
        continues from it), whose points all leave."""
        self.drop_turns(max(replaces, int(replaces_last)))
        self._turn_marks.append(self.log.mark())

    def drop_turns(self, count: int) -> None:
        """The points of the latest `count` turns leave the plots and the CSV (those the log knows the start of)."""
        count = min(count, len(self._turn_marks))
        if count:
            first = self._turn_marks[-count]
            del self._turn_marks[-count:]
            self._rollback(first)

    def turn_starts(self) -> list[int]:
        """Where each turn the log knows of begins in its rows (the latest turns; older ones are not known after
        View → Clear plots)."""
        return [mark.num_rows for mark in self._turn_marks]

    def add_saved(self, rows: list, turn_starts: list[int | None], pools: dict[int, dict]) -> None:
        """Saved steps (a reopened conversation, a branch shown again) drawn as live ones were, each turn's start
        remembered (so that a later edit takes its points), with the block map's saved states."""
        starts, first = Counter(s for s in turn_starts if s is not None), len(self.log.rows)
        kv_precision, weights = self.log.kv_precision, self.log.weights
        for i in range(len(rows) + 1):
            self._turn_marks += [self.log.mark() for _ in range(starts[i])]  # a turn without steps: same start
            if i < len(rows):
                event = SavedStep.from_row(rows[i])
                self.log.set_configuration(event.kv_precision, event.weights)
                self.log.add(event)
        self.log.set_configuration(kv_precision, weights)  # the live configuration keys the next steps again
        self.log.pools.update({first + row: pool for row, pool in pools.items()})
        self.refresh()

    def saved_turns(self, num_turns: int) -> list[SavedTurn]:
        """The block map's saved state after each turn that has one, oldest first, numbered among the
        conversation's num_turns turns (the log knows the starts of the latest ones), with the positions it ran."""
        starts, turns = self.turn_starts(), []
        for row in sorted(self.log.pools):
            known = bisect_right(starts, row)  # the turns the log knows that start at or before this row
            first = starts[known - 1] if known else row
            number = min(max(num_turns - len(starts) + known, 1), max(num_turns, 1))
            turns.append(SavedTurn(number, SavedPool.from_record(self.log.pools[row]), self._x_range(first, row)))
        return turns

    def _x_range(self, first: int, last: int) -> tuple[float, float] | None:
        """The context positions that rows first..last ran (a prefill row ran its n_tokens up to its pos)."""
        rows = self.log.rows[first:last + 1]
        if not rows:
            return None
        return min(r[2] - r[3] + 1 for r in rows) - 0.5, max(r[2] for r in rows) + 0.5

    def highlight(self, x_range: tuple[float, float] | None) -> None:
        """Shade these context positions in both plots (the saved turn the block map shows); None: no shade."""
        for region in self._regions:
            region.setVisible(x_range is not None)
            if x_range is not None:
                region.setRegion(x_range)

    def abandon_turn(self) -> None:
        """The turn failed and the conversation is as it was before it: its points go too."""
        if self._turn_marks:
            self._rollback(self._turn_marks.pop())

    def new_conversation(self) -> None:
        self.log.break_runs()
        self.last_done = None
        self._update_figures()

    def clear(self) -> None:
        for items in self._items.values():
            for name, item in items.items():
                (self.latency_plot if name in LATENCY_ITEMS else self.memory_plot).removeItem(item)
        self._items.clear()
        self.log.clear()
        self._turn_marks.clear()
        self._reset_legends()
        self.refresh()

    def resizeEvent(self, event) -> None:  # noqa: N802 (Qt override)
        super().resizeEvent(event)
        narrow = event.size().width() < SIDE_BY_SIDE_WIDTH
        orientation = Qt.Orientation.Vertical if narrow else Qt.Orientation.Horizontal
        if self.bottom.orientation() != orientation:
            self.bottom.setOrientation(orientation)

    # --- output -------------------------------------------------------------------------------------------------
    def refresh(self) -> None:
        """Draw everything buffered so far (the timer does the same, one part per tick)."""
        for part in PARTS:
            self._refresh_part(part)

    def _tick(self) -> None:
        self._tick_count += 1
        self._refresh_part(PARTS[self._tick_count % len(PARTS)])

    def _refresh_part(self, part: str) -> None:
        if part == "figures":
            if self._figures_dirty:
                self._update_figures()
            return
        for plot in PLOTS:
            for run in self.log.dirty_runs(plot):
                self._draw(run, plot)

    def export_png(self, path: str) -> bool:
        self.refresh()
        return self.plots.grab().save(path, "PNG")

    def export_csv(self, path: str) -> None:
        self.log.write_csv(path)

    def curve(self, strategy: str, name: str) -> tuple[np.ndarray, np.ndarray]:
        """The finite points drawn for a strategy ("decode", "prefill", "allocated", "used", "theoretical")."""
        items = [self._items[id(run)][name] for run in self.log.runs
                 if run.strategy == strategy and id(run) in self._items]
        xs = [item.xData for item in items if item.xData is not None]
        if not xs:
            return np.empty(0), np.empty(0)
        x, y = np.concatenate(xs), np.concatenate([item.yData for item in items if item.yData is not None])
        finite = np.isfinite(y)  # line breaks and empty memory are NaN
        return x[finite], y[finite]

    @property
    def figures_text(self) -> str:
        return "\n".join(" ".join(row) for row in figure_rows(self.info, self.kv, self.last_done))

    # --- internals ------------------------------------------------------------------------------------------------
    def _build(self, companion: QWidget | None) -> None:
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        self.splitter = QSplitter(Qt.Orientation.Vertical, self)
        self.plots = QWidget(self.splitter)
        plots_layout = QVBoxLayout(self.plots)
        plots_layout.setContentsMargins(0, 0, 0, 0)
        self.latency_plot = make_plot("ms per token")
        self.memory_plot = make_plot("MiB")
        self.memory_plot.setXLink(self.latency_plot)  # one context position, one column in both plots
        self.weights_line = pg.InfiniteLine(angle=0, movable=False, pen=_pen(STYLE_GREY, 1, Qt.PenStyle.DashDotLine),
                                            label="weights", labelOpts={"position": 0.02, "color": STYLE_GREY,
                                                                        "anchors": [(0, 0), (0, 0)]})  # below it
        self.weights_line.hide()
        self.memory_plot.addItem(self.weights_line)
        self._regions = [_turn_region(plot) for plot in (self.latency_plot, self.memory_plot)]
        self.weights_room = pg.PlotDataItem(pen=pg.mkPen(None))  # invisible: the autorange keeps the label's room
        self.weights_room.setLogMode(False, True)
        self.memory_plot.getPlotItem().vb.addItem(self.weights_room)
        self.memory_plot.getPlotItem().sigRangeChanged.connect(lambda *_: self.place_weights_label())
        for plot in (self.latency_plot, self.memory_plot):
            plot.getPlotItem().layout.setContentsMargins(0, 0, RIGHT_MARGIN, 0)
        self.latency_plot.getPlotItem().getAxis("bottom").showLabel(False)  # named once, under the lower plot
        self.latency_box = PlotBox("Per-token latency (log scale)", self.latency_plot, self.plots)
        self.memory_box = PlotBox("KV cache memory (log scale)", self.memory_plot, self.plots)
        plots_layout.addWidget(self.latency_box)
        plots_layout.addWidget(self.memory_box)
        self.bottom = QSplitter(Qt.Orientation.Horizontal, self.splitter)
        self.figures = QTextBrowser(self.bottom, objectName="figuresText", openLinks=False)
        self.figures.setFrameShape(QFrame.Shape.NoFrame)
        self.figures.setMinimumWidth(220)
        self.bottom.addWidget(self.figures)
        if companion is not None:
            self.bottom.addWidget(companion)
        self.splitter.addWidget(self.plots)
        self.splitter.addWidget(self.bottom)
        self.splitter.setStretchFactor(0, 2)
        self.splitter.setStretchFactor(1, 1)
        self.splitter.setSizes([560, 300])
        self.bottom.setStretchFactor(0, 1)
        self.bottom.setStretchFactor(1, 1)
        self.bottom.setSizes([330, 330])
        self.bottom.setChildrenCollapsible(False)
        self.splitter.setChildrenCollapsible(False)
        self.figures.setMinimumHeight(MIN_FIGURES_HEIGHT)
        self.setMinimumWidth(MIN_WIDTH)
        self.scroll = QScrollArea(self, widgetResizable=True, objectName="sidePanelScroll")  # short windows scroll
        self.scroll.setFrameShape(QFrame.Shape.NoFrame)
        self.scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.scroll.setWidget(self.splitter)
        layout.addWidget(self.scroll)
        self._figures_dirty = False
        self._figures_html = ""
        self._reset_legends()

    def _reset_legends(self) -> None:
        latency_legend = self.latency_plot.getPlotItem().legend
        memory_legend = self.memory_plot.getPlotItem().legend
        latency_legend.clear()
        memory_legend.clear()
        keys = ((latency_legend, _key(_pen(STYLE_GREY)), "decode step"),
                (latency_legend, _key(_prefill_pen(STYLE_GREY), "├╌┤"), "prefill (per token, across its tokens)"),
                (latency_legend, _key(_pen(STYLE_GREY), "•●⬤"), "speculative verify step (size: tokens it produced)"),
                (memory_legend, _key(_pen(STYLE_GREY, 2)), "allocated"),
                (memory_legend, _key(_pen(STYLE_GREY, 1.5, Qt.PenStyle.DashLine)), "used"),
                (memory_legend, _key(_pen(STYLE_GREY, 1.5, Qt.PenStyle.DotLine)), "theoretical"))
        for legend, item, text in keys:
            legend.addItem(item, text)
        self._sync_legends()

    def _items_for(self, run: Run) -> dict[str, pg.PlotDataItem]:
        key = id(run)
        if key not in self._items:
            self._items[key] = self._create_items(run)
        return self._items[key]

    def _create_items(self, run: Run) -> dict[str, pg.PlotDataItem]:
        color = series_color(run.strategy, self.log.variant(run))  # one colour per configuration
        name = self.log.label(run) if run.index == 0 else None
        items = {
            "decode": pg.PlotDataItem(pen=_pen(color), name=name, connect="finite"),
            "prefill": pg.PlotDataItem(pen=_prefill_pen(color), connect="pairs", symbol="|", symbolSize=9,
                                       symbolPen=_pen(color), symbolBrush=color),
            "allocated": pg.PlotDataItem(pen=_pen(color, 2), name=name, connect="finite"),
            "used": pg.PlotDataItem(pen=_pen(color, 1.5, Qt.PenStyle.DashLine), connect="finite"),
            "theoretical": pg.PlotDataItem(pen=_pen(color, 1.5, Qt.PenStyle.DotLine), connect="finite"),
            "verify": pg.PlotDataItem(pen=None, symbol="o", symbolPen=_pen("#ffffff", 1.2, alpha=220),
                                      symbolBrush=_verify_brush(color)),
        }
        items["verify"].setZValue(2)  # above the decode line it sits on
        _make_hoverable(items["verify"])
        items["prefill"].setZValue(-1)  # behind every line: a prefill never covers a series
        if name is not None:  # the legend's name follows what sets this configuration apart from the others
            items["decode"].series_label = items["allocated"].series_label = lambda: self.log.label(run)
        for key, item in items.items():
            (self.latency_plot if key in LATENCY_ITEMS else self.memory_plot).addItem(item)
            if key != "prefill":  # after addItem, which applies the plot's own (off) downsampling to the item
                item.setDownsampling(auto=True, method="peak")
                item.setClipToView(True)
        return items

    def _rollback(self, mark) -> None:
        for run in self.log.rollback(mark):
            for item in self._items.pop(id(run), {}).values():
                for plot in (self.latency_plot, self.memory_plot):
                    if item in plot.getPlotItem().items:
                        plot.removeItem(item)
        self.refresh()
        for plot in (self.latency_plot, self.memory_plot):
            update_headroom(plot)
        self._sync_legends()

    def _draw(self, run: Run, plot: str) -> None:
        items = self._items_for(run)
        if plot == "latency":
            items["decode"].setData(run.values("decode_x"), run.values("decode_ms"))
            items["prefill"].setData(run.values("prefill_x"), run.values("prefill_ms"))
            items["verify"].setData(run.values("verify_x"), run.values("verify_ms"),
                                    symbolSize=verify_marker_sizes(run.values("verify_n")))
        else:
            x = run.values("mem_x")
            for name in ("allocated", "used", "theoretical"):
                items[name].setData(x, run.values(name))
        run.dirty.discard(plot)
        update_headroom(self.latency_plot if plot == "latency" else self.memory_plot)
        if plot == "memory":
            self.place_weights_label()
        self._sync_legends()

    def _sync_legends(self) -> None:
        self.latency_box.legend.sync()
        self.memory_box.legend.sync()

    def _update_figures(self) -> None:
        html = figures_html(figure_rows(self.info, self.kv, self.last_done))
        if html != self._figures_html:
            self._figures_html = html
            self.figures.setHtml(html)
        self._figures_dirty = False
