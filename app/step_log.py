"""Every step of the conversation as plot-ready columns, split into monotonic runs (no Qt here).

A run is a stretch of steps of one strategy whose context positions only grow. A new chat or a re-prefill after
switching strategy goes back in position and starts a new run, so each plotted curve keeps increasing x (which
clip-to-view and downsampling rely on) while the old curve stays visible.

A run is keyed by the whole configuration the steps ran under (strategy, KV precision, weights: set_configuration
before the steps), so turns under other weights or another precision get their own curve, colour and legend
entry; label() names a run by the parts of its configuration that differ between the log's runs.

A reply that is replaced (Regenerate, Edit and send) takes its steps with it: mark() before each turn, and
rollback(mark) puts the log back as it was before that turn, so the new reply continues the same curve.

The rows (one per step, the CSV's columns) are also the log's saved form: from_rows() rebuilds the runs. Beside
them the log keeps the block map's state after a turn's last step (add_pool: app.pool_snapshot records, by row
index), saved with the rows, so that a reopened conversation shows its pool as it was.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

CSV_COLUMNS = ("strategy", "phase", "pos", "n_tokens", "latency_ms", "per_token_ms", "kv_bytes_allocated",
               "kv_bytes_used", "kv_bytes_theoretical", "prefix_hit_tokens", "n_drafted", "n_accepted", "kv_precision",
               "weights")
MIB = 1024 * 1024


class Column:
    """A float array that grows by doubling; `values` is a view of the filled part."""

    def __init__(self, capacity: int = 256):
        self._data = np.empty(capacity, dtype=np.float64)
        self.size = 0

    def append(self, value: float) -> None:
        if self.size == len(self._data):
            self._data = np.resize(self._data, 2 * len(self._data))
        self._data[self.size] = value
        self.size += 1

    @property
    def values(self) -> np.ndarray:
        return self._data[:self.size]

    def truncate(self, size: int) -> None:
        self.size = min(self.size, size)


@dataclass(frozen=True)
class SeriesKey:
    """The configuration a run's steps ran under ("" where it is not known)."""

    strategy: str
    kv_precision: str = ""
    weights: str = ""


@dataclass
class Run:
    strategy: str
    index: int  # 0 for the configuration's first run (the one named in the legend)
    key: SeriesKey = None  # the whole configuration (None: the strategy alone)
    last_pos: int = -1
    dirty: set = field(default_factory=lambda: {"latency", "memory"})  # plots that have not drawn the last steps
    columns: dict[str, Column] = field(default_factory=lambda: {name: Column() for name in (
        "decode_x", "decode_ms", "prefill_x", "prefill_ms", "mem_x", "allocated", "used", "theoretical",
        "verify_x", "verify_ms", "verify_n")})

    def values(self, name: str) -> np.ndarray:
        return self.columns[name].values

    def add(self, event) -> None:
        c = self.columns
        if event.phase == "prefill":
            if c["decode_x"].size:  # break the decode line: this turn's decoding starts after the prefill
                c["decode_x"].append(c["decode_x"].values[-1] + 0.5)
                c["decode_ms"].append(float("nan"))
            for x in (event.pos - event.n_tokens + 0.5, event.pos + 0.5):  # one bar across the tokens it ran
                c["prefill_x"].append(x)
                c["prefill_ms"].append(event.per_token_ms)
        else:
            c["decode_x"].append(event.pos)
            c["decode_ms"].append(event.latency_ms / max(getattr(event, "n_produced", 1), 1))  # ms per token
            if getattr(event, "n_drafted", 0):  # a speculative verify step: also a marker sized by its tokens
                c["verify_x"].append(event.pos)
                c["verify_ms"].append(event.latency_ms / max(event.n_produced, 1))
                c["verify_n"].append(event.n_produced)
        c["mem_x"].append(event.pos)
        for name in ("allocated", "used", "theoretical"):
            c[name].append(_mib(getattr(event.kv, f"bytes_{name}")))
        self.last_pos = event.pos
        self.dirty = {"latency", "memory"}


@dataclass(frozen=True)
class Mark:
    """Where the log stood before a turn: rows, runs, each run's length and the run each strategy continues."""

    num_rows: int
    num_runs: int
    run_state: tuple[tuple[dict[str, int], int], ...]  # per run: column sizes, last position
    open_runs: tuple[tuple[str, Run], ...]


def _mib(n: int) -> float:
    """MiB for the log-scale memory plot; nothing held is NaN (a gap), not log(0)."""
    return n / MIB if n > 0 else float("nan")


class StepLog:
    """All steps (for CSV) and the runs built from them (for plotting)."""

    def __init__(self):
        self.rows: list[tuple] = []
        self.runs: list[Run] = []
        self.pools: dict[int, dict] = {}  # row index -> the block map's state after that row (pool_snapshot)
        self._open: dict[SeriesKey, Run] = {}
        self.kv_precision = self.weights = ""  # the configuration the next steps run under

    def set_configuration(self, kv_precision: str | None, weights: str | None) -> None:
        """The KV precision and weights of the steps added from now on (with each step's own strategy)."""
        self.kv_precision, self.weights = kv_precision or "", weights or ""

    def add(self, event) -> Run:
        kv = event.kv
        self.rows.append((event.strategy, event.phase, event.pos, event.n_tokens, event.latency_ms,
                          event.per_token_ms, kv.bytes_allocated, kv.bytes_used, kv.bytes_theoretical,
                          event.prefix_hit_tokens, getattr(event, "n_drafted", 0), getattr(event, "n_accepted", 0),
                          self.kv_precision, self.weights))
        key = SeriesKey(event.strategy, self.kv_precision, self.weights)
        run = self._open.get(key)
        if run is None or event.pos <= run.last_pos:
            run = self._new_run(key)
        run.add(event)
        return run

    def add_pool(self, record: dict) -> None:
        """The block map's state after the latest row (the end of a turn)."""
        if self.rows:
            self.pools[len(self.rows) - 1] = record

    def last_pool(self) -> dict | None:
        return self.pools[max(self.pools)] if self.pools else None

    def label(self, run: Run) -> str:
        """The strategy, and the KV precision and weights where the log's runs differ in them:
        'paged', or 'paged · KV bfloat16 · int4 weights' beside 'paged · KV float32 · int4 weights'."""
        keys = {r.key for r in self.runs}
        parts = [run.strategy]
        if len({k.kv_precision for k in keys}) > 1 and run.key.kv_precision:
            parts.append(f"KV {run.key.kv_precision}")
        if len({k.weights for k in keys}) > 1 and run.key.weights:
            parts.append(f"{run.key.weights} weights")
        return " · ".join(parts)

    def variant(self, run: Run) -> int:
        """0 for the first configuration of the run's strategy, 1 for the second, ... (for its colour)."""
        keys = list(dict.fromkeys(r.key for r in self.runs if r.strategy == run.strategy))
        return keys.index(run.key) if run.key in keys else 0

    @classmethod
    def from_rows(cls, rows) -> StepLog:
        """The log whose rows these are (its saved form); ValueError when a row is malformed."""
        log = cls()
        for row in rows:
            event = SavedStep.from_row(row)
            log.set_configuration(event.kv_precision, event.weights)
            log.add(event)
        return log

    def break_runs(self) -> None:
        """The next step of every strategy starts a new run (a new chat, say)."""
        self._open.clear()

    def clear(self) -> None:
        self.rows.clear()
        self.runs.clear()
        self.pools.clear()
        self._open.clear()

    def mark(self) -> Mark:
        state = tuple(({name: c.size for name, c in run.columns.items()}, run.last_pos) for run in self.runs)
        return Mark(len(self.rows), len(self.runs), state, tuple(self._open.items()))

    def rollback(self, mark: Mark) -> list[Run]:
        """Forget every step added since mark; returns the runs that no longer exist (their curves go too)."""
        if mark.num_runs > len(self.runs) or mark.num_rows > len(self.rows):
            raise ValueError("this mark is not from this log's history (it was cleared since)")
        removed = self.runs[mark.num_runs:]
        del self.runs[mark.num_runs:]
        del self.rows[mark.num_rows:]
        self.pools = {row: pool for row, pool in self.pools.items() if row < mark.num_rows}
        for run, (sizes, last_pos) in zip(self.runs, mark.run_state):
            if any(run.columns[name].size != size for name, size in sizes.items()):
                for name, size in sizes.items():
                    run.columns[name].truncate(size)
                run.dirty = {"latency", "memory"}
            run.last_pos = last_pos
        self._open = dict(mark.open_runs)
        return removed

    def dirty_runs(self, plot: str) -> list[Run]:
        return [run for run in self.runs if plot in run.dirty]

    def write_csv(self, path: str | Path) -> None:
        with open(path, "w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f)
            writer.writerow(CSV_COLUMNS)
            writer.writerows(self.rows)

    def _new_run(self, key: SeriesKey) -> Run:
        index = sum(1 for run in self.runs if run.key == key)
        run = Run(key.strategy, index, key)
        self.runs.append(run)
        self._open[key] = run
        return run


@dataclass(frozen=True)
class SavedKV:
    bytes_allocated: int
    bytes_used: int
    bytes_theoretical: int


@dataclass(frozen=True)
class SavedStep:
    """A step read back from a saved row: what the plots draw of a StepEvent."""

    strategy: str
    phase: str
    pos: int
    n_tokens: int
    latency_ms: float
    kv: SavedKV
    prefix_hit_tokens: int
    n_drafted: int = 0
    n_accepted: int = 0
    kv_precision: str = ""
    weights: str = ""

    @property
    def per_token_ms(self) -> float:
        return self.latency_ms / max(self.n_tokens, 1)

    @property
    def n_produced(self) -> int:
        return self.n_accepted + 1

    @classmethod
    def from_row(cls, row) -> SavedStep:
        if not isinstance(row, (list, tuple)) or len(row) not in (10, len(CSV_COLUMNS)):
            raise ValueError(f"a step row must have {len(CSV_COLUMNS)} values")
        row = list(row) + ([0, 0, "", ""] if len(row) == 10 else [])  # rows saved before these columns
        strategy, phase, pos, n_tokens, ms, _, allocated, used, theoretical, hit, drafted, accepted, kv, w = row
        counts = (pos, n_tokens, allocated, used, theoretical, hit, drafted, accepted)
        if phase not in ("prefill", "decode") or not all(isinstance(x, str) for x in (strategy, kv, w)) \
                or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts) \
                or not isinstance(ms, (int, float)) or isinstance(ms, bool) or not ms >= 0:
            raise ValueError(f"not a step row: {row!r}")
        return cls(strategy, phase, pos, n_tokens, float(ms), SavedKV(allocated, used, theoretical), hit, drafted,
                   accepted, kv, w)
