"""Small helpers shared by the engine tests: greedy parameters, running a turn, driving a cache by hand."""

from __future__ import annotations

import pydoc_data.topics
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.config import SamplingParams
from engine.events import DoneEvent, Event, StepEvent, TrimEvent
from engine.kv.base import KVCache


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run torch on n intra-op threads inside the block."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def one_torch_thread():
    """Run torch on one intra-op thread: on a shared 2-core machine, two spinning OpenMP threads competing
    with other processes make each step several times slower (measured 4-5x), one thread never stalls."""
    return torch_threads(1)


def greedy(max_new_tokens: int) -> SamplingParams:
    """Deterministic decoding with no stop token (-1 is never sampled): exactly max_new_tokens come out."""
    return SamplingParams(temperature=0, repetition_penalty=1.0, max_new_tokens=max_new_tokens,
                          stop_token_ids=(-1,))


@dataclass
class Turn:
    """Everything one call of Engine.generate yielded, sorted by kind."""

    events: list[Event] = field(default_factory=list)

    @property
    def steps(self) -> list[StepEvent]:
        return [e for e in self.events if isinstance(e, StepEvent)]

    @property
    def prefill(self) -> list[StepEvent]:
        return [e for e in self.steps if e.phase == "prefill"]

    @property
    def decode(self) -> list[StepEvent]:
        return [e for e in self.steps if e.phase == "decode"]

    @property
    def trims(self) -> list[TrimEvent]:
        return [e for e in self.events if isinstance(e, TrimEvent)]

    @property
    def done(self) -> DoneEvent:
        (done,) = [e for e in self.events if isinstance(e, DoneEvent)]
        assert self.events[-1] is done, "the DoneEvent comes last"
        return done

    @property
    def tokens(self) -> list[int]:
        """The tokens the steps produced (the last one may be a stop token that ended the reply)."""
        return [e.token_id for e in self.steps if e.token_id is not None]


def run_turn(engine, conv, message: str | None, params: SamplingParams) -> Turn:
    return Turn(list(engine.generate(conv, message, params)))


def forward_through_cache(model, cache: KVCache, ids: list[int], prefill: int, seq_id: int = 1) -> torch.Tensor:
    """Logits [len(ids), V] of every position: the first `prefill` tokens run as one step, then each later
    token runs alone (or, for a cache that keeps nothing, 'none', together with the whole sequence before it).
    """
    cache.prepare(seq_id, ids)
    rows = [_step(model, cache, seq_id, ids[:prefill], all_logits=True)[0]]  # [prefill, V]
    for t in range(prefill, len(ids)):
        feed = ids[t:t + 1] if cache.keeps_kv else ids[:t + 1]
        rows.append(_step(model, cache, seq_id, feed, all_logits=False))  # [1, V]
    return torch.cat(rows)


def _step(model, cache: KVCache, seq_id: int, tokens: list[int], all_logits: bool) -> torch.Tensor:
    view = cache.begin_step([seq_id], [tokens])
    logits = model(torch.tensor([tokens]), view, all_logits=all_logits)
    cache.commit_step(view)
    return logits


def held_storage_bytes(obj: object) -> int:
    """Bytes of every distinct tensor storage reachable from obj's attributes (dicts, lists, dataclasses)."""
    seen: dict[int, int] = {}
    _collect_storages(obj, seen, set())
    return sum(seen.values())


def _collect_storages(obj: object, seen: dict[int, int], visited: set[int]) -> None:
    if id(obj) in visited:
        return
    visited.add(id(obj))
    if isinstance(obj, torch.nn.Module):
        return  # a strategy's storage never includes model weights
    if isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    elif isinstance(obj, dict):
        for value in obj.values():
            _collect_storages(value, seen, visited)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _collect_storages(value, seen, visited)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        for value in vars(obj).values():
            _collect_storages(value, seen, visited)


def english_ids(tokenizer, n: int) -> list[int]:
    """The first n tokens of real English: the Python language reference as pydoc_data ships it."""
    topics = pydoc_data.topics.topics
    text = "\n\n".join(topics[name] for name in sorted(topics))
    ids = tokenizer.encode(text[: 12 * n], add_special_tokens=False)
    assert len(ids) >= n
    return ids[:n]


def log_probs(engine, ids: list[int]) -> torch.Tensor:
    """Teacher-forced log-probabilities [len(ids), V] of each next token, DECODE_ROWS tokens per forward (the
    decode kernels, as a reply's steps and speculative verification run)."""
    from engine.weights.linear import DECODE_ROWS

    seq = 7001
    assert engine.cache.prepare(seq, ids) == 0
    try:
        rows = [engine.step([seq], [ids[i:i + DECODE_ROWS]], all_logits=True)[0]
                for i in range(0, len(ids), DECODE_ROWS)]
    finally:
        engine.cache.release(seq)
    return torch.log_softmax(torch.cat(rows).float(), dim=-1)


def kl_and_top1(reference: torch.Tensor, got: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position: KL(reference || got) in nats, and whether their most likely tokens agree."""
    return (reference.exp() * (reference - got)).sum(-1), reference.argmax(-1) == got.argmax(-1)


def engine_in_format(weights, fmt: str):
    """A paged engine on loaded weights (engine.loader.load_weights) converted to the weight format fmt."""
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.model import LlamaModel
    from engine.weights.convert import to_format

    state = {name: to_format(w, fmt, name) for name, w in weights.state_dict.items()}
    model = LlamaModel.from_hf_state_dict(weights.config, state)
    return Engine(model, weights.tokenizer, EngineConfig(cache="paged"), weights.name)


def memoized_contiguous_replies(engine):
    """get(history, message, n=256) -> (n greedy token ids of a fresh `contiguous` turn on engine, the messages
    after it), each computed once."""
    from engine.chat import Message

    replies: dict[tuple, tuple[list[int], list]] = {}

    def get(history: list, message: str, n: int = 256) -> tuple[list[int], list]:
        key = (tuple((m.role, m.content) for m in history), message, n)
        if key not in replies:
            engine.set_cache("contiguous")
            conv = engine.new_conversation()
            conv.messages = [Message(m.role, m.content) for m in history]
            try:
                replies[key] = run_turn(engine, conv, message, greedy(n)).tokens, conv.messages
            finally:
                engine.forget(conv)
        return replies[key]

    return get


class OpRecorder(TorchDispatchMode):
    """Every op the dispatcher runs: ops, each as its name ("aten.mm", "kvscope.decoder_layer") and its tensor
    arguments' shapes and dtypes; names, the names alone."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tensors = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        self.ops.append((str(func.overloadpacket), tuple((tuple(t.shape), t.dtype) for t in tensors)))
        return func(*args, **(kwargs or {}))

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.ops]
