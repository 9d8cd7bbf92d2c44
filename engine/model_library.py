"""The GGUF models already on this machine: where other apps keep them (the Hugging Face cache, LM Studio, Jan,
Ollama's blobs through its manifests) and folders the user adds, each described from its header alone.

A scan reads only inside the folders it is given: a file or link whose real path lies outside its folder is
refused (counted in `Scan.refused`), never opened, and links to folders are not descended. Each model's name,
architecture, quantization, size on disk, context length and the formula's KV bytes per token come from the GGUF
header (engine/gguf_header.py reads it without reading the tensors). No Qt here.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from engine.gguf_header import GGUFHeaderError, read_gguf_header

MAX_DEPTH = 8  # folders below a root that a scan descends
MAX_FILES = 20_000  # directory entries a scan looks at per root, at most
KV_BYTES_PER_ELEMENT = 2  # the formula's figure is for a 16-bit cache (float16 / bfloat16)
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
OLLAMA_DIGEST = re.compile(r"^sha256[:-]([0-9a-f]{64})$")
RECENT_LIMIT = 10


@dataclass(frozen=True)
class LibraryRoot:
    path: Path
    source: str  # "Hugging Face cache", "LM Studio", "Jan", "Ollama", "folder"
    ollama: bool = False  # read through manifests (blobs have no .gguf names)


@dataclass(frozen=True)
class ModelEntry:
    path: Path
    name: str
    source: str
    architecture: str
    quantization: str
    size_bytes: int
    context_length: int | None
    kv_bytes_per_token: int | None  # 2 x 2 bytes x layers x KV heads x head_dim (None: the header lacks them)
    supported: bool  # kvscope implements this architecture
    note: str = ""


@dataclass
class Scan:
    models: list[ModelEntry] = field(default_factory=list)
    refused: list[Path] = field(default_factory=list)  # links or files that lead outside their folder
    unreadable: list[tuple[Path, str]] = field(default_factory=list)  # .gguf files whose header is broken


def default_roots(home: Path | None = None, env: Mapping[str, str] | None = None) -> list[LibraryRoot]:
    """Where the usual apps keep their models, for this home directory (only folders that exist)."""
    home = Path(home or Path.home())
    env = os.environ if env is None else env
    hf_home = Path(env["HF_HOME"]) if env.get("HF_HOME") else home / ".cache" / "huggingface"
    candidates = [
        LibraryRoot(Path(env["HF_HUB_CACHE"]) if env.get("HF_HUB_CACHE") else hf_home / "hub", "Hugging Face cache"),
        LibraryRoot(home / ".lmstudio" / "models", "LM Studio"),
        LibraryRoot(home / ".cache" / "lm-studio" / "models", "LM Studio"),
        LibraryRoot(home / "jan" / "models", "Jan"),
        LibraryRoot(home / ".local" / "share" / "Jan" / "data" / "models", "Jan"),
        LibraryRoot(home / "Library" / "Application Support" / "Jan" / "data" / "models", "Jan"),
        LibraryRoot(Path(env["OLLAMA_MODELS"]) if env.get("OLLAMA_MODELS") else home / ".ollama" / "models",
                    "Ollama", ollama=True),
    ]
    return [root for root in candidates if root.path.is_dir()]


def scan(roots: list[LibraryRoot], folders: list[Path] = ()) -> Scan:
    """Every GGUF model under the roots and the user's folders, sorted by name; one model listed once."""
    result = Scan()
    seen: set[Path] = set()
    for root in [*roots, *(LibraryRoot(Path(f), "folder") for f in folders)]:
        paths = _ollama_models(root, result) if root.ollama else _gguf_files(root, result)
        for path, name in paths:
            real = path.resolve()
            if real in seen:
                continue
            seen.add(real)
            entry = describe(path, root.source, name)
            if isinstance(entry, str):
                result.unreadable.append((path, entry))
            else:
                result.models.append(entry)
    result.models.sort(key=lambda m: (m.name.lower(), str(m.path)))
    return result


def _inside(path: Path, root: Path) -> bool:
    """Whether path's real location (links followed) lies within root's."""
    try:
        return path.resolve().is_relative_to(root.resolve())
    except (OSError, RuntimeError):  # a link loop
        return False


def _gguf_files(root: LibraryRoot, result: Scan):
    """(path, name) of each *.gguf under root, links out of it refused, folders linked to not entered."""
    base = root.path
    if not base.is_dir():
        return
    looked = 0
    for folder, dirs, files in os.walk(base, followlinks=False):
        depth = len(Path(folder).relative_to(base).parts)
        if depth >= MAX_DEPTH:
            dirs.clear()
        for name in sorted(files):
            looked += 1
            if looked > MAX_FILES:
                return
            if not name.lower().endswith(".gguf"):
                continue
            path = Path(folder) / name
            if not _inside(path, base) or not path.is_file():
                result.refused.append(path)
                continue
            yield path, _display_name(path, base, root.source)


def _display_name(path: Path, base: Path, source: str) -> str:
    if source == "Hugging Face cache":  # hub/models--org--name/snapshots/<rev>/file.gguf
        repo = path.relative_to(base).parts[0]
        if repo.startswith("models--"):
            return f"{repo.removeprefix('models--').replace('--', '/')}: {path.stem}"
    return path.stem


def _ollama_models(root: LibraryRoot, result: Scan):
    """(blob path, 'model:tag') for each manifest under root/manifests whose model layer is a blob in root."""
    manifests = root.path / "manifests"
    if not manifests.is_dir():
        return
    for folder, _dirs, files in os.walk(manifests, followlinks=False):
        for tag in sorted(files):
            manifest = Path(folder) / tag
            if not _inside(manifest, root.path):
                result.refused.append(manifest)
                continue
            blob = _ollama_blob(manifest, root.path)
            if blob is None:
                continue
            if not _inside(blob, root.path) or not blob.is_file():
                result.refused.append(blob)
                continue
            yield blob, f"{manifest.parent.name}:{tag}"


def _ollama_blob(manifest: Path, base: Path) -> Path | None:
    try:
        layers = json.loads(manifest.read_text()).get("layers", [])
    except (OSError, ValueError, AttributeError):
        return None
    for layer in layers if isinstance(layers, list) else []:
        if isinstance(layer, dict) and layer.get("mediaType") == OLLAMA_MODEL_LAYER:
            match = OLLAMA_DIGEST.match(str(layer.get("digest", "")))
            return base / "blobs" / f"sha256-{match.group(1)}" if match else None
    return None


def describe(path: Path, source: str, name: str | None = None) -> ModelEntry | str:
    """The entry for one GGUF file from its header, or why it cannot be read."""
    from engine.architectures import BY_GGUF_NAME

    try:
        header = read_gguf_header(path)
    except (GGUFHeaderError, OSError, ValueError) as e:
        return str(e)
    meta = header.metadata
    arch = str(meta.get("general.architecture", "?"))
    layers, kv_heads, head_dim = _kv_shape(meta, arch)
    kv = 2 * KV_BYTES_PER_ELEMENT * layers * kv_heads * head_dim if layers and kv_heads and head_dim else None
    supported = arch in BY_GGUF_NAME
    return ModelEntry(
        path=path, name=name or str(meta.get("general.name") or path.stem),
        source=source, architecture=arch, quantization=quantization(meta, header.tensors),
        size_bytes=header.file_size, context_length=_int(meta.get(f"{arch}.context_length")),
        kv_bytes_per_token=kv, supported=supported,
        note="" if supported else f"kvscope does not implement the {arch!r} architecture",
    )


def _int(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _kv_shape(meta: dict, arch: str) -> tuple[int | None, int | None, int | None]:
    """Layers, KV heads and head_dim from the header's keys (the formula's inputs)."""
    layers, heads = _int(meta.get(f"{arch}.block_count")), _int(meta.get(f"{arch}.attention.head_count"))
    kv_heads = _int(meta.get(f"{arch}.attention.head_count_kv")) or heads
    width = _int(meta.get(f"{arch}.embedding_length"))
    head_dim = _int(meta.get(f"{arch}.attention.key_length")) or (width // heads if width and heads else None)
    return layers, kv_heads, head_dim


def quantization(meta: dict, tensors) -> str:
    """general.file_type as llama.cpp names it (Q4_K_M, Q8_0, ...), else the most common 2-D tensor type."""
    import gguf

    file_type = _int(meta.get("general.file_type"))
    if file_type is not None:
        try:
            return gguf.LlamaFileType(file_type).name.removeprefix("MOSTLY_")
        except ValueError:
            pass
    counts: dict[str, int] = {}
    for t in tensors:
        if len(t.shape) == 2:
            try:
                kind = gguf.GGMLQuantizationType(t.type_id).name
            except ValueError:
                kind = f"type {t.type_id}"
            counts[kind] = counts.get(kind, 0) + 1
    return max(counts, key=counts.get) if counts else "?"


# ---- recent models
def recent_models(file: Path) -> list[str]:
    """The models opened last, newest first (paths as given to the loader)."""
    try:
        items = json.loads(file.read_text())
    except (OSError, ValueError):
        return []
    return [str(p) for p in items if isinstance(p, str)][:RECENT_LIMIT] if isinstance(items, list) else []


def remember_model(file: Path, model: str) -> list[str]:
    """Put `model` first in the recent list (written atomically); returns the list."""
    items = [model] + [p for p in recent_models(file) if p != model]
    items = items[:RECENT_LIMIT]
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_name(f".{file.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(items, indent=1))
    tmp.replace(file)
    return items
