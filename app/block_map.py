"""The paged pool's physical blocks as a grid coloured by state, updated live from KVStats.block_states.

The grid is laid out for the pool's budget (the most blocks it may grow to), so a cell keeps its place as the
pool grows: the blocks that exist are drawn, coloured by state, and the budget is a dashed outline around the
cells they may grow into. The states are drawn as an 8-bit indexed image (one pixel per block) scaled up to
square cells, so a pool of thousands of blocks costs one drawImage per paint; repaints are coalesced by Qt's
update().

After a conversation is opened (or another version of a message shown), the map shows the pool as it was saved at
the end of each turn (show_history: app.pool_snapshot.SavedTurn records, the last turn first), captioned with the
turn shown, and ignores the live pool until the next turn runs (show_live). A '‹ turn 3 of 5 ›' control under the
grid (app.turn_stepper) steps through the saved turns; Left and Right do the same while the map has the focus.
turn_shown(x_range) tells which context positions the turn shown ran (None: the live pool).
"""

from __future__ import annotations

import math

from PySide6.QtCore import QPoint, QRect, Qt, Signal
from PySide6.QtGui import QColor, QImage, QPainter, QPen, QPolygon
from PySide6.QtWidgets import QGridLayout, QLabel, QStackedWidget, QVBoxLayout, QWidget

from app.style import BLOCK_COLORS, BLOCK_LABELS, PLOT_BACKGROUND, TEXT_MUTED
from app.turn_stepper import TurnStepper

PAD_INDEX = len(BLOCK_COLORS)  # colour of the cells past the last block
SAVED_CAPTION = "Saved state: the pool as {turn} left it, until the next turn runs."
NO_BLOCKS_TEXT = {
    "none": "keeps no KV cache at all: every step recomputes the whole context.",
    "contiguous": "reserves one contiguous buffer per sequence, sized for the whole context.",
}


def grid_shape(num_blocks: int, width: int, height: int) -> tuple[int, int, int]:
    """(columns, rows, cell size in pixels) of the largest square cells that fit num_blocks in the area."""
    if num_blocks <= 0 or width <= 0 or height <= 0:
        return 0, 0, 0
    cell = max(1, int(math.sqrt(width * height / num_blocks)))
    while cell > 1:
        cols = max(1, width // cell)
        if math.ceil(num_blocks / cols) * cell <= height:
            break
        cell -= 1
    cols = max(1, width // cell)
    return cols, math.ceil(num_blocks / cols), cell


class BlockGrid(QWidget):
    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.states = b""
        self.budget = 0  # cells laid out: the most blocks the pool may hold (at least the blocks it holds)
        self._colors = [QColor(c).rgb() for c in BLOCK_COLORS] + [QColor(PLOT_BACKGROUND).rgb()]
        self.setMinimumSize(120, 80)
        self.setMouseTracking(True)

    def set_states(self, states: bytes, budget: int = 0) -> None:
        """states: one byte per block that exists; budget: the most blocks the pool may grow to (0: no more)."""
        self.states = bytes(states)
        self.budget = max(budget, len(self.states))
        self.update()

    def paintEvent(self, event) -> None:  # noqa: N802 (Qt override)
        painter = QPainter(self)
        painter.fillRect(self.rect(), QColor(PLOT_BACKGROUND))
        cols, rows, cell = grid_shape(self.budget, self.width(), self.height())
        if not cols:
            return
        data = self.states + bytes([PAD_INDEX]) * (cols * rows - len(self.states))
        image = QImage(data, cols, rows, cols, QImage.Format.Format_Indexed8)
        image.setColorTable(self._colors)
        painter.drawImage(QRect(0, 0, cols * cell, rows * cell), image)
        if cell >= 5:  # gaps between cells
            painter.setPen(QColor(PLOT_BACKGROUND))
            for c in range(cols + 1):
                painter.drawLine(c * cell, 0, c * cell, rows * cell)
            for r in range(rows + 1):
                painter.drawLine(0, r * cell, cols * cell, r * cell)
        if self.budget > len(self.states):
            self._outline_budget(painter, cols, rows, cell)
        if self.hasFocus():  # reached with Tab while saved turns are shown: Left and Right step through them
            painter.setPen(QPen(QColor(TEXT_MUTED), 1, Qt.PenStyle.DotLine))
            painter.drawRect(self.rect().adjusted(0, 0, -1, -1))
        painter.end()

    def _outline_budget(self, painter: QPainter, cols: int, rows: int, cell: int) -> None:
        """A dashed outline around the budget's cells: full rows, then the last row up to its last cell."""
        painter.setPen(QPen(QColor(TEXT_MUTED), 1, Qt.PenStyle.DashLine))
        painter.setBrush(Qt.BrushStyle.NoBrush)
        width, height, last = cols * cell - 1, rows * cell - 1, self.budget - (rows - 1) * cols
        if last == cols:
            painter.drawRect(0, 0, width, height)
            return
        step = (rows - 1) * cell
        painter.drawPolygon(QPolygon([QPoint(0, 0), QPoint(width, 0), QPoint(width, step), QPoint(last * cell, step),
                                      QPoint(last * cell, height), QPoint(0, height)]))

    def block_at(self, x: int, y: int) -> int | None:
        """The cell under (x, y): a block that exists, or a place within the budget; None outside both."""
        cols, rows, cell = grid_shape(self.budget, self.width(), self.height())
        if not cols or x >= cols * cell or y >= rows * cell:
            return None
        index = (y // cell) * cols + x // cell
        return index if index < self.budget else None

    def mouseMoveEvent(self, event) -> None:  # noqa: N802
        pos = event.position().toPoint()
        index = self.block_at(pos.x(), pos.y())
        if index is None:
            self.setToolTip("")
        elif index < len(self.states):
            self.setToolTip(f"block {index}: {BLOCK_LABELS[self.states[index]]}")
        else:
            self.setToolTip("not allocated yet: the pool may grow here, within its budget")


def _held_text(kv) -> str:
    """What a strategy without blocks holds: 'none' holds nothing, whatever the context it recomputes."""
    if kv.strategy != "none":
        return f"{kv.tokens:,} tokens held"
    recomputed = f": the {kv.tokens:,}-token context is recomputed every step" if kv.tokens else ""
    return f"nothing held{recomputed}"


def _turn_text(turn, latest: bool, what: str) -> str:
    """How the caption names a saved turn: 'turn 3 (this conversation's last)', 'turn 2 of this version'."""
    return f"turn {turn.number} (this {what}'s last)" if latest else f"turn {turn.number} of this {what}"


class BlockMap(QWidget):
    """Call set_stats(kv) with each KVStats; non-paged strategies show a line of text instead of a grid."""

    turn_shown = Signal(object)  # the (first, last) context positions of the saved turn shown; None when live

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("blockMapPage")
        layout = QVBoxLayout(self)
        layout.setContentsMargins(8, 4, 8, 8)
        layout.addWidget(QLabel("Block pool", self, objectName="sectionTitle"))
        self.summary = QLabel("No model loaded yet.", self, objectName="muted", wordWrap=True)
        layout.addWidget(self.summary)
        self.caption = QLabel("", self, objectName="savedCaption", wordWrap=True,
                              toolTip="Opened conversations (and versions shown again) show the pool as it was when "
                                      "they were saved; the live pool shows again when the next turn runs")
        self.caption.hide()
        layout.addWidget(self.caption)
        self.saved = False  # showing a saved state (show_history) until the next turn (show_live)
        self.turns: list = []  # the saved turns shown (app.pool_snapshot.SavedTurn), oldest first
        self.what = "conversation"
        self.stack = QStackedWidget(self)
        self.grid = BlockGrid(self.stack)
        self.message = QLabel("", self.stack, objectName="muted", wordWrap=True)
        self.message.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.stack.addWidget(self.grid)
        self.stack.addWidget(self.message)
        layout.addWidget(self.stack, 1)
        self.stepper = TurnStepper(self)
        self.stepper.moved.connect(self._show_turn)
        self.stepper.hide()
        layout.addWidget(self.stepper)
        self.legend = QWidget(self)
        self.legend.setLayout(self._legend())
        layout.addWidget(self.legend)
        self.precision = ""  # what the blocks store keys and values in (set_precision)

    def set_precision(self, name: str) -> None:
        """Name the blocks' KV precision in the summary and the legend ('' when unknown or no cache is kept)."""
        self.precision = name
        self.legend_title.setText(f"Each cell: one block of {name} keys and values" if name else "")
        self.legend_title.setVisible(bool(name))

    def show_history(self, turns: list, total: int, what: str = "conversation") -> None:
        """Draw the last of these saved turns (app.pool_snapshot.SavedTurn, oldest first) and keep them, captioned,
        until show_live; with two or more, the control steps through them. total: the turns the conversation has;
        what: whose turns they are ("conversation", "version"). No turns: the live pool."""
        if not turns:
            self.show_live()
            return
        self.turns, self.what = list(turns), what
        self.stepper.set_turns([t.number for t in self.turns], total)
        self.stepper.setVisible(len(self.turns) > 1)
        self.grid.setFocusPolicy(Qt.FocusPolicy.StrongFocus if len(self.turns) > 1 else Qt.FocusPolicy.NoFocus)
        self._show_turn(len(self.turns) - 1)

    def _show_turn(self, index: int) -> None:
        turn = self.turns[index]
        self.saved = False
        self.set_stats(turn.pool)
        self.saved = True
        self.caption.setText(SAVED_CAPTION.format(turn=_turn_text(turn, index == len(self.turns) - 1, self.what)))
        self.caption.show()
        self.turn_shown.emit(turn.x_range)

    def show_live(self) -> None:
        """From now on, draw the live pool (the next set_stats)."""
        was_saved, self.saved, self.turns = self.saved, False, []
        self.caption.hide()
        self.stepper.hide()
        self.grid.setFocusPolicy(Qt.FocusPolicy.NoFocus)
        if was_saved:
            self.turn_shown.emit(None)

    def keyPressEvent(self, event) -> None:  # noqa: N802 (Qt override): Left/Right step through saved turns
        delta = {Qt.Key.Key_Left: -1, Qt.Key.Key_Right: +1}.get(event.key())
        if self.saved and self.stepper.isVisible() and delta is not None:
            self.stepper.step(delta)
            event.accept()
        else:
            super().keyPressEvent(event)

    def set_stats(self, kv) -> None:
        if self.saved:
            return  # the saved state stays until the next turn runs
        budget = getattr(kv, "num_blocks_budget", 0)  # a growing pool: drawn even before its first block
        if not budget and (not kv.num_blocks or not kv.block_states):
            why = NO_BLOCKS_TEXT.get(kv.strategy, "does not use a block pool.")
            self.message.setText(f"The '{kv.strategy}' strategy has no blocks: it {why}")
            self.summary.setText(_held_text(kv))
            self.stack.setCurrentWidget(self.message)
            self.legend.hide()
            return
        of_budget = f" of {budget:,} (the budget, outlined)" if budget > kv.num_blocks else ""
        stored = f" ({self.precision})" if self.precision else ""
        self.summary.setText(
            f"{kv.strategy}{stored}: {kv.num_blocks:,} blocks{of_budget} × {kv.block_size} tokens · "
            f"{kv.num_blocks_used:,} used · {kv.num_blocks_cached:,} cached · {kv.num_blocks_free:,} free"
        )
        self.grid.set_states(kv.block_states, budget)
        self.stack.setCurrentWidget(self.grid)
        self.legend.show()

    @property
    def showing_grid(self) -> bool:
        return self.stack.currentWidget() is self.grid

    def _legend(self) -> QGridLayout:
        grid = QGridLayout()
        grid.setContentsMargins(0, 0, 0, 0)
        grid.setHorizontalSpacing(12)
        grid.setVerticalSpacing(2)
        self.legend_title = QLabel("", self, objectName="muted")
        self.legend_title.hide()
        grid.addWidget(self.legend_title, 0, 0, 1, 2)
        for i, (color, label) in enumerate(zip(BLOCK_COLORS, BLOCK_LABELS)):
            swatch = QLabel(f'<span style="color:{color}; font-size:13pt;">■</span> {label}', self)
            grid.addWidget(swatch, 1 + i // 2, i % 2)
        grid.setColumnStretch(2, 1)
        return grid
