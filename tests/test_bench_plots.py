"""The benchmark plots are readable: every series of a plot has its own colour, no two tick labels overlap, no
legend sits on the data, and turns are whole numbers. Checked on the figures themselves (report.describe: the
artists and their rendered extents), drawn from the recorded full run in docs/bench/results.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.bench import branches, decode, report, turns
from engine.bench.suite import BENCHMARKS

RECORDED = Path(__file__).resolve().parents[1] / "docs" / "bench" / "results.json"


def recorded() -> dict:
    return json.loads(RECORDED.read_text())["benchmarks"]


def drawn(name: str, result: dict, tmp_path) -> list[dict]:
    BENCHMARKS[name].plot(result, tmp_path / f"{name}.png")
    assert (tmp_path / f"{name}.png").stat().st_size > 0
    return report.last_saved["axes"]


def series_colours(axes: dict) -> dict[str, str]:
    """One colour per series; '(sampled)' / '(integrated)' variants of a series share its colour on purpose."""
    colours: dict[str, str] = {}
    for label, colour in axes["series"].items():
        base = label.split(" (sampled)")[0].split(" (integrated)")[0]
        assert colours.setdefault(base, colour) == colour, f"{label} is not drawn in {base}'s colour"
    return colours


def assert_readable(axes_list: list[dict]) -> None:
    for axes in axes_list:
        colours = series_colours(axes)
        assert len(set(colours.values())) == len(colours), f"{axes['title']}: two series share a colour: {colours}"
        assert not axes["tick_labels_overlap"], f"{axes['title']}: tick labels overlap"
        assert not axes["legend_inside_axes"], f"{axes['title']}: the legend sits on the plot area"


@pytest.mark.parametrize("name", ["recompute", "decode", "prefill", "turns", "memory", "concurrency", "quality"])
def test_every_recorded_plot_is_readable(name, tmp_path):
    assert_readable(drawn(name, recorded()[name], tmp_path))


def test_the_decode_peers_that_shared_green_now_have_their_own_colours(tmp_path):
    (latency, _) = drawn("decode", recorded()["decode"], tmp_path)
    colours = latency["series"]
    formats = [name for name in colours if name.startswith("paged, ")]
    assert formats and all(colours["paged"] != colours[name] for name in formats)
    assert len(set(colours.values())) == len(colours) == latency["n_series"]


def test_colours_are_keyed_by_the_whole_series_name_not_a_substring_of_it():
    assert report.color(decode.weights_row("bfloat16")) != report.color("paged")
    assert report.color("transformers fp8 cache") != report.color("transformers")
    assert len({report.color(n) for n in turns.SERIES}) == len(turns.SERIES)
    unknown = report.color("a series no palette names")
    assert unknown in report.EXTRA_COLORS and unknown == report.color("a series no palette names")


def turns_result(n: int) -> dict:
    series = {name: [{"turn": t, "ttft_ms": 100.0 + 10 * t * (k + 1), "prompt_tokens": 170 * t,
                      "prefix_hit_tokens": 0 if k == 0 else 170 * (t - 1), "generated_tokens": 100}
                     for t in range(1, n + 1)] for k, name in enumerate(turns.SERIES)}
    return {"method": "", "turns": n, "series": series, "paged": series["paged, reuse"],
            "contiguous": series[turns.BASELINE], "last_turn": n,
            "last_over_second": {name: 1.0 for name in series}}


@pytest.mark.parametrize("n", [6, 20])
def test_the_turns_plot_shows_four_series_on_whole_turns(n, tmp_path):
    (axes,) = drawn("turns", turns_result(n), tmp_path)
    assert list(axes["series"]) == list(turns.SERIES)
    assert axes["xticks"] and all(t == int(t) for t in axes["xticks"])
    assert_readable([axes])


def test_the_turns_summary_has_a_column_per_series():
    text = turns.summarize(turns_result(6))
    for name in turns.SERIES:
        assert f"{name} TTFT (ms)" in text


def branches_result() -> dict:
    def strategy(scale: float) -> dict:
        return {"branches": 9, "live_tokens": 5000, "bytes_used": int(scale * 2**20), "bytes_allocated": 0,
                "bytes_theoretical": 0, "prefill_tokens": 900, "copied_tokens": 0, "shared_blocks": 3,
                "ttft_ms": {k: scale * (i + 1) for i, k in enumerate(branches.KINDS)}, "turns": []}

    return {"method": "", "conversations": 3, "branches_per_conversation": 2, "reply_tokens": 24,
            "system_tokens": 512, "contiguous": strategy(200.0), "paged": strategy(40.0),
            "contiguous_over_paged": {"bytes_used": 5.0, "prefill_tokens": 1.0,
                                      **{f"ttft {k}": 5.0 for k in branches.KINDS}}}


def test_the_branches_plot_and_summary_are_readable(tmp_path):
    memory, ttft = drawn("branches", branches_result(), tmp_path)
    assert_readable([memory, ttft])
    assert set(ttft["series"]) == {"contiguous", "paged"}
    text = branches.summarize(branches_result())
    assert "contiguous / paged" in text and "TTFT, regenerate" in text
