"""Settings → Weights: the model's weights change format between turns, the conversation stays, and the status
bar, Help → About and the figures say what is resident and when the KV cache outgrows the weights."""

from __future__ import annotations

from test_app_support import Catch, send

from app.dialogs import about_html
from app.figures import figure_rows


def test_choosing_a_weight_format_converts_the_weights_and_keeps_the_conversation(qtbot, window):
    send(qtbot, window, "Hello")
    before = window.info.weights_bytes
    with Catch(qtbot, window.client.signals.loaded) as loaded:
        window.menus.weight_formats["int8"].trigger()
    info = loaded.args[0]
    assert info.weight_format == "int8" and window.settings.weights == "int8"
    assert 0 < info.weights_bytes < before / 2  # int8 codes and scales, not float32
    assert "int8 weights" in window.status.text("device")
    assert "<b>Weights:</b> int8 weights" in about_html(window.info)
    assert [m.role for m in window.client.worker.conv.messages] == ["user", "assistant"]
    recorder = send(qtbot, window, "Again")
    assert recorder.done[0].prefix_hit_tokens == 0  # new weights: the history is prefilled again


def test_the_figures_name_the_context_where_the_kv_cache_outgrows_the_weights(qtbot, window):
    rows = {title: (value, detail) for title, value, detail in figure_rows(window.info, None)}
    value, detail = rows["KV cache outgrows the weights at"]
    info = window.info
    expected = info.weights_bytes // (2 * 4 * info.num_layers * info.num_kv_heads * info.head_dim) + 1
    assert value.startswith(f"{expected:,} tokens") and "weights" in detail


def test_the_memory_plot_draws_the_weights_as_a_line_beside_the_kv_lines(qtbot, window):
    line = window.metrics.weights_line
    assert line.isVisible()
    assert abs(10 ** line.value() * 1024 * 1024 - window.info.weights_bytes) < 0.01 * window.info.weights_bytes
    assert window.info.weight_format in line.label.toPlainText()
