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
    return STRATEGY_COLORS.get(strategy, FALLBACK_COLOR)


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


def load_stylesheet() -> str:
    path = RESOURCES / "style.qss"
    return path.read_text(encoding="utf-8") if path.exists() else ""


def default_system_prompt() -> str:
    path = RESOURCES / "system_prompt.txt"
    return path.read_text(encoding="utf-8").strip() if path.exists() else "You are a helpful assistant."
