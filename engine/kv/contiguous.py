"""'contiguous': per sequence, one K and one V buffer reserved up to the context limit when it starts.

With prefix reuse (the default, as llama.cpp keeps one contiguous cache per slot) a new turn keeps the longest
common prefix of what the buffer holds and the new prompt, and cuts the rest; without it every turn starts a
new reservation and prefills the whole history again.

A model's sliding-window layers are not in the reservation: each sequence keeps their window in a ring
(engine/kv/window.py), and a reservation holds the global layers only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.kv.attention import KeyMap, attend, write
from engine.kv.base import KVCache, KVCacheFull, KVStats, StepView
from engine.kv.paged import common_prefix_length


@dataclass
class Reservation:
    k: torch.Tensor  # [L, Hkv, capacity, D]
    v: torch.Tensor  # [L, Hkv, capacity, D]
    length: int = 0
    tokens: list[int] = field(default_factory=list)  # the ids whose keys and values are held

    def __post_init__(self):
        self.k_layers, self.v_layers = self.k.unbind(0), self.v.unbind(0)  # per layer [Hkv, capacity, D] views

    @property
    def capacity(self) -> int:
        return self.k.shape[2]


class ContiguousView(StepView):
    def __init__(self, cache: ContiguousCache, seq_ids, past, n_new):
        super().__init__(seq_ids, past, n_new, cache.device)
        self.buffers = [cache.reservations[s] for s in seq_ids]
        self.keys = KeyMap.one_store_each([buf.capacity for buf in self.buffers], past, n_new, cache.device)
        self.cache = cache
        self.window = cache.windows.step(seq_ids, past, n_new) if cache.windows else None

    def attend(self, layer, q, k, v, spec=None):
        if (at := self.store_layer(layer)) is None:
            return self.window.attend(layer, q, k, v, spec)
        keys, values = self.layer_stores(at)
        write(keys, values, k, v, self.keys)
        return attend(q, keys, values, self.keys, spec)

    def layer_stores(self, at: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The keys and the values of the cache's layer `at`: [Hkv, capacity, D] per sequence of the step."""
        return [b.k_layers[at] for b in self.buffers], [b.v_layers[at] for b in self.buffers]

    def fused_kv(self, layer):
        if (at := self.store_layer(layer)) is None:
            return None
        return self.keys.fused_kv(*self.layer_stores(at))


class ContiguousCache(KVCache):
    """The article's naive KV cache: memory reserved up front, whatever the sequence ends up using.

    prefix_reuse: a new turn keeps the common prefix in the same reservation (True), or starts a new
    reservation and prefills the whole history again (False).
    """

    name = "contiguous"
    prefix_reuse = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.reservations: dict[int, Reservation] = {}

    def prepare(self, seq_id, token_ids, reserve_tokens: int | None = None):
        capacity = min(reserve_tokens or self.max_context, self.max_context)
        if len(token_ids) > capacity:
            raise KVCacheFull(f"{len(token_ids)} tokens do not fit a reservation of {capacity}")
        held = self.reservations.get(seq_id)
        if self.prefix_reuse and held is not None and held.capacity >= len(token_ids):
            keep = self.reusable(seq_id, held.tokens, token_ids)
            self.truncate(seq_id, keep)  # at least one token is left to compute: its logits start the reply
            return keep
        self.release(seq_id)
        c = self.store_config
        shape = (c.num_layers, c.num_kv_heads, capacity, c.head_dim)
        self.reservations[seq_id] = Reservation(
            torch.empty(shape, dtype=self.dtype, device=self.device),
            torch.empty(shape, dtype=self.dtype, device=self.device),
        )
        self._start_window(seq_id)
        return 0

    def reusable(self, seq_id: int, held: list[int], token_ids: list[int]) -> int:
        """The held prefix a new prompt may keep: the common prefix, leaving at least one token to compute, as
        long as the sliding layers still hold its window (else none: the prompt is computed again)."""
        keep = min(common_prefix_length(held, token_ids), len(token_ids) - 1)
        return keep if self.window_holds(seq_id, keep) else 0

    def _start_window(self, seq_id: int) -> None:
        if self.windows:
            self.windows.start(seq_id)

    def begin_step(self, seq_ids, new_tokens):
        past = [self.reservations[s].length for s in seq_ids]
        n_new = [len(t) for t in new_tokens]
        for s, p, n in zip(seq_ids, past, n_new):
            if p + n > self.reservations[s].capacity:
                raise KVCacheFull(f"sequence {s} reserved {self.reservations[s].capacity} tokens, needs {p + n}")
        view = self._make_view(seq_ids, past, n_new)
        view.new_tokens = new_tokens
        return view

    def _make_view(self, seq_ids, past, n_new) -> StepView:
        return ContiguousView(self, seq_ids, past, n_new)

    def commit_step(self, view):
        for buf, end, tokens in zip(view.buffers, view.kv_len, view.new_tokens):
            buf.length = end
            buf.tokens += tokens

    def truncate(self, seq_id, keep):
        self.check_truncate(seq_id, keep)
        if seq_id in self.reservations:
            self.reservations[seq_id].length = keep
            del self.reservations[seq_id].tokens[keep:]
            if self.windows:
                self.windows.truncate(seq_id, keep)

    def fork(self, src: int, dst: int) -> None:
        """dst starts holding what src holds: one buffer per sequence cannot share, so the bytes are copied
        (a branch of a conversation, or a new conversation from a shared system prompt)."""
        buf, n = self.reservations[src], self.reservations[src].length
        self.release(dst)
        copy = Reservation(torch.empty_like(buf.k), torch.empty_like(buf.v), n, list(buf.tokens))
        copy.k[:, :, :n] = buf.k[:, :, :n]  # [L, Hkv, n, D]
        copy.v[:, :, :n] = buf.v[:, :, :n]
        self.reservations[dst] = copy
        if self.windows:
            self.windows.fork(src, dst)

    def release(self, seq_id):
        self.reservations.pop(seq_id, None)
        if self.windows:
            self.windows.release(seq_id)

    def tokens_held(self, seq_id):
        buf = self.reservations.get(seq_id)
        return buf.length if buf else 0

    def stats(self, seq_id=None):
        """allocated: the reservations and the sliding layers' rings; used: the formula for the live tokens (a
        reservation's live tokens, a ring's live window)."""
        reserved = sum(r.k.nbytes + r.v.nbytes for r in self.reservations.values()) + self.window_bytes()
        formula = self.theoretical_bytes_of(r.length for r in self.reservations.values())
        return KVStats(self.name, tokens=self.tokens_held(seq_id), bytes_allocated=reserved,
                       bytes_used=formula, bytes_theoretical=formula,
                       bytes_per_element=self.bytes_per_element, precision=self.precision)
