"""'none': no cache. Every step runs the whole sequence again, the O(n^2) baseline."""

from __future__ import annotations

from engine.kv.attention import KeyMap, attend
from engine.kv.base import KVCache, KVStats, StepView


class RecomputeView(StepView):
    def __init__(self, seq_ids, past, n_new, device):
        super().__init__(seq_ids, past, n_new, device)
        self.keys = KeyMap.one_store_each([max(n_new)] * len(seq_ids), past, n_new, device)

    def attend(self, layer, q, k, v, spec=None):
        # q: [B, Hq, T, D]; k, v: [B, Hkv, T, D] hold the whole sequence: each sequence's own store
        return attend(q, list(k.unbind(0)), list(v.unbind(0)), self.keys, spec)


class RecomputeCache(KVCache):
    name = "none"
    keeps_kv = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.context_tokens: dict[int, int] = {}

    def prepare(self, seq_id, token_ids):
        self.context_tokens[seq_id] = 0
        return 0

    def begin_step(self, seq_ids, new_tokens):
        n_new = [len(t) for t in new_tokens]
        return RecomputeView(seq_ids, [0] * len(seq_ids), n_new, self.device)

    def commit_step(self, view):
        for seq_id, n in zip(view.seq_ids, view.n_new):
            self.context_tokens[seq_id] = n

    def truncate(self, seq_id, keep):
        """Nothing is held: only the context the figures report shrinks; the next step recomputes its input."""
        context = self.context_tokens.get(seq_id, 0)
        if not 0 <= keep <= context:
            raise ValueError(f"cannot keep {keep} tokens of sequence {seq_id}: its context is {context}")
        self.context_tokens[seq_id] = keep

    def release(self, seq_id):
        self.context_tokens.pop(seq_id, None)

    def tokens_held(self, seq_id):
        return 0

    def stats(self, seq_id=None):
        context = self.context_tokens.get(seq_id, 0)
        return KVStats(self.name, tokens=context, bytes_allocated=0, bytes_used=0,
                       bytes_theoretical=self.theoretical_bytes_of(self.context_tokens.values()),
                       bytes_per_element=self.bytes_per_element, precision=self.precision)
