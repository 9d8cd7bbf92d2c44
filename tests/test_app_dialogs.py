"""Menus, dialogs and preferences of the window, without generating."""

from __future__ import annotations

import pytest
from test_app_support import Catch

from app.dialogs import SamplingDialog, SystemPromptDialog, about_html
from app.model_info import ModelInfo
from app.settings import MENU_BLOCK_SIZES
from app.style import default_system_prompt, human_bytes
from engine.config import CACHE_STRATEGIES, SamplingParams


def test_the_menus_offer_every_strategy_and_block_size_as_exclusive_choices(window):
    menus = window.menus

    assert tuple(menus.strategies) == CACHE_STRATEGIES
    assert tuple(menus.block_sizes) == MENU_BLOCK_SIZES == (8, 16, 32, 64)
    assert menus.strategy_group.isExclusive() and menus.block_size_group.isExclusive()
    assert menus.strategies["paged"].isChecked() and menus.block_sizes[16].isChecked()
    titles = [a.text() for a in window.menuBar().actions()]
    assert titles == ["&File", "&Settings", "&View", "&Compare", "&Help"]


def test_a_block_size_chosen_in_the_menu_is_used_and_remembered(qtbot, window):
    with Catch(qtbot, window.client.signals.loaded, timeout=10_000) as loaded:
        window.menus.block_sizes[32].trigger()

    assert loaded.args[0].block_size == 32 and window.settings.block_size == 32
    assert f"paged · 32 · {window.info.kv_dtype}" in window.status.text("strategy")  # strategy, block, precision
    with Catch(qtbot, window.client.signals.stats, timeout=10_000) as stats:
        window.menus.new_chat.trigger()
    assert stats.args[0].block_size == 32


def test_the_side_panel_toggle_hides_the_panel_and_is_remembered(window):
    window.menus.show_side_panel.trigger()

    assert window.side.isHidden() and window.settings.show_side_panel is False
    window.menus.show_side_panel.trigger()
    assert not window.side.isHidden() and window.settings.show_side_panel is True


def test_the_sampling_dialog_round_trips_every_parameter(qtbot):
    params = SamplingParams(temperature=0.35, top_k=12, top_p=0.8, repetition_penalty=1.25, max_new_tokens=77,
                            seed=1234)
    dialog = SamplingDialog(params)
    qtbot.addWidget(dialog)

    assert dialog.params() == params
    dialog.seed.setValue(-1)
    assert dialog.params().seed is None and dialog.seed.text() == "random"


def test_the_system_prompt_applies_to_the_current_chat_and_is_remembered(qtbot, window):
    with Catch(qtbot, window.client.signals.conversation, timeout=10_000) as conversation:
        window.actions_.set_system_prompt("Answer in French.")

    assert conversation.args[0]["system_prompt"] == "Answer in French."
    assert window.settings.system_prompt == "Answer in French."


def test_the_system_prompt_dialog_can_reset_to_the_default(qtbot):
    dialog = SystemPromptDialog("Custom")
    qtbot.addWidget(dialog)
    assert dialog.prompt() == "Custom"

    dialog.reset_button.click()

    assert dialog.prompt() == default_system_prompt()


def test_about_fills_in_the_bytes_per_token_formula_with_the_models_numbers():
    info = ModelInfo("SmolLM2", "cpu", "float32", 8192, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                     cache_strategy="paged", block_size=16)

    html = about_html(info)

    assert "2 × bytes/element × layers × KV heads × head_dim" in html
    assert "2 × 4 B/element × 30 layers × 3 KV heads × 64 head_dim = 46,080 bytes/token" in html
    assert "SmolLM2" in html and "cpu" in html and "360.0 MiB" in html


@pytest.mark.parametrize("n, text", [(0, "0 B"), (1023, "1023 B"), (1536, "1.50 KiB"), (46080, "45.0 KiB"),
                                     (720 * 2**20, "720.0 MiB"), (3 * 2**30, "3.00 GiB")])
def test_human_bytes(n, text):
    assert human_bytes(n) == text
