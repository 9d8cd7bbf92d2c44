"""Edits keep branches: editing a user message keeps the version it replaces (its replies, footers and points in
the plots), the message shows "‹ 1/2 ›", switching shows the other version as opening a conversation does, and the
versions are saved in the conversation file (version 4; older versions still open)."""

from __future__ import annotations

import json

import pytest
from PySide6.QtCore import Qt
from test_app_support import Catch, run_turn, send, worker_messages

from app import storage
from app.branches import Branches, Tail
from app.conversation_store import ConversationStore
from engine.chat import Conversation, Message, prompt_ids


def tail(*texts: str) -> Tail:
    """A kept version: a user message, then alternately replies and user messages."""
    return Tail([{"role": ("user", "assistant")[i % 2], "content": text} for i, text in enumerate(texts)])


# --- the model ---------------------------------------------------------------------------------------------------
def test_an_edit_keeps_the_version_it_replaces_and_shows_the_new_one_last():
    branches = Branches()

    kept = branches.keep(2, tail("Old question", "Old answer"))

    assert kept == 0 and branches.position(2) == (2, 2) and branches.position(0) is None
    chosen = branches.switch(2, 0, tail("New question", "New answer"))
    assert chosen.messages[0]["content"] == "Old question" and branches.position(2) == (1, 2)
    assert branches.switch(2, 1, chosen).messages[0]["content"] == "New question"


def test_a_second_edit_of_the_same_message_adds_a_third_version():
    branches = Branches()
    branches.keep(0, tail("One"))
    branches.switch(0, 0, tail("Two"))  # back to the first

    branches.keep(0, tail("One, shown again"))

    assert branches.position(0) == (3, 3)
    assert [t.messages[0]["content"] for t in branches.forks[0].alternatives[:2]] == ["One, shown again", "Two"]


def test_the_forks_after_an_edited_message_go_with_its_version_and_come_back_with_it():
    branches = Branches()
    branches.keep(0, tail("First", "a", "Second", "b"))  # version 2 of message 0 is shown
    branches.keep(2, tail("Second of version 2", "c"))  # then message 2 of version 2 is edited
    assert set(branches.forks) == {0, 2}

    first = branches.switch(0, 0, tail("First v2", "a2", "Second v2b", "d"))

    assert set(branches.forks) == {0}  # message 2's versions belong to version 2 of message 0
    assert first.messages[0]["content"] == "First"
    second = branches.switch(0, 1, first)
    assert set(branches.forks) == {0, 2} and branches.position(2) == (2, 2)
    assert second.messages[2]["content"] == "Second v2b"


def test_a_failed_edit_shows_the_version_it_replaced_again_and_leaves_no_fork():
    branches = Branches()
    kept = branches.keep(4, tail("Old", "reply"))

    back = branches.drop_new(4, kept)

    assert back.messages[0]["content"] == "Old" and branches.forks == {}


def test_switching_to_a_version_that_does_not_exist_is_refused():
    branches = Branches()
    branches.keep(0, tail("Old"))

    with pytest.raises(ValueError, match="no other version 3"):
        branches.switch(0, 2, tail("New"))
    with pytest.raises(ValueError, match="no other version"):
        branches.switch(5, 0, tail("New"))


# --- the file ----------------------------------------------------------------------------------------------------
ROW = ("paged", "prefill", 9, 10, 30.0, 3.0, 1024, 512, 400, 0, 0, 0, "float32", "int8")
POOL = {"strategy": "paged", "block_size": 16, "tokens": 10, "budget": 8, "precision": "float32", "states": "1:1 3:2"}


def two_turns() -> Conversation:
    conv = Conversation(system_prompt="S")
    for text, reply in (("Hi", "Yo"), ("New question", "New answer")):
        conv.add("user", text)
        conv.add("assistant", reply, (7, 8))
    return conv


def test_versions_turn_starts_and_block_map_states_are_saved_and_read_back(tmp_path):
    branches = Branches()
    old = Tail([{"role": "user", "content": "Old question"},
                {"role": "assistant", "content": "Old answer", "token_ids": [5, 6], "footer": "2 tokens · paged"}],
               [ROW, ROW], [0], {1: POOL})
    branches.keep(2, old)

    storage.save_conversation(tmp_path / "c.json", two_turns(), [None] * 4,
                              {"steps": [list(ROW)] * 3, "turn_steps": [0, 2], "pools": {2: POOL},
                               "forks": branches.forks})
    saved = storage.open_chat(tmp_path / "c.json")

    assert json.loads((tmp_path / "c.json").read_text())["version"] == storage.VERSION == 4
    assert saved.turn_steps == [0, 2] and saved.pools == {2: POOL}
    (kept, shown) = saved.forks[2].alternatives
    assert shown is None
    assert [m["content"] for m in kept.messages] == ["Old question", "Old answer"]
    assert kept.messages[1]["token_ids"] == [5, 6] and kept.messages[1]["footer"] == "2 tokens · paged"
    assert kept.steps == [ROW, ROW] and kept.turn_steps == [0] and kept.pools == {1: POOL}


def test_a_version_3_file_still_opens_with_its_turn_starts_read_from_its_prefills(tmp_path):
    decode = ROW[:1] + ("decode",) + ROW[2:]
    data = storage.with_replies(storage.conversation_dict(two_turns()), [])
    data.update(version=3, steps=[list(ROW), list(decode), list(ROW), list(ROW), list(decode)])
    (tmp_path / "v3.json").write_text(json.dumps(data))

    saved = storage.open_chat(tmp_path / "v3.json")

    assert saved.turn_steps == [0, 2] and saved.forks == {} and saved.pools == {}


def saved_with(change) -> dict:
    data = storage.with_replies(storage.conversation_dict(two_turns()), [])
    data.update(steps=[list(ROW)], branches=[{"at": 2, "alternatives": [
        {"messages": [{"role": "user", "content": "Old"}, {"role": "assistant", "content": "Yes"}]}, None]}])
    change(data)
    return data


@pytest.mark.parametrize("change, reason", [
    (lambda d: d["branches"][0].update(at=1), "not at a user message"),
    (lambda d: d["branches"][0].update(at=9), "not at a user message"),
    (lambda d: d["branches"][0].update(at=True), "not at a user message"),
    (lambda d: d["branches"][0]["alternatives"].append(None), "one of them null"),
    (lambda d: d["branches"][0].update(alternatives=[None]), "two or more alternatives"),
    (lambda d: d["branches"][0]["alternatives"][0]["messages"].reverse(), "begin with the user's message"),
    (lambda d: d["branches"][0]["alternatives"][0].update(colour="red"), "must be an object with its messages"),
    (lambda d: d["branches"][0]["alternatives"][0]["messages"][1].update(reply={"x": 1}), "reply figures"),
    (lambda d: d.update(branches={"at": 2}), "branches must be a list"),
    (lambda d: d.update(turn_steps=[0]), "turn_steps"),
    (lambda d: d.update(turn_steps=[1, 0]), "turn_steps"),
    (lambda d: d.update(turn_steps=[0, None]), "turn_steps"),
    (lambda d: d.update(pools=[{**POOL, "step": 5}]), "block-map snapshot must name the step"),
    (lambda d: d.update(pools=[{**POOL, "step": 0, "states": "9:1"}]), "block-state run"),
    (lambda d: d.update(pools=[{**POOL, "step": 0, "tokens": -1}]), "tokens"),
])
def test_a_malformed_version_4_file_is_refused_with_the_reason(tmp_path, change, reason):
    (tmp_path / "bad.json").write_text(json.dumps(saved_with(change)))

    with pytest.raises(storage.StorageError, match=reason):
        storage.open_chat(tmp_path / "bad.json")


def test_versions_nested_too_deep_are_refused(tmp_path):
    point = None
    for _ in range(storage.MAX_BRANCH_DEPTH + 2):
        inner = {"messages": [{"role": "user", "content": "q"}]}
        if point is not None:  # a fork inside: at the next message, so it needs one more user message
            inner["messages"] += [{"role": "assistant", "content": "a"}, {"role": "user", "content": "q"}]
            inner["branches"] = [point]
        point = {"at": 2, "alternatives": [inner, None]}
    data = saved_with(lambda d: d.update(branches=[point]))
    (tmp_path / "deep.json").write_text(json.dumps(data))

    with pytest.raises(storage.StorageError):
        storage.open_chat(tmp_path / "deep.json")


def test_rename_keeps_the_versions_and_the_block_map_states(tmp_path):
    store = ConversationStore(tmp_path)
    branches = Branches()
    branches.keep(2, tail("Old", "Yes"))
    store.save("c1", storage.conversation_dict(two_turns()), [None] * 4, steps=[ROW], pools={0: POOL},
               forks=branches.forks, turn_steps=[None, 0])

    store.rename("c1", "Renamed")

    saved = store.open("c1")
    assert saved.title == "Renamed" and saved.pools == {0: POOL} and saved.turn_steps == [None, 0]
    assert saved.forks[2].alternatives[0].messages[0]["content"] == "Old"


# --- the window ----------------------------------------------------------------------------------------------------
def shown(window) -> list[tuple[str, str, str]]:
    return [(m.role, m.text, m.footer.text()) for m in window.chat.messages]


def test_editing_a_message_keeps_the_old_version_and_the_switcher_shows_it_again(qtbot, window):
    send(qtbot, window, "First question")
    send(qtbot, window, "Second question")
    before, rows_before = shown(window), list(window.metrics.log.rows)

    run_turn(qtbot, window, lambda: window.edit_and_resend("A better first question", 0))
    after, rows_after = shown(window), list(window.metrics.log.rows)

    first = window.chat.messages[0]
    assert first.branch_text == "2/2" and first.previous_button.isEnabled() and not first.next_button.isEnabled()
    assert len(after) == 2 and after[0][1] == "A better first question"
    assert window.branching.switch(0, 0)
    assert shown(window) == before  # the old replies, with their footers
    assert window.metrics.log.rows == rows_before  # and their points in the plots
    assert window.chat.messages[0].branch_text == "1/2"
    qtbot.waitUntil(lambda: worker_messages(window) == [(r, t) for r, t, _ in before], timeout=60_000)
    qtbot.mouseClick(window.chat.messages[0].next_button, Qt.MouseButton.LeftButton)  # "›"
    assert shown(window) == after and window.metrics.log.rows == rows_after
    assert window.chat.messages[0].branch_text == "2/2"


def common_history(window, old: str, new: str) -> int:
    """The prompt tokens two versions of the first message have in common (the system prompt and template)."""
    engine = window.client.worker.engine
    prompts = [prompt_ids(engine.tokenizer, window.settings.system_prompt, [Message("user", text)])
               for text in (old, new)]
    return next(i for i, (a, b) in enumerate(zip(*prompts)) if a != b)


def test_an_edit_reuses_the_whole_common_history_from_the_old_versions_sequence(qtbot, window):
    send(qtbot, window, "First question")

    edit = run_turn(qtbot, window, lambda: window.edit_and_resend("Another first question", 0)).done[0]

    assert edit.prefix_hit_tokens == common_history(window, "First question", "Another first question")


@pytest.mark.parametrize("cache", ["contiguous", "paged-int8"])
def test_other_caches_keep_the_common_history_on_an_edit_too(qtbot, window, cache):
    with Catch(qtbot, window.client.signals.loaded, timeout=60_000):
        window.set_cache(cache, 16)
    send(qtbot, window, "First question")

    edit = run_turn(qtbot, window, lambda: window.edit_and_resend("Another first question", 0)).done[0]

    assert edit.prefix_hit_tokens == common_history(window, "First question", "Another first question")
    assert window.branching.switch(0, 0)


def test_after_a_switch_back_the_next_turn_finds_the_old_versions_blocks_in_the_prefix_cache(qtbot, window):
    first = send(qtbot, window, "First question").done[0]
    run_turn(qtbot, window, lambda: window.edit_and_resend("Another first question", 0))
    assert window.branching.switch(0, 0)
    qtbot.waitUntil(lambda: worker_messages(window)[0][1] == "First question", timeout=60_000)

    turn = send(qtbot, window, "A follow-up")

    held = first.n_prompt_tokens + first.n_generated_tokens - 1  # the last token generated was never fed
    assert turn.done[0].prefix_hit_tokens == held // 16 * 16  # every full block of the old version, reused
    assert [t for _, t in worker_messages(window)][:3] == ["First question", shown(window)[1][1], "A follow-up"]
    assert window.chat.messages[0].branch_text == "1/2"  # the follow-up belongs to version 1


def test_a_failed_edit_shows_the_version_it_replaced_again(qtbot, window):
    send(qtbot, window, "Keep me")
    before, rows = shown(window), list(window.metrics.log.rows)
    engine = window.client.worker.engine

    def broken(*_args, **_kwargs):
        raise RuntimeError("the engine broke")
        yield  # a generator, as Engine.generate is

    engine.generate = broken
    try:
        run_turn(qtbot, window, lambda: window.edit_and_resend("Lose me", 0), expect_error=True)
    finally:
        del engine.generate

    assert shown(window) == before and window.metrics.log.rows == rows
    assert window.chat.messages[0].branch_text == "" and window.branching.forks == {}
    assert "the engine broke" in window.chat.error_text


def test_versions_are_saved_with_the_conversation_and_switch_after_reopening(qtbot, window):
    send(qtbot, window, "Original")
    original = shown(window)
    run_turn(qtbot, window, lambda: window.edit_and_resend("Edited", 0))
    conversations = window.conversations
    first = conversations.current
    qtbot.waitUntil(lambda: bool(conversations.store.open(first).forks), timeout=60_000)
    window.new_chat()

    assert conversations.open(first)

    assert window.chat.messages[0].branch_text == "2/2" and window.chat.messages[0].text == "Edited"
    done = window.metrics.last_done  # the status bar shows the last reply's context, not an empty one
    assert window.status.text("context").startswith(f"context {done.n_prompt_tokens + done.n_generated_tokens:,} /")
    assert window.branching.switch(0, 0)
    assert shown(window) == original
    qtbot.waitUntil(lambda: conversations.store.open(first).forks[0].shown == 0, timeout=60_000)  # saved again


def test_after_clear_plots_an_edit_keeps_the_points_the_plots_still_have(qtbot, window):
    send(qtbot, window, "Before the clear")
    window.menus.clear_plots.trigger()
    send(qtbot, window, "After the clear")
    rows = list(window.metrics.log.rows)

    run_turn(qtbot, window, lambda: window.edit_and_resend("Edited", 0))
    kept = window.branching.forks[0].alternatives[0]

    assert kept.steps == rows and kept.turn_steps == [None, 0]  # the first turn's points were cleared already
    assert window.branching.switch(0, 0)
    assert window.metrics.log.rows == rows


def test_at_a_full_kv_budget_an_edit_still_answers(qtbot, window):
    from test_app_budget_turns import set_budget
    from test_app_support import greedy

    set_budget(window, qtbot, 6)
    window.sampling_override = greedy(500)
    assert send(qtbot, window, "Tell me everything.").done[0].finish_reason == "budget"  # every block in use

    edit = run_turn(qtbot, window, lambda: window.edit_and_resend("Tell me less.", 0)).done[0]

    assert edit.n_generated_tokens > 0 and not window.chat.error_text
    assert window.chat.messages[0].branch_text == "2/2"
