"""Weight formats: GGUF blocks load as the same integers, each format's kernels compute what its dequantized
weights say, conversions go one tensor at a time, and bad files are refused with a clear message."""

from __future__ import annotations

import contextlib

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from transformers import LlamaForCausalLM

from engine import kernels, loader
from engine.config import EngineConfig
from engine.engine import Engine
from engine.loader import ModelLoadError
from engine.model import LlamaModel
from engine.weights.convert import to_format
from engine.weights.formats import QuantizedWeight, quantize_int4, quantize_int8
from engine.weights.gguf_blocks import quantize_int8_groups, unpermute_rows
from engine.weights.linear import (
    DECODE_ROWS,
    Int4Linear,
    Int8Linear,
    build_linear,
    dequantize_codes,
    int8_rows16_parts,
    int8_to_rows16,
    rows16_parts,
    to_rows16,
)
from tests.gguf_files import gguf_name, write_tiny_gguf


@pytest.fixture(autouse=True, scope="module")
def private_cache(tmp_path_factory, default_weights):
    """One conversion cache for this module's files, never the user's (each conversion takes seconds)."""
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVSCOPE_CACHE_DIR", str(cache))
        yield cache


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """(path, float weights written) of a 2-layer GGUF mixing Q4_1, Q4_0, Q5_0 and Q8_0 (see MIXED_TYPES)."""
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def file_tensor_dequantized(path, hf: str, num_heads: int | None = None) -> torch.Tensor:
    """gguf-py's own dequantization of one tensor, in PyTorch order and Hugging Face's row order."""
    tensor = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == gguf_name(hf))
    shape = tuple(int(d) for d in reversed(tensor.shape))
    w = torch.from_numpy(np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type)).reshape(shape).copy())
    return w[unpermute_rows(w.shape[0], num_heads)] if num_heads else w


# ---- GGUF blocks -> formats without a float32 round-trip ------------------------------------------------


@pytest.mark.parametrize("name, heads, bits", [
    ("model.layers.0.mlp.down_proj.weight", None, 4),  # Q4_1
    ("model.layers.0.self_attn.q_proj.weight", 4, 4),  # Q4_1, rows back in Hugging Face's rotary order
    ("model.layers.1.self_attn.k_proj.weight", 2, 4),  # Q4_0
    ("model.layers.1.mlp.gate_proj.weight", None, 4),  # Q4_0
    ("model.embed_tokens.weight", None, 8),  # Q8_0
])
def test_gguf_blocks_load_as_the_same_integers(tiny_gguf, name, heads, bits):
    path, _ = tiny_gguf
    weight = loader.load_weights(str(path)).state_dict[name]
    assert isinstance(weight, QuantizedWeight) and weight.bits == bits and weight.group_size == 32
    assert weight.scales.dtype == torch.float16
    assert torch.equal(weight.dequantize(), file_tensor_dequantized(path, name, heads))


def test_a_tiny_gguf_gives_the_logits_transformers_computes_from_the_same_file(tiny_gguf):
    path, _ = tiny_gguf
    engine = Engine.load(str(path), EngineConfig(cache="paged", weights="float32", kv_dtype="float32"))
    hf = LlamaForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    ids = engine.tokenizer.encode("The KV cache keeps keys and values.", add_special_tokens=False)
    engine.cache.prepare(1, ids)
    ours = engine.step([1], [ids], all_logits=True)[0]
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_other_block_types_are_dequantized_one_tensor_at_a_time_and_requantized(tiny_gguf):
    path, _ = tiny_gguf
    name = "model.layers.1.mlp.down_proj.weight"  # Q5_0
    state = loader.load_weights(str(path), weight_format="int4").state_dict
    down = state[name]
    assert isinstance(down, QuantizedWeight) and down.bits == 4
    exact = file_tensor_dequantized(path, name).view(down.shape[0], -1, 32)
    step = (exact.amax(-1) - exact.amin(-1)) / 15
    assert ((down.dequantize().view(exact.shape) - exact).abs() <= step[..., None] * 0.51 + 1e-3).all()


def test_the_disk_cache_keeps_the_quantized_form_and_is_read_on_the_second_start(tiny_gguf, monkeypatch):
    path, _ = tiny_gguf
    loader.load_weights(str(path))
    cached = loader.gguf_cache_folder(path) / "model.safetensors"
    assert cached.stat().st_size <= 1.3 * path.stat().st_size
    conversions = []
    monkeypatch.setattr(loader, "convert_gguf", lambda *args: conversions.append(args))
    loader.load_weights(str(path), weight_format="int4")
    assert conversions == []


def test_a_tensor_type_that_cannot_be_read_is_named_in_the_error(tmp_path):
    path = tmp_path / "odd.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    raw = np.zeros((4, 292), dtype=np.uint8)  # four rows of one Q8_K block each: a type gguf-py cannot read
    writer.add_tensor("blk.0.ffn_down.weight", raw, raw_dtype=T.Q8_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError) as error:
        loader.read_gguf_weights(path, {"num_attention_heads": 1})
    assert "Q8_K" in str(error.value) and "blk.0.ffn_down.weight" in str(error.value)


# ---- kernels: each format computes what its dequantized weights say -------------------------------------


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8", "int4"])
@pytest.mark.parametrize("rows", [1, DECODE_ROWS, 64])
def test_each_format_multiplies_like_its_dequantized_weight(fmt, rows):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(128, 256, generator=g) * 0.05
    module = build_linear(to_format(w, fmt, "model.layers.0.mlp.down_proj.weight"))
    assert module.format_name == fmt
    x = torch.randn(rows, 256, generator=g)
    exact = x @ module.dense(torch.float32).T
    got = module(x)
    assert got.dtype == torch.float32 and got.shape == (rows, 128)
    # kvscope's kernels quantize int8 / int4 weights' activations to 15 bits a row (any number of rows in their
    # 16-row layout); torch's fallback kernels round activations to bfloat16 (~3 significant digits)
    kernel = module.decodes(rows) and fmt != "float32"
    tolerance = (1e-4 if module.compiled is not None else 2e-2) if kernel else 1e-5
    torch.testing.assert_close(got, exact, atol=tolerance * float(exact.abs().max()), rtol=0)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("pure", [False, True])
def test_a_quantized_projection_moved_off_the_cpu_decodes_by_dequantizing(fmt, pure):
    """Built on the CPU (as a GGUF loads) then moved, as Engine moves a model to CUDA: neither the compiled
    kernels nor torch's CPU int4 packing / int8 groups may be called there. The meta device stands in for CUDA."""
    w = torch.randn(64, 64, generator=torch.Generator().manual_seed(1)) * 0.05
    with kernels.pure_pytorch() if pure else contextlib.nullcontext():
        moved = build_linear(to_format(w, fmt, "model.layers.0.mlp.down_proj.weight")).to("meta")
    got = moved.decode(torch.randn(2, 64, device="meta"))
    assert got.device.type == "meta" and got.shape == (2, 64)


def test_int4_reads_its_codes_back_from_the_kernel_layout_without_a_second_copy():
    w = torch.randn(192, 128) * 0.1
    q = quantize_int4(w)
    module = Int4Linear(q)
    assert torch.equal(module.codes(), q.unpacked_codes())
    if module.packed is not None and module.kernel_codes is None:
        groups = q.scales.numel()
        # packed codes + float16 scales and minimums + the kernel's bfloat16 (scale, zero) pairs
        assert module.resident_bytes == q.codes.nbytes + 4 * groups + 4 * groups


@pytest.mark.parametrize("group", [32, 64])
def test_the_16_row_layout_holds_the_same_weight_and_dequantizes_to_the_same_values(group):
    q = quantize_int4(torch.randn(48, 192), group).with_float16_scales()
    codes, scales, minimums = to_rows16(q)
    assert codes.shape == (3, 6, 256) and scales.shape == minimums.shape == (3, 192 // group, 16)
    plain, back_scales, back_minimums = rows16_parts(codes, scales, minimums)
    assert all(torch.equal(a, b) for a, b in [(plain.reshape(48, 192), q.unpacked_codes()),
                                              (back_scales, q.scales), (back_minimums, q.minimums)])
    assert torch.equal(dequantize_codes(*rows16_parts(codes, scales, minimums), torch.float32), q.dequantize())


def rows16_kernel():
    ops = kernels.ops()
    if ops is None or ops.int4_row_block() != 16:
        pytest.skip("the 16-row int4 kernel is built only for AVX2 and AVX-512")
    return ops


def assert_the_16_row_layout_computes_what_rows_one_at_a_time_do(linear, x, rows16, plain, dense):
    """linear(x, *rows16) against linear(x, *plain) and the float64 product with `dense`, and row by row."""
    got = linear(x, *rows16)
    exact = x.double() @ dense.T
    # the same integers, other float steps: both within the int16 activations' error of the exact product
    torch.testing.assert_close(got, linear(x, *plain), atol=1e-5 * float(exact.abs().max()), rtol=0)
    torch.testing.assert_close(got.double(), exact, atol=1e-4 * float(exact.abs().max()), rtol=0)
    for i in range(x.shape[0]):  # a row's result does not depend on the rows beside it
        assert torch.equal(linear(x[i:i + 1].contiguous(), *rows16)[0], got[i])


@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize("rows", [1, 3, 8, 13, 16])
def test_the_16_row_int4_kernel_computes_what_the_row_at_a_time_kernel_does(group, rows):
    ops = rows16_kernel()
    g = torch.Generator().manual_seed(rows)
    q = quantize_int4(torch.randn(96, 320, generator=g) * 0.05, group).with_float16_scales()
    x = torch.randn(rows, 320, generator=g)
    assert_the_16_row_layout_computes_what_rows_one_at_a_time_do(
        ops.int4_linear, x, to_rows16(q), (q.codes, q.scales, q.minimums), q.dequantize(torch.float64))


def test_a_projection_whose_rows_do_not_fill_16_keeps_the_row_at_a_time_layout():
    rows16_kernel()
    w = torch.randn(40, 64) * 0.1
    module, whole = Int4Linear(quantize_int4(w)), Int4Linear(quantize_int4(torch.cat([w, w[:8]])))
    assert not module.rows16 and module.kernel_codes.shape == (40, 32) and whole.rows16
    x = torch.randn(2, 64)
    torch.testing.assert_close(module(x), whole(x)[:, :40], atol=1e-5, rtol=0)


def test_the_16_row_kernel_refuses_tensors_of_another_shape_by_what_it_expects():
    ops = rows16_kernel()
    codes, scales, minimums = to_rows16(quantize_int4(torch.randn(32, 64)).with_float16_scales())
    with pytest.raises(RuntimeError, match="16-row layout"):
        ops.int4_linear(torch.randn(1, 64), codes, scales[:, :, :8].contiguous(), minimums)


def int8_weight(n: int, k: int, group: int | None, seed: int = 0) -> QuantizedWeight:
    """int8 codes with a scale per group of `group` inputs (None: one per output row), float16 scales."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    return (quantize_int8(w) if group is None else quantize_int8_groups(w, group)).with_float16_scales()


@pytest.mark.parametrize("group", [32, 64, None])
def test_the_int8_16_row_layout_holds_the_same_weight_and_reads_back_the_same_values(group):
    q = int8_weight(48, 192, group)
    codes, scales = int8_to_rows16(q)
    assert codes.shape == (3, 6, 512) and scales.shape == (3, q.scales.shape[1], 16)
    plain, back_scales = int8_rows16_parts(codes, scales)
    assert torch.equal(plain.reshape(48, 192), q.codes) and torch.equal(back_scales, q.scales)
    rows16_kernel()
    module = Int8Linear(q)
    assert module.rows16 and module.codes.shape == (3, 6, 512)
    assert torch.equal(module.quantized().codes, q.codes) and torch.equal(module.quantized().scales, q.scales)
    assert torch.equal(module.dense(torch.float32), q.dequantize())
    ids = torch.tensor([[0, 17, 47], [31, 31, 2]])
    for dtype in (torch.float32, torch.bfloat16):  # the compiled lookup, and the tensor ops for other dtypes
        assert torch.equal(module.rows(ids, dtype), q.dequantize(dtype)[ids])


@pytest.mark.parametrize("group", [32, 64, None])
@pytest.mark.parametrize("rows", [1, 3, 8, 13, 16])
def test_the_16_row_int8_kernel_computes_what_the_row_at_a_time_kernel_does(group, rows):
    ops = rows16_kernel()
    q = int8_weight(96, 320, group, seed=rows)
    x = torch.randn(rows, 320, generator=torch.Generator().manual_seed(rows + 100))
    assert_the_16_row_layout_computes_what_rows_one_at_a_time_do(
        ops.int8_linear, x, int8_to_rows16(q), (q.codes, q.scales), q.dequantize(torch.float64))


def test_an_int8_projection_whose_rows_do_not_fill_16_keeps_the_row_at_a_time_layout():
    rows16_kernel()
    q = int8_weight(40, 64, 32)
    module, whole = Int8Linear(q), Int8Linear(QuantizedWeight.concat([q, q.rows(torch.arange(8))]))
    assert not module.rows16 and module.codes.shape == (40, 64) and whole.rows16
    x = torch.randn(2, 64)
    torch.testing.assert_close(module(x), whole(x)[:, :40], atol=1e-5, rtol=0)


def test_the_int8_16_row_kernel_and_lookup_refuse_tensors_of_another_shape_by_what_they_expect():
    ops = rows16_kernel()
    codes, scales = int8_to_rows16(int8_weight(32, 64, 32))
    with pytest.raises(RuntimeError, match="16-row layout"):
        ops.int8_linear(torch.randn(1, 64), codes, scales[:, :, :8].contiguous())
    with pytest.raises(RuntimeError, match="outside the 32 rows"):
        ops.int8_embed(codes, scales, torch.tensor([32]))


def test_quantization_rounds_to_the_nearest_step():
    w = torch.randn(64, 128)
    for q, step in [(quantize_int8(w), w.abs().amax(1, keepdim=True) / 127),
                    (quantize_int4(w), None)]:
        error = (q.dequantize() - w).abs()
        if step is None:
            groups = w.view(64, 4, 32)
            step = ((groups.amax(-1) - groups.amin(-1)) / 15).repeat_interleave(32, dim=1)
        assert (error <= step * 0.5 + step * 2**-9 + 1e-6).all()


@pytest.mark.parametrize("group", [32, 64])
def test_int8_embedding_rows_are_the_dequantized_tables_rows_bit_for_bit_on_either_path(group):
    w = torch.randn(100, 64)
    q = quantize_int8(w) if group == 64 else quantize_int8_groups(w, group)
    ids = torch.tensor([[0, 5, 99], [7, 7, 1]])
    expected = Int8Linear(q).dense(torch.float32)[ids]
    assert torch.equal(Int8Linear(q).rows(ids, torch.float32), expected)  # the compiled lookup where it is built
    with kernels.pure_pytorch():
        assert torch.equal(Int8Linear(q).rows(ids, torch.float32), expected)


@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize("rows", [128, 112, 100])  # the 16-row layout where it is built, else GGUF's order;
@pytest.mark.parametrize("pure", [False, True])  # without the kernels torch's packing (128 rows) or GGUF's order
def test_int4_embedding_rows_are_the_dequantized_tables_rows_bit_for_bit_in_every_layout(rows, pure, group):
    q = quantize_int4(torch.randn(rows, 128), group)
    ids = torch.tensor([[0, 5, rows - 1], [7, 7, 17]])
    with kernels.pure_pytorch() if pure else contextlib.nullcontext():
        module = Int4Linear(q)
        for dtype in (torch.float32, torch.bfloat16):
            assert torch.equal(module.rows(ids, dtype), module.dense(dtype)[ids])
        with pytest.raises(IndexError, match=str(rows)):
            module.rows(torch.tensor([[3, rows]]), torch.float32)


@pytest.mark.parametrize("pure", [False, True])
def test_an_embedding_row_outside_the_table_is_refused_by_its_number(pure):
    with kernels.pure_pytorch() if pure else contextlib.nullcontext():
        module = Int8Linear(quantize_int8(torch.randn(100, 64)))
        with pytest.raises((RuntimeError, IndexError), match="100"):
            module.rows(torch.tensor([[3, 100]]), torch.float32)


def test_a_model_converts_to_every_format_and_reports_what_it_holds(tiny_config, tokenizer):
    sizes = {}
    for fmt in ("float32", "bfloat16", "int8", "int4"):
        engine = Engine(LlamaModel.random(tiny_config, seed=0), tokenizer, EngineConfig(weights=fmt))
        assert engine.weight_format == fmt
        sizes[fmt] = engine.weights_resident_bytes
    assert sizes["float32"] > sizes["bfloat16"] > sizes["int8"] > sizes["int4"]


# ---- auto: the fastest measured format that meets the quality bounds, measured once ---------------------------


def test_auto_is_the_fastest_measured_candidate_and_is_remembered_for_this_machine(tmp_path, monkeypatch):
    from engine.weights import convert

    measured = []

    def measure(shape, stream_bytes):
        measured.append((shape, stream_bytes))
        return {"float32": 90.0, "bfloat16": 50.0, "int8": 10.0, "int4": 30.0}  # int8 is no candidate

    monkeypatch.setattr(convert, "measure_decode_formats", measure)
    cpu = torch.device("cpu")
    assert convert.resolve_auto(cpu, (1536, 576), tmp_path) == "int4"
    assert convert.resolve_auto(cpu, (1536, 576), tmp_path) == "int4"
    assert measured == [((1536, 576), convert.STREAM_BYTES)]  # a model's bytes stream at most STREAM_BYTES
    assert convert.resolve_auto(cpu, (64, 64), tmp_path) == "int4" and len(measured) == 2  # another shape: measured
    assert convert.resolve_auto(cpu, (64, 64), tmp_path, 300_000) == "int4"  # a tiny model: its own bytes
    assert measured[-1] == ((64, 64), 300_000)
    assert convert.resolve_auto(torch.device("cuda"), (64, 64), tmp_path) == "bfloat16"
    assert [p.name for p in tmp_path.iterdir()] == [convert.CHOICE_FILE]  # no temp file left behind


def test_a_damaged_choice_file_is_measured_again_and_rewritten(tmp_path, monkeypatch):
    from engine.weights import convert

    (tmp_path / convert.CHOICE_FILE).write_text("{ not json")
    monkeypatch.setattr(convert, "measure_decode_formats", lambda shape, stream_bytes: {
        "float32": 1.0, "bfloat16": 2.0, "int8": 3.0, "int4": 4.0})
    assert convert.resolve_auto(torch.device("cpu"), (8, 8), tmp_path) == "float32"
    assert "float32" in (tmp_path / convert.CHOICE_FILE).read_text()


def test_the_real_measurement_times_every_format_on_the_shape_asked():
    from engine.weights.convert import AUTO_CANDIDATES, measure_decode_formats

    timings = measure_decode_formats((64, 64), repeats=3, stream_bytes=2**20)
    assert set(timings) == {"float32", "bfloat16", "int8", "int4"} >= set(AUTO_CANDIDATES)
    assert all(t > 0 for t in timings.values())


def test_a_conversion_finished_meanwhile_by_another_process_is_kept(tmp_path):
    target, staging = tmp_path / "model-q1", tmp_path / ".converting-x"
    for folder, text in ((target, "theirs"), (staging, "ours")):
        folder.mkdir()
        (folder / "model.safetensors").write_text(text)
    loader._publish(staging, target)
    assert (target / "model.safetensors").read_text() == "theirs"
    (target / "model.safetensors").unlink()  # a folder without weights (an older layout) is replaced
    loader._publish(staging, target)
    assert (target / "model.safetensors").read_text() == "ours" and not staging.exists()


def test_auto_takes_the_smaller_format_when_a_bigger_one_is_barely_faster():
    from engine.weights.convert import fastest_or_smallest

    assert fastest_or_smallest({"float32": 292.6, "bfloat16": 457.4, "int8": 331.2, "int4": 316.6}) == "int4"
    assert fastest_or_smallest({"float32": 200.0, "bfloat16": 400.0, "int8": 300.0, "int4": 300.0}) == "float32"


def test_the_measurement_streams_a_copy_of_its_own_per_layer_in_every_format():
    from engine.weights.convert import AUTO_CANDIDATES, weight_copies

    w = torch.randn(64, 64)
    for fmt in {"float32", *AUTO_CANDIDATES}:
        modules = weight_copies(w, fmt, 3)
        places = [t.data_ptr() for m in modules for t in m.state_dict().values()]
        assert len(set(places)) == len(places), fmt  # shared memory would be timed from the caches
