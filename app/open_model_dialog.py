"""File → Open model: the GGUFs already on this machine (engine/model_library.py), the recent ones first; picking
one loads it through the window's usual path (its progress bar, its errors). No tensor math here."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QAbstractItemView,
    QDialog,
    QDialogButtonBox,
    QHBoxLayout,
    QLabel,
    QPushButton,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from app import file_dialogs
from app.style import human_bytes
from engine import loader
from engine import model_library as lib

COLUMNS = ("Name", "Architecture", "Quantization", "Size", "Context", "KV bytes/token", "Where")
RECENT_FILE, FOLDERS_FILE = "recent-models.json", "model-folders.json"


def library_file(name: str) -> Path:
    return loader.cache_root() / name


def entry_cells(entry: lib.ModelEntry) -> list[str]:
    context = f"{entry.context_length:,}" if entry.context_length else "?"
    kv = f"{entry.kv_bytes_per_token:,}" if entry.kv_bytes_per_token else "?"
    return [entry.name, entry.architecture, entry.quantization, human_bytes(entry.size_bytes), context, kv,
            entry.source]


class OpenModelDialog(QDialog):
    """The table of models found; `chosen` is the path to load once accepted (None: nothing chosen)."""

    def __init__(self, parent: QWidget | None = None, roots: list[lib.LibraryRoot] | None = None):
        super().__init__(parent)
        self.setWindowTitle("Open model")
        self.resize(960, 420)
        self.roots = lib.default_roots() if roots is None else roots
        self.chosen: str | None = None
        self.entries: list[lib.ModelEntry] = []
        layout = QVBoxLayout(self)
        self.summary = QLabel()
        self.summary.setWordWrap(True)
        layout.addWidget(self.summary)
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.itemSelectionChanged.connect(self._selection_changed)
        self.table.cellDoubleClicked.connect(lambda _r, _c: self._open())
        layout.addWidget(self.table)
        layout.addLayout(self._buttons())
        self.rescan()

    def _buttons(self) -> QHBoxLayout:
        row = QHBoxLayout()
        self.add_folder = QPushButton("Add folder…")
        self.add_folder.clicked.connect(self._ask_folder)
        row.addWidget(self.add_folder)
        self.box = QDialogButtonBox(QDialogButtonBox.StandardButton.Open | QDialogButtonBox.StandardButton.Cancel)
        self.open_button = self.box.button(QDialogButtonBox.StandardButton.Open)
        self.open_button.setEnabled(False)
        self.box.accepted.connect(self._open)
        self.box.rejected.connect(self.reject)
        row.addWidget(self.box)
        return row

    def rescan(self) -> None:
        folders = [Path(f) for f in lib.recent_models(library_file(FOLDERS_FILE))]
        result = lib.scan(self.roots, folders)
        recent = {p: i for i, p in enumerate(lib.recent_models(library_file(RECENT_FILE)))}
        self.entries = sorted(result.models, key=lambda m: (recent.get(str(m.path), len(recent)), m.name.lower()))
        self._fill(recent)
        where = ", ".join(sorted({r.source for r in self.roots} | ({"your folders"} if folders else set())))
        skipped = f"; {len(result.refused)} link(s) out of their folder refused" if result.refused else ""
        broken = f"; {len(result.unreadable)} unreadable file(s)" if result.unreadable else ""
        self.summary.setText(f"{len(self.entries)} GGUF model(s) in {where or 'no known folder'}{skipped}{broken}. "
                             "KV bytes per token: 2 × 2 bytes (16-bit cache) × layers × KV heads × head_dim.")

    def _fill(self, recent: dict[str, int]) -> None:
        self.table.setRowCount(len(self.entries))
        for row, entry in enumerate(self.entries):
            for col, text in enumerate(entry_cells(entry)):
                if col == 0 and str(entry.path) in recent:
                    text = f"★ {text}"
                item = QTableWidgetItem(text)
                item.setToolTip(f"{entry.path}\n{entry.note}".strip())
                if not entry.supported:
                    item.setFlags(item.flags() & ~Qt.ItemFlag.ItemIsSelectable & ~Qt.ItemFlag.ItemIsEnabled)
                self.table.setItem(row, col, item)
        self.table.resizeColumnsToContents()

    def _selection_changed(self) -> None:
        self.open_button.setEnabled(self.selected() is not None)

    def selected(self) -> lib.ModelEntry | None:
        rows = {i.row() for i in self.table.selectedItems()}
        if len(rows) != 1:
            return None
        entry = self.entries[rows.pop()]
        return entry if entry.supported else None

    def select(self, path: Path) -> None:
        """Select the row of this model (tests, and the recent model on open)."""
        for row, entry in enumerate(self.entries):
            if entry.path == path:
                self.table.selectRow(row)

    def _ask_folder(self) -> None:
        folder = file_dialogs.ask(self, "Add a folder of GGUF models", mode="folder")
        if folder:
            self.add_models_folder(Path(folder))

    def add_models_folder(self, folder: Path) -> None:
        lib.remember_model(library_file(FOLDERS_FILE), str(folder))
        self.rescan()

    def _open(self) -> None:
        entry = self.selected()
        if entry is None:
            return
        self.chosen = str(entry.path)
        lib.remember_model(library_file(RECENT_FILE), self.chosen)
        self.accept()


def choose_and_load(window) -> None:
    """Show the library; load the model picked through window.load_model (its progress bar and errors)."""
    dialog = OpenModelDialog(window)
    accepted = dialog.exec() == QDialog.DialogCode.Accepted
    if hasattr(window, "restore_focus"):
        window.restore_focus()
    if accepted and dialog.chosen:
        window.load_model(dialog.chosen)
