"""Decode steps as CUDA graphs: one per fixed Shape (engine/kv/fixed.py), captured at its first step and replayed
at every later step of that shape: the article's "fixed shapes, bucketed lengths" against launch overhead. The
CPU's compiled step makes one call a step and needs none.

A step of one new token a sequence over a float cache that has a KeyMap (contiguous, paged; not sliding-window
rings or quantized codes) takes this path; prefill chunks, speculative verify rows and other caches run eagerly.
A graph keeps raw addresses: its Shape names every store's address and size, and weights replaced (another
format) drop every graph. Without capture (a CPU, the tests) the same body runs eagerly on the same buffers,
which is what a replay computes.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from dataclasses import dataclass

import torch

from engine import model as model_module
from engine.kv.base import StepView
from engine.kv.fixed import FixedView, Planner, Shape, float_layer_stores
from engine.weights.linear import row_outside

MAX_GRAPHS = 16  # graphs kept, the least recently used dropped first (they share one memory pool)
WARMUP_RUNS = 2  # eager runs on a side stream before a capture (cuBLAS workspaces, the allocator's blocks)


@dataclass
class Entry:
    view: FixedView  # the body's view over `packed`
    packed: torch.Tensor  # int64 [shape.size] on the device: the step's indices, rewritten before each run
    graph: torch.cuda.CUDAGraph | None = None  # None until captured (always, without capture)
    logits: torch.Tensor | None = None  # the graph's output [R, V], rewritten by each replay


class DecodeGraphs:
    """Decode steps through fixed shapes. capture: record each Shape's step as a CUDA graph and replay it (CUDA);
    otherwise run the same body eagerly (what a replay computes)."""

    def __init__(self, model, capture: bool):
        self.model, self.capture = model, capture
        self.entries: OrderedDict[Shape, Entry] = OrderedDict()
        self.captures = 0  # graphs captured (without capture: shapes built)
        self.generation = model_module.plans_generation()
        self.planner = Planner()
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.refused: str | None = None  # why a capture failed: every step is eager from then on

    def step(self, view: StepView, new_tokens: list[list[int]]) -> torch.Tensor | None:
        """The logits [B, V] of a decode step through its Shape, or None where the step is not one (then the caller
        runs it eagerly)."""
        if self.refused or any(len(t) != 1 for t in new_tokens):
            return None
        stores = float_layer_stores(view, self.model.config.num_layers)
        if stores is None:
            return None
        tokens = [t[0] for t in new_tokens]
        check_ids(tokens, self.model.embed_tokens.table.out_features)
        self.forget_if_weights_changed()
        shape, packed = self.planner.plan(view, tokens, stores)
        entry = self.entry(shape, view.positions.device)
        entry.packed.copy_(torch.from_numpy(packed))
        logits = self.run(entry, stores)
        return None if logits is None else logits[:len(tokens)]

    def entry(self, shape: Shape, device: torch.device) -> Entry:
        entry = self.entries.pop(shape, None)
        if entry is None:
            packed = torch.zeros(shape.size, dtype=torch.int64, device=device)
            entry = Entry(FixedView(shape, packed), packed)
            self.captures += not self.capture
        self.entries[shape] = entry  # the most recently used last
        while len(self.entries) > MAX_GRAPHS:
            self.entries.popitem(last=False)
        return entry

    def run(self, entry: Entry, stores) -> torch.Tensor | None:
        """[R, V] logits, or None where the device refused the capture (then this and every later step is eager:
        the warm-up runs wrote only this step's own keys, which the eager step writes again)."""
        if not self.capture:
            return self.body(entry, stores)
        if entry.graph is None:
            try:
                entry.graph, entry.logits = self.record(entry, stores)
            except RuntimeError as error:
                self.refuse(f"{type(error).__name__}: {error}")
                return None
        entry.graph.replay()
        return entry.logits.clone()

    def refuse(self, reason: str) -> None:
        self.refused = reason
        self.entries.clear()
        print(f"kvscope: decode steps run without CUDA graphs ({reason[:300]})", file=sys.stderr)

    def body(self, entry: Entry, stores) -> torch.Tensor:
        """One step over the entry's buffers: [R, V] logits (the padding rows' are those of token 0 at 0)."""
        entry.view.stores = stores
        try:
            return self.model(entry.view.ids, entry.view)
        finally:
            entry.view.stores = None  # a graph keeps the stores' addresses, never the tensors

    def record(self, entry: Entry, stores) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Capture the body as a graph. The warm-up runs write this step's keys twice more: the same values."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                self.body(entry, stores)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):  # the app's other threads
            logits = self.body(entry, stores)
        self.captures += 1
        return graph, logits

    def forget_if_weights_changed(self) -> None:
        """Weights converted or moved: every graph names the old tensors' addresses."""
        generation = model_module.plans_generation()
        if generation != self.generation:
            self.entries.clear()
            self.generation = generation


def check_ids(tokens: list[int], vocab: int) -> None:
    """The check the embedding makes in an eager step, made on the host (a graph cannot read ids back)."""
    for token in tokens:
        if not 0 <= token < vocab:
            raise row_outside(token, vocab)
