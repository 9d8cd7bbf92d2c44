"""Settings → KV precision: the menu offers every precision the engine does, the worker applies a choice between
turns as a new cache, and the window says which precision holds the keys and values (status bar, reply footer,
figures, block map)."""

from __future__ import annotations

from PySide6.QtCore import QSettings
from test_app_support import HANG_GUARD_MS, send

from app.block_map import BlockMap
from app.figures import figure_rows
from app.model_info import ModelInfo
from app.settings import AppSettings
from engine.config import KV_DTYPES
from engine.kv.base import KVStats
from main import build_parser


def test_the_kv_precision_setting_round_trips_and_an_unknown_one_reads_auto(tmp_path):
    settings = AppSettings(QSettings(str(tmp_path / "settings.ini"), QSettings.Format.IniFormat))
    assert settings.kv_dtype == "auto"
    settings.kv_dtype = KV_DTYPES[-1]
    assert settings.kv_dtype == KV_DTYPES[-1]
    settings.q.setValue("engine/kv_dtype", "float8")  # written by another version, or by hand
    assert settings.kv_dtype == "auto"


def test_gui_takes_kv_dtype_on_the_command_line():
    args = build_parser().parse_args(["gui", "--kv-dtype", "float16"])
    assert args.kv_dtype == "float16"
    assert build_parser().parse_args(["gui"]).kv_dtype is None


def test_the_menu_offers_exactly_the_engines_precisions(window):
    assert tuple(window.menus.kv_dtypes) == KV_DTYPES
    assert all(action.isCheckable() and action.toolTip() for action in window.menus.kv_dtypes.values())


def test_choosing_a_precision_makes_a_new_cache_in_it_and_the_window_names_it(window, qtbot):
    engine = window.client.worker.engine
    window.menus.kv_dtypes["bfloat16"].trigger()

    qtbot.waitUntil(lambda: engine.kv_dtype_name == "bfloat16" and window.info.kv_dtype == "bfloat16",
                    timeout=HANG_GUARD_MS)
    assert window.settings.kv_dtype == "bfloat16" and engine.config.kv_dtype == "bfloat16"
    assert engine.cache.dtype.is_floating_point and engine.cache.bytes_per_element == 2
    assert window.menus.kv_dtypes["bfloat16"].isChecked()
    assert "bfloat16" in window.status.text("strategy")
    assert "(bfloat16)" in window.block_map.summary.text()
    assert "bfloat16" in window.block_map.legend_title.text()

    send(qtbot, window, "Hello there")

    footer = window.chat.messages[-1].footer.text()
    assert "KV bfloat16" in footer
    assert f"weights auto → {window.info.weight_format}" in footer  # the setting, and what it chose


def test_a_ready_made_engine_keeps_its_precision_until_one_is_chosen(window):
    engine = window.client.worker.engine
    assert window.kv_dtype is None and engine.config.kv_dtype is None
    assert window.info.kv_dtype == engine.kv_dtype_name and window.info.kv_dtype_setting == ""


def test_auto_names_what_it_chose():
    info = _info(kv_dtype="bfloat16", kv_dtype_setting="auto")
    assert info.kv_dtype_text == "auto → bfloat16"
    assert _info(kv_dtype="float16", kv_dtype_setting="float16").kv_dtype_text == "float16"
    assert _info(cache_strategy="none", kv_dtype="").kv_dtype_text == ""


def test_the_figures_give_each_precision_for_this_conversation_and_where_it_outgrows_the_weights(window):
    info = window.info
    names = [name for name, _ in info.precision_bytes]
    assert "float32" in names and "bfloat16" in names and "auto" not in names
    per_token = dict(info.precision_bytes)
    elements = 2 * info.num_layers * info.num_kv_heads * info.head_dim
    assert per_token["float32"] == 4 * elements and per_token["bfloat16"] == 2 * elements
    kv = KVStats("paged", 100, 0, 0, 0, 4.0)

    title, value, detail = next(row for row in figure_rows(info, kv) if row[0].startswith("Each KV precision"))

    assert "(100 tokens)" in title and info.kv_dtype in value
    lines = detail.split("\n")
    assert len(lines) == len(info.precision_bytes)
    float32 = next(line for line in lines if line.lstrip("▸ ").startswith("float32:"))
    at = int(info.weights_bytes // per_token["float32"]) + 1
    assert f"outgrows the weights at {at:,}" in float32


def test_a_quantized_caches_full_precision_window_is_a_line_of_its_own():
    kv = KVStats("paged-int8", 40, 3 << 20, 2 << 20, 1 << 20, 1.0625)
    object.__setattr__(kv, "bytes_window", 1 << 20)  # KVStats.bytes_window: a quantized cache's unquantized tail
    rows = {title: value for title, value, _ in figure_rows(_info(cache_strategy="paged-int8"), kv)}
    assert rows["Full-precision window"] == "1.00 MiB"


def test_the_block_map_names_no_precision_until_told(qtbot):
    block_map = BlockMap()
    qtbot.addWidget(block_map)
    assert not block_map.legend_title.isVisibleTo(block_map)
    block_map.set_precision("int8")
    assert block_map.legend_title.text() == "Each cell: one block of int8 keys and values"


def _info(**fields) -> ModelInfo:
    base = dict(model_name="m", device="cpu", dtype_name="float32", max_context=8192, num_layers=30, num_heads=9,
                num_kv_heads=3, head_dim=64, cache_strategy="paged", block_size=16, weights_bytes=100 << 20,
                kv_dtype="float32", precision_bytes=(("float32", 46080.0),))
    return ModelInfo(**{**base, **fields})
