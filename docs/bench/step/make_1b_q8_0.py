"""A random-weight GGUF with Llama-3.2-1B's layer shapes in Q8_0, for `bench step --model FILE --weights int8`
(issue 16: kvscope with the file's own int8 integers against llama.cpp on a bigger model than the default).

    .venv/bin/python docs/bench/step/make_1b_q8_0.py /tmp/llama-1b-shapes-q8_0.gguf

Shapes: hidden 2,048, 16 layers, 32 query heads and 8 KV heads of 64, MLP 8,192, rope theta 500,000, a tied
head; the vocabulary is the default model's (49,152 tokens, its tokenizer and chat template: no model hub here),
so the head is 49,152 x 2,048 instead of Llama 3's 128,256. Weights are normal(0, 0.02), quantized to Q8_0 by
gguf-py as llama.cpp's converter does (`--outtype q8_0`); norms F32. ~1.2 GB, a minute or two on 2 cores.
"""

from __future__ import annotations

import sys

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T

from engine import loader

SHAPES = dict(hidden=2048, layers=16, heads=32, kv_heads=8, head_dim=64, mlp=8192, theta=500000.0, context=8192)


def tokenizer_fields() -> dict[str, tuple]:
    source = gguf.GGUFReader(str(loader.default_model_path()))
    return {key: (field.contents(), field.types[0], field.types[1] if len(field.types) > 1 else None)
            for key, field in source.fields.items() if key.startswith("tokenizer.")}


def main(path: str) -> None:
    s, rng = SHAPES, np.random.default_rng(0)
    fields = tokenizer_fields()
    vocab = len(fields["tokenizer.ggml.tokens"][0])
    writer = gguf.GGUFWriter(path, "llama")
    for key, (value, kind, sub) in fields.items():
        writer.add_key_value(key, value, kind, sub_type=sub)
    for add, value in ((writer.add_block_count, s["layers"]), (writer.add_context_length, s["context"]),
                       (writer.add_embedding_length, s["hidden"]), (writer.add_feed_forward_length, s["mlp"]),
                       (writer.add_head_count, s["heads"]), (writer.add_head_count_kv, s["kv_heads"]),
                       (writer.add_rope_dimension_count, s["head_dim"]), (writer.add_rope_freq_base, s["theta"]),
                       (writer.add_layer_norm_rms_eps, 1e-5), (writer.add_vocab_size, vocab)):
        add(value)

    def matrix(name: str, rows: int, cols: int) -> None:
        w = rng.normal(0.0, 0.02, (rows, cols)).astype(np.float32)
        writer.add_tensor(name, gguf.quants.quantize(w, T.Q8_0), raw_dtype=T.Q8_0)

    h, q, kv, f = s["hidden"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"], s["mlp"]
    matrix("token_embd.weight", vocab, h)
    for i in range(s["layers"]):
        for name, rows, cols in (("attn_q", q, h), ("attn_k", kv, h), ("attn_v", kv, h), ("attn_output", h, q),
                                 ("ffn_gate", f, h), ("ffn_up", f, h), ("ffn_down", h, f)):
            matrix(f"blk.{i}.{name}.weight", rows, cols)
        for name in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{name}.weight", np.ones(h, dtype=np.float32))
        print(f"layer {i + 1}/{s['layers']}", flush=True)
    writer.add_tensor("output_norm.weight", np.ones(h, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "llama-1b-shapes-q8_0.gguf")
