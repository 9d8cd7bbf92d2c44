"""Faults, repeated: closing the window in the middle of a prefill, of a decode step and of a model load (50 times
each), a fault raised inside the model's forward at several points of a turn (every strategy), and the process
killed between writing a conversation file and renaming it into place. Each leaves nothing behind and changes
nothing it should not. On the tiny random model; every wait is an event-driven hang guard, never a timing bound."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest
from PySide6.QtCore import Qt
from test_app_support import CloseGate, dispose, make_settings, open_window

from app.storage import open_conversation, save_conversation
from engine.config import CACHE_STRATEGIES, SamplingParams
from engine.events import DoneEvent
from engine.kv.base import BLOCK_OWN

ROOT = Path(__file__).resolve().parents[1]
CLOSES = 50  # per phase
FAULT_AT = (1, 2, 5)  # the forward that raises: the prefill, the first decode step, a later decode step
KILLS = 3
SYSTEM = "You are a helpful assistant."
HOLD_TIMEOUT_MS = 60_000  # a hang guard


class InjectedFault(RuntimeError):
    """Raised inside the model's forward by the test."""


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=n, stop_token_ids=(10**9,))


def reply(engine, conv, text: str, n: int = 6) -> DoneEvent:
    return [e for e in engine.generate(conv, text, greedy(n)) if isinstance(e, DoneEvent)][0]


def os_threads() -> int:
    return psutil.Process().num_threads()


# ---- closing the window mid-prefill, mid-decode, mid-load ------------------------------------------------------
def hold_in_forward(engine, gate: CloseGate, phase: str):
    """Hold the worker inside the turn's first forward (its prefill, whatever the prefix cache already held), or
    inside its fourth (the third decode step)."""
    forwards = []
    hold_at = 1 if phase == "prefill" else 4

    def hook(_module, _args):
        forwards.append(1)
        if len(forwards) == hold_at:
            gate.hold()

    return engine.model.register_forward_pre_hook(hook).remove


def hold_in_load(window, gate: CloseGate):
    """Hold the worker inside the model load, at its first progress report (a direct call on the worker thread)."""
    threads = []

    def on_progress(_message, _fraction):
        threads.append(threading.get_ident())
        gate.hold()

    window.client.signals.progress.connect(on_progress, Qt.ConnectionType.DirectConnection)
    return lambda: threads


def close_once(qtbot, window, phase: str, engine, model_folder) -> tuple[int, int]:
    """Start the phase, close the window while the worker is held inside it; (closed inside, blocks in use after)."""
    gate = CloseGate(window)
    if phase == "load":
        progress_threads = hold_in_load(window, gate)
        window.load_model(str(model_folder))
    else:
        remove = hold_in_forward(engine, gate, phase)
        window.send("Tell me about the KV cache, at length please.")
    try:
        qtbot.waitUntil(gate.reached.is_set, timeout=HOLD_TIMEOUT_MS)
        window.close()
        assert not window.client.thread.isRunning()
    finally:
        if phase != "load":
            remove()
    if phase == "load":
        assert threading.get_ident() not in progress_threads()  # it was held on the worker thread
    worker_engine = window.client.worker.engine
    used = engine.kv_stats().num_blocks_used + worker_engine.kv_stats().num_blocks_used
    return gate.closed_inside, used


@pytest.mark.parametrize("phase", ["prefill", "decode", "load"])
def test_closing_the_window_50_times_mid_phase_leaves_no_thread_and_no_block(qtbot, qtlog, tmp_path, phase,
                                                                           tiny_engine_factory,
                                                                           small_vocab_model_folder):
    engine = tiny_engine_factory("paged", 16)
    threads = None
    closed_inside = 0
    for i in range(CLOSES):
        window = open_window(qtbot, make_settings(tmp_path / str(i)), engine, max_new_tokens=64, show=False)
        try:
            closed, used = close_once(qtbot, window, phase, engine, small_vocab_model_folder)
        finally:
            dispose(window)
        closed_inside += closed
        assert used == 0, f"close {i}: {used} blocks still in use"
        threads = threads or os_threads()  # after the first close: the app's own threads have started
        assert os_threads() <= threads, f"close {i}: a thread was left running"  # idle helper threads may end
    assert closed_inside == CLOSES  # every close landed while the worker was held inside the phase
    assert not [r for r in qtlog.records if "QThread" in r.message]


# ---- a fault inside a step ---------------------------------------------------------------------------------------
def fail_at_forward(model, n: int):
    calls = []

    def hook(_module, _args):
        calls.append(1)
        if len(calls) == n:
            raise InjectedFault(f"injected into forward {n}")

    return model.register_forward_pre_hook(hook).remove


def pool_state(engine, conv) -> dict:
    """What the sequence holds and where, and the blocks in use (a pool that grew a chunk for the failed step
    keeps it, free, until a sequence is released: its capacity is not compared)."""
    s = engine.kv_stats(conv)
    return {"tokens_held": engine.cache.tokens_held(conv.seq_id), "used": s.num_blocks_used,
            "bytes_used": s.bytes_used, "own": [i for i, b in enumerate(s.block_states) if b == BLOCK_OWN]}


def conversation_state(conv) -> tuple:
    system, messages, start = conv.snapshot()
    return system, [(m.role, m.content, m.token_ids) for m in messages], start, conv.seq_id


@pytest.mark.parametrize("cache", CACHE_STRATEGIES)
def test_a_fault_inside_a_step_leaves_the_conversation_and_the_pool_as_they_were(tiny_engine_factory, cache):
    """At the prefill, the first decode step or a later one: the conversation is exactly as before, the sequence
    holds exactly what it held in exactly the same blocks, no block is leaked (blocks the failed turn filled whole
    stay in the prefix cache, free to evict); and the next turn is token for token what an engine that never
    failed answers."""
    engine, twin = tiny_engine_factory(cache, 16), tiny_engine_factory(cache, 16)
    conv, twin_conv = engine.new_conversation(SYSTEM), twin.new_conversation(SYSTEM)
    for text in ("Hi there", "Tell me more about caches"):
        assert reply(engine, conv, text).text == reply(twin, twin_conv, text).text
    for n in FAULT_AT:
        before, pool_before = conversation_state(conv), pool_state(engine, conv)
        cached_before = engine.kv_stats().num_blocks_cached
        remove = fail_at_forward(engine.model, n)
        try:
            with pytest.raises(InjectedFault):
                reply(engine, conv, "And what about paging?", n=8)
        finally:
            remove()
        assert conversation_state(conv) == before, f"fault at forward {n}"
        assert pool_state(engine, conv) == pool_before, f"fault at forward {n}"
        if n == 1:  # nothing was committed: not even the prefix cache changed
            assert engine.kv_stats().num_blocks_cached == cached_before
    for text in ("And what about paging?", "Thanks"):
        assert reply(engine, conv, text, n=8).text == reply(twin, twin_conv, text, n=8).text
    assert conversation_state(conv)[1] == conversation_state(twin_conv)[1]


# ---- killed while saving -------------------------------------------------------------------------------------------
SAVE_AND_BLOCK = """
import os, sys, threading
from app import storage

def replace_after_the_parent_kills_me(src, dst):
    print(src, flush=True)  # written and fsynced, not yet renamed: the parent kills this process now
    threading.Event().wait()

os.replace = replace_after_the_parent_kills_me
storage.save_conversation(sys.argv[1], {"format": "kvscope-conversation", "version": 1, "system_prompt": None,
                                        "context_start": 0, "messages": [{"role": "user", "content": sys.argv[2]}]})
"""


def test_a_process_killed_between_writing_and_renaming_leaves_the_previous_file_intact(tmp_path):
    path = tmp_path / "chat.json"
    for i in range(KILLS):
        previous = {"format": "kvscope-conversation", "version": 1, "system_prompt": "be brief",
                    "context_start": 0, "messages": [{"role": "user", "content": f"previous {i}"},
                                                     {"role": "assistant", "content": "kept"}]}
        save_conversation(path, previous)
        saved = path.read_bytes()
        child = subprocess.Popen([sys.executable, "-c", SAVE_AND_BLOCK, str(path), f"new {i} " * 1000],
                                 cwd=ROOT, stdout=subprocess.PIPE, text=True)
        try:
            temp = Path(child.stdout.readline().strip())
            assert json.loads(temp.read_text())["messages"][0]["content"].startswith(f"new {i}")  # all written
        finally:
            os.kill(child.pid, signal.SIGKILL)
            assert child.wait(timeout=60) == -signal.SIGKILL
            child.stdout.close()

        assert path.read_bytes() == saved
        assert open_conversation(path).to_dict() == previous
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".tmp")) == ["chat.json"]
