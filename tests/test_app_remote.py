"""The app as a client of an OpenAI-compatible server: `main.py serve` started as a subprocess on a free loopback
port (a tiny random model in a real Hugging Face folder), the real window (pytest-qt, offscreen).

Chat works as with the local engine (streaming, Stop, Regenerate, Edit); the side panel shows the server's KV
figures from its /metrics; local-only settings are disabled and say why; an unreachable server, an error status
and a server killed mid-stream each give the error banner and leave the conversation as it was."""

from __future__ import annotations

import httpx
import pytest
from serve_helpers import metric, write_tiny_model
from test_app_support import LONG_SYSTEM_PROMPT, TURN_TIMEOUT_MS, dispose, make_settings, run_turn, send

from app.backends.dialog import BackendChoice
from app.backends.remote import RemoteClient
from app.main_window import MainWindow
from engine.config import SamplingParams
from server.process import ServerProcess, free_port

MODEL = "tiny"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    return write_tiny_model(tmp_path_factory.mktemp("remote") / MODEL, tokenizer)


@pytest.fixture(scope="module")
def server(model_dir):
    with ServerProcess(["--model", str(model_dir)]) as s:
        yield s


def greedy(max_new_tokens: int = 12) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)


def remote_window(qtbot, tmp_path, url: str, api_key: str | None = None, wait: bool = True) -> MainWindow:
    settings = make_settings(tmp_path)
    settings.backend, settings.server_url, settings.server_api_key = "remote", url, api_key
    window = MainWindow(settings=settings)
    window.sampling_override = greedy()
    window.show()
    if wait:
        qtbot.waitUntil(lambda: window.info is not None, timeout=TURN_TIMEOUT_MS)
    return window


@pytest.fixture
def window(qtbot, tmp_path, server):
    window = remote_window(qtbot, tmp_path, server.url)
    yield window
    dispose(window)


def server_reply(server, messages: list[dict], max_tokens: int = 12) -> str:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"][
        "content"]


def roles_and_texts(window) -> list[tuple[str, str]]:
    return [(m["role"], m["content"]) for m in window.snapshot["messages"]]


def wait_for_idle_server(qtbot, server) -> None:
    qtbot.waitUntil(lambda: metric(server.url, "kvscope:num_requests_running") == 0, timeout=TURN_TIMEOUT_MS)


def test_a_remote_turn_streams_the_servers_reply(qtbot, window, server):
    assert isinstance(window.client, RemoteClient) and window.info.model_name == MODEL
    turn = send(qtbot, window, "Hello")
    expected = server_reply(server, [{"role": "system", "content": LONG_SYSTEM_PROMPT},
                                     {"role": "user", "content": "Hello"}])
    assert turn.done[0].text == expected == "".join(turn.tokens)
    assert roles_and_texts(window) == [("user", "Hello"), ("assistant", expected)]
    assert turn.steps[0].phase == "prefill" and all(s.phase == "decode" for s in turn.steps[1:])
    assert all(s.latency_ms >= 0 and s.strategy == "server" for s in turn.steps)  # inter-token arrival times
    assert turn.done[0].n_prompt_tokens > 0 and turn.done[0].n_generated_tokens == 12
    assert window.chat.messages[-1].role == "assistant"


def test_the_panel_shows_the_servers_kv_and_local_settings_are_disabled(qtbot, window):
    qtbot.waitUntil(lambda: window.backends.view.kv is not None, timeout=TURN_TIMEOUT_MS)
    text = window.backends.view.text
    assert "kvscope server" in text and "Server block pool" in text and "unavailable" not in text
    assert window.backends.view.isVisibleTo(window) and not window.metrics.figures.isVisibleTo(window)
    assert window.status.text("kv").startswith("server KV")
    for submenu in window.menus.local_only:
        assert not submenu.isEnabled()
        assert "local engine only" in submenu.menuAction().toolTip()
    assert window.menus.backend.isEnabled()


def test_stop_ends_the_reply_and_the_server_frees_the_request(qtbot, window, server):
    window.sampling_override = greedy(900)
    recorder = run_turn(qtbot, window, lambda: (window.send("Tell me everything"),
                                                qtbot.waitUntil(lambda: len(window.chat.messages[-1].text) > 0,
                                                                timeout=TURN_TIMEOUT_MS),
                                                window.stop()))
    assert recorder.done[0].finish_reason == "cancelled"
    assert recorder.done[0].n_generated_tokens < 900
    wait_for_idle_server(qtbot, server)
    assert metric(server.url, "kvscope:kv_blocks_used") == 0


def test_regenerate_and_edit_work_against_the_server(qtbot, window):
    first = send(qtbot, window, "Hello").done[0].text
    window.sampling_override = SamplingParams(temperature=1.0, seed=7, max_new_tokens=12)
    regenerated = run_turn(qtbot, window, window.regenerate).done[0].text
    assert roles_and_texts(window) == [("user", "Hello"), ("assistant", regenerated)]
    assert regenerated != first  # sampled with a seed instead of greedy
    edited = run_turn(qtbot, window, lambda: window.edit_and_resend("Goodbye")).done[0].text
    assert roles_and_texts(window) == [("user", "Goodbye"), ("assistant", edited)]


def test_a_server_killed_mid_stream_gives_a_banner_and_keeps_the_conversation(qtbot, tmp_path, model_dir):
    with ServerProcess(["--model", str(model_dir)]) as doomed:
        window = remote_window(qtbot, tmp_path, doomed.url)
        try:
            send(qtbot, window, "Hello")
            before = roles_and_texts(window)
            window.sampling_override = greedy(900)

            def start():
                window.send("Now a long story")
                qtbot.waitUntil(lambda: len(window.chat.messages[-1].text) > 0, timeout=TURN_TIMEOUT_MS)
                doomed.kill()

            turn = run_turn(qtbot, window, start, expect_error=True)
            assert turn.errors and "server" in turn.errors[0]
            assert window.chat.error_text
            assert roles_and_texts(window) == before  # the failed turn left nothing behind
            assert window.chat.input.toPlainText() == "Now a long story"  # the text is given back
            assert not window.generating
        finally:
            dispose(window)


def test_an_unreachable_server_gives_a_clear_banner(qtbot, tmp_path):
    window = remote_window(qtbot, tmp_path, f"http://127.0.0.1:{free_port()}", wait=False)
    try:
        qtbot.waitUntil(lambda: bool(window.chat.error_text), timeout=TURN_TIMEOUT_MS)
        assert "Cannot reach the server" in window.chat.error_text
        assert window.info is None and not window.loading
    finally:
        dispose(window)


def test_an_error_status_gives_a_banner_with_the_servers_message(qtbot, tmp_path, model_dir):
    with ServerProcess(["--model", str(model_dir)], api_key="right") as keyed:
        window = remote_window(qtbot, tmp_path, keyed.url, api_key="wrong", wait=False)
        try:
            qtbot.waitUntil(lambda: bool(window.chat.error_text), timeout=TURN_TIMEOUT_MS)
            assert "401" in window.chat.error_text and "API key" in window.chat.error_text
        finally:
            dispose(window)


def test_switching_backends_from_settings(qtbot, tmp_path, server, model_dir, tiny_engine_factory):
    settings = make_settings(tmp_path)
    settings.model_path = str(model_dir)  # the local engine loads the same tiny folder
    window = MainWindow(settings=settings, engine=tiny_engine_factory())
    window.sampling_override = greedy()
    window.show()
    try:
        qtbot.waitUntil(lambda: window.info is not None, timeout=TURN_TIMEOUT_MS)
        assert not window.backends.remote and all(m.isEnabled() for m in window.menus.local_only)
        window.backends.apply(BackendChoice("remote", server.url + "/v1"))
        qtbot.waitUntil(lambda: getattr(window.info, "remote", False), timeout=TURN_TIMEOUT_MS)
        assert settings.backend == "remote" and settings.server_model == MODEL
        assert send(qtbot, window, "Hi").done[0].strategy == "server"
        store = window.conversations.store
        qtbot.waitUntil(lambda: len(store.entries()) == 1, timeout=TURN_TIMEOUT_MS)  # the server's chat is kept
        window.backends.apply(BackendChoice("local", server.url))
        qtbot.waitUntil(lambda: window.info is not None and not getattr(window.info, "remote", False),
                        timeout=TURN_TIMEOUT_MS)
        assert all(m.isEnabled() for m in window.menus.local_only)
        assert window.metrics.figures.isVisibleTo(window) and not window.backends.view.isVisibleTo(window)
        assert send(qtbot, window, "Hi").done[0].strategy == "paged"
        qtbot.waitUntil(lambda: len(store.entries()) == 2, timeout=TURN_TIMEOUT_MS)  # a new chat, its own file
    finally:
        dispose(window)


def test_the_backend_dialog_lists_the_servers_models(qtbot, server):
    from app.backends.dialog import BackendDialog

    dialog = BackendDialog(BackendChoice("local", server.url))
    qtbot.addWidget(dialog)
    assert not dialog.model.isEnabled()  # server fields wait for "server" to be chosen
    dialog.remote.setChecked(True)
    dialog.fetch_models()
    assert [dialog.model.itemText(i) for i in range(dialog.model.count())] == [MODEL]
    assert dialog.choice() == BackendChoice("remote", server.url, None, MODEL)
    dialog.url.setText(f"http://127.0.0.1:{free_port()}")
    dialog.fetch_models()
    assert "Cannot reach the server" in dialog.message.text()
