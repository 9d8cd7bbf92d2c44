"""A compact '‹ turn 3 of 5 ›' control: steps through a list of saved turns (the block map's history).

set_turns(numbers, total) shows the control at the last entry; ‹ and › (Tab reaches them, Space presses them)
or step(-1) / step(+1) move one entry and emit moved(index). numbers are the turns' own numbers (a turn without a
saved state is skipped, so they need not be consecutive); total is how many turns the conversation has.
"""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QHBoxLayout, QLabel, QToolButton, QWidget


class TurnStepper(QWidget):
    moved = Signal(int)  # the index (into the numbers given to set_turns) now shown

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("turnStepper")
        layout = QHBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(4)
        self.back = self._button("‹", "Previous turn's saved state (Left)", -1)
        self.label = QLabel("", self, objectName="muted")
        self.label.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.forward = self._button("›", "Next turn's saved state (Right)", +1)
        layout.addWidget(self.back)
        layout.addWidget(self.label)
        layout.addWidget(self.forward)
        layout.addStretch(1)
        self.numbers: list[int] = []
        self.total = 0
        self.index = -1

    def _button(self, text: str, tip: str, delta: int) -> QToolButton:
        button = QToolButton(self, text=text, toolTip=tip, autoRaise=True)
        button.setAccessibleName(tip.split(" (")[0])
        button.setFocusPolicy(Qt.FocusPolicy.StrongFocus)  # Tab reaches it
        button.clicked.connect(lambda: self.step(delta))
        return button

    def set_turns(self, numbers: list[int], total: int) -> None:
        """Show the last of these turns (no signal: the caller draws it)."""
        self.numbers, self.total = list(numbers), max(total, max(numbers, default=0))
        self.index = len(self.numbers) - 1
        self._update()

    def step(self, delta: int) -> bool:
        """Move by delta entries (clamped); False when that goes nowhere."""
        index = min(max(self.index + delta, 0), len(self.numbers) - 1)
        if index == self.index or index < 0:
            return False
        self.index = index
        self._update()
        self.moved.emit(index)
        return True

    @property
    def turn(self) -> int | None:
        """The number of the turn shown (None when there is none)."""
        return self.numbers[self.index] if 0 <= self.index < len(self.numbers) else None

    def _update(self) -> None:
        self.label.setText(f"turn {self.turn} of {self.total}" if self.turn is not None else "")
        focused = next((b for b in (self.back, self.forward) if b.hasFocus()), None)
        self.back.setEnabled(self.index > 0)
        self.forward.setEnabled(self.index < len(self.numbers) - 1)
        if focused is not None and not focused.isEnabled():  # at an end: the focus stays on the control
            other = self.forward if focused is self.back else self.back
            if other.isEnabled():
                other.setFocus(Qt.FocusReason.OtherFocusReason)
