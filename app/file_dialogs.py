"""File dialogs whose columns fit: Open / Save conversation, export, choose model.

Where the platform has a native file dialog (GNOME, KDE, macOS, Windows) Qt shows it and nothing here changes it.
Where it has none (a bare X server, Xvfb, `offscreen`), Qt draws its own, 642 pixels wide, whose detail view cut
the Date Modified column ("2 12 2… 03:10"). Here that dialog opens wide enough for name, size, type and date, its
Size, Type and Date columns fit their contents (header included) and Name takes the rest of the width.
"""

from __future__ import annotations

from PySide6.QtCore import QSize
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import QFileDialog, QHeaderView, QTreeView, QWidget

SIZE = QSize(900, 540)  # room for a 300-pixel name beside size, type and a whole date, and the places sidebar
SCREEN_SHARE = 0.9  # never wider or taller than this share of the screen's free area


def make_file_dialog(parent: QWidget | None, title: str, folder: str = "", file_filter: str = "",
                     mode: str = "open") -> QFileDialog:
    """A file dialog (mode "open", "save" or "folder") with columns that fit; exec() it, then selectedFiles()."""
    dialog = QFileDialog(parent, title, folder, file_filter)
    if mode == "save":
        dialog.setAcceptMode(QFileDialog.AcceptMode.AcceptSave)
    elif mode == "folder":
        dialog.setFileMode(QFileDialog.FileMode.Directory)
        dialog.setOption(QFileDialog.Option.ShowDirsOnly)
    else:
        dialog.setFileMode(QFileDialog.FileMode.ExistingFile)
    dialog.setViewMode(QFileDialog.ViewMode.Detail)
    dialog.resize(fitting_size(parent))
    fit_columns(dialog)
    return dialog


def ask(parent: QWidget | None, title: str, folder: str = "", file_filter: str = "", mode: str = "open") -> str:
    """The path chosen ("" when cancelled)."""
    dialog = make_file_dialog(parent, title, folder, file_filter, mode)
    chosen = dialog.selectedFiles() if dialog.exec() else []
    dialog.deleteLater()
    return chosen[0] if chosen else ""


def fitting_size(parent: QWidget | None, size: QSize = SIZE) -> QSize:
    """size, bounded to SCREEN_SHARE of the free area of the parent's screen (or the primary one)."""
    screen = parent.screen() if parent is not None else QGuiApplication.primaryScreen()
    room = screen.availableGeometry().size() * SCREEN_SHARE if screen is not None else size
    return size.boundedTo(room)


def fit_columns(dialog: QFileDialog) -> None:
    """Size, Type and Date fit their contents; Name stretches (Qt's own dialog; a native one has no tree view)."""
    view = dialog.findChild(QTreeView)
    if view is None:
        return
    header = view.header()
    header.setStretchLastSection(False)
    header.setMinimumSectionSize(60)
    for column in range(1, header.count()):
        header.setSectionResizeMode(column, QHeaderView.ResizeMode.ResizeToContents)
    header.setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
