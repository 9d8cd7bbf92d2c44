"""Conversation files (atomic save, validated open) and preferences in a temporary QSettings."""

from __future__ import annotations

import json
import os

import pytest
from PySide6.QtCore import QSettings

from app.settings import AppSettings
from app.storage import StorageError, open_conversation, save_conversation
from engine.chat import Conversation, Message
from engine.config import SamplingParams


def conversation() -> Conversation:
    return Conversation("Be brief.", [Message("user", "Hi ünïcode ✓"), Message("assistant", "```py\nx = 1\n```")],
                        context_start=0)


def test_save_then_open_restores_the_conversation_exactly(tmp_path):
    path = tmp_path / "chat.json"

    save_conversation(path, conversation())
    restored = open_conversation(path)

    assert restored.to_dict() == conversation().to_dict()


def test_saving_replaces_the_file_atomically_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    path = tmp_path / "chat.json"
    save_conversation(path, conversation())
    replaced = []
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (replaced.append((a, b)), real_replace(a, b)))

    save_conversation(path, {**conversation().to_dict(), "system_prompt": "New"})

    assert len(replaced) == 1 and os.path.dirname(replaced[0][0]) == str(tmp_path)
    assert open_conversation(path).system_prompt == "New"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chat.json"]


def test_a_failed_save_keeps_the_old_file_whole(tmp_path, monkeypatch):
    path = tmp_path / "chat.json"
    save_conversation(path, conversation())
    before = path.read_bytes()

    def fail(a, b):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(StorageError, match="No space left"):
        save_conversation(path, {**conversation().to_dict(), "system_prompt": "New"})

    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chat.json"]


@pytest.mark.parametrize("content, reason", [
    (b"{not json", "invalid JSON"),
    (b"\xff\xfe\x00garbage", "not UTF-8"),
    (json.dumps({"messages": []}).encode(), "missing \"format\""),
    (json.dumps({"format": "kvscope-conversation", "version": 99, "messages": []}).encode(), "version 99"),
    (json.dumps({"format": "kvscope-conversation", "version": 1, "messages": [{"role": "robot", "content": ""}]})
     .encode(), "message 0"),
])
def test_a_corrupt_or_foreign_file_raises_a_clear_error(tmp_path, content, reason):
    path = tmp_path / "bad.json"
    path.write_bytes(content)

    with pytest.raises(StorageError, match="is not a kvscope conversation") as error:
        open_conversation(path)
    assert reason in str(error.value)


def test_a_missing_file_raises_a_clear_error(tmp_path):
    with pytest.raises(StorageError, match="Could not open"):
        open_conversation(tmp_path / "missing.json")


def test_settings_persist_in_the_given_location(tmp_path):
    location = str(tmp_path / "settings.ini")
    settings = AppSettings(QSettings(location, QSettings.Format.IniFormat))
    settings.cache_strategy = "paged-int8"
    settings.block_size = 32
    settings.sampling = SamplingParams(temperature=0.2, top_k=7, top_p=0.5, repetition_penalty=1.3,
                                       max_new_tokens=99, seed=42)
    settings.system_prompt = "Talk like a pirate."
    settings.model_path = "/models/x.gguf"
    settings.sync()

    again = AppSettings(QSettings(location, QSettings.Format.IniFormat))

    assert (again.cache_strategy, again.block_size) == ("paged-int8", 32)
    assert again.sampling == SamplingParams(temperature=0.2, top_k=7, top_p=0.5, repetition_penalty=1.3,
                                            max_new_tokens=99, seed=42)
    assert again.system_prompt == "Talk like a pirate." and again.model_path == "/models/x.gguf"


def test_settings_fall_back_to_defaults_on_nonsense_values(tmp_path):
    q = QSettings(str(tmp_path / "settings.ini"), QSettings.Format.IniFormat)
    q.setValue("engine/cache", "quantum")
    q.setValue("engine/block_size", "banana")
    q.setValue("sampling/top_p", "7")
    settings = AppSettings(q)

    assert settings.cache_strategy == "paged" and settings.block_size == 16
    assert settings.sampling == SamplingParams()
    assert settings.sampling.seed is None
