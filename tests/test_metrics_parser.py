"""The /metrics parser on expositions written with the names vLLM and llama.cpp's server document, and on
kvscope's own; what a server does not publish is None (unavailable), never zero."""

from __future__ import annotations

from app.backends.metrics_parser import ServerKV, parse_exposition, server_kv

# vLLM (docs: "Production Metrics"; V1 engine names, model_name label on every series)
VLLM = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.42
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2000.0
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1500.0
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2000.0
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 640.0
# TYPE vllm:inter_token_latency_seconds histogram
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.01",model_name="meta-llama/Llama-3.1-8B-Instruct"} 12.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 640.0
vllm:inter_token_latency_seconds_count{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 640.0
vllm:inter_token_latency_seconds_sum{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 9.5
"""

# vLLM before V1: gpu_cache_usage_perc and no prefix-cache counters
VLLM_V0 = """\
vllm:num_requests_running{model_name="m"} 2.0
vllm:num_requests_waiting{model_name="m"} 0.0
vllm:gpu_cache_usage_perc{model_name="m"} 0.25
vllm:prompt_tokens_total{model_name="m"} 10.0
"""

# llama.cpp server with --metrics (tools/server README: "GET /metrics")
LLAMA_CPP = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 6886
# HELP llamacpp:prompt_seconds_total Prompt process time
# TYPE llamacpp:prompt_seconds_total counter
llamacpp:prompt_seconds_total 2903.63
# HELP llamacpp:tokens_predicted_total Number of generation tokens processed.
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 3469
# HELP llamacpp:prompt_tokens_seconds Average prompt throughput in tokens/s.
# TYPE llamacpp:prompt_tokens_seconds gauge
llamacpp:prompt_tokens_seconds 2.37151
# HELP llamacpp:kv_cache_usage_ratio KV-cache usage. 1 means 100 percent usage.
# TYPE llamacpp:kv_cache_usage_ratio gauge
llamacpp:kv_cache_usage_ratio 0.125
# HELP llamacpp:kv_cache_tokens KV-cache tokens.
# TYPE llamacpp:kv_cache_tokens gauge
llamacpp:kv_cache_tokens 1024
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 1
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 0
"""

# newer llama.cpp builds no longer export the KV gauges: usage must come out unavailable, not 0
LLAMA_CPP_NEW = """\
llamacpp:prompt_tokens_total 96641
llamacpp:tokens_predicted_total 23210
llamacpp:n_decode_total 23381
llamacpp:n_tokens_max 42094
llamacpp:requests_processing 0
llamacpp:requests_deferred 0
"""

KVSCOPE = """\
# TYPE kvscope:kv_cache_usage_perc gauge
kvscope:kv_cache_usage_perc{model_name="SmolLM2"} 0.5
kvscope:num_requests_running{model_name="SmolLM2"} 4.0
kvscope:num_requests_waiting{model_name="SmolLM2"} 2.0
kvscope:prefix_cache_queries_total{model_name="SmolLM2"} 100.0
kvscope:prefix_cache_hits_total{model_name="SmolLM2"} 64.0
kvscope:prompt_tokens_total{model_name="SmolLM2"} 100.0
kvscope:generation_tokens_total{model_name="SmolLM2"} 40.0
kvscope:kv_blocks_total{model_name="SmolLM2"} 512.0
kvscope:kv_blocks_used{model_name="SmolLM2"} 256.0
kvscope:kv_blocks_free{model_name="SmolLM2"} 200.0
kvscope:kv_blocks_cached{model_name="SmolLM2"} 56.0
kvscope:kv_cache_bytes_allocated{model_name="SmolLM2"} 3.7748736e+08
kvscope:kv_cache_bytes_used{model_name="SmolLM2"} 1.8874368e+08
kvscope:kv_cache_bytes_theoretical{model_name="SmolLM2"} 1.8e+08
"""


def test_vllm_names_are_read():
    kv = server_kv(VLLM)
    assert kv.flavour == "vLLM"
    assert (kv.kv_usage, kv.running, kv.waiting) == (0.42, 3, 1)
    assert (kv.prefix_queries, kv.prefix_hits, kv.prefix_hit_rate) == (2000, 1500, 0.75)
    assert (kv.prompt_tokens, kv.generation_tokens) == (2000, 640)
    assert kv.bytes_allocated is None and kv.blocks_used is None  # vLLM does not publish them


def test_older_vllm_names_are_read_and_missing_prefix_counters_are_unavailable():
    kv = server_kv(VLLM_V0)
    assert kv.flavour == "vLLM" and kv.kv_usage == 0.25 and kv.running == 2
    assert kv.prefix_hits is None and kv.prefix_hit_rate is None


def test_llama_cpp_names_are_read():
    kv = server_kv(LLAMA_CPP)
    assert kv.flavour == "llama.cpp"
    assert (kv.kv_usage, kv.kv_tokens, kv.running, kv.waiting) == (0.125, 1024, 1, 0)
    assert (kv.prompt_tokens, kv.generation_tokens) == (6886, 3469)
    assert kv.prefix_hits is None


def test_a_llama_cpp_build_without_kv_gauges_leaves_usage_unavailable():
    kv = server_kv(LLAMA_CPP_NEW)
    assert kv.flavour == "llama.cpp" and kv.kv_usage is None and kv.kv_tokens is None
    assert kv.running == 0 and kv.generation_tokens == 23210


def test_kvscope_names_include_the_block_pool():
    kv = server_kv(KVSCOPE)
    assert kv.flavour == "kvscope"
    assert (kv.blocks_total, kv.blocks_used, kv.blocks_free, kv.blocks_cached) == (512, 256, 200, 56)
    assert kv.bytes_allocated == 377487360 and kv.bytes_theoretical == 1.8e8
    assert kv.prefix_hit_rate == 0.64


def test_an_unknown_exposition_is_all_unavailable():
    assert server_kv("process_cpu_seconds_total 12.5\n") == ServerKV()
    assert server_kv("") == ServerKV()


def test_labels_escapes_timestamps_and_bad_lines():
    samples = parse_exposition('m{a="x\\"y",b="1"} 2.5 1700000000000\nbroken line here\nn NaN\nm2 +Inf\nz abc\n')
    assert samples[0].name == "m" and samples[0].labels == {"a": 'x"y', "b": "1"} and samples[0].value == 2.5
    assert [s.name for s in samples] == ["m", "n", "m2"]


def test_several_series_add_up_but_a_usage_fraction_is_averaged():
    text = ('vllm:num_requests_running{engine="0"} 2\nvllm:num_requests_running{engine="1"} 3\n'
            'vllm:kv_cache_usage_perc{engine="0"} 0.2\nvllm:kv_cache_usage_perc{engine="1"} 0.4\n')
    kv = server_kv(text)
    assert kv.running == 5 and abs(kv.kv_usage - 0.3) < 1e-12


def test_the_panel_rows_label_the_servers_figures_and_say_what_is_unavailable():
    from app.backends.server_view import server_rows, status_text

    vllm = dict((title, (value, detail)) for title, value, detail in server_rows(server_kv(VLLM), "m", "http://gpu"))
    assert vllm["Server"] == ("vLLM server", "m at http://gpu")
    assert vllm["Server KV-cache usage"][0] == "42.0%"
    assert vllm["Server prefix cache"][0] == "75.0% of prompt tokens hit"
    assert vllm["Server block pool"] == ("unavailable", "vLLM does not publish it")
    assert vllm["Server KV memory"] == ("unavailable", "vLLM does not publish it")
    ours = dict((title, value) for title, value, _ in server_rows(server_kv(KVSCOPE)))
    assert ours["Server block pool"] == "256 of 512 blocks used" and ours["Server KV memory"] == "360.0 MiB"
    assert "unavailable" in server_rows(None, "m", "http://x")[0][2]
    assert status_text(server_kv(LLAMA_CPP_NEW)) == "server KV unavailable"
    assert status_text(server_kv(LLAMA_CPP)) == "server KV 12%"


def test_a_url_that_is_not_a_server_url_is_a_clear_error():
    import pytest

    from app.backends import http

    with http.make_client() as client:
        for url in ("localhost:8000", "foo", "http://"):
            with pytest.raises(http.RemoteError, match="is not a server URL"):
                http.list_models(client, url, None)
    assert http.base_url(" http://h:8000/v1/ ") == "http://h:8000"


def test_llama_cpp_cached_prompt_tokens_are_its_prefix_cache_hits():
    kv = server_kv("llamacpp:prompt_tokens_total 300\nllamacpp:prompt_tokens_cached_total 100\n")
    assert (kv.prefix_hits, kv.prefix_queries, kv.prefix_hit_rate) == (100, 400, 0.25)
    assert kv.prompt_tokens == 300  # the tokens it computed


def test_context_and_token_figures_a_server_does_not_publish_read_unavailable_never_zero():
    from app.backends.server_view import server_rows

    def rows(text):
        return {title: (value, detail) for title, value, detail in server_rows(server_kv(text))}

    new = rows(LLAMA_CPP_NEW)  # no KV gauges: tokens held unavailable, the longest sequence published
    assert new["Server context"] == ("unavailable", "longest sequence so far 42,094 tokens; tokens held: llama.cpp "
                                     "does not publish it")
    assert new["Server tokens"] == ("23,210 generated", "96,641 prompt tokens processed")
    assert rows(LLAMA_CPP)["Server context"][0] == "1,024 tokens held"
    assert rows(LLAMA_CPP)["Server context"][1] == "longest sequence: unavailable"
    assert "Server context" not in rows(VLLM) and "Server context" not in rows(KVSCOPE)  # no such figures at all
    gauges_only = rows("llamacpp:requests_processing 1\nllamacpp:requests_deferred 0\n")
    assert gauges_only["Server tokens"] == ("unavailable", "llama.cpp does not publish it")
    generated_only = rows("llamacpp:tokens_predicted_total 5\n")
    assert generated_only["Server tokens"] == ("5 generated", "prompt tokens: unavailable (llama.cpp does not "
                                                               "publish it)")


# a real llama-server /metrics (llama.cpp 0.5.0-dev, commit 0c1e570, built by `make peers` from the llama-cpp-python
# 0.3.36 sdist; --metrics, SmolLM2-135M-Instruct Q4_1, after a few requests): no KV gauges any more, the prompt
# tokens it computed and those it reused from its cache counted apart, the longest sequence it held
LLAMA_SERVER_REAL = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed, excluding cached tokens
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 87
# HELP llamacpp:prompt_tokens_cached_total Number of prompt tokens reused from the cache
# TYPE llamacpp:prompt_tokens_cached_total counter
llamacpp:prompt_tokens_cached_total 24
# HELP llamacpp:prompt_seconds_total Total time spent processing prompts
# TYPE llamacpp:prompt_seconds_total counter
llamacpp:prompt_seconds_total 7.36684
# HELP llamacpp:tokens_predicted_total Number of generation tokens processed
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 36
# HELP llamacpp:tokens_predicted_seconds_total Total time spent generating tokens
# TYPE llamacpp:tokens_predicted_seconds_total counter
llamacpp:tokens_predicted_seconds_total 24.9922
# HELP llamacpp:n_decode_total Total number of llama_decode() calls, excluding speculative decoding and multimodal \
decoding
# TYPE llamacpp:n_decode_total counter
llamacpp:n_decode_total 21
# HELP llamacpp:n_tokens_max Largest observed sequence length (prompt + generation)
# TYPE llamacpp:n_tokens_max counter
llamacpp:n_tokens_max 54
# HELP llamacpp:spec_decode_num_draft_tokens_total Speculative: Total draft tokens generated
# TYPE llamacpp:spec_decode_num_draft_tokens_total counter
llamacpp:spec_decode_num_draft_tokens_total 0
# HELP llamacpp:spec_decode_num_accepted_tokens_total Speculative: Total draft tokens accepted by the target model
# TYPE llamacpp:spec_decode_num_accepted_tokens_total counter
llamacpp:spec_decode_num_accepted_tokens_total 0
# HELP llamacpp:spec_decode_num_drafts_total Speculative: Total speculative decoding verification steps
# TYPE llamacpp:spec_decode_num_drafts_total counter
llamacpp:spec_decode_num_drafts_total 0
# HELP llamacpp:prompt_tokens_seconds Average prompt throughput in tokens/s
# TYPE llamacpp:prompt_tokens_seconds gauge
llamacpp:prompt_tokens_seconds 11.8097
# HELP llamacpp:predicted_tokens_seconds Average generation throughput in tokens/s
# TYPE llamacpp:predicted_tokens_seconds gauge
llamacpp:predicted_tokens_seconds 1.32041
# HELP llamacpp:requests_processing Number of requests processing
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 0
# HELP llamacpp:requests_deferred Number of requests deferred
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 0
# HELP llamacpp:n_busy_slots_per_decode Average number of busy slots per llama_decode() call
# TYPE llamacpp:n_busy_slots_per_decode gauge
llamacpp:n_busy_slots_per_decode 1.71429
"""


def test_a_real_llama_server_exposition_reads_its_figures_and_leaves_the_rest_unavailable():
    from app.backends.server_view import server_rows, status_text

    kv = server_kv(LLAMA_SERVER_REAL)
    assert kv.flavour == "llama.cpp" and (kv.running, kv.waiting) == (0, 0)
    assert (kv.prompt_tokens, kv.generation_tokens, kv.longest_sequence) == (87, 36, 54)
    assert (kv.prefix_hits, kv.prefix_queries) == (24, 87 + 24)
    assert kv.kv_usage is None and kv.kv_tokens is None and kv.blocks_used is None and kv.bytes_allocated is None
    rows = {title: (value, detail) for title, value, detail in server_rows(kv, "m", "http://127.0.0.1:8080")}
    assert rows["Server KV-cache usage"] == ("unavailable", "llama.cpp does not publish it")
    held, longest = rows["Server context"]
    assert held == "unavailable" and "longest sequence so far 54 tokens" in longest
    assert rows["Server tokens"] == ("36 generated", "87 prompt tokens processed")
    assert rows["Server prefix cache"][0] == "21.6% of prompt tokens hit"
    assert status_text(kv) == "server KV unavailable"


def test_a_prefix_cache_that_has_seen_no_prompt_yet_says_so_rather_than_unavailable():
    from app.backends.server_view import server_rows

    idle = KVSCOPE.replace("prefix_cache_queries_total{model_name=\"SmolLM2\"} 100.0",
                           "prefix_cache_queries_total{model_name=\"SmolLM2\"} 0.0")
    idle = idle.replace("prefix_cache_hits_total{model_name=\"SmolLM2\"} 64.0",
                        "prefix_cache_hits_total{model_name=\"SmolLM2\"} 0.0")
    rows = {title: (value, detail) for title, value, detail in server_rows(server_kv(idle))}
    assert rows["Server prefix cache"] == ("no prompt tokens yet", "0 of 0 tokens looked up")
    assert not any("unavailable" in value for value, _ in rows.values())  # kvscope publishes every figure shown
