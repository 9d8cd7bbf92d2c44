"""Compare → Replay under…: pick the configurations to replay the conversation under.

Each group is a set of choices (cache strategies, KV precisions, weights, block sizes, prefix reuse); the
configurations are every combination that means something (a KV precision only for contiguous and paged, a
block size only for the paged strategies), listed in the dialog as they will run. The first one is the
reference the others' greedy agreement is measured against.
"""

from __future__ import annotations

import itertools

from PySide6.QtWidgets import (
    QCheckBox,
    QDialog,
    QDialogButtonBox,
    QGridLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QVBoxLayout,
    QWidget,
)

from engine.config import BLOCK_SIZES, CACHE_STRATEGIES, KV_DTYPES, WEIGHT_FORMATS
from engine.replay import ReplayConfig

MAX_CONFIGURATIONS = 12
PRECISION_CACHES = ("contiguous", "paged")  # the caches that store K/V in a chosen precision


def configurations(caches, kv_dtypes, weights, block_sizes, prefix_reuse) -> list[ReplayConfig]:
    """Every meaningful combination, in the order given, without repeats (a choice that does not apply to a
    strategy leaves it out: 'none' has no precision and no blocks)."""
    found: dict[str, ReplayConfig] = {}
    for w, cache, kv, block, reuse in itertools.product(weights, caches, kv_dtypes or [None], block_sizes,
                                                         prefix_reuse):
        config = ReplayConfig(cache, kv if cache in PRECISION_CACHES else None, w,
                              block if cache.startswith("paged") else block_sizes[0],
                              reuse if cache != "none" else True)
        found.setdefault(config.label, config)
    return list(found.values())


class CompareDialog(QDialog):
    def __init__(self, info, current_block_size: int, prefix_reuse: bool, parent: QWidget | None = None):
        super().__init__(parent)
        self.setWindowTitle("Replay under…")
        weights_now = getattr(info, "weight_format", "") or "float32"
        kv_now = getattr(info, "kv_dtype", "") or ""
        self.caches = self._group("Cache strategy", CACHE_STRATEGIES, ("contiguous", "paged"))
        self.kv = self._group("KV precision (contiguous, paged)", [k for k in KV_DTYPES if k != "auto"],
                              (kv_now,) if kv_now in KV_DTYPES else (KV_DTYPES[1],))
        self.weights = self._group("Weights", [w for w in WEIGHT_FORMATS if w != "auto"], (weights_now,))
        self.blocks = self._group("Block size (paged)", [str(b) for b in BLOCK_SIZES], (str(current_block_size),))
        self.reuse = self._group("Prefix reuse", ("on", "off"), ("on" if prefix_reuse else "off",))
        self.preview = QLabel(self, wordWrap=True, objectName="comparePreview")
        self.buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel)
        self.buttons.button(QDialogButtonBox.StandardButton.Ok).setText("Replay")
        self.buttons.accepted.connect(self.accept)
        self.buttons.rejected.connect(self.reject)
        grid = QGridLayout()
        for i, (box, _) in enumerate((self.caches, self.kv, self.weights, self.blocks, self.reuse)):
            grid.addWidget(box, i // 3, i % 3)
        layout = QVBoxLayout(self)
        layout.addLayout(grid)
        layout.addWidget(self.preview)
        layout.addWidget(self.buttons)
        self._update()

    def _group(self, title: str, names, checked) -> tuple[QGroupBox, dict[str, QCheckBox]]:
        box = QGroupBox(title, self)
        row = QHBoxLayout(box)
        boxes = {}
        for name in names:
            check = QCheckBox(name, box, checked=name in checked)
            check.toggled.connect(self._update)
            row.addWidget(check)
            boxes[name] = check
        return box, boxes

    @staticmethod
    def _chosen(group) -> list[str]:
        return [name for name, check in group[1].items() if check.isChecked()]

    def configurations(self) -> list[ReplayConfig]:
        return configurations(self._chosen(self.caches), self._chosen(self.kv), self._chosen(self.weights),
                              [int(b) for b in self._chosen(self.blocks)] or [16],
                              [name == "on" for name in self._chosen(self.reuse)])

    def check(self, group: str, name: str, on: bool = True) -> None:
        """Tick or untick one choice (scripts and tests)."""
        getattr(self, group)[1][name].setChecked(on)

    def _update(self) -> None:
        configs = self.configurations()
        ok = 1 <= len(configs) <= MAX_CONFIGURATIONS
        self.buttons.button(QDialogButtonBox.StandardButton.Ok).setEnabled(ok)
        if not configs:
            self.preview.setText("Choose at least one cache strategy, one set of weights and prefix reuse on or off.")
        elif not ok:
            self.preview.setText(f"{len(configs)} configurations: choose at most {MAX_CONFIGURATIONS}.")
        else:
            listed = "".join(f"<li>{c.label}{' (reference)' if i == 0 else ''}</li>" for i, c in enumerate(configs))
            self.preview.setText(f"{len(configs)} configuration{'s' if len(configs) > 1 else ''}, replayed in this "
                                 f"order on the same tokens:<ol>{listed}</ol>")
