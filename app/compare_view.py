"""The Compare window: each configuration's replay of the same tokens overlaid in two plots (ms per token and KV
memory against the context position), and the table that compares them (engine.replay_result.Summary).

Steps arrive while the job runs (add_step) and are drawn a few times per second; finish() fills the table; a
saved result (show_saved) draws the same way. Export writes the steps as CSV and the plots with the table as PNG.
"""

from __future__ import annotations

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtWidgets import (
    QAbstractItemView,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QProgressBar,
    QPushButton,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from app.plots import PlotBox, make_plot, series_color, update_headroom
from app.style import human_bytes
from engine.replay_result import CompareResult, Summary

MIB = 1024 * 1024
REDRAW_MS = 200
TABLE_MAX_HEIGHT = 360  # the table shows every row up to this height, then scrolls
COLUMNS = ("Configuration", "Decode ms/token\nmedian", "p90", "Median by context\n(positions: ms)",
           "TTFT per turn\n(ms)", "KV peak\nallocated / used", "KV final\nallocated / used",
           "Greedy agreement\nwith the first")


def _mib(n: int) -> float:
    return n / MIB if n > 0 else float("nan")


def decode_line(rows) -> tuple[list[float], list[float]]:
    """Decode latency against position, broken (a NaN) between turns: no line across a turn's prefill."""
    x, y, turn = [], [], None
    for row in rows:
        if turn is not None and row.turn != turn:
            x.append(row.pos - 0.5)
            y.append(float("nan"))
        x.append(row.pos)
        y.append(row.latency_ms)
        turn = row.turn
    return x, y


def agreement_text(summary: Summary, index: int) -> str:
    if index == 0:
        return "reference"
    if summary.agreement is None:
        return "—"
    return f"{100 * summary.agreement:.1f}% of {summary.num_compared}".replace(".0%", "%")


def summary_cells(summary: Summary, index: int) -> list[str]:
    """The table's row for one configuration, as text."""
    ms = (lambda v: "—" if v is None else f"{v:,.1f}")  # noqa: E731
    label = summary.label + ("" if summary.complete else " (incomplete)")
    by_context = " · ".join(f"{first}–{last}: {median:,.1f}" for first, last, median in summary.by_context) or "—"
    return [label, ms(summary.decode_median_ms), ms(summary.decode_p90_ms), by_context,
            ", ".join(f"{t:,.0f}" for t in summary.ttft_ms) or "—",
            f"{human_bytes(summary.peak_allocated)} / {human_bytes(summary.peak_used)}",
            f"{human_bytes(summary.final_allocated)} / {human_bytes(summary.final_used)}",
            agreement_text(summary, index)]


class CompareView(QWidget):
    stop_requested = Signal()
    replay_requested = Signal()
    export_csv_requested = Signal()
    export_png_requested = Signal()

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent, Qt.WindowType.Window)
        self.setObjectName("compareView")
        self.setWindowTitle("kvscope — Compare")
        self.resize(1100, 820)
        self.result = CompareResult()
        self._items: list[dict] = []
        self._dirty = False
        self._build()
        self._timer = QTimer(self, interval=REDRAW_MS)
        self._timer.timeout.connect(self._redraw)
        self._timer.start()

    # --- inputs -------------------------------------------------------------------------------------------------------
    def start(self, configs, num_turns: int) -> None:
        """A new job: empty plots and table, one series per configuration to come."""
        from engine.replay_result import ConfigRun

        self._clear()
        self.result = CompareResult([ConfigRun(c) for c in configs], num_turns)
        self._create_series()
        self.set_running(True)
        self.heading.setText(f"Replaying the conversation's {num_turns} turn{'s' * (num_turns != 1)} under "
                             f"{len(configs)} configuration{'s' * (len(configs) != 1)}…")

    def add_step(self, step) -> None:
        if step.config_index < len(self.result.runs):
            self.result.runs[step.config_index].rows.append(step.row)
            self._dirty = True

    def set_progress(self, fraction: float) -> None:
        self.progress.setValue(int(1000 * fraction) if fraction >= 0 else 0)

    def finish(self, result: CompareResult) -> None:
        """The job's result (also when stopped): redrawn from it, and the table filled in."""
        self.show_result(result)
        self.set_running(False)

    def show_result(self, result: CompareResult | None) -> None:
        self._clear()
        self.result = result or CompareResult()
        self._create_series()
        self._dirty = True
        self._redraw()
        self._fill_table()
        runs = self.result.runs
        stopped = any(not run.complete for run in runs)
        if self.result.error:
            self.heading.setText(f"Compare: {self.result.error}")
        else:
            self.heading.setText(
                "No Compare yet: Replay under… picks configurations and replays this conversation's exact tokens "
                "through each." if not runs else
                f"The conversation's {self.result.num_turns} turn{'s' * (self.result.num_turns != 1)}, teacher-forced "
                f"through {len(runs)} configuration{'s' * (len(runs) != 1)}" + (" (stopped part way)" if stopped
                                                                                 else ""))
        self.export_csv.setEnabled(bool(runs))
        self.export_png.setEnabled(bool(runs))

    def set_running(self, running: bool) -> None:
        self.progress.setVisible(running)
        self.stop_button.setVisible(running)
        self.replay_button.setEnabled(not running)
        if running:
            self.progress.setValue(0)

    # --- what tests and exports read -------------------------------------------------------------------------------
    def series(self, index: int, name: str = "decode"):
        """The finite points drawn for configuration `index` (line breaks between turns left out)."""
        import numpy as np

        item = self._items[index][name]
        if item.xData is None:
            return np.empty(0), np.empty(0)
        finite = np.isfinite(item.yData)
        return item.xData[finite], item.yData[finite]

    def table_text(self) -> list[list[str]]:
        return [[self.table.item(r, c).text() for c in range(self.table.columnCount())]
                for r in range(self.table.rowCount())]

    def export_png_to(self, path: str) -> bool:
        self._redraw()
        return self.content.grab().save(path, "PNG")

    # --- internals --------------------------------------------------------------------------------------------------
    def _build(self) -> None:
        self.heading = QLabel(self, wordWrap=True, objectName="compareHeading")
        self.progress = QProgressBar(self, maximum=1000, textVisible=False)
        self.stop_button = QPushButton("Stop", self, toolTip="Stop the replay (the configurations so far stay)")
        self.replay_button = QPushButton("Replay under…", self)
        self.export_csv = QPushButton("Export CSV…", self)
        self.export_png = QPushButton("Export PNG…", self)
        top = QHBoxLayout()
        for widget in (self.progress, self.stop_button, self.replay_button, self.export_csv, self.export_png):
            top.addWidget(widget)
        top.insertStretch(2)
        self.content = QWidget(self)
        content = QVBoxLayout(self.content)
        self.latency_plot = make_plot("ms per token")
        self.memory_plot = make_plot("MiB")
        self.memory_plot.setXLink(self.latency_plot)
        self.latency_box = PlotBox("Per-token latency on the same tokens (log scale)", self.latency_plot, self.content)
        self.memory_box = PlotBox("KV cache memory, allocated ━━ and used ╸ ╸ (log scale)", self.memory_plot,
                                  self.content)
        self.table = QTableWidget(0, len(COLUMNS), self.content)
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.verticalHeader().hide()
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        self.table.horizontalHeader().setStretchLastSection(True)
        content.addWidget(self.heading)
        content.addWidget(self.latency_box, 3)
        content.addWidget(self.memory_box, 2)
        content.addWidget(self.table, 0)
        layout = QVBoxLayout(self)
        layout.addLayout(top)
        layout.addWidget(self.content, 1)
        self.stop_button.clicked.connect(self.stop_requested)
        self.replay_button.clicked.connect(self.replay_requested)
        self.export_csv.clicked.connect(self.export_csv_requested)
        self.export_png.clicked.connect(self.export_png_requested)
        self.set_running(False)
        self.show_result(None)

    def _clear(self) -> None:
        for items in self._items:
            for name, item in items.items():
                (self.latency_plot if name in ("decode", "prefill") else self.memory_plot).removeItem(item)
        self._items.clear()
        for plot in (self.latency_plot, self.memory_plot):
            plot.getPlotItem().legend.clear()
        self.table.setRowCount(0)

    def _create_series(self) -> None:
        import pyqtgraph as pg

        seen: dict[str, int] = {}
        for run in self.result.runs:
            variant = seen[run.config.cache] = seen.get(run.config.cache, -1) + 1
            color = series_color(run.config.cache, variant)
            pen, dashed = pg.mkPen(color, width=1.5), pg.mkPen(color, width=1.5, style=Qt.PenStyle.DashLine)
            items = {"decode": pg.PlotDataItem(pen=pen, name=run.config.label, connect="finite"),
                     "prefill": pg.PlotDataItem(pen=pg.mkPen(color, width=1.2, style=Qt.PenStyle.DotLine),
                                                connect="pairs"),
                     "allocated": pg.PlotDataItem(pen=pg.mkPen(color, width=2), name=run.config.label,
                                                  connect="finite"),
                     "used": pg.PlotDataItem(pen=dashed, connect="finite")}
            for name, item in items.items():
                (self.latency_plot if name in ("decode", "prefill") else self.memory_plot).addItem(item)
            self._items.append(items)
        self.latency_box.legend.sync()
        self.memory_box.legend.sync()

    def _redraw(self) -> None:
        if not self._dirty:
            return
        self._dirty = False
        for run, items in zip(self.result.runs, self._items):
            items["decode"].setData(*decode_line(run.decode_rows()))
            prefill_x, prefill_y = [], []
            for r in run.rows:
                if r.phase == "prefill":
                    prefill_x += [r.pos - r.n_tokens + 0.5, r.pos + 0.5]
                    prefill_y += [r.latency_ms / max(r.n_tokens, 1)] * 2
            items["prefill"].setData(prefill_x, prefill_y)
            x = [r.pos for r in run.rows]
            items["allocated"].setData(x, [_mib(r.kv_bytes_allocated) for r in run.rows])
            items["used"].setData(x, [_mib(r.kv_bytes_used) for r in run.rows])
        for plot in (self.latency_plot, self.memory_plot):
            update_headroom(plot)

    def _fill_table(self) -> None:
        summaries = self.result.summaries() if self.result.runs else []
        self.table.setRowCount(len(summaries))
        for row, summary in enumerate(summaries):
            cells = summary_cells(summary, row)
            run = self.result.runs[row]
            if run.error:
                cells[0] += f"\nfailed: {run.error}"
            for column, text in enumerate(cells):
                item = QTableWidgetItem(text)
                if column:
                    item.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
                self.table.setItem(row, column, item)
        self.table.resizeRowsToContents()
        rows = sum(self.table.rowHeight(r) for r in range(self.table.rowCount()))
        self.table.setMinimumHeight(min(self.table.horizontalHeader().height() + rows + 6, TABLE_MAX_HEIGHT))
