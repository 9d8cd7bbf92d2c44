"""The block map's history: the pool's state at the end of every turn is kept with the step log (compactly) and
saved with the conversation, so that reopening one shows the block map as it was at the end of its last turn,
captioned as the saved state, until the next turn runs; a '‹ turn 3 of 3 ›' control under the map steps back
through the other turns' saved states (and shades the turn's positions in the plots)."""

from __future__ import annotations

import pytest
from PySide6.QtCore import Qt
from test_app_support import Catch, run_turn, send

from app.pool_snapshot import SavedPool, decode_states, encode_states, pool_record


# --- the record ----------------------------------------------------------------------------------------------------
def test_block_states_are_run_length_encoded_and_read_back():
    states = bytes([1] * 12 + [3] * 4 + [0] * 100 + [2])

    text = encode_states(states)

    assert text == "1:12 3:4 0:100 2:1"
    assert decode_states(text) == states and decode_states("") == b"" and encode_states(b"") == ""


@pytest.mark.parametrize("bad", ["1", "4:2", "1:0", "x:1", "1:-3", "1:2:3", f"0:{(1 << 22) + 1}"])
def test_anything_else_is_not_a_block_state_run(bad):
    with pytest.raises(ValueError, match="block-state run"):
        decode_states(bad)


def test_a_saved_pool_counts_its_blocks_as_the_live_stats_do():
    class Stats:  # the KVStats fields a record is made of
        strategy, block_size, tokens, num_blocks_budget, precision = "paged", 16, 40, 12, "bfloat16"
        block_states = bytes([1, 1, 1, 2, 3, 3, 0, 0])

    pool = SavedPool.from_record(pool_record(Stats))

    assert (pool.num_blocks, pool.num_blocks_used, pool.num_blocks_cached, pool.num_blocks_free) == (8, 4, 2, 2)
    assert (pool.strategy, pool.block_size, pool.tokens, pool.num_blocks_budget, pool.precision) == (
        "paged", 16, 40, 12, "bfloat16")


# --- the window ----------------------------------------------------------------------------------------------------
def test_each_turn_keeps_the_pool_as_its_last_step_left_it(qtbot, window):
    turn = send(qtbot, window, "What is a KV cache?")
    send(qtbot, window, "And a paged one?")

    log = window.metrics.log
    assert sorted(log.pools) == [11, len(log.rows) - 1]  # after each turn's last step
    first = SavedPool.from_record(log.pools[11])
    assert first.block_states == turn.steps[-1].kv.block_states and first.tokens == turn.steps[-1].kv.tokens


def test_a_regenerated_reply_takes_its_pool_state_with_it(qtbot, window):
    send(qtbot, window, "Hello")
    run_turn(qtbot, window, window.regenerate)

    log = window.metrics.log
    assert sorted(log.pools) == [len(log.rows) - 1] == [11]


def test_reopening_shows_the_pool_as_it_was_until_the_next_turn(qtbot, window):
    send(qtbot, window, "What is a KV cache?")
    send(qtbot, window, "And a paged one?")
    conversations, block_map = window.conversations, window.block_map
    first = conversations.current
    qtbot.waitUntil(lambda: bool(conversations.store.open(first).pools), timeout=60_000)
    saved = SavedPool.from_record(window.metrics.log.last_pool())
    with Catch(qtbot, window.client.signals.stats, timeout=60_000):
        window.new_chat()
    assert block_map.grid.states != saved.block_states  # the new chat's pool: the old blocks are only cached now

    with Catch(qtbot, window.client.signals.stats, timeout=60_000) as live:
        assert conversations.open(first)

    assert live.args[0].block_states != saved.block_states  # the live pool came, and was not drawn:
    assert block_map.saved and block_map.grid.states == saved.block_states
    assert not block_map.caption.isHidden() and "Saved state" in block_map.caption.text()
    assert "turn 2 (this conversation's last) left it, until the next turn runs" in block_map.caption.text()
    assert f"{saved.num_blocks_used:,} used" in block_map.summary.text()
    turn = send(qtbot, window, "One more")
    window._refresh_live()
    assert not block_map.saved and block_map.caption.isHidden()
    assert block_map.grid.states == turn.steps[-1].kv.block_states


def test_a_file_without_pool_states_shows_the_live_pool(qtbot, window, tmp_path):
    path = tmp_path / "old.json"
    path.write_text('{"format": "kvscope-conversation", "version": 1, "messages": [{"role": "user", '
                    '"content": "Hi"}, {"role": "assistant", "content": "Yo"}]}')

    assert window.actions_.open_file(str(path))

    assert not window.block_map.saved and window.block_map.caption.isHidden()
    assert window.block_map.stepper.isHidden()


# --- stepping through the saved turns ---------------------------------------------------------------------------
def _three_turns_reopened(qtbot, window) -> list[SavedPool]:
    """Three turns, a new chat, the first conversation opened again; the pools saved for its turns, in order."""
    for text in ("What is a KV cache?", "And a paged one?", "Why blocks?"):
        send(qtbot, window, text)
    conversations = window.conversations
    first = conversations.current
    qtbot.waitUntil(lambda: len(conversations.store.open(first).pools) == 3, timeout=60_000)
    saved = [SavedPool.from_record(conversations.store.open(first).pools[row])
             for row in sorted(conversations.store.open(first).pools)]
    with Catch(qtbot, window.client.signals.stats, timeout=60_000):
        window.new_chat()
    assert window.block_map.stepper.isHidden()  # live: no control
    with Catch(qtbot, window.client.signals.stats, timeout=60_000):
        assert conversations.open(first)
    return saved


def test_a_reopened_conversation_steps_back_through_its_turns(qtbot, window):
    saved = _three_turns_reopened(qtbot, window)
    block_map, stepper = window.block_map, window.block_map.stepper

    assert not stepper.isHidden() and stepper.label.text() == "turn 3 of 3"
    assert block_map.grid.states == saved[2].block_states
    assert stepper.forward.isEnabled() is False and stepper.back.isEnabled()

    qtbot.mouseClick(stepper.back, Qt.MouseButton.LeftButton)

    assert stepper.label.text() == "turn 2 of 3" and block_map.saved
    assert block_map.grid.states == saved[1].block_states != saved[2].block_states
    assert "turn 2 of this conversation left it" in block_map.caption.text()
    assert f"{saved[1].num_blocks_used:,} used" in block_map.summary.text()
    shaded = window.metrics._regions[0]
    assert shaded.isVisible() and shaded.getRegion()[1] < window.metrics.log.rows[-1][2]  # turn 2's positions


def test_left_and_right_step_while_the_map_has_the_focus(qtbot, window):
    saved = _three_turns_reopened(qtbot, window)
    block_map, stepper = window.block_map, window.block_map.stepper
    assert all(b.focusPolicy() & Qt.FocusPolicy.TabFocus for b in (stepper.back, stepper.forward, block_map.grid))
    block_map.grid.setFocus()

    for _ in range(3):  # past the first turn: stays there
        qtbot.keyClick(block_map.grid, Qt.Key.Key_Left)

    assert stepper.label.text() == "turn 1 of 3" and block_map.grid.states == saved[0].block_states
    assert not stepper.back.isEnabled()
    qtbot.keyClick(block_map.grid, Qt.Key.Key_Right)
    assert stepper.label.text() == "turn 2 of 3" and block_map.grid.states == saved[1].block_states


def test_the_control_hides_and_the_map_goes_live_when_a_turn_runs(qtbot, window):
    _three_turns_reopened(qtbot, window)
    window.block_map.stepper.step(-1)

    turn = send(qtbot, window, "One more")
    window._refresh_live()

    block_map = window.block_map
    assert block_map.stepper.isHidden() and block_map.caption.isHidden() and not block_map.saved
    assert not window.metrics._regions[0].isVisible()
    assert block_map.grid.states == turn.steps[-1].kv.block_states


def test_a_version_shown_again_steps_through_its_own_turns(qtbot, window):
    for text in ("What is a KV cache?", "And a paged one?", "Why blocks?"):
        send(qtbot, window, text)
    log = window.metrics.log
    saved = [SavedPool.from_record(log.pools[row]) for row in sorted(log.pools)]
    run_turn(qtbot, window, lambda: window.edit_and_resend("And a contiguous one?", 2))
    assert window.block_map.stepper.isHidden()

    assert window.branching.switch(2, 0)  # the first version of message 3: three turns again

    block_map, stepper = window.block_map, window.block_map.stepper
    assert not stepper.isHidden() and stepper.label.text() == "turn 3 of 3"
    assert block_map.grid.states == saved[2].block_states and "this version's last" in block_map.caption.text()
    stepper.step(-1)
    assert stepper.label.text() == "turn 2 of 3" and block_map.grid.states == saved[1].block_states
