"""Fuzzing the two readers of files a user hands to the app: the conversation loader (app.storage) and the GGUF
header reader (engine.loader.gguf_architecture). Random bytes, truncations, wrong types and huge lengths: each input
either loads or raises the module's own error (StorageError, ModelLoadError) naming the file, never another
exception; and never a hang (a guard of HANG_GUARD_S per input) or a peak allocation beyond ALLOCATION_FACTOR times
the file's size plus 1 MiB (a length field that claims more than the file holds must not be believed)."""

from __future__ import annotations

import json
import signal
import struct
import tracemalloc
from contextlib import contextmanager
from pathlib import Path

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.storage import MAX_FILE_BYTES, StorageError, open_conversation, save_conversation
from engine.loader import ModelLoadError, gguf_architecture

EXAMPLES = 200  # per property; 9 properties: 1,800 inputs a run
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
HANG_GUARD_S = 30
ALLOCATION_FACTOR = 64  # Python objects of parsed JSON take up to ~20x its text; a believed length field, far more
# tracemalloc counts every thread of the worker process (one a small file failed at 1 MiB once, under xdist, and
# never again alone); a believed length of 2**31 and more still allocates far above it
ALLOCATION_FLOOR = 8 * 2**20
ROLES = ("user", "assistant")
HUGE = (2**31, 2**32 - 1, 2**40, 2**62, 2**63 - 1, 2**64 - 1)


class Hang(Exception):
    """The reader ran past the hang guard."""


@contextmanager
def hang_guard(seconds: int = HANG_GUARD_S):
    def expire(_signum, _frame):
        raise Hang(f"no answer within {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def read(reader, path: Path, error: type[Exception]):
    """The reader's answer for the file: a value, or its own error naming the file; nothing else."""
    tracemalloc.start()
    try:
        with hang_guard():
            try:
                return reader(path)
            except error as e:
                assert path.name in str(e), f"the message does not name the file: {e}"
                return e
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        limit = ALLOCATION_FACTOR * path.stat().st_size + ALLOCATION_FLOOR
        assert peak <= limit, f"{peak:,} bytes allocated for a file of {path.stat().st_size:,}"


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


# ---- conversation files --------------------------------------------------------------------------------------------
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12)
CONVERSATIONS = st.builds(
    lambda system, messages, start: {"format": "kvscope-conversation", "version": 1, "system_prompt": system,
                                     "context_start": min(start, len(messages)),
                                     "messages": [{"role": r, "content": c} for r, c in messages]},
    st.none() | st.text(max_size=40), st.lists(st.tuples(st.sampled_from(ROLES), st.text(max_size=60)), max_size=6),
    st.integers(0, 6))
TOP_KEYS = ("format", "version", "system_prompt", "context_start", "messages")
MESSAGE_KEYS = ("role", "content", "reply")


def open_bytes(folder: Path, raw: bytes):
    path = folder / "chat.json"
    path.write_bytes(raw)
    result = read(open_conversation, path, StorageError)
    if not isinstance(result, StorageError):  # what loads can be saved and opened again, unchanged
        again = folder / "again.json"
        save_conversation(again, result)
        assert open_conversation(again).to_dict() == result.to_dict()
    return result


@FUZZ
@given(raw=st.binary(max_size=4096))
def test_random_bytes_open_or_raise_storage_error(folder, raw):
    open_bytes(folder, raw)


@FUZZ
@given(data=CONVERSATIONS, cut=st.integers(0, 10**6))
def test_a_truncated_conversation_opens_whole_or_raises_storage_error(folder, data, cut):
    raw = json.dumps(data, ensure_ascii=False).encode()
    result = open_bytes(folder, raw[:cut])
    if cut >= len(raw):
        assert result.to_dict() == data


@FUZZ
@given(data=CONVERSATIONS, key=st.sampled_from(TOP_KEYS + MESSAGE_KEYS), value=JSON_VALUES, drop=st.booleans())
def test_a_field_of_the_wrong_type_or_missing_opens_or_raises_storage_error(folder, data, key, value, drop):
    target = data if key in TOP_KEYS else (data["messages"][0] if data["messages"] else data)
    if drop:
        target.pop(key, None)
    else:
        target[key] = value
    open_bytes(folder, json.dumps(data).encode())


@FUZZ
@given(kind=st.sampled_from(["nesting", "digits", "long text", "many messages", "exponent"]),
       n=st.integers(1, 300_000))
def test_huge_lengths_and_depths_open_or_raise_storage_error(folder, kind, n):
    body = {"nesting": "[" * n + "]" * n,
            "digits": "1" * n,
            "exponent": f"1e{n}",
            "long text": json.dumps({"format": "kvscope-conversation", "version": 1,
                                     "messages": [{"role": "user", "content": "x" * n}]}),
            "many messages": json.dumps({"format": "kvscope-conversation", "version": 1,
                                         "messages": [{"role": "user", "content": ""}] * (n // 40)})}[kind]
    open_bytes(folder, body.encode())


def test_a_file_over_the_size_limit_is_refused_before_it_is_read(folder):
    path = folder / "huge.json"
    with open(path, "wb") as f:
        f.truncate(MAX_FILE_BYTES + 1)  # sparse: nothing is written
    with pytest.raises(StorageError, match="too large"):
        open_conversation(path)


# ---- GGUF headers --------------------------------------------------------------------------------------------------
def gguf_string(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


def gguf_header(kvs: list[tuple[bytes, int, bytes]], n_tensors: int = 0, version: int = 3) -> bytes:
    """GGUF magic, version, tensor count, key-value count, then each key, its value type and its value bytes."""
    out = b"GGUF" + struct.pack("<IQQ", version, n_tensors, len(kvs))
    for key, value_type, value in kvs:
        out += gguf_string(key) + struct.pack("<I", value_type) + value
    return out


@pytest.fixture(scope="module")
def real_gguf(folder) -> bytes:
    """A small but complete GGUF (header, key-values, one tensor) written by the gguf package."""
    path = folder / "valid.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_array("tokenizer.ggml.tokens", ["a", "b", "c"])
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert gguf_architecture(path) == "llama"
    return path.read_bytes()


def architecture_of(folder: Path, raw: bytes):
    path = folder / "model.gguf"
    path.write_bytes(raw)
    result = read(gguf_architecture, path, ModelLoadError)
    assert isinstance(result, (str, ModelLoadError)), f"returned {type(result).__name__}"
    return result


@FUZZ
@given(tail=st.binary(max_size=2048), version=st.sampled_from([1, 2, 3, 4, 2**32 - 1]))
def test_random_bytes_after_the_magic_give_an_architecture_or_a_model_load_error(folder, tail, version):
    architecture_of(folder, b"GGUF" + struct.pack("<I", version) + tail)


@FUZZ
@given(cut=st.integers(0, 10**5))
def test_a_truncated_gguf_gives_its_architecture_or_a_model_load_error(folder, real_gguf, cut):
    result = architecture_of(folder, real_gguf[:cut])
    assert isinstance(result, ModelLoadError) or result == "llama"


@FUZZ
@given(offset=st.integers(0, 400), value=st.sampled_from(HUGE) | st.integers(0, 2**64 - 1),
       flips=st.lists(st.tuples(st.integers(0, 400), st.integers(0, 255)), max_size=4))
def test_huge_lengths_and_flipped_bytes_in_a_gguf_header_give_a_model_load_error_or_an_answer(
        folder, real_gguf, offset, value, flips):
    raw = bytearray(real_gguf)
    offset = min(offset, len(raw) - 8)
    raw[offset:offset + 8] = struct.pack("<Q", value)  # a count or a length where there was one, or near it
    for at, byte in flips:
        raw[min(at, len(raw) - 1)] = byte
    architecture_of(folder, bytes(raw))


@FUZZ
@given(value_type=st.integers(0, 20), value=st.binary(max_size=64), n_tensors=st.sampled_from((0, 1) + HUGE),
       key=st.sampled_from([b"general.architecture", b"general.name", b""]))
def test_an_architecture_of_the_wrong_type_gives_a_model_load_error_or_a_string(folder, value_type, value,
                                                                               n_tensors, key):
    architecture_of(folder, gguf_header([(key, value_type, value)], n_tensors))


@FUZZ
@given(length=st.sampled_from(HUGE), n_kv=st.sampled_from((1,) + HUGE))
def test_a_string_or_a_count_longer_than_the_file_gives_a_model_load_error(folder, length, n_kv):
    raw = b"GGUF" + struct.pack("<IQQ", 3, 0, n_kv) + gguf_string(b"general.architecture")
    raw += struct.pack("<I", 8) + struct.pack("<Q", length) + b"llama"  # 8: a string, claiming `length` bytes
    assert isinstance(architecture_of(folder, raw), ModelLoadError)
