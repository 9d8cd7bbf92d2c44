"""The window at the KV budget (issue 20 part 5), on the tiny random model: a reply that reaches the budget is
kept with a footer that says why it ended, earlier replies keep their footers, a failed turn leaves the block map
showing only what the conversation holds, and the messages name what the user can do."""

from __future__ import annotations

from test_app_support import HANG_GUARD_MS, greedy, send

from app.main_window import trim_message
from engine.events import TrimEvent
from engine.kv.base import BLOCK_OWN

BLOCKS = 6


def set_budget(window, qtbot, blocks: int) -> None:
    engine = window.client.worker.engine
    mib = blocks * engine.cache.bytes_per_block() / 2**20
    window.set_kv_budget(mib)
    qtbot.waitUntil(lambda: window.client.worker.engine.config.kv_budget_mib == mib, timeout=HANG_GUARD_MS)


def test_a_reply_at_the_budget_is_kept_and_says_why_and_earlier_footers_stay(window, qtbot):
    set_budget(window, qtbot, BLOCKS)
    window.sampling_override = greedy(4)
    send(qtbot, window, "Hi.")
    first_footer = window.chat.messages[-1].footer.text()

    window.sampling_override = greedy(500)
    turn = send(qtbot, window, "Tell me everything.")

    assert turn.done[0].finish_reason == "budget" and not window.chat.error_text
    reply = window.chat.messages[-1]
    assert reply.text == turn.done[0].text != "" and "KV budget reached" in reply.footer.text()
    assert window.chat.messages[1].footer.text() == first_footer
    assert len(window.snapshot["messages"]) == 4


def test_a_failed_turn_keeps_earlier_footers_and_the_block_map_shows_only_what_is_held(window, qtbot):
    set_budget(window, qtbot, 4)
    window.sampling_override = greedy(4)
    send(qtbot, window, "Hi.")
    footer = window.chat.messages[-1].footer.text()
    widgets = list(window.chat.messages)

    turn = send(qtbot, window, "word " * 300, expect_error=True)

    assert "KV budget" in turn.errors[0] and "raise the KV budget" in turn.errors[0]
    qtbot.waitUntil(lambda: len(window.chat.messages) == 2, timeout=HANG_GUARD_MS)
    assert window.chat.messages == widgets and window.chat.messages[1].footer.text() == footer
    assert window.chat.input.toPlainText() == "word " * 300  # the text is given back to send again
    engine = window.client.worker.engine
    held = engine.cache.tokens_held(window.client.worker.conv.seq_id)
    assert held > 0  # the first turn's history, kept
    qtbot.waitUntil(lambda: window.block_map.grid.states.count(BLOCK_OWN) == -(-held // 16), timeout=HANG_GUARD_MS)


def test_the_trim_message_says_which_turns_left_and_why():
    texts = [("user", "What is a KV cache, and why is it so large?"), ("assistant", "It holds..."),
             ("user", "Next"), ("assistant", "")]
    budget = trim_message(TrimEvent(2, 40, 96, "budget"), {"context_start": 0}, texts)
    assert budget.startswith("The KV budget holds 96 tokens: the 2 oldest messages")
    assert '(from "What is a KV cache, and why is it so lar…")' in budget and "stay in the chat" in budget
    context = trim_message(TrimEvent(2, 40, 8192), {"context_start": 0}, texts)
    assert context.startswith("The context (8,192 tokens) was full")


def test_the_budget_dialog_refuses_what_cannot_hold_the_system_prompt_and_one_short_turn(window, qtbot):
    from app.dialogs import SHORT_REPLY_TOKENS, KVBudgetDialog, minimum_budget

    info = window.info
    least, why = minimum_budget(info, window.settings.system_prompt)
    prompt = info.count_prompt(window.settings.system_prompt, [("user", "Could you explain briefly?")])
    assert least * 2**20 >= (prompt + SHORT_REPLY_TOKENS) / info.block_size * info.kv_bytes_per_block
    assert "blocks of 16 tokens" in why and "system prompt" in why
    dialog = KVBudgetDialog(None, window, (least, why))
    qtbot.addWidget(dialog)
    dialog.show()

    assert least >= 0.02
    dialog.spin.setValue(least - 0.01)
    dialog.accept()
    assert dialog.isVisible() and "cannot hold one turn" in dialog.problem.text()
    assert f"Choose {least:g} MiB or more, or 0 for one context's worth" in dialog.problem.text()

    dialog.spin.setValue(least)
    dialog.accept()
    assert not dialog.isVisible() and dialog.value() == least


def test_no_minimum_where_the_strategy_has_no_pool(window, qtbot):
    from dataclasses import replace

    from app.dialogs import minimum_budget

    assert minimum_budget(replace(window.info, kv_bytes_per_block=0, cache_strategy="contiguous"), "x") is None
    assert minimum_budget(None, "x") is None
