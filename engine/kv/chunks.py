"""The chunks a growing paged pool keeps its blocks in, and where a sequence's tokens sit among them.

Block ids are dense, 0..num_blocks-1: chunk c holds the ids starts[c] .. starts[c] + sizes[c] - 1. Growing
appends a chunk and giving back removes the last one, so a block keeps its chunk and its offset in the chunk
for as long as it exists: growth never moves a held block. The first chunk holds `first_chunk_blocks`; each
next one as many blocks as the pool already has (the pool doubles), at most `max_chunk_blocks`; the last is
clipped to the budget, `max_blocks`. Pure arithmetic: the tensors live in the cache (paged.py).
"""

from __future__ import annotations

from dataclasses import dataclass

FIRST_CHUNK_TOKENS = 64  # a short chat fits; its chunks stay within 2x of what it uses (and one made ahead)
MAX_CHUNK_TOKENS = 4096  # past this a pool grows linearly, one chunk of this size at a time


@dataclass(frozen=True)
class Piece:
    """The tokens of one sequence held in one chunk: the table indices of their blocks (in table order) and
    their slots in the chunk, a slice when those blocks are consecutive ids (read without a copy)."""

    chunk: int
    indices: list[int]
    slots: slice | list[int]

    @property
    def is_slice(self) -> bool:
        return isinstance(self.slots, slice)


class ChunkLayout:
    def __init__(self, block_size: int, max_blocks: int, first_chunk_blocks: int, max_chunk_blocks: int):
        if min(block_size, max_blocks, first_chunk_blocks) < 1 or max_chunk_blocks < first_chunk_blocks:
            raise ValueError(
                f"a chunk layout needs block_size, max_blocks, first_chunk_blocks >= 1 and max_chunk_blocks >= "
                f"first_chunk_blocks; got {block_size}, {max_blocks}, {first_chunk_blocks}, {max_chunk_blocks}"
            )
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.first_chunk_blocks = first_chunk_blocks
        self.max_chunk_blocks = max_chunk_blocks
        self.sizes: list[int] = []
        self.starts: list[int] = []
        self.chunk_of: list[int] = []  # per block id: its chunk

    @property
    def num_blocks(self) -> int:
        return len(self.chunk_of)

    @property
    def num_chunks(self) -> int:
        return len(self.sizes)

    # ---- growth and give-back
    def next_chunk_blocks(self) -> int:
        """Blocks the next chunk would hold; 0 when the pool is at its budget."""
        doubling = max(self.first_chunk_blocks, self.num_blocks)
        return max(0, min(doubling, self.max_chunk_blocks, self.max_blocks - self.num_blocks))

    def add_chunk(self) -> int:
        n = self.next_chunk_blocks()
        if not n:
            raise ValueError(f"the pool is at its budget of {self.max_blocks} blocks")
        self.starts.append(self.num_blocks)
        self.sizes.append(n)
        self.chunk_of += [len(self.sizes) - 1] * n
        return n

    def remove_last_chunk(self) -> int:
        n = self.sizes.pop()
        del self.starts[-1], self.chunk_of[-n:]
        return n

    # ---- where things are
    def locate(self, block: int) -> tuple[int, int]:
        """(chunk, offset of the block in it)."""
        chunk = self.chunk_of[block]
        return chunk, block - self.starts[chunk]

    def pieces(self, table: list[int], length: int) -> list[Piece]:
        """The first `length` tokens of a sequence, one piece per chunk they touch (in order of first use)."""
        n = -(-length // self.block_size)
        by_chunk: dict[int, list[int]] = {}
        for i, block in enumerate(table[:n]):
            by_chunk.setdefault(self.chunk_of[block], []).append(i)
        return [self._piece(chunk, indices, table, length) for chunk, indices in by_chunk.items()]

    def _piece(self, chunk: int, indices: list[int], table: list[int], length: int) -> Piece:
        bs = self.block_size
        offsets = [table[i] - self.starts[chunk] for i in indices]
        tokens = min(len(indices) * bs, length - indices[-1] * bs + (len(indices) - 1) * bs)
        if offsets == list(range(offsets[0], offsets[0] + len(offsets))):
            return Piece(chunk, indices, slice(offsets[0] * bs, offsets[0] * bs + tokens))
        return Piece(chunk, indices, [o * bs + j for o in offsets for j in range(bs)][:tokens])

    def key_positions(self, pieces: list[Piece], length: int) -> list[int] | None:
        """Positions of the tokens in piece order; None when that is already 0..length-1."""
        order = [i for piece in pieces for i in piece.indices]
        if order == list(range(len(order))):
            return None
        bs = self.block_size
        return [p for i in order for p in range(i * bs, min((i + 1) * bs, length))]
