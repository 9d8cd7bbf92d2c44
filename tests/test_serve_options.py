"""`main.py serve --max-body-bytes N`: the flag, else KVSCOPE_MAX_BODY_BYTES, else 4 MiB; a bad value is a clear
error before the model loads. (The limit itself, 413 JSON, over real HTTP: tests/test_server.py.) The same for
`--prefill-rows-while-decoding N` (the scheduler's rule itself: tests/test_scheduler.py). And how much of its KV pool
`serve` holds from the start (the pool held: tests/test_pool_growth.py and tests/test_server.py), and its startup
objects frozen out of the cyclic collector's walks."""

from __future__ import annotations

import gc

import pytest

from engine.machine import available_memory
from server.limits import DEFAULT_MAX_BODY_BYTES
from server.run import freeze_startup_objects, hold_limit, kv_pool_note, max_body_bytes


def test_the_flag_wins_over_the_environment_which_wins_over_the_default():
    env = {"KVSCOPE_MAX_BODY_BYTES": "5000"}
    assert max_body_bytes(1234, env, DEFAULT_MAX_BODY_BYTES) == 1234
    assert max_body_bytes(None, env, DEFAULT_MAX_BODY_BYTES) == 5000
    assert max_body_bytes(None, {}, DEFAULT_MAX_BODY_BYTES) == DEFAULT_MAX_BODY_BYTES == 4 * 2**20
    assert max_body_bytes(None, {"KVSCOPE_MAX_BODY_BYTES": ""}, 77) == 77  # set but empty: as unset


@pytest.mark.parametrize(("flag", "env", "named"), [(0, {}, "--max-body-bytes"), (-5, {}, "--max-body-bytes"),
                                                    (None, {"KVSCOPE_MAX_BODY_BYTES": "4MB"}, "KVSCOPE_MAX_BODY_BYTES"),
                                                    (None, {"KVSCOPE_MAX_BODY_BYTES": "-1"}, "KVSCOPE_MAX_BODY_BYTES")])
def test_a_limit_that_is_not_a_positive_number_names_the_setting(flag, env, named):
    with pytest.raises(ValueError, match=f"{named} must be a positive number of bytes"):
        max_body_bytes(flag, env, DEFAULT_MAX_BODY_BYTES)


def test_serve_refuses_a_bad_limit_before_it_loads_any_model(capsys, tmp_path):
    import main

    missing = tmp_path / "no-such-model"  # never read: the limit is checked first
    assert main.main(["serve", "--max-body-bytes", "0", "--model", str(missing)]) == 1
    err = capsys.readouterr().err
    assert "--max-body-bytes must be a positive number of bytes, not '0'" in err and "no-such-model" not in err


@pytest.mark.parametrize("rows", ["0", "-3"])
def test_serve_refuses_prefill_rows_below_one_before_it_loads_any_model(capsys, tmp_path, rows):
    import main

    missing = tmp_path / "no-such-model"
    assert main.main(["serve", "--prefill-rows-while-decoding", rows, "--model", str(missing)]) == 1
    err = capsys.readouterr().err
    assert f"--prefill-rows-while-decoding must be at least 1, not {rows}" in err and "no-such-model" not in err


def test_serve_holds_at_most_a_quarter_of_the_memory_the_machine_has_available():
    available = available_memory("cpu")
    assert available is not None and available > 0  # Linux's MemAvailable (the CI machines)
    assert abs(hold_limit("cpu") - available // 4) < available // 20  # (read twice: the machine moves on)
    assert available_memory("meta") is None and hold_limit("meta") is None  # cannot be told: the whole budget


def test_the_startup_line_says_whether_the_pool_is_held_whole():
    mib = 2**20
    assert kv_pool_note(0, 0) == ""  # not a pool (contiguous)
    assert kv_pool_note(180 * mib, 180 * mib) == ", KV pool 180 MiB held"
    assert kv_pool_note(4096 * mib, 1984 * mib) == (", KV pool 1984 of 4096 MiB held (a quarter of the memory "
                                                    "available), the rest grown as requests need it")


class Node:
    def __init__(self):
        self.other = None


def test_the_startup_objects_are_frozen_out_of_the_collectors_walks_and_later_ones_are_not():
    startup = Node()
    startup.other = startup  # a cycle built before the freeze, as a model's modules are
    try:
        freeze_startup_objects()
        assert gc.get_freeze_count() > 0
        assert not any(o is startup for o in gc.get_objects())  # a full collection no longer walks it
        later = Node()
        later.other = later
        assert any(o is later for o in gc.get_objects())
        del later
        assert gc.collect() >= 1  # what requests create is still collected
    finally:
        gc.unfreeze()  # (this test process goes on)
