"""The engine thread's handoff to the server's event loop after a tick's outputs: it returns once the loop has run
the callbacks that carry them and the streams they woke, never waits on a loop longer than its timeout, and does
nothing with a loop that has closed."""

from __future__ import annotations

import asyncio
import threading

from server.app import LoopHandoff


class LoopThread:
    """An event loop on a thread of its own (as uvicorn runs the server's), with a stream that writes what it takes."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.queue: asyncio.Queue | None = None
        self.written: list[str] = []
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.queue = asyncio.Queue()
        stream = self.loop.create_task(self._stream())
        self.loop.call_soon(self.ready.set)
        self.loop.run_forever()
        stream.cancel()
        self.loop.run_until_complete(asyncio.gather(stream, return_exceptions=True))
        self.loop.close()

    async def _stream(self) -> None:
        while True:
            self.written.append(await self.queue.get())

    def __enter__(self) -> LoopThread:
        self.thread.start()
        assert self.ready.wait(30)
        return self

    def __exit__(self, *exc) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)

    def send(self, output: str) -> None:  # what the scheduler's sink does on the engine thread
        self.loop.call_soon_threadsafe(self.queue.put_nowait, output)


def test_the_handoff_returns_when_the_streams_have_taken_the_ticks_outputs():
    with LoopThread() as lt:
        handoff = LoopHandoff(lt.loop, timeout_s=60.0)  # (a loaded test machine: never the timeout here)
        for tick in range(50):
            outputs = [f"{tick}.{i}" for i in range(4)]
            for out in outputs:
                lt.send(out)
            handoff()
            assert lt.written[-4:] == outputs


def test_a_loop_that_does_not_answer_is_waited_for_no_longer_than_the_timeout():
    with LoopThread() as lt:
        release = threading.Event()
        lt.loop.call_soon_threadsafe(release.wait, 60)  # the loop busy with something else
        lt.send("token")
        LoopHandoff(lt.loop, timeout_s=0.01)()
        assert lt.written == []  # returned without the loop
        release.set()
        LoopHandoff(lt.loop, timeout_s=60.0)()
        assert lt.written == ["token"]


def test_a_closed_loop_is_not_waited_for():
    loop = asyncio.new_event_loop()
    loop.close()
    LoopHandoff(loop, timeout_s=3600.0)()  # returns at once (the server is stopping)
