"""Bench `serve` and its llama-server peer: the build's CPU options from /proc/cpuinfo, a peer that is absent,
not a GGUF, killed on start or failing its first batch reported absent with why (never trusted), the clients,
summaries, greedy equality, targets and plot against a tiny in-process server without the peer, and, where a
llama-server binary exists, one short real run of it on the default GGUF."""

from __future__ import annotations

import asyncio
import json
import sys
import textwrap
from pathlib import Path

import httpx
import pytest
from engine_helpers import one_torch_thread
from test_serve_api import InProcessServer

from app.backends.metrics_parser import server_kv
from engine import loader
from engine.bench import llama_server, serve, targets
from engine.bench.common import BenchContext

AVX2_ONLY = "processor\t: 0\nflags\t\t: fpu sse4_2 avx avx2 fma f16c bmi2 amx_tile amx_int8 amx_bf16\n"
AVX512 = "flags\t\t: fpu avx avx2 avx512f avx512bw avx512_vnni avx512_bf16\n"


def options(flags: list[str]) -> dict[str, str]:
    return dict(f.removeprefix("-D").split("=") for f in flags)


# ---- the build's instruction sets --------------------------------------------------------------------------------
def test_native_detection_and_amx_are_off_and_avx2_on_even_where_amx_is_advertised():
    opts = options(llama_server.cmake_cpu_flags(AVX2_ONLY * 2))
    assert opts["GGML_NATIVE"] == "OFF" and opts["GGML_AVX2"] == "ON"
    assert opts["GGML_AMX_TILE"] == opts["GGML_AMX_INT8"] == opts["GGML_AMX_BF16"] == "OFF"
    assert opts["GGML_AVX512"] == opts["GGML_AVX512_VNNI"] == opts["GGML_AVX512_BF16"] == "OFF"


def test_avx512_and_its_parts_are_on_only_where_every_processor_advertises_them():
    assert options(llama_server.cmake_cpu_flags(AVX512 * 2))["GGML_AVX512_BF16"] == "ON"
    just_f = options(llama_server.cmake_cpu_flags("flags : avx2 avx512f\n"))
    assert (just_f["GGML_AVX512"], just_f["GGML_AVX512_VNNI"], just_f["GGML_AVX512_BF16"]) == ("ON", "OFF", "OFF")
    mixed = options(llama_server.cmake_cpu_flags(AVX512 + "flags : avx2 fma\n"))  # one core without AVX-512
    assert mixed["GGML_AVX512"] == "OFF" and mixed["GGML_AVX2"] == "ON"


# ---- a peer that cannot be trusted is absent, with why -----------------------------------------------------------
def test_no_binary_anywhere_makes_the_peer_absent_and_says_how_to_get_one(tmp_path, monkeypatch):
    assert llama_server.find_binary(tmp_path / "peers", path=str(tmp_path)) is None
    monkeypatch.setenv("PATH", str(tmp_path))
    peer, note = llama_server.start_peer(Path("model.gguf"), 1, peers=tmp_path / "peers")
    assert peer is None and note.startswith("absent") and "make peers" in note


def test_the_built_binary_comes_before_one_on_path(tmp_path):
    built = write_executable(tmp_path / "peers" / "bin" / "llama-server", "#!/bin/sh\nexit 0\n")
    on_path = write_executable(tmp_path / "path" / "llama-server", "#!/bin/sh\nexit 0\n")
    assert llama_server.find_binary(tmp_path / "peers", path=str(on_path.parent)) == built
    assert llama_server.find_binary(tmp_path / "none", path=str(on_path.parent)) == on_path


def test_a_model_that_is_not_a_gguf_makes_the_peer_absent(tmp_path):
    binary = write_executable(tmp_path / "llama-server", "#!/bin/sh\nexit 0\n")
    peer, note = llama_server.start_peer(None, 1, binary=binary)
    assert peer is None and "not a GGUF" in note


def test_a_binary_killed_by_sigill_is_reported_absent_with_the_rebuild_hint(tmp_path):
    binary = write_executable(tmp_path / "llama-server", "#!/bin/sh\necho illegal instruction ahead\nkill -ILL $$\n")
    peer, note = llama_server.start_peer(tmp_path / "m.gguf", 1, binary=binary)
    assert peer is None and "SIGILL" in note and "make peers" in note and "illegal instruction ahead" in note


FAKE_SERVER = """\
    import json, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer

    port = int(sys.argv[sys.argv.index("--port") + 1])

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            body = json.dumps({"error": {"message": "failed to decode the batch"}}).encode()
            self.send_response(500)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    HTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


def test_a_server_that_is_healthy_but_fails_its_first_batch_is_not_trusted(tmp_path):
    script = f"#!{sys.executable}\n" + textwrap.dedent(FAKE_SERVER)
    binary = write_executable(tmp_path / "llama-server", script)
    peer, note = llama_server.start_peer(tmp_path / "m.gguf", 1, binary=binary)
    assert peer is None and "first batch answered 500" in note and "failed to decode the batch" in note


def test_the_command_line_is_loopback_only_with_metrics_slots_and_one_shared_context():
    config = llama_server.LlamaServerConfig(Path("/x/llama-server"), Path("/m/model.gguf"), threads=2, parallel=16,
                                            context=8192)
    args = config.args(8123)
    for flag, value in (("--host", "127.0.0.1"), ("--port", "8123"), ("-t", "2"), ("-tb", "2"),
                        ("--parallel", "16"), ("-c", "8192"), ("-m", "/m/model.gguf")):
        assert args[args.index(flag) + 1] == value
    assert {"--metrics", "--kv-unified", "--offline"} <= set(args)
    assert config.describe().startswith("llama-server -m model.gguf --host 127.0.0.1 -t 2")
    assert "--port" not in config.describe()


# ---- the bench's own parts, on a tiny server without the peer ----------------------------------------------------
def test_greedy_equality_counts_each_batched_stream_against_the_same_request_alone():
    def runs(texts):
        return {"texts": texts}

    raw = {"batched/4": runs(["ab", "cd", "eX", "gh"]), "one at a time/4": runs(["ab", "cd", "ef", "gh"]),
           "batched/1": runs(["ab"]), "one at a time/1": runs(["ab"])}
    assert serve.greedy_equality(raw) == {"1": {"equal": 1, "total": 1, "differ": []},
                                          "4": {"equal": 3, "total": 4, "differ": [[2, 1]]}}
    assert serve.greedy_equality({"batched/4": runs(["abc"]), "one at a time/4": runs(["ab"])})["4"]["differ"] == [
        [0, 2]]  # one a prefix of the other: they differ where the shorter ends


@pytest.fixture(scope="module")
def tiny_server(tiny_config, tokenizer):
    with one_torch_thread(), InProcessServer(tiny_config, tokenizer) as s:
        yield s


def test_the_bench_measures_every_client_count_and_reports_the_absent_peer(tiny_server, tiny_engine_factory,
                                                                          tmp_path):
    raw = serve.measure({serve.KVSCOPE: tiny_server.url}, max_tokens=4)
    assert set(raw[serve.KVSCOPE]) == {f"{m}/{n}" for m in serve.MODES for n in serve.CLIENTS}
    for n in serve.CLIENTS:
        batched = raw[serve.KVSCOPE][f"batched/{n}"]
        assert len(batched["texts"]) == n and 0 < batched["tokens"] <= 4 * n and len(batched["gaps_ms"]) <= 3 * n
    part = serve.stream_results(raw, "absent: no llama-server (run `make peers`)", "absent")
    result = {"method": "m", "clients": list(serve.CLIENTS), "engine_step_ms": 1.0, **part,
              "pool_fit": {"budget_tokens": 256, "budget_bytes": 2**20, "paged": 3, "paged_preemptions": 0,
                           "paged_errors": 0, "contiguous": 1, "contiguous_reservation_bytes": 2**20, "requests": 4}}
    assert sum(g["total"] for g in result["greedy"].values()) == sum(serve.CLIENTS)
    ctx = BenchContext(tiny_engine_factory(), None, quick=True, tiny=True)
    result["turns"] = serve.in_turns(tiny_server.url, max_tokens=4, rounds=2,
                                     engine_step=lambda: serve.engine_step_ms(ctx, max_tokens=4, samples=3))
    assert set(result["turns"]["clients"]) == {str(n) for n in serve.TURN_CLIENTS}
    assert len(result["turns"]["engine_step_samples_ms"]) == 2 * 3  # before each of the two one-client runs
    for n, runs in result["turns"]["clients"].items():
        assert len(runs["tok_s_runs"]) == 2 and 0 < runs["gaps"] <= 2 * 3 * int(n)
    by_name = {t.name: t for t in targets.serve_targets(result)}
    vs_peer = [t for name, t in by_name.items() if "vs llama-server" in name]
    assert len(vs_peer) == 6 and all(t.passed is None and "absent" in t.why for t in vs_peer)
    greedy = by_name["serve: concurrent greedy streams equal to the same request alone"]
    assert greedy.measured is not None and "llama-server not run" in greedy.why
    text = serve.summarize(json.loads(json.dumps(result)))  # what results.json gives back
    assert "llama-server: absent: no llama-server" in text and "| 16 | kvscope |" in text
    assert "kvscope in turns (2 rounds" in text
    serve.plot(result, tmp_path / "serve.png")
    assert (tmp_path / "serve.png").stat().st_size > 0


def test_each_round_in_turns_runs_every_client_count_once_starting_one_count_later():
    assert serve.turn_order((1, 4, 16), 3) == [1, 4, 16, 4, 16, 1, 16, 1, 4]
    assert serve.turn_order((1, 4, 16), 4)[-3:] == [1, 4, 16]


def test_the_ratio_targets_read_the_runs_in_turns_and_keep_the_tables_in_their_why():
    def run(tok_s, p50, p99):
        return {"tok_s": tok_s, "itl_p50_ms": p50, "itl_p99_ms": p99}

    # the table's one-client run in a slow phase: its ratios look better than the machine is
    table = {"batched/1": run(50.0, 10.0, 12.0), "batched/4": run(180.0, 7.0, 15.0),
             "batched/16": run(200.0, 20.0, 30.0)}
    turns = {"rounds": 3, "clients": {"1": run(100.0, 5.0, 8.0), "4": run(180.0, 7.0, 14.0),
                                      "16": run(350.0, 20.0, 30.0)}}
    apart = {t.name: t for t in targets.serve_targets({"streams": table})}
    together = {t.name: t for t in targets.serve_targets({"streams": table, "turns": turns})}
    throughput, p99 = ("serve: aggregate tok/s, 16 streams / 1 stream",
                       "serve: p99 inter-token latency with 4 clients / single-client median")
    assert apart[throughput].measured == pytest.approx(4.0) and apart[p99].measured == pytest.approx(1.5)
    assert apart[p99].passed and "turns" not in apart[p99].why
    assert together[throughput].measured == pytest.approx(3.5) and not together[throughput].passed
    assert together[p99].measured == pytest.approx(2.8) and not together[p99].passed
    assert "3 rounds in turns" in together[p99].why and "minutes apart: 4x and 1.5x" in together[p99].why


def test_the_serving_path_reads_the_engines_steps_timed_between_the_runs_in_turns():
    one = {"tok_s": 130.0, "itl_p50_ms": 7.2, "itl_p99_ms": 11.0}  # the table's one-client run in a slow phase
    turns = {"rounds": 3, "clients": {"1": {"tok_s": 200.0, "itl_p50_ms": 5.0, "itl_p99_ms": 8.0}},
             "engine_step_ms": 4.8}
    name = "serve: one client's inter-token p50 / the engine's own decode step"
    apart = {t.name: t for t in targets.serve_targets({"streams": {"batched/1": one}, "engine_step_ms": 4.8})}
    together = {t.name: t for t in targets.serve_targets({"streams": {"batched/1": one}, "engine_step_ms": 4.8,
                                                          "turns": turns})}
    assert apart[name].measured == pytest.approx(1.5) and not apart[name].passed
    assert together[name].measured == pytest.approx(5.0 / 4.8) and together[name].passed
    assert "before and after the servers: 1.5x" in together[name].why


def test_the_engines_own_step_is_timed_at_a_one_client_context(tiny_engine_factory):
    ctx = BenchContext(tiny_engine_factory(), None, quick=True, tiny=True)
    with one_torch_thread():
        samples = serve.engine_step_ms(ctx, max_tokens=8, samples=5)
    assert len(samples) == 5 and all(ms > 0 for ms in samples)


# ---- the real llama-server, where one was built or is on PATH ----------------------------------------------------
def test_a_real_llama_server_passes_its_batch_check_streams_and_publishes_metrics():
    binary = llama_server.find_binary()
    if binary is None:
        pytest.skip("no llama-server: `make peers` builds one (the peer plumbing is tested above without it)")
    peer, note = llama_server.start_peer(loader.default_model_path(), 1, parallel=4, context=2048, binary=binary)
    assert peer is not None, note
    try:
        model = httpx.get(peer.url + "/v1/models", timeout=30).json()["data"][0]["id"]
        two = asyncio.run(serve._clients(peer.url, model, 2, 8, together=True))
        assert two["tokens"] == 16 and all(two["texts"]) and len(two["gaps_ms"]) > 0
        kv = server_kv(httpx.get(peer.url + "/metrics", timeout=30).text)
        assert kv.flavour == "llama.cpp" and kv.generation_tokens >= 16
    finally:
        peer.stop()
    assert peer.proc.poll() is not None


def write_executable(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path
