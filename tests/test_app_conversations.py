"""Saved conversations: the file format (old versions still open), the store (one file per conversation, newest
first, search, rename, delete), and the sidebar in the window: create, switch, rename, delete and reopen
conversations with their plots; a new chat starts with empty plots."""

from __future__ import annotations

import json

import pytest
from test_app_support import send

from app import storage
from app.conversation_store import ConversationStore, title_from
from engine.chat import Conversation


def v1_file(path, messages, system="Be brief.") -> None:
    """A conversation file as the first versions of kvscope wrote it (version 1: no figures, no steps)."""
    path.write_text(json.dumps({"format": "kvscope-conversation", "version": 1, "system_prompt": system,
                                "context_start": 0, "messages": [{"role": r, "content": c} for r, c in messages]}))


# --- the file format ---------------------------------------------------------------------------------------------
def test_an_old_version_1_file_still_opens_with_no_figures_steps_or_title(tmp_path):
    v1_file(tmp_path / "old.json", [("user", "Hi"), ("assistant", "Hello!")])

    saved = storage.open_chat(tmp_path / "old.json")

    assert [(m.role, m.content) for m in saved.conversation.messages] == [("user", "Hi"), ("assistant", "Hello!")]
    assert saved.replies == [None, None] and saved.steps == [] and saved.compare is None and saved.title == ""


def test_an_old_version_2_file_still_opens_with_its_reply_figures(tmp_path):
    reply = {"n_prompt_tokens": 20, "n_generated_tokens": 3, "ttft_ms": 12.5, "decode_tok_s": 40.0,
             "finish_reason": "stop", "strategy": "paged", "prefix_hit_tokens": 0}
    (tmp_path / "v2.json").write_text(json.dumps({
        "format": "kvscope-conversation", "version": 2, "system_prompt": None, "context_start": 0,
        "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo", "reply": reply}]}))

    saved = storage.open_chat(tmp_path / "v2.json")

    assert saved.replies[1] == reply and saved.done_event(1).ttft_ms == 12.5


def test_version_3_keeps_title_token_ids_steps_and_compare(tmp_path):
    conv = Conversation(system_prompt="S")
    conv.add("user", "Hi")
    conv.add("assistant", "Yo", (17, 23))
    steps = [("paged", "prefill", 9, 10, 30.0, 3.0, 1024, 512, 400, 0, 0, 0, "float32", "int8")]
    compare = {"num_turns": 1, "runs": [{"config": {"cache": "paged"}, "complete": True, "error": "",
                                         "steps": [[0, "decode", 10, 1, 2.5, 1024, 512, 420, 5]]}]}

    storage.save_conversation(tmp_path / "c.json", conv, [None, None],
                              {"title": "Caches", "steps": [list(r) for r in steps], "compare": compare})
    saved = storage.open_chat(tmp_path / "c.json")

    assert saved.title == "Caches" and saved.steps == steps and saved.compare == compare
    assert saved.conversation.messages[1].token_ids == (17, 23)
    assert json.loads((tmp_path / "c.json").read_text())["version"] == storage.VERSION


@pytest.mark.parametrize("change, reason", [
    (lambda d: d.update(steps=[["paged", "decode", -1, 1, 1.0, 1.0, 1, 1, 1, 0]]), "step log is malformed"),
    (lambda d: d.update(compare={"runs": "x"}), "Compare result is malformed"),
    (lambda d: d.update(title=5), "title must be a string"),
    (lambda d: d["messages"][1].update(token_ids=["a"]), "token_ids"),
    (lambda d: d["messages"][0].update(token_ids=[1]), "token_ids"),
])
def test_a_malformed_version_3_file_is_refused_with_the_reason(tmp_path, change, reason):
    conv = Conversation()
    conv.add("user", "Hi")
    conv.add("assistant", "Yo")
    data = storage.with_replies(conv.to_dict(), [])
    change(data)
    (tmp_path / "bad.json").write_text(json.dumps(data))

    with pytest.raises(storage.StorageError, match=reason):
        storage.open_chat(tmp_path / "bad.json")


# --- the store -------------------------------------------------------------------------------------------------------
def saved_conversation(store: ConversationStore, text: str, reply: str = "ok") -> str:
    conv = Conversation()
    conv.add("user", text)
    conv.add("assistant", reply)
    conversation_id = store.new_id()
    store.save(conversation_id, conv.to_dict(), [None, None])
    return conversation_id


def test_the_store_lists_newest_first_searches_renames_and_deletes(tmp_path):
    store = ConversationStore(tmp_path / "conversations")
    first = saved_conversation(store, "What is a paged KV cache?")
    second = saved_conversation(store, "Tell me about int8 quantization", "Scales per block.")
    import os
    os.utime(store.path(first), (1_000_000_000, 1_000_000_000))  # the first is older

    assert [e.id for e in store.entries()] == [second, first]
    assert [e.title for e in store.entries()] == ["Tell me about int8 quantization", "What is a paged KV cache?"]
    assert [e.id for e in store.entries("PAGED")] == [first]
    assert [e.id for e in store.entries("per block")] == [second]  # the replies' text counts too
    assert [e.id for e in store.entries("int8 scales")] == [second]  # every word, any order
    assert store.entries("nothing like this") == []

    store.rename(first, "  Paging,   explained ")
    assert store.open(first).title == "Paging, explained"
    assert [m.content for m in store.open(first).conversation.messages] == ["What is a paged KV cache?", "ok"]
    store.delete(second)
    assert [e.id for e in store.entries()] == [first]
    assert sorted(p.name for p in store.folder.iterdir()) == [f"{first}.json"]  # no temporary file is left


def test_a_file_that_cannot_be_read_is_listed_with_the_reason_and_not_touched(tmp_path):
    store = ConversationStore(tmp_path)
    (tmp_path / "20250101-000000-abcdef.json").write_text("{ not json")

    (entry,) = store.entries()

    assert "invalid JSON" in entry.error
    assert (tmp_path / "20250101-000000-abcdef.json").read_text() == "{ not json"


@pytest.mark.parametrize("bad", ["", "../x", "a/b", ".hidden"])
def test_ids_never_leave_the_folder(tmp_path, bad):
    with pytest.raises(storage.StorageError):
        ConversationStore(tmp_path).path(bad)


def test_an_empty_title_is_refused(tmp_path):
    store = ConversationStore(tmp_path)
    conversation_id = saved_conversation(store, "Hi")

    with pytest.raises(storage.StorageError, match="needs a title"):
        store.rename(conversation_id, "   ")


def test_titles_come_from_the_first_user_message():
    assert title_from([{"role": "user", "content": "\n  Short one\nsecond line"}]) == "Short one"
    assert title_from([{"role": "user", "content": "x" * 100}]).endswith("…")
    assert title_from([]) == "New chat"


# --- the window ------------------------------------------------------------------------------------------------
def plotted_points(window) -> int:
    window.metrics.refresh()
    return sum(len(item.xData) for item in window.metrics.latency_plot.getPlotItem().listDataItems()
               if item.xData is not None)


def test_a_conversation_is_saved_by_itself_and_listed_in_the_sidebar(qtbot, window):
    send(qtbot, window, "What is a KV cache?")

    conversations = window.conversations
    (entry,) = conversations.store.entries()
    assert conversations.widget.ids() == [entry.id] == [conversations.current]
    assert entry.title == "What is a KV cache?" and entry.num_messages == 2
    saved = conversations.store.open(entry.id)
    assert [m.content for m in saved.conversation.messages] == [c for _, c in window.chat.message_texts()]
    assert saved.steps == window.metrics.log.rows and saved.replies[1]["n_generated_tokens"] == 12
    assert saved.conversation.messages[1].token_ids  # the exact tokens, for Compare


def test_new_chat_starts_with_empty_plots_and_a_new_file(qtbot, window):
    send(qtbot, window, "First chat")
    assert plotted_points(window) > 0

    window.new_chat()
    assert window.metrics.log.rows == [] and plotted_points(window) == 0
    assert window.chat.messages == [] and window.conversations.current is None
    send(qtbot, window, "Second chat")

    assert len(window.conversations.store.entries()) == 2
    assert {s[0] for s in window.metrics.log.rows} == {"paged"}
    assert len(window.metrics.log.rows) == 12  # only this chat's steps: one prefill and eleven decode steps


def test_switching_conversations_restores_chat_plots_footers_and_figures(qtbot, window):
    send(qtbot, window, "About caches")
    first_id, first_rows = window.conversations.current, list(window.metrics.log.rows)
    first_chat, first_footer = window.chat.message_texts(), window.chat.messages[1].footer.text()
    first_curve = window.metrics.curve("paged", "decode")
    window.new_chat()
    send(qtbot, window, "About blocks")
    send(qtbot, window, "And more")
    second_id = window.conversations.current

    assert window.conversations.open(first_id)
    qtbot.waitUntil(lambda: window.snapshot.get("messages") and
                    window.snapshot["messages"][0]["content"] == "About caches", timeout=60_000)

    assert window.chat.message_texts() == first_chat
    assert window.chat.messages[1].footer.text() == first_footer
    assert window.metrics.log.rows == first_rows
    x, y = window.metrics.curve("paged", "decode")
    assert list(x) == list(first_curve[0]) and list(y) == pytest.approx(list(first_curve[1]))
    assert window.metrics.last_done is not None and window.metrics.last_done.n_generated_tokens == 12
    assert [(m["role"], m["content"]) for m in window.snapshot["messages"]] == first_chat  # the worker has it too
    again = send(qtbot, window, "A follow-up")  # and the conversation goes on where it was
    assert again.done[0].n_prompt_tokens > 0
    assert window.conversations.store.open(first_id).conversation.messages[-2].content == "A follow-up"
    assert len(window.conversations.store.open(second_id).conversation.messages) == 4  # the other is untouched


def test_rename_and_delete_from_the_sidebar(qtbot, window):
    send(qtbot, window, "To be renamed")
    conversations = window.conversations
    first = conversations.current
    window.new_chat()
    send(qtbot, window, "To be deleted")
    second = conversations.current

    assert conversations.rename(first, "Renamed chat")
    assert [e.title for e in conversations.store.entries() if e.id == first] == ["Renamed chat"]
    assert "Renamed chat" in conversations.widget.list.item(conversations.widget.ids().index(first)).text()
    assert conversations.delete(second)  # the open one: the window starts a new chat

    assert conversations.widget.ids() == [first] and conversations.current is None
    assert window.chat.messages == [] and window.metrics.log.rows == []
    conversations.widget.search.setText("renamed")
    assert conversations.widget.ids() == [first]
    conversations.widget.search.setText("deleted")
    assert conversations.widget.ids() == []


def test_a_reopened_window_lists_and_opens_what_the_last_one_saved(qtbot, tmp_path, tiny_engine_factory):
    from test_app_support import dispose, make_settings, open_window

    settings = make_settings(tmp_path)
    window = open_window(qtbot, settings, tiny_engine_factory())
    send(qtbot, window, "Remember me")
    saved_id, rows = window.conversations.current, list(window.metrics.log.rows)
    dispose(window)

    window = open_window(qtbot, settings, tiny_engine_factory())
    try:
        assert window.conversations.widget.ids() == [saved_id]
        assert window.metrics.log.rows == []  # a new window starts with a new chat
        assert window.conversations.open(saved_id)
        assert window.chat.message_texts()[0] == ("user", "Remember me")
        assert window.metrics.log.rows == rows and plotted_points(window) > 0
    finally:
        dispose(window)


def test_another_conversation_cannot_be_opened_while_a_reply_streams(qtbot, window):
    send(qtbot, window, "One")
    first = window.conversations.current
    window.new_chat()
    window.generating = True  # as while a reply streams
    try:
        assert not window.conversations.open(first)
    finally:
        window.generating = False
    assert window.conversations.current is None


def test_file_open_of_an_old_file_starts_empty_plots_and_joins_the_list(qtbot, window, tmp_path):
    send(qtbot, window, "Before the file")
    v1_file(tmp_path / "old.json", [("user", "From an old file"), ("assistant", "An old reply")])

    assert window.actions_.open_file(str(tmp_path / "old.json"))
    qtbot.waitUntil(lambda: len(window.conversations.store.entries()) == 2, timeout=60_000)

    assert window.metrics.log.rows == [] and plotted_points(window) == 0
    assert window.chat.message_texts() == [("user", "From an old file"), ("assistant", "An old reply")]
    assert window.conversations.store.entries()[0].title == "From an old file"
