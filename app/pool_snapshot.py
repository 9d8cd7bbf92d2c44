"""The block map's state at the end of a turn, saved compactly with the step log (no Qt here).

A record is what the block map draws of a KVStats: the strategy, block size, tokens held, the budget in blocks,
the KV precision, and one state per physical block, run-length encoded as "state:count" pairs
("1:12 3:4 0:100": twelve blocks of this conversation, four cached, a hundred free). SavedPool reads a record back
as the KVStats fields BlockMap.set_stats uses, so a saved pool is drawn exactly as a live one.
"""

from __future__ import annotations

from dataclasses import dataclass

from app.style import BLOCK_LABELS

FIELDS = {"strategy": str, "block_size": int, "tokens": int, "budget": int, "precision": str, "states": str}
MAX_BLOCKS = 1 << 22  # a record that decodes to more blocks than this is not one kvscope wrote
FREE, OWN, OTHER, CACHED = range(4)  # engine.kv.base's BLOCK_* values (not imported: that module loads torch)


def encode_states(states: bytes) -> str:
    """Run-length encoding: "state:count" pairs separated by spaces ("" for no blocks)."""
    runs: list[list[int]] = []
    for state in states:
        if runs and runs[-1][0] == state:
            runs[-1][1] += 1
        else:
            runs.append([state, 1])
    return " ".join(f"{state}:{count}" for state, count in runs)


def decode_states(text: str) -> bytes:
    """The states encode_states wrote; ValueError for anything else."""
    out = bytearray()
    for pair in text.split():
        state, sep, count = pair.partition(":")
        if not sep or not state.isdigit() or not count.isdigit() or int(state) >= len(BLOCK_LABELS) \
                or int(count) < 1 or len(out) + int(count) > MAX_BLOCKS:
            raise ValueError(f"not a block-state run: {pair[:40]!r}")
        out += bytes([int(state)]) * int(count)
    return bytes(out)


def pool_record(kv) -> dict:
    """A KVStats (or anything with its fields) as a JSON-ready record."""
    return {"strategy": str(kv.strategy), "block_size": int(getattr(kv, "block_size", 0)),
            "tokens": int(getattr(kv, "tokens", 0)), "budget": int(getattr(kv, "num_blocks_budget", 0)),
            "precision": str(getattr(kv, "precision", "")),
            "states": encode_states(bytes(getattr(kv, "block_states", b"") or b""))}


@dataclass(frozen=True)
class SavedPool:
    """A record read back, with the fields of KVStats that the block map draws."""

    strategy: str
    block_size: int
    tokens: int
    num_blocks_budget: int
    precision: str
    block_states: bytes

    @classmethod
    def from_record(cls, record) -> SavedPool:
        """ValueError when the record is malformed."""
        if not isinstance(record, dict) or set(record) - {"step"} != set(FIELDS):
            raise ValueError(f"a block-map snapshot has the fields {', '.join(FIELDS)}")
        for name, kind in FIELDS.items():
            value = record[name]
            if not isinstance(value, kind) or isinstance(value, bool) or (kind is int and value < 0):
                raise ValueError(f"a block-map snapshot's {name} {value!r} is not valid")
        states = decode_states(record["states"])
        return cls(record["strategy"], record["block_size"], record["tokens"], record["budget"],
                   record["precision"], states)

    @property
    def num_blocks(self) -> int:
        return len(self.block_states)

    @property
    def num_blocks_used(self) -> int:
        return self.block_states.count(OWN) + self.block_states.count(OTHER)

    @property
    def num_blocks_cached(self) -> int:
        return self.block_states.count(CACHED)

    @property
    def num_blocks_free(self) -> int:
        return self.block_states.count(FREE)


@dataclass(frozen=True)
class SavedTurn:
    """A turn's saved pool: the turn's number in its conversation (1 for the first) and the context positions its
    steps ran, (first, last), for the plots (None where not known)."""

    number: int
    pool: SavedPool
    x_range: tuple[float, float] | None = None
