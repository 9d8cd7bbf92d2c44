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


def test_the_weights_label_sits_where_no_memory_line_crosses_it_on_the_grabbed_pixels(qtbot):
    from dataclasses import replace

    from PySide6.QtGui import QColor
    from test_app_metrics import SMOL, kv, turn

    from app.metrics_panel import MetricsPanel

    panel = MetricsPanel()
    qtbot.addWidget(panel)
    panel.resize(620, 760)
    panel.show()
    allocated = kv(1).bytes_allocated  # a flat allocated line, just under the weights' line
    panel.set_model_info(replace(SMOL, weights_bytes=int(allocated * 1.15), weight_format="float32"))
    for event in turn(0, 40, 300):
        panel.add_step(event)
    panel.refresh()
    settle(qtbot)
    panel.place_weights_label()
    settle(qtbot)

    plot, label = panel.memory_plot, panel.weights_line.label
    box = plot.mapFromScene(label.sceneBoundingRect()).boundingRect().adjusted(1, 1, -1, -1)
    image = plot.grab().toImage()
    line_colours = {QColor(item.opts["pen"].color()).rgb() & 0xFFFFFF
                    for item in plot.getPlotItem().listDataItems() if item.opts.get("pen") is not None
                    and item.getData()[0] is not None}
    crossed = [(x, y) for x in range(box.left(), box.right()) for y in range(box.top(), box.bottom())
               if image.pixelColor(x, y).rgb() & 0xFFFFFF in line_colours]
    assert box.width() > 20 and crossed == []
    assert (label.orthoPos, label.anchors) != (0.02, [(0, 0), (0, 0)])  # it moved off the line it would sit on
