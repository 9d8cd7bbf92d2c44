"""The window's side of app.branches: an edit keeps the version it replaces, and "‹ 1/2 ›" switches between them.

An edit of user message i keeps the continuation shown from i (its messages with their footers, its turns' step
rows and block-map snapshots, and the forks inside it) before the chat continues from the edited message.
Switching to another version puts the shown one aside the same way and shows the chosen one: the chat with its
footers, its points in the plots, its block map as saved; the engine is handed the conversation as when one is
opened (the next turn prefills what the cache does not hold; the paged pool's prefix cache keeps the common
history, and often the old version's blocks too). An edit whose reply fails shows the version it replaced again.
"""

from __future__ import annotations

from app import storage
from app.branches import Branches, Fork, Tail
from engine.chat import Conversation, Message
from engine.events import DoneEvent


def shown_records(window) -> list[dict]:
    """The conversation shown, as storage's message records: token ids (the worker's), reply figures and
    footers (the chat's)."""
    snapshot = window.snapshot or {}
    n = len(snapshot.get("messages", []))
    messages = window.chat.messages[:n]
    replies = [getattr(m, "reply", None) for m in messages]
    footers = [m.footer.text() if m.role == "assistant" else "" for m in messages]
    return storage.with_replies(snapshot, replies, footers)["messages"] if n else []


def turn_steps(window, num_turns: int) -> list[int | None]:
    """Per user message of the conversation shown, the step row its turn began at (None: not known)."""
    starts = window.metrics.turn_starts()[-num_turns:] if num_turns else []
    return [None] * (num_turns - len(starts)) + starts


def add_records(window, records: list[dict]) -> DoneEvent | None:
    """Add these messages to the chat, each reply with its footer as saved; returns the last reply's figures."""
    last = None
    for record in records:
        widget = window.chat.add_message(record["role"], record["content"])
        reply = record.get("reply")
        if reply is not None:
            widget.reply = reply
            last = DoneEvent(record["content"], **reply)
            widget.set_footer(record.get("footer") or window.reply_footer(last))
    return last


class BranchController:
    def __init__(self, window):
        self.window = window
        self.branches = Branches()
        self.revision = 0  # grows with every change: the conversation list saves again
        self._pending: tuple[int, int] | None = None  # (message, version kept) of an edit being answered
        window.chat.branch_requested.connect(self.switch)

    @property
    def forks(self) -> dict[int, Fork]:
        return self.branches.forks

    def reset(self, forks: dict[int, Fork] | None = None) -> None:
        """Another conversation is shown (new, opened): these are its forks."""
        self.branches, self._pending = Branches(forks), None
        self._changed()

    # --- edits ----------------------------------------------------------------------------------------------------
    def edit(self, index: int) -> None:
        """Message `index` is about to be edited and answered: keep the version shown from it."""
        self._pending = (index, self.branches.keep(index, self.live_tail(index)))
        self._changed()

    def turn_ended(self, failed: bool) -> None:
        """A turn is over; a failed edit's new version goes, and the one it replaced is shown again (the worker
        has put its conversation back already; the failed turn's points have left the plots)."""
        pending, self._pending = self._pending, None
        if pending is not None and failed:
            self._show(pending[0], self.branches.drop_new(*pending), dropped_turns=0, tell_worker=False)
        self._changed()

    # --- switching ------------------------------------------------------------------------------------------------
    def switch(self, index: int, to: int) -> bool:
        """Show version `to` (from 0) of message `index`, the version shown until now kept."""
        w = self.window
        if w.generating or w.loading:
            w.status.showMessage("Wait for the reply (or Stop it) before showing another version", 5000)
            return False
        live = self.live_tail(index)
        try:
            chosen = self.branches.switch(index, to, live)
        except ValueError as e:
            w.chat.show_error(str(e))
            return False
        w.chat.clear_error()
        self._show(index, chosen, dropped_turns=live.num_turns, tell_worker=True)
        shown, count = self.branches.position(index)
        w.status.showMessage(f"Version {shown} of {count} of message {index + 1}: the next turn prefills what the "
                             "cache does not hold", 5000)
        return True

    def live_tail(self, index: int) -> Tail:
        """The version shown from message `index`: its records, its turns' step rows and block-map snapshots."""
        w = self.window
        records = shown_records(w)
        before = sum(1 for r in records[:index] if r["role"] == "user")
        starts = turn_steps(w, sum(1 for r in records if r["role"] == "user"))[before:]
        first = next((s for s in starts if s is not None), None)  # older turns' points: not known (plots cleared)
        if first is None:
            return Tail(records[index:], [], starts, {})
        log = w.metrics.log
        pools = {row - first: pool for row, pool in log.pools.items() if row >= first}
        return Tail(records[index:], list(log.rows[first:]), [None if s is None else s - first for s in starts],
                    pools)

    # --- internals ------------------------------------------------------------------------------------------------
    def _show(self, index: int, tail: Tail, dropped_turns: int, tell_worker: bool) -> None:
        """The chat, plots and block map show `tail` from message `index`; the worker is told when asked."""
        w = self.window
        kept = shown_records(w)[:index]
        w.chat.keep_first(index)
        last = add_records(w, tail.messages)
        w.metrics.drop_turns(dropped_turns)
        w.metrics.add_saved(tail.steps, tail.turn_steps, tail.pools)
        w.metrics.last_done = last or next((DoneEvent(r["content"], **r["reply"]) for r in reversed(kept)
                                            if r.get("reply")), None)
        w.metrics.refresh()
        w.show_saved_pools("version")
        w.show_last_reply(w.metrics.last_done)
        if tell_worker:
            conv = Conversation(w.snapshot.get("system_prompt"), [_message(r) for r in kept + tail.messages],
                                min(int(w.snapshot.get("context_start", 0)), index))
            w.snapshot = storage.conversation_dict(conv)  # what the worker holds from now on
            w.client.open_conversation(conv)
        self._changed()

    def _changed(self) -> None:
        self.revision += 1
        forks = self.branches.forks
        self.window.chat.set_branch_positions({i: self.branches.position(i) for i in forks})


def _message(record: dict) -> Message:
    ids = record.get("token_ids")
    return Message(record["role"], record["content"], tuple(ids) if ids else None)
