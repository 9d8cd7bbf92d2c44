"""Loose ends of a real-window trial (issue 20 part 3): at 900x600 the status bar keeps strategy, context and KV
and says the rest in its tooltip; the weights' label on the memory plot sits where no line crosses it."""

from __future__ import annotations

from test_app_readable import settle
from test_app_support import send


def test_at_900_pixels_the_status_bar_keeps_strategy_context_and_kv_and_tells_the_rest(qtbot, window):
    window.status.labels["model"].setText("SmolLM2-135M-Instruct-with-a-very-long-name-Q4_K_M")
    window.resize(900, 600)
    send(qtbot, window, "Hello")
    settle(qtbot)

    labels = window.status.labels
    shown = window.status_fit.shown
    assert {labels["strategy"], labels["context"], labels["kv"]} <= set(shown)
    folded = [name for name, label in labels.items() if label in window.status_fit.folded and label.text()]
    assert folded  # something had to give at this width...
    tip = window.status.toolTip()
    for name in folded:  # ...and is still there to read
        assert labels[name].text().split("<")[0].strip() in tip or name == "strategy"
