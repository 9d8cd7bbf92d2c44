"""Markdown tables, number formatting and plot plumbing (matplotlib, Agg backend) shared by the benchmarks."""

from __future__ import annotations

import json
import math
import zlib
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter, MaxNLocator, NullFormatter  # noqa: E402

# One fixed colour per series name (a qualitative palette: tab10 first, then the darker and lighter tab20 shades),
# so a series has the same colour in every plot and no two series of one plot share a colour.
PALETTE = {
    "none": "#d62728",
    "contiguous": "#1f77b4",
    "contiguous, no reuse": "#1f77b4",
    "contiguous, reuse": "#17becf",
    "paged": "#2ca02c",
    "paged, reuse": "#2ca02c",
    "paged, prefix cache across conversations": "#ff7f0e",
    "paged-int8": "#bcbd22",
    "paged, KV float32": "#2ca02c",
    "paged, KV bfloat16": "#1f77b4",
    "paged, KV float16": "#aec7e8",
    "paged, KV int8": "#bcbd22",
    "paged, KV int4": "#e377c2",
    "engine KV bfloat16 vs float32": "#1f77b4",
    "engine KV float16 vs float32": "#aec7e8",
    "engine KV int8 vs float32": "#bcbd22",
    "engine KV int4 vs float32": "#e377c2",
    "paged, float32 weights": "#8c564b",
    "paged, bfloat16 weights": "#e377c2",
    "paged, int8 weights": "#17becf",
    "paged, int4 weights": "#98df8a",
    "transformers": "#9467bd",
    "transformers fp8 cache": "#c5b0d5",
    "llama.cpp": "#7f7f7f",
    "measured": "#1f77b4",
    "formula": "#ff7f0e",
    "engine paged-int8 vs paged": "#bcbd22",
    "transformers fp8 cache vs dynamic": "#e377c2",
}


def kv_row(layout: str, kv: str) -> str:
    """The name of the row that runs `layout` with keys and values stored in precision `kv` (decode, step)."""
    return f"{layout}, KV {kv}"


def parse_kv_row(name: str) -> tuple[str, str | None]:
    """kv_row's inverse: (layout, precision); a plain strategy name gives (name, None)."""
    layout, _, kv = name.partition(", KV ")
    return layout, kv or None


def weights_row(fmt: str) -> str:
    """The name of the row that runs the paged cache with the weights in `fmt` (decode and prefill)."""
    return f"paged, {fmt} weights"


EXTRA_COLORS = ("#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94", "#f7b6d2", "#dbdb8d", "#9edae5")


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


def color(name: str) -> str:
    """The series' fixed colour; a name outside the palette gets a stable one of the extra colours."""
    if name in PALETTE:
        return PALETTE[name]
    return EXTRA_COLORS[zlib.crc32(name.encode()) % len(EXTRA_COLORS)]


def line(ax, name: str, xs, ys, **kwargs) -> None:
    """One labelled series in its own colour, with markers."""
    ax.plot(xs, ys, kwargs.pop("fmt", "o-"), label=name, color=color(name), ms=4, **kwargs)


def integer_ticks(axis) -> None:
    """Ticks only at whole numbers (turns, sequences): never 2.5."""
    axis.set_major_locator(MaxNLocator(integer=True))


def plain_log_ticks(axis) -> None:
    """Log-axis ticks as plain numbers (30, 100, 1000), without the crowded minor labels."""
    axis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def legend_outside(ax, *others) -> None:
    """The legend to the right of the plot area, where it cannot cover a series; with other axes given, one
    legend for the series of all of them (each label once)."""
    entries: dict[str, object] = {}
    for a in (*others, ax):
        for handle, label in zip(*a.get_legend_handles_labels()):
            entries.setdefault(label, handle)
    ax.legend(list(entries.values()), list(entries), loc="upper left", bbox_to_anchor=(1.02, 1.0),
              borderaxespad=0, fontsize=8, frameon=False)


def categories(ax, labels: list[str]) -> None:
    """Categories down the y axis, first on top, for horizontal bars: a label per row, so however long the
    labels are, neighbours never overlap (slanted labels under vertical bars do)."""
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylim(len(labels) - 0.5, -0.5)


def figure_for_rows(n_rows: int, ncols: int = 1, width: float = 6.0):
    """A figure tall enough for n_rows horizontal bars (or groups of bars) per axes."""
    return figure(ncols, width=width, height=max(2.5, 1.2 + 0.42 * n_rows))


def figure(ncols: int = 1, width: float = 6.0, height: float = 4.2):
    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, height), squeeze=False)
    return fig, list(axes[0])


def save(fig, path: Path) -> None:
    global last_saved
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")  # "tight": legends placed outside the axes stay in the image
    last_saved = describe(fig)
    plt.close(fig)


last_saved: dict = {}  # describe() of the last figure saved: what tests check a benchmark's plot showed


def describe(fig) -> dict:
    """What a drawn figure shows, per axes: its labelled series and their colours, the x tick values and
    whether any two x tick labels, or the legend and a series, overlap on the canvas."""
    fig.draw_without_rendering()  # the layout, no pixels (the PNG is written already)
    renderer = fig.canvas.get_renderer()
    return {"axes": [_describe_axes(ax, renderer) for ax in fig.axes]}


def _describe_axes(ax, renderer) -> dict:
    series = {h.get_label(): matplotlib.colors.to_hex(_face(h)) for h in _labelled(ax)}
    legend = ax.get_legend()
    covers = legend is not None and ax.get_window_extent(renderer).overlaps(legend.get_window_extent(renderer))
    lo, hi = sorted(ax.get_xlim())
    ticks = [float(t) for t in ax.get_xticks() if lo <= t <= hi]
    return {"title": ax.get_title(), "series": series, "n_series": len(_labelled(ax)), "xticks": ticks,
            "tick_labels_overlap": _overlap(ax.get_xticklabels(), renderer) or _overlap(ax.get_yticklabels(), renderer),
            "legend_inside_axes": bool(covers)}


def _overlap(labels, renderer) -> bool:
    boxes = [t.get_window_extent(renderer) for t in labels if t.get_text() and t.get_visible()]
    return any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])


def _labelled(ax) -> list:
    return [h for h in [*ax.lines, *ax.containers] if not h.get_label().startswith("_")]


def _face(handle):
    if hasattr(handle, "get_color"):
        return handle.get_color()
    return handle.patches[0].get_facecolor()  # a bar container: its first bar


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
