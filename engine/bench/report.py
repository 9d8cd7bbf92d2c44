"""Markdown tables, number formatting and plot plumbing (matplotlib, Agg backend) shared by the benchmarks."""

from __future__ import annotations

import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

STYLE = {"none": "tab:red", "contiguous": "tab:blue", "paged": "tab:green", "paged-int8": "tab:olive",
         "transformers": "tab:purple", "transformers fp8 cache": "tab:pink", "llama.cpp": "tab:brown"}


def fmt(x, digits: int = 3) -> str:
    """A number for a table: None/NaN -> '-', ints as ints, floats to `digits` significant figures."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, float):
        if x == 0:
            return "0"
        if abs(x) >= 10 ** digits:
            return f"{x:,.0f}"
        return f"{x:.{digits}g}"
    return str(x)


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def md_table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
    lines += ["| " + " | ".join(c if isinstance(c, str) else fmt(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def section(title: str, *parts: str) -> str:
    return "\n\n".join([f"## {title}", *[p for p in parts if p]])


def color(name: str) -> str | None:
    for key in sorted(STYLE, key=len, reverse=True):
        if key in name:
            return STYLE[key]
    return None


def figure(ncols: int = 1, width: float = 6.0, height: float = 4.2):
    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, height), squeeze=False)
    return fig, list(axes[0])


def save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=_jsonable))
    tmp.replace(path)


def _jsonable(x):
    if hasattr(x, "__dataclass_fields__"):
        return x.__dict__
    if hasattr(x, "tolist"):
        return x.tolist()
    return str(x)
