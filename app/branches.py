"""Branches of a conversation: editing a user message keeps what the edit replaced (no Qt, no tensors here).

A fork sits at the index of a user message that was edited. Its alternatives are the continuations from that
message on: the message itself, the turns after it, their step-log rows and block-map snapshots, and the forks
inside them. One alternative is shown: its messages are the conversation's, and its slot holds None; the others
are kept as Tails. Switching puts the shown continuation into its slot and takes the chosen one out.

    messages  0 user "Hi"   1 assistant   2 user "What is a KV cache?"   3 assistant ...
    forks     {2: Fork([Tail(2 user "What is paged attention?", 3 assistant, ...), None])}   -> "‹ 2/2 ›" on 2

Invariants: a fork has at least two alternatives and exactly one None; a tail starts with a user message; the
forks inside a tail sit after its first message, at indexes of its user messages (indexes count from the
conversation's first message, as the shown path's do).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Tail:
    """A continuation that is not shown: message records (app.storage's form: role, content, and for replies
    token_ids, reply, footer), the step-log rows of its turns, where each of its turns begins in those rows (one
    entry per user message; None: not known), the block-map snapshots taken after its rows (row index ->
    app.pool_snapshot record) and the forks inside it."""

    messages: list[dict]
    steps: list[tuple] = field(default_factory=list)
    turn_steps: list[int | None] = field(default_factory=list)
    pools: dict[int, dict] = field(default_factory=dict)
    forks: dict[int, Fork] = field(default_factory=dict)

    @property
    def num_turns(self) -> int:
        return sum(1 for m in self.messages if m.get("role") == "user")


@dataclass
class Fork:
    alternatives: list[Tail | None]

    @property
    def shown(self) -> int:
        return self.alternatives.index(None)

    def __len__(self) -> int:
        return len(self.alternatives)


class Branches:
    """The forks of the conversation shown, by the index of their user message."""

    def __init__(self, forks: dict[int, Fork] | None = None):
        self.forks: dict[int, Fork] = dict(forks or {})

    def position(self, index: int) -> tuple[int, int] | None:
        """(shown, count) of the fork at this message, both counted from 1; None: the message has no fork."""
        fork = self.forks.get(index)
        return None if fork is None else (fork.shown + 1, len(fork))

    def keep(self, index: int, shown: Tail) -> int:
        """An edit of message `index`: the continuation shown until now is kept, and the edit's new one (about to
        be generated) is shown, as the fork's last alternative. Returns the kept one's place (for drop_new)."""
        fork = self.forks.get(index) or Fork([None])
        kept = fork.shown
        shown.forks = self._take_after(index)
        fork.alternatives[kept] = shown
        fork.alternatives.append(None)
        self.forks[index] = fork
        return kept

    def drop_new(self, index: int, kept: int) -> Tail:
        """The edit of message `index` failed: its new alternative goes, and the continuation it replaced (at
        `kept`) is shown again: returned, with its forks back among the conversation's."""
        fork = self.forks[index]
        fork.alternatives.pop()
        chosen = self._take(fork, kept)
        if len(fork) == 1:
            del self.forks[index]
        return chosen

    def switch(self, index: int, to: int, shown: Tail) -> Tail:
        """Show alternative `to` (from 0) of the fork at `index`: `shown` (the continuation shown until now) goes
        into its slot; returns the chosen tail, whose forks join the conversation's."""
        fork = self.forks.get(index)
        if fork is None or not 0 <= to < len(fork) or fork.alternatives[to] is None:
            raise ValueError(f"message {index} has no other version {to + 1}")
        shown.forks = self._take_after(index)
        fork.alternatives[fork.shown] = shown
        return self._take(fork, to)

    def _take(self, fork: Fork, to: int) -> Tail:
        chosen, fork.alternatives[to] = fork.alternatives[to], None
        self.forks.update(chosen.forks)
        chosen.forks = {}
        return chosen

    def _take_after(self, index: int) -> dict[int, Fork]:
        """The forks after message `index`: they belong to the continuation shown from it."""
        after = {i: fork for i, fork in self.forks.items() if i > index}
        for i in after:
            del self.forks[i]
        return after
