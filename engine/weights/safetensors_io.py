"""A safetensors file written one tensor at a time: each tensor's bytes go to disk as it is added, so a converter
holds one tensor, never the whole model (safetensors' own save_file serializes every tensor into one buffer).

The format (https://github.com/huggingface/safetensors): an 8-byte little-endian header length, a JSON header
{name: {"dtype", "shape", "data_offsets": [begin, end]}} padded with spaces to a multiple of 8, then the tensors'
bytes back to back. The header must come first but is known only at the end, so the bytes go to a side file
first and are copied after the header by `finish` (a copy through the page cache, not through this process)."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import torch

DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}
COPY_CHUNK = 16 * 2**20


class SafetensorsStream:
    """stream = SafetensorsStream(path); stream.add(name, tensor) ...; stream.finish(). Nothing is at `path`
    until finish() returns; close() drops the side file (after a failure)."""

    def __init__(self, path: Path, metadata: dict[str, str] | None = None):
        self.path = Path(path)
        self.side = self.path.with_name(self.path.name + ".data")
        self.data = open(self.side, "wb")  # noqa: SIM115 - closed by finish() or close()
        self.entries: dict[str, dict] = {}
        self.metadata = metadata or {}
        self.offset = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.entries:
            raise ValueError(f"tensor {name} added twice")
        if tensor.dtype not in DTYPES:
            raise ValueError(f"{name}: safetensors has no dtype for {tensor.dtype}")
        t = tensor.detach().to("cpu").contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""
        self.data.write(raw)
        nbytes = t.numel() * t.element_size()
        self.entries[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape),
                              "data_offsets": [self.offset, self.offset + nbytes]}
        self.offset += nbytes

    def header(self) -> bytes:
        entries = {"__metadata__": self.metadata, **self.entries} if self.metadata else self.entries
        text = json.dumps(entries, separators=(",", ":")).encode()
        return text + b" " * (-len(text) % 8)

    def finish(self) -> None:
        self.data.close()
        header = self.header()
        with open(self.path, "wb") as out, open(self.side, "rb") as data:
            out.write(struct.pack("<Q", len(header)))
            out.write(header)
            shutil.copyfileobj(data, out, COPY_CHUNK)
        self.side.unlink()

    def close(self) -> None:
        self.data.close()
        self.side.unlink(missing_ok=True)
