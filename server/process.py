"""`main.py serve` as a child process on a free loopback port: for tests and the serve benchmark."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


class _PortTaken(RuntimeError):
    """The server could not bind its port: another process took it first."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """with ServerProcess(["--model", folder]) as server: server.url ... (stopped, and waited for, on exit)."""

    def __init__(self, args: list[str], api_key: str | None = None, threads: int = 1, log: Path | None = None):
        self.api_key = api_key
        self.serve_args = [*args, *(["--api-key", api_key] if api_key else [])]
        self.use_port(free_port())
        self.env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        self.log = log
        self.proc: subprocess.Popen | None = None

    def use_port(self, port: int) -> None:
        self.port, self.url = port, f"http://127.0.0.1:{port}"
        self.args = [*self.serve_args, "--port", str(port)]

    def start(self, timeout: float = 180.0, attempts: int = 3) -> ServerProcess:
        """Start and wait for /health; a port taken between free_port() and the server's bind (another process
        picked it meanwhile) is retried on a new port."""
        for _ in range(attempts - 1):
            try:
                return self._start_once(timeout)
            except _PortTaken:
                self.use_port(free_port())
        return self._start_once(timeout)

    def _start_once(self, timeout: float) -> ServerProcess:
        self._own_log = self.log is None
        if self._own_log:  # keep the output somewhere, to quote it if the server does not come up
            fd, name = tempfile.mkstemp(prefix="kvscope-serve-", suffix=".log")
            os.close(fd)
            self.log = Path(name)
        out = open(self.log, "wb")  # noqa: SIM115 - closed in stop()
        self._out = out
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "main.py"), "serve", *self.args], cwd=ROOT,
                                     env=self.env, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.output_tail()
                self.stop()
                if "address already in use" in tail.lower():
                    raise _PortTaken(tail)
                raise RuntimeError(f"the server exited with status {self.proc.returncode} before it was ready:\n"
                                   f"{tail}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        tail = self.output_tail()
        self.stop()
        raise TimeoutError(f"the server was not ready within {timeout:.0f} s:\n{tail}")

    def output_tail(self, chars: int = 3000) -> str:
        self._out.flush()
        return self.log.read_bytes()[-chars:].decode(errors="replace")

    def kill(self) -> None:
        """Die at once, as a crashed server would (SIGKILL: no graceful shutdown)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()
        if getattr(self, "_out", None):
            self._out.close()
            if self._own_log:
                self.log.unlink(missing_ok=True)
                self.log = None

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
