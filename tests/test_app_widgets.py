"""Chat widgets without an engine: Markdown rendering that never loads anything, the input box, the message
actions, the block map and the status bar."""

from __future__ import annotations

from PySide6.QtCore import Qt, QUrl
from PySide6.QtGui import QGuiApplication, QTextDocument
from test_app_support import HANG_GUARD_MS

from app.block_map import BlockMap, grid_shape
from app.chat_view import ChatView
from app.markdown_render import render_markdown
from app.message_widget import MessageBrowser, MessageWidget
from engine.kv.base import BLOCK_CACHED, BLOCK_FREE, BLOCK_OTHER, BLOCK_OWN, KVStats


def kv_stats(strategy="paged", states=b"", **kw) -> KVStats:
    return KVStats(strategy=strategy, tokens=kw.pop("tokens", 40), bytes_allocated=1 << 20, bytes_used=1 << 16,
                   bytes_theoretical=1 << 15, bytes_per_element=4, block_size=16, num_blocks=len(states),
                   num_blocks_used=states.count(BLOCK_OWN) + states.count(BLOCK_OTHER),
                   num_blocks_free=states.count(BLOCK_FREE), num_blocks_cached=states.count(BLOCK_CACHED),
                   block_states=states, **kw)


def test_markdown_renders_code_blocks_and_escapes_raw_html():
    html = render_markdown("Use **this**:\n\n```python\nprint('<b>hi</b>')\n```\n\n<script>alert(1)</script>")

    assert "<strong>this</strong>" in html
    assert "<pre" in html and "&lt;b&gt;hi&lt;/b&gt;" in html and ">python<" in html
    assert "<script>" not in html and "&lt;script&gt;" in html


def test_markdown_shows_images_as_their_alt_text_and_never_links_them():
    html = render_markdown("![a cat](http://example.com/cat.png)")

    assert "<img" not in html and "[image: a cat]" in html


def test_the_message_browser_loads_no_resource_and_follows_no_link(qtbot):
    browser = MessageBrowser()
    qtbot.addWidget(browser)

    assert browser.loadResource(QTextDocument.ResourceType.ImageResource.value, QUrl("http://x/y.png")) is None
    assert browser.loadResource(QTextDocument.ResourceType.ImageResource.value, QUrl("file:///etc/passwd")) is None
    assert not browser.openExternalLinks() and not browser.openLinks()


def test_enter_sends_and_shift_enter_starts_a_new_line(qtbot):
    view = ChatView()
    qtbot.addWidget(view)
    view.input.setPlainText("first line")
    view.input.moveCursor(view.input.textCursor().MoveOperation.End)

    qtbot.keyClick(view.input, Qt.Key.Key_Return, Qt.KeyboardModifier.ShiftModifier)
    qtbot.keyClicks(view.input, "second line")
    assert view.input.toPlainText() == "first line\nsecond line"
    with qtbot.waitSignal(view.send_requested) as sent:
        qtbot.keyClick(view.input, Qt.Key.Key_Return)

    assert sent.args == ["first line\nsecond line"]
    assert view.input.toPlainText() == ""


def test_the_send_button_becomes_stop_while_generating(qtbot):
    view = ChatView()
    qtbot.addWidget(view)
    view.set_generating(True)

    assert view.send_button.text() == "Stop"
    with qtbot.waitSignal(view.stop_requested):
        view.send_button.click()
    view.set_generating(False)
    assert view.send_button.text() == "Send"


def test_every_user_message_offers_edit_and_only_the_last_reply_regenerate(qtbot):
    view = ChatView()
    qtbot.addWidget(view)
    view.show()
    view.set_messages([("user", "a"), ("assistant", "b"), ("user", "c"), ("assistant", "d")])

    visible = [(not m.edit_button.isHidden(), not m.regenerate_button.isHidden()) for m in view.messages]
    assert visible == [(True, False), (False, False), (True, False), (False, True)]
    view.set_generating(True)
    assert all(m.regenerate_button.isHidden() and m.edit_button.isHidden() for m in view.messages)


def test_copy_puts_the_raw_message_text_on_the_clipboard(qtbot):
    message = MessageWidget("assistant", "**bold** and `code`")
    qtbot.addWidget(message)

    message.copy_button.click()

    assert QGuiApplication.clipboard().text() == "**bold** and `code`"


def test_a_streaming_reply_grows_token_by_token(qtbot):
    view = ChatView()
    qtbot.addWidget(view)
    view.add_message("user", "hi")
    view.add_message("assistant", "")

    for piece in ("Hello", ", ", "world"):
        view.append_to_last(piece)

    assert view.messages[-1].text == "Hello, world"
    qtbot.waitUntil(lambda: "world" in view.messages[-1].browser.toPlainText(), timeout=HANG_GUARD_MS)


def test_the_error_banner_shows_and_dismisses(qtbot):
    view = ChatView()
    qtbot.addWidget(view)
    view.show()

    view.show_error("Could not load the model")
    assert view.error_text == "Could not load the model"
    view.clear_error()
    assert view.error_text == ""


def test_grid_shape_fits_every_block_in_square_cells():
    for n, w, h in [(1, 100, 100), (1024, 600, 200), (5000, 300, 100), (7, 1000, 10)]:
        cols, rows, cell = grid_shape(n, w, h)
        assert cols * rows >= n and cell >= 1
        assert cols * cell <= w and (rows * cell <= h or cell == 1)


def test_the_block_map_draws_one_cell_per_block_with_its_state(qtbot):
    block_map = BlockMap()
    qtbot.addWidget(block_map)
    block_map.resize(400, 300)
    block_map.show()
    states = bytes([BLOCK_OWN] * 3 + [BLOCK_CACHED] * 2 + [BLOCK_OTHER] + [BLOCK_FREE] * 1200)

    block_map.set_stats(kv_stats(states=states))

    assert block_map.showing_grid and block_map.grid.states == states
    assert "1,206 blocks" in block_map.summary.text() and "2 cached" in block_map.summary.text()
    image = block_map.grid.grab().toImage()
    cols, rows, cell = grid_shape(len(states), block_map.grid.width(), block_map.grid.height())
    assert image.pixelColor(cell // 2, cell // 2).name() == "#61afef"  # block 0: this conversation


def test_the_block_map_explains_strategies_without_blocks(qtbot):
    block_map = BlockMap()
    qtbot.addWidget(block_map)

    block_map.set_stats(kv_stats(strategy="contiguous"))

    assert not block_map.showing_grid
    assert "'contiguous' strategy has no blocks" in block_map.message.text()
