"""A GGUF file's structure, read without believing it: the key-values (scalars and strings; arrays counted, or read
on request) and where each tensor's data lies, every length and count checked against the bytes the file holds.

gguf-py's reader builds a numpy view per field part (about 600,000 for a 49k-token vocabulary: seconds); this
walks the same bytes with struct in milliseconds, and is what the loader asks before anything else."""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 8  # ggml's GGML_MAX_DIMS is 4; a few more is still a header, not a corrupt count
MAX_ARRAY_DEPTH = 4

# value type -> struct format of one scalar (8: string and 9: array are read their own way)
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9


class GGUFHeaderError(ValueError):
    """The file is not a GGUF file this reader accepts; the message says what is wrong and where."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    type_id: int
    offset: int  # from the start of the data section


@dataclass
class GGUFHeader:
    version: int
    metadata: dict[str, object] = field(default_factory=dict)  # arrays appear as their element count (or a list)
    types: dict[str, tuple[int, int | None]] = field(default_factory=dict)  # key -> (value type, array element type)
    tensors: list[TensorInfo] = field(default_factory=list)
    data_start: int = 0
    file_size: int = 0


def read_gguf_header(path: Path, arrays: bool = False) -> GGUFHeader:
    """The header, key-values and tensor table; raises GGUFHeaderError if any of it is malformed or if a
    tensor's data would run past the end of the file. arrays: array values read as lists (a vocabulary's 49k
    strings: ~0.1 s), else counted."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size < 24:
            raise GGUFHeaderError(f"the file holds {size} bytes, fewer than a GGUF header")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            header = _Cursor(data, arrays).read_header()
    _check_tensor_extents(header)
    return header


class _Cursor:
    """Reads little-endian values at a moving offset, refusing to read past the end."""

    def __init__(self, data: mmap.mmap, arrays: bool = False):
        self.data, self.at, self.arrays = data, 0, arrays

    def read_header(self) -> GGUFHeader:
        if bytes(self.data[:4]) != b"GGUF":
            raise GGUFHeaderError("it does not start with the GGUF magic bytes")
        self.at = 4
        version = self.scalar("<I")
        if version not in SUPPORTED_VERSIONS:
            hint = " (a big-endian file?)" if struct.unpack("<I", struct.pack(">I", version))[0] in (2, 3) else ""
            raise GGUFHeaderError(f"GGUF version {version}{hint} is not supported; versions 2 and 3 are")
        header = GGUFHeader(version, file_size=len(self.data))
        n_tensors, n_kv = self.count("tensor", 8 + 4 + 4 + 8), self.count("key-value", 8 + 4)
        for _ in range(n_kv):
            key, type_id = self.string("a key"), self.scalar("<I")
            element = self.peek_u32() if type_id == ARRAY else None  # the array's element type, read next
            header.metadata[key], header.types[key] = self.value(type_id, key, depth=0), (type_id, element)
        header.tensors = [self.tensor_info() for _ in range(n_tensors)]
        alignment = header.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise GGUFHeaderError(f"general.alignment is {alignment!r}, not a power of two")
        header.data_start = -(-self.at // alignment) * alignment
        return header

    def take(self, n: int, what: str) -> bytes:
        start = self.skip(n, what)
        return self.data[start:self.at]

    def skip(self, n: int, what: str) -> int:
        if n > len(self.data) - self.at:
            raise GGUFHeaderError(f"{what} at byte {self.at} needs {n:,} bytes; the file ends at {len(self.data):,}")
        start, self.at = self.at, self.at + n
        return start

    def peek_u32(self) -> int | None:
        return struct.unpack_from("<I", self.data, self.at)[0] if len(self.data) - self.at >= 4 else None

    def scalar(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), f"a value ({fmt})"))[0]

    def count(self, what: str, min_bytes_each: int) -> int:
        n = self.scalar("<Q")
        if n * min_bytes_each > len(self.data) - self.at:
            raise GGUFHeaderError(f"the header claims {n:,} {what}s; the file is too small to hold them")
        return n

    def string(self, what: str) -> str:
        length = self.scalar("<Q")
        raw = self.take(length, f"{what} ({length:,} bytes)")
        try:
            return bytes(raw).decode("utf-8")
        except UnicodeDecodeError:
            raise GGUFHeaderError(f"{what} at byte {self.at - length} is not UTF-8 text") from None

    def value(self, type_id: int, key: str, depth: int):
        if type_id in SCALARS:
            return self.scalar(SCALARS[type_id])
        if type_id == STRING:
            return self.string(f"the value of {key}")
        if type_id == ARRAY:
            if depth >= MAX_ARRAY_DEPTH:
                raise GGUFHeaderError(f"{key} nests arrays more than {MAX_ARRAY_DEPTH} deep")
            return self.read_array(key, depth) if self.arrays else self.skip_array(key, depth)
        raise GGUFHeaderError(f"{key} has value type {type_id}, which GGUF does not define")

    def array_head(self, key: str) -> tuple[int, int]:
        """(element type, element count) of the array value starting here."""
        element = self.scalar("<I")
        if element not in SCALARS and element not in (STRING, ARRAY):
            raise GGUFHeaderError(f"{key} is an array of value type {element}, which GGUF does not define")
        return element, self.count(f"element of {key}", struct.calcsize(SCALARS[element]) if element in SCALARS else 8)

    def skip_array(self, key: str, depth: int) -> int:
        element, n = self.array_head(key)
        if element in SCALARS:
            self.skip(n * struct.calcsize(SCALARS[element]), f"the elements of {key}")
        elif element == STRING:
            for _ in range(n):
                self.skip(self.scalar("<Q"), f"a string of {key}")
        else:
            for _ in range(n):
                self.value(element, key, depth + 1)
        return n

    def read_array(self, key: str, depth: int) -> list:
        element, n = self.array_head(key)
        if element in SCALARS:
            fmt = SCALARS[element]
            raw = self.take(n * struct.calcsize(fmt), f"the elements of {key}")
            return list(struct.unpack(f"<{n}{fmt[1:]}", raw))
        return [self.value(element, key, depth + 1) for _ in range(n)]

    def tensor_info(self) -> TensorInfo:
        name = self.string("a tensor name")
        n_dims = self.scalar("<I")
        if n_dims > MAX_DIMS:
            raise GGUFHeaderError(f"tensor {name} claims {n_dims} dimensions")
        shape = tuple(self.scalar("<Q") for _ in range(n_dims))
        return TensorInfo(name, shape, self.scalar("<I"), self.scalar("<Q"))


@dataclass(frozen=True)
class TensorData:
    """One tensor's bytes in memory, with the fields of gguf-py's ReaderTensor that the weight readers use: data
    shaped as gguf-py shapes it (float and integer types as their numpy type, block types as bytes per row)."""

    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: the fastest dimension first
    data: object  # np.ndarray


def tensor_nbytes(t: TensorInfo) -> int:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    block_elements, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(t.type_id)]
    return _elements(t) // block_elements * block_bytes


def read_tensor(f, header: GGUFHeader, t: TensorInfo) -> TensorData:
    """t's bytes read from the open file f into memory: a reader holds one tensor at a time, never the file's
    mapped pages (a mapping's pages count in the process's resident memory once touched)."""
    import numpy as np
    from gguf.constants import GGMLQuantizationType as T
    from gguf.quants import quant_shape_to_byte_shape

    kind = T(t.type_id)
    f.seek(header.data_start + t.offset)
    raw = np.fromfile(f, dtype=np.uint8, count=tensor_nbytes(t))
    numpy_shape = tuple(reversed(t.shape))
    plain = {T.F16: np.float16, T.F32: np.float32, T.F64: np.float64, T.I8: np.int8, T.I16: np.int16,
             T.I32: np.int32, T.I64: np.int64}
    if kind in plain:
        return TensorData(t.name, kind, t.shape, raw.view(plain[kind]).reshape(numpy_shape))
    return TensorData(t.name, kind, t.shape, raw.reshape(quant_shape_to_byte_shape(numpy_shape, kind)))


def _elements(t: TensorInfo) -> int:
    n = 1
    for d in t.shape:
        n *= d
    return n


def _check_tensor_extents(header: GGUFHeader) -> None:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    for t in header.tensors:
        try:
            block_elements, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(t.type_id)]
        except (ValueError, KeyError):
            raise GGUFHeaderError(f"tensor {t.name} has type {t.type_id}, which gguf does not know") from None
        n = _elements(t)
        if n % block_elements:
            raise GGUFHeaderError(f"tensor {t.name} has {n} elements, not whole blocks of {block_elements}")
        end = header.data_start + t.offset + n // block_elements * block_bytes
        if end > header.file_size:
            raise GGUFHeaderError(f"tensor {t.name} ends at byte {end:,}; the file ends at {header.file_size:,}")
