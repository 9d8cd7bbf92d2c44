"""Fuzzing what version 4 of the conversation file adds (the versions edits kept, each turn's first step, the block
map's states): valid files with random versions inside versions, and the same with one field replaced by any JSON
value or dropped. Each opens or raises StorageError naming the file, never another exception; what opens saves
and opens again unchanged."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app import storage

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                        HealthCheck.function_scoped_fixture])
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 2**40) | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8)
ROW = ["paged", "decode", 9, 1, 3.0, 3.0, 1024, 512, 400, 0, 0, 0, "float32", "int8"]
POOL = {"strategy": "paged", "block_size": 16, "tokens": 10, "budget": 8, "precision": "float32", "states": "1:1 0:2"}


@st.composite
def versions(draw, num_turns: int, depth: int, first: int = 0) -> dict:
    """Messages of num_turns turns (the first one is the conversation's message `first`), their steps, turn starts
    and pools, and maybe versions inside them."""
    messages = []
    for turn in range(num_turns):
        messages += [{"role": "user", "content": draw(st.text(max_size=8))},
                     {"role": "assistant", "content": draw(st.text(max_size=8)), "token_ids": [turn, 5]}]
    steps = [ROW] * draw(st.integers(0, 3))
    record = {"messages": messages, "steps": steps,
              "turn_steps": sorted(draw(st.lists(st.integers(0, len(steps)), min_size=num_turns,
                                                 max_size=num_turns)))}
    if steps and draw(st.booleans()):
        record["pools"] = [{"step": len(steps) - 1, **POOL}]
    if depth and num_turns > 1 and draw(st.booleans()):
        turn = draw(st.integers(1, num_turns - 1))  # a user message after the first
        at = first + 2 * turn
        inner = draw(versions(num_turns - turn, depth - 1, at))
        record["branches"] = [{"at": at, "alternatives": [inner, None]}]
    return record


def a_file(record: dict) -> dict:
    """The record as a whole file."""
    return {"format": "kvscope-conversation", "version": 4, "system_prompt": None, "context_start": 0, **record}


def targets(data: dict) -> list[dict]:
    """Every object of the file a mutation may land in: the file, its branch points, versions, messages, pools."""
    found, stack = [data], [data]
    while stack:
        node = stack.pop()
        for point in node.get("branches", []):
            found.append(point)
            for version in point["alternatives"]:
                if version is not None:
                    found.append(version)
                    stack.append(version)
        found += node.get("messages", []) + node.get("pools", [])
    return found


def open_or_refuse(tmp_path, data: dict):
    path = tmp_path / "chat.json"
    path.write_text(json.dumps(data))
    try:
        saved = storage.open_chat(path)
    except storage.StorageError as e:
        assert path.name in str(e)
        return e
    again = tmp_path / "again.json"  # what opens, saves and opens again unchanged
    storage.save_conversation(again, storage.conversation_dict(saved.conversation), saved.replies,
                              {"footers": saved.footers, "steps": saved.steps, "turn_steps": saved.turn_steps,
                               "pools": saved.pools, "forks": saved.forks})
    reopened = storage.open_chat(again)
    assert (reopened.steps, reopened.turn_steps, reopened.pools, reopened.forks) == (
        saved.steps, saved.turn_steps, saved.pools, saved.forks)
    return saved


@FUZZ
@given(record=st.integers(1, 4).flatmap(lambda n: versions(n, 3)))
def test_a_valid_version_4_file_opens_with_its_versions_and_round_trips(tmp_path, record):
    saved = open_or_refuse(tmp_path, a_file(record))

    assert not isinstance(saved, storage.StorageError), saved
    assert bool(saved.forks) == bool(record.get("branches"))


@FUZZ
@given(record=st.integers(1, 4).flatmap(lambda n: versions(n, 3)), where=st.integers(0, 10**6),
       key=st.sampled_from(["at", "alternatives", "messages", "steps", "turn_steps", "pools", "branches", "step",
                            "states", "budget", "role", "content", "token_ids", "footer", "reply"]),
       value=JSON_VALUES, drop=st.booleans())
def test_any_field_of_the_wrong_type_or_missing_opens_or_is_refused_by_name(tmp_path, record, where, key, value,
                                                                             drop):
    data = a_file(record)
    places = targets(data)
    target = places[where % len(places)]
    if drop:
        target.pop(key, None)
    else:
        target[key] = value

    open_or_refuse(tmp_path, data)
