"""Make docs/compare.png: three greedy turns on the default model, replayed under contiguous, paged and paged
with a bfloat16 KV cache (engine.replay, the Compare job's own code), drawn by the Compare window (app.compare_view)
and saved as a PNG; the table is printed too.

    QT_QPA_PLATFORM=offscreen .venv/bin/python docs/compare_screenshot.py docs/compare.png

The engine runs on this script's thread (not the window's worker), so nothing is saved under the user's data."""

from __future__ import annotations

import sys

from PySide6.QtTest import QTest
from PySide6.QtWidgets import QApplication

from app.compare_view import CompareView
from app.style import apply_theme
from engine.chat import Conversation
from engine.config import EngineConfig, SamplingParams
from engine.engine import Engine
from engine.replay import ReplayConfig, conversation_turns, replay, with_engine_weights
from engine.replay_result import CompareResult, ConfigRun, StepRow

QUESTIONS = ("What is a KV cache, in two sentences?", "How does a paged KV cache differ from a contiguous one?",
             "Which one should a chat app use?")


def main(path: str) -> None:
    app = QApplication([])
    apply_theme(app)
    engine = Engine.load(None, EngineConfig(cache="paged", kv_dtype="float32"))
    conv = Conversation()
    for question in QUESTIONS:
        for _ in engine.generate(conv, question, SamplingParams(temperature=0, max_new_tokens=48)):
            pass
    turns = conversation_turns(engine.tokenizer, conv)
    result = CompareResult([], len(turns))
    for config in (ReplayConfig("contiguous", "float32"), ReplayConfig("paged", "float32"),
                   ReplayConfig("paged", "bfloat16")):
        run = ConfigRun(with_engine_weights(config, engine))
        run.rows = [StepRow.from_step(step) for step in replay(engine, turns, config)]
        run.complete = True
        result.runs.append(run)
    view = CompareView()
    view.resize(1560, 960)
    view.show()
    view.finish(result)
    QTest.qWait(500)
    view.export_png_to(path)
    print(f"{engine.model_name}: {engine.weight_format} weights, {sum(len(t.reply) for t in turns)} reply tokens")
    for row in view.table_text():
        print(" | ".join(cell.replace("\n", " ") for cell in row))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "docs/compare.png")
