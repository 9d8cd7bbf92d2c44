"""The figures panel and Help → About say what a sliding-window model's cache holds: N of L layers slide with window
W and hold only it, and the bytes the formula predicts are per layer (global layers x context + sliding layers x
min(context, window)), the same bytes the engine reports."""

from __future__ import annotations

import pytest
import torch

from app.dialogs import about_html
from app.figures import figure_rows
from app.model_info import ModelInfo, kv_bytes, kv_outgrows_weights_at
from engine import loader
from engine.config import EngineConfig
from engine.engine import Engine
from engine.model import LlamaModel
from tests.engine_helpers import one_torch_thread
from tests.test_architectures import CASES, random_reference, write_case

GEMMA3 = ModelInfo("gemma-3-like", "cpu", "float32", 1024, num_layers=6, num_heads=4, num_kv_heads=2, head_dim=256,
                   cache_strategy="paged", block_size=16, kv_bytes_per_element=4.0, weights_bytes=10 * 2**20,
                   sliding_layers=5, sliding_window=8, window_rows=24, window_bytes_per_element=4.0)
PER_LAYER_TOKEN = 2 * 4 * 2 * 256


@pytest.fixture(scope="module")
def gemma3_engine(tmp_path_factory):
    """The tiny random Gemma 3 of test_architectures.py (window 8, five sliding layers of six) in an Engine."""
    tmp = tmp_path_factory.mktemp("gemma3")
    mp = pytest.MonkeyPatch()
    mp.setenv("KVSCOPE_CACHE_DIR", str(tmp / "cache"))
    try:
        weights = loader.load_weights(str(write_case(tmp, CASES["gemma3"], random_reference(CASES["gemma3"]))))
    finally:
        mp.undo()
    model = LlamaModel.from_hf_state_dict(weights.config, weights.state_dict, max_positions=256)
    with one_torch_thread():
        yield Engine(model, weights.tokenizer, EngineConfig(cache="paged", block_size=16), "tiny-gemma3")


def rows_of(info, kv=None) -> dict[str, tuple[str, str]]:
    return {title: (value, detail) for title, value, detail in figure_rows(info, kv)}


def test_the_model_record_says_which_layers_slide_and_what_the_cache_holds_of_them(gemma3_engine):
    info = ModelInfo.from_engine(gemma3_engine)
    assert (info.sliding_layers, info.sliding_window, info.window_rows) == (5, 8, 24)
    assert info.held_layers == 1
    assert info.kv_bytes_per_element == 4.0, "a block's bytes over the global layers' elements it holds"


def test_the_engines_reported_bytes_for_a_long_context_are_the_figures_formula(gemma3_engine):
    engine = gemma3_engine
    info, cache = ModelInfo.from_engine(engine), engine.cache
    ids = torch.randint(3, 200, (150,), generator=torch.Generator().manual_seed(0)).tolist()
    cache.prepare(7, ids)
    view = cache.begin_step([7], [ids])
    engine.model(torch.tensor([ids]), view)
    cache.commit_step(view)
    try:
        assert kv_bytes(info).bytes_at(150) == cache.stats(7).bytes_theoretical == PER_LAYER_TOKEN * (150 + 5 * 8)
    finally:
        cache.release(7)


def test_the_figures_panel_states_that_n_of_l_layers_slide_and_hold_only_their_window():
    value, detail = rows_of(GEMMA3)["Sliding-window layers"]
    assert value == "5 of 6 layers slide with window 8 and hold only it"
    assert "24 rows a sequence" in detail and "the other 1 layers hold every token" in detail
    formula = rows_of(GEMMA3)["KV bytes per token"][1]
    assert "1 global layers" in formula and "5 sliding layers" in formula and "min(context, 8)" in formula
    about = about_html(GEMMA3)
    assert "5 of 6 layers slide with a window of 8 tokens and hold only it" in about and formula in about


def test_the_per_token_figure_is_the_global_layers_and_the_window_a_bounded_extra():
    kv = kv_bytes(GEMMA3)
    assert kv.bytes_per_token == PER_LAYER_TOKEN
    assert kv.bytes_at(4) == 6 * 4 * PER_LAYER_TOKEN, "within the window every layer holds every token"
    assert kv.bytes_at(1000) == PER_LAYER_TOKEN * (1000 + 5 * 8)


def test_where_the_cache_outgrows_the_weights_follows_the_per_layer_formula():
    at = kv_outgrows_weights_at(GEMMA3)
    kv = kv_bytes(GEMMA3)
    assert kv.bytes_at(at) > GEMMA3.weights_bytes >= kv.bytes_at(at - 1)
    every_layer = ModelInfo(**{**GEMMA3.__dict__, "window_rows": 0})
    assert kv_outgrows_weights_at(every_layer) < at


def test_a_cache_that_keeps_every_token_of_sliding_layers_says_so():
    keeps = ModelInfo(**{**GEMMA3.__dict__, "window_rows": 0})
    value, detail = rows_of(keeps)["Sliding-window layers"]
    assert value == "5 of 6 slide" and "the cache holds every token of them" in detail
    assert "6 layers" in kv_bytes(keeps).formula and "sliding" not in kv_bytes(keeps).formula


def test_a_model_without_sliding_layers_has_no_such_row():
    plain = ModelInfo(**{**GEMMA3.__dict__, "sliding_layers": 0, "sliding_window": 0, "window_rows": 0})
    assert "Sliding-window layers" not in rows_of(plain)
