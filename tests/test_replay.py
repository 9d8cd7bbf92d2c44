"""Replaying a conversation's exact tokens under another configuration (engine/replay.py), and the figures that
compare the replays (engine/replay_result.py). On the tiny random model: the engine is real, only small."""

from __future__ import annotations

import csv

import pytest

from engine.chat import Conversation
from engine.replay import ReplayConfig, ReplayError, Turn, conversation_turns, replay
from engine.replay_result import CompareResult, ConfigRun, StepRow, context_ranges, percentile
from tests.engine_helpers import greedy

QUESTIONS = ("What is a KV cache?", "And a paged one?", "Which is faster?")


@pytest.fixture(scope="module")
def three_turns(tiny_config, tokenizer):
    """A 3-turn greedy conversation on a tiny paged engine: the engine, the conversation and its token turns."""
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.model import LlamaModel

    engine = Engine(LlamaModel.random(tiny_config, seed=0, std=0.1), tokenizer, EngineConfig(cache="paged"), "tiny")
    conv = Conversation(system_prompt="You are brief.")
    for question in QUESTIONS:
        list(engine.generate(conv, question, greedy(9)))
    return engine, conv, conversation_turns(tokenizer, conv)


def run(engine, turns, config) -> ConfigRun:
    result = ConfigRun(config)
    result.rows = [StepRow.from_step(step) for step in replay(engine, turns, config)]
    result.complete = True
    return result


def test_the_turns_are_the_prompts_the_engine_built_and_the_replies_it_generated(three_turns):
    engine, conv, turns = three_turns

    assert len(turns) == 3
    assert [t.reply for t in turns] == [m.token_ids for m in conv.messages if m.role == "assistant"]
    assert all(len(t.reply) == 9 for t in turns)
    assert turns[1].prompt[:len(turns[0].prompt) + 9] == turns[0].prompt + turns[0].reply  # history kept exact
    assert len(turns[0].prompt) < len(turns[1].prompt) < len(turns[2].prompt)


def test_teacher_forced_greedy_tokens_are_the_greedy_reply_itself(three_turns):
    engine, _, turns = three_turns

    steps = list(replay(engine, turns, ReplayConfig("paged")))

    for index, turn in enumerate(turns):
        mine = {s.event.pos: s.event.token_id for s in steps if s.turn == index}
        start = len(turn.prompt) - 1  # the prompt's last position predicts the reply's first token, and so on
        assert [mine[start + j] for j in range(len(turn.reply))] == list(turn.reply)


def test_contiguous_and_paged_replay_the_same_positions_and_agree_everywhere(three_turns):
    engine, _, turns = three_turns

    result = CompareResult([run(engine, turns, ReplayConfig("contiguous")), run(engine, turns, ReplayConfig("paged"))],
                           len(turns))
    contiguous, paged = result.runs

    decode_positions = [[r.pos for r in c.decode_rows()] for c in result.runs]
    assert decode_positions[0] == decode_positions[1]
    assert len(decode_positions[0]) == sum(len(t.reply) for t in turns)
    first, second = result.summaries()
    assert first.agreement == second.agreement == 1.0
    assert second.num_compared == len(contiguous.greedy_by_position())
    assert len(first.ttft_ms) == len(second.ttft_ms) == 3
    assert paged.rows[-1].kv_bytes_used > 0 and second.peak_allocated >= second.final_allocated > 0


def test_paged_reuses_the_history_and_prefills_only_the_new_part_of_each_turn(three_turns):
    engine, _, turns = three_turns

    steps = list(replay(engine, turns, ReplayConfig("paged", block_size=8)))

    prefills = [s.event for s in steps if s.event.phase == "prefill"]
    assert [p.prefix_hit_tokens for p in prefills][0] == 0
    assert all(p.prefix_hit_tokens > 0 for p in prefills[1:])
    assert sum(p.n_tokens for p in prefills[1:]) < len(turns[2].prompt)


def test_none_recomputes_the_whole_context_every_step_and_still_agrees(three_turns):
    engine, _, turns = three_turns
    short = turns[:1]

    none = run(engine, short, ReplayConfig("none"))
    paged = run(engine, short, ReplayConfig("paged"))

    assert [r.n_tokens for r in none.decode_rows()] == [len(short[0].prompt) + j + 1 for j in range(9)]
    assert CompareResult([paged, none], 1).summaries()[1].agreement == 1.0


def test_the_engine_keeps_its_own_cache_and_settings(three_turns):
    engine, conv, turns = three_turns
    before = (engine.cache, engine.config, engine.kv_dtype, engine.kv_stats(conv))

    list(replay(engine, turns, ReplayConfig("contiguous", prefix_reuse=False)))

    assert (engine.cache, engine.config, engine.kv_dtype, engine.kv_stats(conv)) == before


def test_a_cancelled_replay_stops_after_the_step_and_puts_the_engine_back(three_turns):
    engine, _, turns = three_turns
    cache = engine.cache
    seen = []

    for step in replay(engine, turns, ReplayConfig("contiguous"), cancelled=lambda: len(seen) >= 3):
        seen.append(step)

    assert len(seen) == 3 and engine.cache is cache


@pytest.mark.parametrize("turns, message", [([], "no reply to replay"),
                                            ([Turn((), (1,))], "empty prompt"),
                                            ([Turn(tuple(range(1000)), tuple(range(100)))], "more than the context")])
def test_what_cannot_be_replayed_is_refused_with_the_reason(three_turns, turns, message):
    engine = three_turns[0]

    with pytest.raises(ReplayError, match=message):
        list(replay(engine, turns, ReplayConfig("paged")))


def test_other_weights_need_an_engine_loaded_with_them(three_turns):
    engine, _, turns = three_turns

    with pytest.raises(ReplayError, match="float32 weights, not int4"):
        list(replay(engine, turns, ReplayConfig("paged", weights="int4")))
    assert engine.weight_format == "float32"


def test_a_result_round_trips_through_its_saved_form_and_writes_csv(three_turns, tmp_path):
    engine, _, turns = three_turns
    result = CompareResult([run(engine, turns[:1], ReplayConfig("contiguous", kv_dtype="float32"))], 1)

    again = CompareResult.from_dict(result.to_dict())
    result.write_csv(tmp_path / "compare.csv")

    assert again.runs[0].rows == result.runs[0].rows and again.runs[0].config == result.runs[0].config
    with open(tmp_path / "compare.csv", encoding="utf-8") as f:
        rows = list(csv.reader(f))
    assert rows[0][:3] == ["configuration", "turn", "phase"]
    assert len(rows) == 1 + len(result.runs[0].rows) and rows[1][0] == "contiguous · KV float32"


def saved(steps, config=None) -> dict:
    return {"runs": [{"config": config or {}, "complete": True, "steps": steps}], "num_turns": 1}


@pytest.mark.parametrize("bad", [saved([[0, "x", 0, 1, 1.0, 0, 0, 0, 1]]),
                                 saved([[0, "decode", -1, 1, 1.0, 0, 0, 0, 1]]),
                                 saved([[0]]), saved([], {"cache": "huge"}), saved([], {"block_size": 3})])
def test_a_malformed_saved_result_is_refused(bad):
    with pytest.raises(ValueError):
        CompareResult.from_dict(bad)


def test_context_ranges_split_the_positions_evenly_and_percentiles_interpolate():
    assert context_ranges(list(range(10, 40))) == [(10, 19), (20, 29), (30, 39)]
    assert context_ranges([5, 6]) == [(5, 5), (6, 6)]
    assert context_ranges([]) == []
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 90) == pytest.approx(4.6)
    assert percentile([7.0], 90) == 7.0
