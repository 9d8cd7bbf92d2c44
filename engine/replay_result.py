"""A Compare result: each configuration's replayed steps, and the figures that compare them (no Qt here).

Per configuration: decode ms per token (median, p90) overall and by context range, time to first token per turn
(the turn's prefill steps), peak and final KV allocated / used, and the greedy agreement with the first
configuration (the share of the positions both replayed at which both would have picked the same token).
Results are plain data, saved with the conversation (to_dict / from_dict) and written as CSV.
"""

from __future__ import annotations

import csv
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from engine.replay import ReplayConfig, ReplayStep

ROW_FIELDS = ("turn", "phase", "pos", "n_tokens", "latency_ms", "kv_bytes_allocated", "kv_bytes_used",
              "kv_bytes_theoretical", "greedy_token")
CSV_COLUMNS = ("configuration",) + ROW_FIELDS
NUM_CONTEXT_RANGES = 3  # decode latency by context: the positions replayed split into this many equal ranges


@dataclass(frozen=True)
class StepRow:
    turn: int
    phase: str
    pos: int
    n_tokens: int
    latency_ms: float
    kv_bytes_allocated: int
    kv_bytes_used: int
    kv_bytes_theoretical: int
    greedy_token: int

    @classmethod
    def from_step(cls, step: ReplayStep) -> StepRow:
        e, kv = step.event, step.event.kv
        return cls(step.turn, e.phase, e.pos, e.n_tokens, e.latency_ms, kv.bytes_allocated, kv.bytes_used,
                   kv.bytes_theoretical, e.token_id)

    def as_tuple(self) -> tuple:
        return tuple(getattr(self, name) for name in ROW_FIELDS)


@dataclass
class ConfigRun:
    """One configuration's replay; complete is False when it was stopped or failed part way."""

    config: ReplayConfig
    rows: list[StepRow] = field(default_factory=list)
    complete: bool = False
    error: str = ""

    def greedy_by_position(self) -> dict[int, int]:
        return {row.pos: row.greedy_token for row in self.rows}

    def decode_rows(self) -> list[StepRow]:
        return [row for row in self.rows if row.phase == "decode"]


@dataclass(frozen=True)
class Summary:
    """The table's row for one configuration (ms, bytes, and agreement in [0, 1]; None: nothing to compare)."""

    label: str
    decode_median_ms: float | None
    decode_p90_ms: float | None
    by_context: tuple[tuple[int, int, float], ...]  # (first position, last position, median ms) per range
    ttft_ms: tuple[float, ...]  # per turn replayed
    peak_allocated: int
    peak_used: int
    final_allocated: int
    final_used: int
    agreement: float | None
    num_compared: int
    complete: bool


@dataclass
class CompareResult:
    runs: list[ConfigRun] = field(default_factory=list)
    num_turns: int = 0
    error: str = ""  # why the job could not start ("": it ran)

    def summaries(self) -> list[Summary]:
        reference = self.runs[0].greedy_by_position() if self.runs else {}
        ranges = context_ranges([row.pos for run in self.runs for row in run.decode_rows()])
        return [summarize(run, reference, ranges) for run in self.runs]

    def to_dict(self) -> dict:
        return {"num_turns": self.num_turns, "runs": [
            {"config": run.config.to_dict(), "complete": run.complete, "error": run.error,
             "steps": [list(row.as_tuple()) for row in run.rows]} for run in self.runs]}

    @classmethod
    def from_dict(cls, data: dict) -> CompareResult:
        """Raises ValueError (or KeyError / TypeError) when the data is not a saved result."""
        runs = []
        for run in data["runs"]:
            rows = [_row(values) for values in run["steps"]]
            runs.append(ConfigRun(ReplayConfig.from_dict(run["config"]), rows, bool(run["complete"]),
                                  str(run.get("error", ""))))
        return cls(runs, int(data["num_turns"]))

    def write_csv(self, path: str | Path) -> None:
        with open(path, "w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f)
            writer.writerow(CSV_COLUMNS)
            for run in self.runs:
                writer.writerows((run.config.label, *row.as_tuple()) for row in run.rows)


def _row(values) -> StepRow:
    if not isinstance(values, list) or len(values) != len(ROW_FIELDS):
        raise ValueError(f"a replayed step must be a list of {len(ROW_FIELDS)} values")
    turn, phase, pos, n_tokens, ms, allocated, used, theoretical, greedy = values
    if phase not in ("prefill", "decode"):
        raise ValueError(f"unknown phase {phase!r}")
    ints = (turn, pos, n_tokens, allocated, used, theoretical, greedy)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ints):
        raise ValueError("a replayed step's counts must be non-negative integers")
    if not isinstance(ms, (int, float)) or isinstance(ms, bool) or not ms >= 0:
        raise ValueError("a replayed step's latency must be a non-negative number")
    return StepRow(turn, phase, pos, n_tokens, float(ms), allocated, used, theoretical, greedy)


def context_ranges(positions: list[int], parts: int = NUM_CONTEXT_RANGES) -> list[tuple[int, int]]:
    """The span of positions split into `parts` equal ranges (fewer when there are fewer positions)."""
    if not positions:
        return []
    low, high = min(positions), max(positions)
    parts = max(1, min(parts, high - low + 1))
    edges = [low + round(i * (high - low + 1) / parts) for i in range(parts + 1)]
    return [(edges[i], edges[i + 1] - 1) for i in range(parts)]


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default), q in [0, 100]."""
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    below = int(rank)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (rank - below)


def summarize(run: ConfigRun, reference: dict[int, int], ranges: list[tuple[int, int]]) -> Summary:
    decode = [row.latency_ms for row in run.decode_rows()]
    by_context = []
    for first, last in ranges:
        inside = [row.latency_ms for row in run.decode_rows() if first <= row.pos <= last]
        if inside:
            by_context.append((first, last, statistics.median(inside)))
    ttft: dict[int, float] = {}
    for row in run.rows:
        if row.phase == "prefill":
            ttft[row.turn] = ttft.get(row.turn, 0.0) + row.latency_ms
    greedy = run.greedy_by_position()
    common = [pos for pos in greedy if pos in reference]
    agreeing = sum(greedy[pos] == reference[pos] for pos in common)
    last = run.rows[-1] if run.rows else None
    return Summary(
        run.config.label, statistics.median(decode) if decode else None, percentile(decode, 90) if decode else None,
        tuple(by_context), tuple(ttft[turn] for turn in sorted(ttft)),
        max((row.kv_bytes_allocated for row in run.rows), default=0),
        max((row.kv_bytes_used for row in run.rows), default=0),
        last.kv_bytes_allocated if last else 0, last.kv_bytes_used if last else 0,
        agreeing / len(common) if common else None, len(common), run.complete)
