"""The model library finds the GGUFs other apps keep, in a fake home laid out like each app, reads each from its
header, and never reads a file outside the folders it was asked to read."""

from __future__ import annotations

import json
import os
from pathlib import Path

import gguf
import numpy as np
import pytest

from engine import model_library as lib
from engine.model_library import LibraryRoot

HEX = "ab" * 32


def write_header_gguf(path: Path, arch: str = "qwen2", name: str = "Tiny", file_type: int | None = 15,
                      layers: int = 24, heads: int = 14, kv_heads: int = 2, width: int = 896,
                      context: int = 32768) -> Path:
    """A GGUF with the keys a library reads (no real weights: one small tensor)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(name)
    if file_type is not None:
        writer.add_file_type(file_type)
    writer.add_block_count(layers)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_embedding_length(width)
    writer.add_context_length(context)
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def home(tmp_path) -> Path:
    """A home directory with one model in each app's place, the Hugging Face one as the hub's blob + link."""
    home = tmp_path / "home"
    hub = home / ".cache" / "huggingface" / "hub" / "models--Qwen--Qwen2.5-0.5B-Instruct-GGUF"
    blob = write_header_gguf(hub / "blobs" / "0123abcd", name="Qwen2.5 0.5B Instruct")
    snapshot = hub / "snapshots" / "rev1"
    snapshot.mkdir(parents=True)
    (snapshot / "qwen2.5-0.5b-instruct-q4_k_m.gguf").symlink_to(os.path.relpath(blob, snapshot))
    write_header_gguf(home / ".lmstudio" / "models" / "lmstudio-community" / "gemma" / "gemma-2-2b-Q8_0.gguf",
                      arch="gemma2", file_type=7, layers=26, heads=8, kv_heads=4, width=2304, context=8192)
    write_header_gguf(home / "jan" / "models" / "phi" / "Phi-3-mini.gguf", arch="phi3", file_type=None,
                      layers=32, heads=32, kv_heads=32, width=3072, context=4096)
    ollama = home / ".ollama" / "models"
    write_header_gguf(ollama / "blobs" / f"sha256-{HEX}", arch="llama", name="llama3.2", file_type=2)
    manifest = ollama / "manifests" / "registry.ollama.ai" / "library" / "llama3.2" / "1b"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"layers": [
        {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "cd" * 32},
        {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{HEX}"}]}))
    return home


def scan_home(home: Path, folders=()) -> lib.Scan:
    return lib.scan(lib.default_roots(home, env={}), list(folders))


def test_each_apps_folder_is_found_in_the_home_directory(home):
    sources = {root.source for root in lib.default_roots(home, env={})}
    assert sources == {"Hugging Face cache", "LM Studio", "Jan", "Ollama"}


def test_the_models_of_every_app_are_listed_with_their_header_facts(home):
    models = {m.source: m for m in scan_home(home).models}
    qwen = models["Hugging Face cache"]
    assert qwen.name == "Qwen/Qwen2.5-0.5B-Instruct-GGUF: qwen2.5-0.5b-instruct-q4_k_m"
    assert (qwen.architecture, qwen.quantization, qwen.context_length) == ("qwen2", "Q4_K_M", 32768)
    assert qwen.kv_bytes_per_token == 2 * 2 * 24 * 2 * 64  # 2 KV heads of 14: the formula's 12,288 bytes
    assert qwen.size_bytes == qwen.path.resolve().stat().st_size and qwen.supported
    gemma = models["LM Studio"]
    assert (gemma.architecture, gemma.quantization, gemma.kv_bytes_per_token) == ("gemma2", "Q8_0", 2*2*26*4*288)
    phi = models["Jan"]
    assert phi.quantization == "F32"  # no file type key: the most common 2-D tensor type
    assert phi.kv_bytes_per_token == 2 * 2 * 32 * 32 * 96  # Phi-3-mini: no GQA
    llama = models["Ollama"]
    assert llama.name == "llama3.2:1b" and llama.path.name == f"sha256-{HEX}" and llama.quantization == "Q4_0"


def test_an_unsupported_architecture_is_listed_and_says_so(tmp_path):
    write_header_gguf(tmp_path / "mine" / "falcon.gguf", arch="falcon")
    (entry,) = lib.scan([], [tmp_path / "mine"]).models
    assert not entry.supported and "'falcon'" in entry.note


def test_a_link_to_a_file_outside_the_folder_is_refused_and_never_read(home, tmp_path):
    secret = write_header_gguf(tmp_path / "elsewhere" / "secret.gguf", name="secret")
    models = home / ".lmstudio" / "models"
    (models / "escape.gguf").symlink_to(secret)
    (models / "linked-dir").symlink_to(secret.parent, target_is_directory=True)
    result = scan_home(home)
    assert "secret" not in {m.name for m in result.models}
    assert all(m.path.resolve().is_relative_to(home) for m in result.models)
    assert models / "escape.gguf" in result.refused


def test_an_ollama_manifest_cannot_point_outside_its_blobs(home, tmp_path):
    write_header_gguf(tmp_path / "outside" / "x.gguf", name="outside")
    manifest = home / ".ollama" / "models" / "manifests" / "registry.ollama.ai" / "library" / "evil" / "latest"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"layers": [{"mediaType": "application/vnd.ollama.image.model",
                                                "digest": "sha256:../../../../outside/x.gguf"}]}))
    blob_link = home / ".ollama" / "models" / "blobs" / f"sha256-{'ef' * 32}"
    blob_link.symlink_to(tmp_path / "outside" / "x.gguf")
    other = manifest.parent.parent / "evil2" / "latest"
    other.parent.mkdir(parents=True)
    other.write_text(json.dumps({"layers": [{"mediaType": "application/vnd.ollama.image.model",
                                             "digest": f"sha256:{'ef' * 32}"}]}))
    result = scan_home(home)
    assert {m.name for m in result.models if m.source == "Ollama"} == {"llama3.2:1b"}
    assert blob_link in result.refused


def test_a_folder_the_user_adds_is_scanned_and_a_broken_file_is_reported_not_raised(home, tmp_path):
    mine = tmp_path / "my-models"
    write_header_gguf(mine / "deep" / "a" / "b" / "tiny.gguf", name="mine")
    (mine / "broken.gguf").write_bytes(b"GGUF\x03\x00\x00\x00truncated")
    result = scan_home(home, [mine])
    assert "tiny" in {m.name for m in result.models}
    assert [p.name for p, _ in result.unreadable] == ["broken.gguf"]


def test_one_file_reached_twice_is_listed_once(tmp_path):
    path = write_header_gguf(tmp_path / "m" / "one.gguf")
    assert len(lib.scan([], [tmp_path / "m", tmp_path / "m"]).models) == 1
    assert lib.scan([], [path.parent]).models[0].path == path


def test_recent_models_are_remembered_newest_first_without_repeats(tmp_path):
    file = tmp_path / "recent.json"
    for model in ("a.gguf", "b.gguf", "a.gguf"):
        lib.remember_model(file, model)
    assert lib.recent_models(file) == ["a.gguf", "b.gguf"]
    file.write_text("not json")
    assert lib.recent_models(file) == []


def test_environment_overrides_name_the_hub_and_ollama_folders(tmp_path):
    (tmp_path / "hub").mkdir()
    (tmp_path / "ollama").mkdir()
    roots = lib.default_roots(tmp_path / "nohome", env={"HF_HUB_CACHE": str(tmp_path / "hub"),
                                                        "OLLAMA_MODELS": str(tmp_path / "ollama")})
    assert roots == [LibraryRoot(tmp_path / "hub", "Hugging Face cache"),
                     LibraryRoot(tmp_path / "ollama", "Ollama", ollama=True)]


def test_an_ollama_blob_loads_as_a_gguf_though_it_has_no_suffix(tmp_path, monkeypatch):
    from engine import loader
    from tests.gguf_files import write_tiny_gguf

    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path / "cache"))
    path, _ = write_tiny_gguf(tmp_path / f"sha256-{HEX}")
    weights = loader.load_weights(str(path))
    assert weights.config.num_layers == 2 and weights.source == str(path)


# ---- File → Open model ------------------------------------------------------------------------------------


def test_file_open_model_lists_the_library_and_loads_the_pick(qtbot, window, tmp_path, monkeypatch):
    from PySide6.QtCore import QTimer
    from PySide6.QtWidgets import QApplication
    from test_app_support import Catch

    from app.open_model_dialog import OpenModelDialog
    from tests.gguf_files import write_tiny_gguf

    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path / "cache"))
    folder = tmp_path / "models"
    folder.mkdir()
    tiny, _ = write_tiny_gguf(folder / "tiny-llama.gguf")
    write_header_gguf(folder / "falcon.gguf", arch="falcon")
    monkeypatch.setattr("engine.model_library.default_roots", lambda *a, **k: [LibraryRoot(folder, "LM Studio")])
    seen = {}

    def pick():
        dialog = QApplication.activeModalWidget()
        assert isinstance(dialog, OpenModelDialog)
        seen["rows"] = [dialog.table.item(r, 0).text() for r in range(dialog.table.rowCount())]
        dialog.grab().save(str(tmp_path / "open-model.png"))
        falcon = next(r for r, e in enumerate(dialog.entries) if e.architecture == "falcon")
        dialog.table.selectRow(falcon)
        seen["falcon_openable"] = dialog.open_button.isEnabled()
        dialog.select(tiny)
        dialog.open_button.click()

    QTimer.singleShot(0, pick)
    with Catch(qtbot, window.client.signals.loaded, timeout=120_000):
        window.menus.open_model.trigger()
    assert seen["rows"] == ["falcon", "tiny-llama"] and not seen["falcon_openable"]
    assert window.info.model_name == "tiny-llama" and window.settings.model_path == str(tiny)
    assert lib.recent_models(tmp_path / "cache" / "recent-models.json") == [str(tiny)]


def test_a_folder_added_in_the_dialog_is_scanned_and_remembered(qtbot, tmp_path, monkeypatch):
    from app.open_model_dialog import OpenModelDialog

    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path / "cache"))
    dialog = OpenModelDialog(roots=[])
    qtbot.addWidget(dialog)
    assert dialog.table.rowCount() == 0
    write_header_gguf(tmp_path / "mine" / "qwen.gguf")
    dialog.add_models_folder(tmp_path / "mine")
    assert dialog.table.rowCount() == 1 and dialog.entries[0].architecture == "qwen2"
    again = OpenModelDialog(roots=[])
    qtbot.addWidget(again)
    assert again.table.rowCount() == 1
