"""llama.cpp's `llama-server` as the serve benchmark's peer: found (.peers/bin, then PATH) or built by `make peers`
from the llama.cpp sources inside the llama-cpp-python sdist, started on loopback, and trusted only after it
answers one batch evaluation (a short completion).

    .venv/bin/python -m engine.bench.llama_server build     # what `make peers` runs (~10-25 minutes on 2 cores)
    .venv/bin/python -m engine.bench.llama_server status    # which binary the bench would use, or why none
    .venv/bin/python -m engine.bench.llama_server flags     # this CPU's GGML options (CMAKE_ARGS for pip)

The build never uses the CPU's native detection (-march=native): on virtual machines whose CPU advertises AMX
that the hypervisor does not allow, a native build dies with SIGILL on its first batch. The instruction sets are
chosen from /proc/cpuinfo instead: AVX2 always, AVX-512 (and its VNNI / BF16 parts) only where advertised, AMX
never. No network but the package registry (pip) at build time, and loopback at run time (`--offline`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
PEERS = ROOT / ".peers"  # ignored by git: the sdist, the build tree, the binary
BINARY = PEERS / "bin" / "llama-server"
SDIST_PACKAGE = "llama-cpp-python"

ALWAYS_FLAGS = ("-DGGML_NATIVE=OFF", "-DGGML_AVX2=ON", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF",
                "-DGGML_AMX_BF16=OFF")
AVX512_FLAGS = (("avx512_vnni", "GGML_AVX512_VNNI"), ("avx512_bf16", "GGML_AVX512_BF16"))
BUILD_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
               "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",  # the prebuilt web UI is a download
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF")


class PeerUnavailable(RuntimeError):
    """llama-server cannot be used as a peer; the message says why (shown in the bench's report)."""


# ---- the build ----------------------------------------------------------------------------------------------------
def cpu_flag_set(cpuinfo: str) -> set[str]:
    """The instruction-set flags every processor in a /proc/cpuinfo text advertises (their intersection)."""
    sets = [set(line.split(":", 1)[1].split()) for line in cpuinfo.splitlines()
            if line.split(":", 1)[0].strip() == "flags" and ":" in line]
    return set.intersection(*sets) if sets else set()


def cmake_cpu_flags(cpuinfo: str) -> list[str]:
    """The GGML instruction-set options for this CPU: native detection and AMX off, AVX2 on, AVX-512 on only where
    avx512f is advertised (VNNI and BF16 only where those are too)."""
    have = cpu_flag_set(cpuinfo)
    flags = list(ALWAYS_FLAGS)
    avx512 = "avx512f" in have
    flags.append(f"-DGGML_AVX512={'ON' if avx512 else 'OFF'}")
    for cpu_flag, option in AVX512_FLAGS:
        flags.append(f"-D{option}={'ON' if avx512 and cpu_flag in have else 'OFF'}")
    return flags


def _tool_path() -> str:
    """PATH with the venv's bin first (pip's cmake and ninja live there)."""
    return f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"


def _tool(name: str) -> str:
    """cmake / ninja from the venv (pip) or the system; installed with pip into the venv when neither has it."""
    found = shutil.which(name, path=_tool_path())
    if found:
        return found
    _say(f"{name} not found: pip install {name}")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", name], check=True)
    found = shutil.which(name, path=_tool_path())
    if not found:
        raise PeerUnavailable(f"{name} is not on PATH even after pip install {name}")
    return found


def llama_cpp_sources(peers: Path = PEERS) -> Path:
    """vendor/llama.cpp of the llama-cpp-python sdist (downloaded with pip, unpacked once under peers/src)."""
    src = peers / "src"
    unpacked = sorted(src.glob("llama_cpp_python-*/vendor/llama.cpp/CMakeLists.txt"))
    if unpacked:
        return unpacked[-1].parent
    src.mkdir(parents=True, exist_ok=True)
    archives = sorted(src.glob("llama_cpp_python-*.tar.gz"))
    if not archives:
        _say(f"downloading the {SDIST_PACKAGE} sdist (its vendor/llama.cpp is the source)")
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        SDIST_PACKAGE, "-d", str(src)], check=True)
        archives = sorted(src.glob("llama_cpp_python-*.tar.gz"))
    if not archives:
        raise PeerUnavailable(f"pip download gave no {SDIST_PACKAGE} sdist in {src}")
    with tarfile.open(archives[-1]) as tar:
        tar.extractall(src, filter="data")  # "data": no absolute paths, no links out of src
    unpacked = sorted(src.glob("llama_cpp_python-*/vendor/llama.cpp/CMakeLists.txt"))
    if not unpacked:
        raise PeerUnavailable(f"{archives[-1].name} has no vendor/llama.cpp")
    return unpacked[-1].parent


def build(peers: Path = PEERS, jobs: int = 2, cpuinfo: str | None = None) -> Path:
    """Configure and build the llama-server target only; copy the binary to peers/bin. Returns its path."""
    source = llama_cpp_sources(peers)
    cpuinfo = Path("/proc/cpuinfo").read_text() if cpuinfo is None else cpuinfo
    flags = cmake_cpu_flags(cpuinfo)
    build_dir = peers / "build"
    cmake, _ = _tool("cmake"), _tool("ninja")
    env = {**os.environ, "PATH": _tool_path()}
    _say(f"configuring {source} with {' '.join(flags)}")
    subprocess.run([cmake, "-S", str(source), "-B", str(build_dir), "-G", "Ninja", *BUILD_FLAGS, *flags],
                   check=True, env=env)
    _say(f"building llama-server with -j{jobs} (~10-25 minutes on 2 cores)")
    subprocess.run([cmake, "--build", str(build_dir), "--target", "llama-server", f"-j{jobs}"], check=True, env=env)
    binary = peers / "bin" / "llama-server"
    binary.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(build_dir / "bin" / "llama-server", binary)
    (peers / "bin" / "build-flags.txt").write_text(" ".join([*BUILD_FLAGS, *flags]) + "\n")
    return binary


# ---- finding it ---------------------------------------------------------------------------------------------------
def find_binary(peers: Path | None = None, path: str | None = None) -> Path | None:
    """The llama-server the bench uses: the one `make peers` built (under peers, default .peers), else one on PATH
    (or `path`); None when neither."""
    built = (peers or PEERS) / "bin" / "llama-server"
    if built.is_file() and os.access(built, os.X_OK):
        return built
    found = shutil.which("llama-server", path=path)
    return Path(found) if found else None


def version(binary: Path) -> str:
    """`llama-server --version` (llama.cpp prints it on stderr), first line; '' when it does not run."""
    try:
        done = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    lines = (done.stdout + done.stderr).strip().splitlines()
    return next((line for line in lines if line.startswith("version")), lines[0] if lines else "")


# ---- running it ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LlamaServerConfig:
    binary: Path
    gguf: Path
    threads: int
    parallel: int = 16  # slots: requests decoded together (continuous batching)
    context: int = 8192  # tokens of KV for all slots together (--kv-unified), as kvscope's pool of one context

    def describe(self) -> str:
        """The command line as the report shows it: the GGUF by name, no binary path, no port."""
        args = self.args(0)[1:]
        args[1] = self.gguf.name
        i = args.index("--port")
        return " ".join(["llama-server", *args[:i], *args[i + 2:]])

    def args(self, port: int) -> list[str]:
        return [str(self.binary), "-m", str(self.gguf), "--host", "127.0.0.1", "--port", str(port),
                "-t", str(self.threads), "-tb", str(self.threads), "--parallel", str(self.parallel),
                "-c", str(self.context), "--kv-unified", "--metrics", "--offline", "--no-webui"]


def _clean_env() -> dict:
    """The environment without llama.cpp's LLAMA_ARG_* overrides and Hugging Face settings."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("LLAMA_ARG_", "HF_", "LLAMA_CACHE"))}


class LlamaServer:
    """with LlamaServer(config) as peer: peer.url ... (started, health-checked, batch-checked; stopped on exit)."""

    name = "llama-server"

    def __init__(self, config: LlamaServerConfig):
        from server.process import free_port

        self.config = config
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self._log = None

    def start(self, timeout: float = 300.0) -> LlamaServer:
        fd, name = tempfile.mkstemp(prefix="kvscope-llama-server-", suffix=".log")
        os.close(fd)
        self.log_path = Path(name)
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(self.config.args(self.port), stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=_clean_env())
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._raise_if_exited("before it was ready")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        self.stop()
        raise PeerUnavailable(f"llama-server was not ready within {timeout:.0f} s: {self.output_tail()}")

    def _raise_if_exited(self, when: str) -> None:
        if self.proc is None or self.proc.poll() is None:
            return
        code = self.proc.returncode
        why = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
        if code == -signal.SIGILL:
            why += " (an instruction this CPU does not allow: rebuild with `make peers`, native detection off)"
        tail = self.output_tail()
        self.stop()
        raise PeerUnavailable(f"llama-server {why} {when}: {tail}")

    def check_batch(self, max_tokens: int = 4) -> dict:
        """One short completion through the whole server (a batch evaluation): it must answer 200 with text and
        a completion-token count, and still be running. Raises PeerUnavailable otherwise."""
        body = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": max_tokens,
                "temperature": 0}
        try:
            response = httpx.post(self.url + "/v1/chat/completions", json=body, timeout=120)
        except httpx.TransportError as e:
            self._raise_if_exited("on its first batch")
            raise PeerUnavailable(f"llama-server did not answer its first batch: {e}") from e
        self._raise_if_exited("on its first batch")
        try:
            reply = response.json()
            tokens = reply["usage"]["completion_tokens"]
            text = reply["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise PeerUnavailable(f"llama-server's first batch answered {response.status_code}: "
                                  f"{response.text[:300]}") from e
        if response.status_code != 200 or not tokens or not text:
            raise PeerUnavailable(f"llama-server's first batch answered {response.status_code} with "
                                  f"{tokens!r} tokens: {response.text[:300]}")
        return {"completion_tokens": tokens, "text": text}

    def output_tail(self, chars: int = 1500) -> str:
        if self._log is None:
            return ""
        self._log.flush()
        return self.log_path.read_bytes()[-chars:].decode(errors="replace").strip()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None
            self.log_path.unlink(missing_ok=True)

    def __enter__(self) -> LlamaServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def start_peer(gguf: Path | None, threads: int, parallel: int = 16, context: int = 8192,
               binary: Path | None = None, peers: Path | None = None) -> tuple[LlamaServer | None, str]:
    """A started, batch-checked llama-server on the GGUF, or None and why not (the bench reports it absent).
    binary: this one, else find_binary(peers)."""
    binary = binary or find_binary(peers)
    if binary is None:
        return None, "absent: no llama-server (run `make peers` to build it, or put one on PATH)"
    if gguf is None:
        return None, "absent: the model is not a GGUF file (llama-server reads GGUF only)"
    server = LlamaServer(LlamaServerConfig(binary, gguf, threads, parallel, context))
    try:
        server.start()
        server.check_batch()
    except PeerUnavailable as e:
        server.stop()
        return None, f"absent: {e}"
    return server, f"available: {binary} ({version(binary) or 'version unknown'})"


# ---- command line -------------------------------------------------------------------------------------------------
def _say(message: str) -> None:
    print(f"[peers] {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.bench.llama_server", description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=("build", "status", "flags"))
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args(argv)
    if args.command == "flags":
        print(" ".join(cmake_cpu_flags(Path("/proc/cpuinfo").read_text())))
        return 0
    found = find_binary()
    if args.command == "status":
        print(f"llama-server: {found} ({version(found)})" if found else "llama-server: none (make peers builds it)")
        return 0 if found else 1
    if found and found != BINARY:
        _say(f"llama-server found on PATH: {found} ({version(found)}); not building")
        return 0
    if found:
        _say(f"already built: {found} ({version(found)}); delete {PEERS / 'bin'} to rebuild")
        return 0
    try:
        binary = build(jobs=args.jobs)
    except (PeerUnavailable, subprocess.CalledProcessError) as e:
        _say(f"build failed: {e}")
        return 1
    _say(f"built {binary} ({version(binary)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
