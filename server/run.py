"""`main.py serve`: load the engine, hold its KV pool (its budget, up to a quarter of the memory available), freeze the
startup objects out of the cyclic collector's walks, start the scheduler's thread, serve HTTP with uvicorn until
interrupted."""

from __future__ import annotations

import gc
import os
import socket
import sys

from engine.config import EngineConfig
from engine.scheduler import Scheduler, SchedulerConfig


def max_body_bytes(flag: int | None, environ, default: int) -> int:
    """The request-body limit: --max-body-bytes, else KVSCOPE_MAX_BODY_BYTES, else the default; a positive
    number of bytes, or a ValueError that says which setting is wrong."""
    if flag is not None:
        source, value = "--max-body-bytes", str(flag)
    elif environ.get("KVSCOPE_MAX_BODY_BYTES"):
        source, value = "KVSCOPE_MAX_BODY_BYTES", environ["KVSCOPE_MAX_BODY_BYTES"]
    else:
        return default
    try:
        limit = int(value.strip())
    except ValueError:
        limit = 0
    if limit <= 0:
        raise ValueError(f"{source} must be a positive number of bytes, not {value!r}")
    return limit


def listening_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the model loads: a port in use is reported at once, not after the load
    (OSError: '... Address already in use')."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a restart reuses the port
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def hold_limit(device) -> int | None:
    """The most of a paged pool's budget `serve` holds from the start: a quarter of the memory the device has
    available (a model's default budget is one whole context: 4 GiB of float16 KV for Llama-3.2-1B's 131,072 tokens,
    16 GiB for Llama-3-8B's); None (all of it) when that cannot be told."""
    from engine.machine import available_memory

    available = available_memory(device)
    return None if available is None else available // 4


def kv_pool_note(budget: int, held: int) -> str:
    """The startup line's words on the KV pool: held whole, or how much of it (the rest grows as requests need)."""
    if not budget:
        return ""  # not a pool
    if held >= budget:
        return f", KV pool {held / 2**20:.0f} MiB held"
    return (f", KV pool {held / 2**20:.0f} of {budget / 2**20:.0f} MiB held (a quarter of the memory available), "
            f"the rest grown as requests need it")


def freeze_startup_objects() -> None:
    """Everything built so far (the model, its tokenizer, the app) moved out of the cyclic collector's sight: a full
    collection then walks only what requests create. It walked them all before, 85-88 ms each time with the default
    model, twice in a 20-round serve run (every stream's next token that late); frozen, 2 ms. Safe here: the server
    keeps what it loaded until it exits (the app, which reloads models, does not freeze)."""
    gc.collect()
    gc.freeze()


def run_serve(args) -> int:
    import uvicorn

    from engine.engine import Engine
    from server.app import create_app
    from server.limits import DEFAULT_MAX_BODY_BYTES, JSONErrorH11Protocol

    try:
        max_body = max_body_bytes(getattr(args, "max_body_bytes", None), os.environ, DEFAULT_MAX_BODY_BYTES)
    except ValueError as e:
        print(f"kvscope serve: {e}", file=sys.stderr)
        return 1  # before the model loads: a typo costs no wait
    rows = getattr(args, "prefill_rows_while_decoding", None)
    if rows is not None and rows < 1:
        print(f"kvscope serve: --prefill-rows-while-decoding must be at least 1, not {rows}", file=sys.stderr)
        return 1
    try:
        sock = listening_socket(args.host, args.port)
    except OSError as e:
        print(f"kvscope serve: cannot listen on {args.host}:{args.port}: {e.strerror or e}", file=sys.stderr)
        return 1
    try:
        weights = {"weights": args.weights} if getattr(args, "weights", None) else {}  # default: the engine's auto
        config = EngineConfig(cache=args.cache, block_size=args.block_size or 16, pool_tokens=args.pool_tokens,
                              kv_dtype=getattr(args, "kv_dtype", None),
                              cuda_graphs=getattr(args, "cuda_graphs", None) != "off", **weights)
        batching = SchedulerConfig(max_concurrency=args.max_concurrency,
                                   **({} if rows is None else {"prefill_rows_while_decoding": rows}))
        engine = Engine.load(args.model, config)
        held = engine.reserve_kv_pool(hold_limit(engine.device))  # no growth beside the steps while it serves
        scheduler = Scheduler(engine, batching)
    except Exception as e:  # noqa: BLE001 - a clear message and an exit code, not a traceback
        sock.close()
        print(f"kvscope serve: {e}", file=sys.stderr)
        return 1
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        print(f"kvscope serve: warning: listening on {args.host} without --api-key: anyone who can reach this "
              f"port can use the model", file=sys.stderr)
    app = create_app(scheduler, engine.model_name, args.api_key, max_body_bytes=max_body)
    freeze_startup_objects()
    scheduler.start()
    port = sock.getsockname()[1]  # --port 0: the one the system chose
    pool = kv_pool_note(engine.kv_stats().bytes_budget, held)
    print(f"kvscope: serving {engine.model_name} ({engine.cache_strategy}, block size {engine.block_size}, "
          f"context {engine.max_context}{pool}) on http://{args.host}:{port}", file=sys.stderr, flush=True)
    config = uvicorn.Config(app, host=args.host, port=port, log_level="warning", timeout_graceful_shutdown=2,
                            http=JSONErrorH11Protocol)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()
        scheduler.close()
    return 0
