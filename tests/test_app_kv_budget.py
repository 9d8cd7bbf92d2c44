"""What the window shows of a pool that grows: the block map draws the blocks that exist inside the budget's
outline, the figures say allocated / used / budget, and the KV budget is a setting the engine follows."""

from __future__ import annotations

from PySide6.QtCore import QSettings
from test_app_support import HANG_GUARD_MS

from app.block_map import BlockMap, grid_shape
from app.dialogs import KVBudgetDialog
from app.figures import _memory_now
from app.settings import AppSettings
from app.style import BLOCK_COLORS, PLOT_BACKGROUND
from engine.kv.base import BLOCK_FREE, BLOCK_OWN, KVStats


def pool_stats(states: bytes, budget: int) -> KVStats:
    per_block = 16 * 512
    return KVStats(strategy="paged", tokens=40, bytes_allocated=len(states) * per_block,
                   bytes_used=states.count(BLOCK_OWN) * per_block, bytes_theoretical=40 * 512, bytes_per_element=4,
                   block_size=16, num_blocks=len(states), num_blocks_used=states.count(BLOCK_OWN),
                   num_blocks_free=states.count(BLOCK_FREE), block_states=states,
                   bytes_budget=budget * per_block, num_blocks_budget=budget)


def test_the_block_map_lays_out_the_budget_and_draws_only_the_blocks_that_exist(qtbot):
    block_map = BlockMap()
    qtbot.addWidget(block_map)
    block_map.resize(400, 300)
    block_map.show()
    states = bytes([BLOCK_OWN] * 3 + [BLOCK_FREE])

    block_map.set_stats(pool_stats(states, budget=64))

    assert block_map.showing_grid and block_map.grid.states == states and block_map.grid.budget == 64
    assert "4 blocks of 64 (the budget, outlined)" in block_map.summary.text()
    image = block_map.grid.grab().toImage()
    cols, rows, cell = grid_shape(64, block_map.grid.width(), block_map.grid.height())
    assert image.pixelColor(cell // 2, cell // 2).name() == BLOCK_COLORS[BLOCK_OWN]  # block 0 exists
    far = 63  # the budget's last cell: no block there yet, so no colour, only the outline around it
    centre = ((far % cols) * cell + cell // 2, (far // cols) * cell + cell // 2)
    assert image.pixelColor(*centre).name() == PLOT_BACKGROUND
    assert block_map.grid.block_at(*centre) == far


def test_a_pool_with_no_block_yet_is_still_drawn_as_its_empty_budget(qtbot):
    block_map = BlockMap()
    qtbot.addWidget(block_map)

    block_map.set_stats(pool_stats(b"", budget=512))

    assert block_map.showing_grid and "0 blocks of 512" in block_map.summary.text()


def test_the_memory_figure_reads_allocated_used_and_budget():
    title, value, detail = _memory_now(pool_stats(bytes([BLOCK_OWN] * 7 + [BLOCK_FREE]), budget=512))
    assert title == "KV memory now"
    assert value == "64.0 KiB allocated / 56.0 KiB used / 4.00 MiB budget"
    assert "8 of 512 blocks exist" in detail


def test_the_kv_budget_setting_round_trips_and_zero_means_one_context(qtbot, tmp_path):
    settings = AppSettings(QSettings(str(tmp_path / "settings.ini"), QSettings.Format.IniFormat))
    assert settings.kv_budget_mib is None
    settings.kv_budget_mib = 96.5
    assert settings.kv_budget_mib == 96.5
    settings.kv_budget_mib = None
    assert settings.kv_budget_mib is None
    dialog = KVBudgetDialog(None)
    qtbot.addWidget(dialog)
    assert dialog.value() is None and dialog.spin.text() == "one context (default)"
    dialog.spin.setValue(48)
    assert dialog.value() == 48.0


def test_the_window_hands_the_budget_to_the_engine(window, qtbot):
    window.set_kv_budget(0.5)
    engine = window.client.worker.engine
    qtbot.waitUntil(lambda: engine.config.kv_budget_mib == 0.5, timeout=HANG_GUARD_MS)
    assert window.settings.kv_budget_mib == 0.5
    assert engine.kv_stats().bytes_budget <= 0.5 * 2**20
    window.set_kv_budget(None)
    qtbot.waitUntil(lambda: engine.config.kv_budget_mib is None, timeout=HANG_GUARD_MS)
