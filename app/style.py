"""Colours, fonts and small formatting helpers shared by the widgets (no Qt state at import time)."""

from __future__ import annotations

from pathlib import Path

RESOURCES = Path(__file__).resolve().parent.parent / "resources"

STRATEGY_COLORS = {
    "none": "#e06c75",
    "contiguous": "#e5c07b",
    "paged": "#61afef",
    "paged-int8": "#98c379",
}
FALLBACK_COLOR = "#c8ccd4"

# block states, indexed by engine.kv.base.BLOCK_FREE / OWN / OTHER / CACHED
BLOCK_COLORS = ("#3a3f4b", "#61afef", "#c678dd", "#56b6c2")
BLOCK_LABELS = ("free", "this conversation", "another sequence", "cached, reusable")

PLOT_BACKGROUND = "#1b1d23"
PLOT_FOREGROUND = "#abb2bf"
TEXT_MUTED = "#8b93a1"
CODE_BACKGROUND = "#15171c"
ERROR_COLOR = "#e06c75"


def strategy_color(strategy: str) -> str:
    """A quantized cache ('paged-int4', 'contiguous-int8') takes its layout's colour unless it has its own."""
    return STRATEGY_COLORS.get(strategy) or STRATEGY_COLORS.get(strategy.split("-")[0], FALLBACK_COLOR)


def human_bytes(n: float) -> str:
    """1023 B, 1.5 KiB, 12.3 MiB, 1.20 GiB."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            break
        n /= 1024
    if unit == "B":
        return f"{int(n)} B"
    return f"{n:.2f} {unit}" if abs(n) < 10 else f"{n:.1f} {unit}"


# the dark palette behind the style sheet: widgets the sheet does not name (the non-native file dialog's views,
# combo boxes, message boxes) take their colours from it, so no dialog shows light text on a white base
PALETTE = {
    "Window": "#1e2127", "WindowText": "#d7dae0", "Base": "#262a33", "AlternateBase": "#2b3038",
    "Text": "#d7dae0", "Button": "#2f3542", "ButtonText": "#d7dae0", "BrightText": "#ffffff",
    "ToolTipBase": "#22262e", "ToolTipText": "#d7dae0", "PlaceholderText": "#7f8796", "Highlight": "#3e6fb0",
    "HighlightedText": "#ffffff", "Link": "#61afef", "Light": "#3a404c", "Midlight": "#343a46", "Mid": "#2c313a",
    "Dark": "#191c21", "Shadow": "#101215",
}
DISABLED_TEXT = "#5c6370"


def load_stylesheet() -> str:
    """The style sheet, with @RESOURCES@ (images such as the spin-box arrows) replaced by the resources folder."""
    path = RESOURCES / "style.qss"
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    return text.replace("@RESOURCES@", RESOURCES.as_posix())


def dark_palette():
    from PySide6.QtGui import QColor, QPalette

    palette = QPalette()
    for role, color in PALETTE.items():
        palette.setColor(getattr(QPalette.ColorRole, role), QColor(color))
    for role in ("WindowText", "Text", "ButtonText"):
        palette.setColor(QPalette.ColorGroup.Disabled, getattr(QPalette.ColorRole, role), QColor(DISABLED_TEXT))
    return palette


def apply_theme(app) -> None:
    """The app's look on every platform: the Fusion style, the dark palette, then the style sheet."""
    app.setStyle("Fusion")
    app.setPalette(dark_palette())
    app.setStyleSheet(load_stylesheet())


def default_system_prompt() -> str:
    path = RESOURCES / "system_prompt.txt"
    return path.read_text(encoding="utf-8").strip() if path.exists() else "You are a helpful assistant."
