"""The HTTP server's life: the socket bound, uvicorn serving the app, signals taken, a graceful
drain on SIGTERM, and the exit status (``pagedllm serve`` parses its flags, then calls ``serve``)."""

from __future__ import annotations

import contextlib
import signal
import socket
import sys
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from .app import drain


def serve(app: FastAPI, host: str, port: int, *, port_file: str | None = None, verbose: bool = False) -> int:
    """Serves ``app`` on ``host:port`` until a signal or a failed engine ends it: 0 after a
    graceful shutdown, 1 when the engine failed. ``port`` 0: the kernel picks a free one, written
    to ``port_file`` (when given) before serving."""
    failed: list[BaseException] = []
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="info" if verbose else "warning",
            timeout_graceful_shutdown=int(app.state.shutdown_timeout),
        )
    )
    take_signals(app, server)

    def engine_failed(error: BaseException) -> None:
        """Every request has its error answer; the server shuts down and exits 1, so whatever
        supervises it (systemd, Kubernetes, a shell loop) starts a new one."""
        failed.append(error)
        server.should_exit = True

    app.state.engine.on_failure.append(engine_failed)
    sock = bound_socket(host, port)
    port = sock.getsockname()[1]
    if port_file:
        Path(port_file).write_text(f"{port}\n")
    print(f"pagedllm serve: listening on http://{host}:{port}", file=sys.stderr, flush=True)
    server.run(sockets=[sock])
    if failed:
        print(f"pagedllm serve: the engine failed ({failed[0]!r}); exiting 1", file=sys.stderr)
        return 1
    return 0


def take_signals(app: FastAPI, server: uvicorn.Server) -> None:
    """uvicorn re-raises SIGTERM after its graceful shutdown, so the process would die of the
    signal; we take SIGTERM/SIGINT ourselves: new requests get 503 while what is in flight
    finishes (up to the app's shutdown timeout), the rest end with an error, then exit 0. A
    second signal stops at once."""
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]

    def on_signal(*_) -> None:
        if app.state.draining:  # the second: no waiting for open connections or the engine
            server.should_exit = server.force_exit = True
        else:
            drain(app, lambda: setattr(server, "should_exit", True))

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)


def bound_socket(host: str, port: int) -> socket.socket:
    """The socket is bound here, before serving: with port 0 the kernel picks a free port, and
    whoever started us reads it from the port file (no pick-a-port-then-bind race)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP explicitly: asyncio turns Nagle off (TCP_NODELAY) only on sockets that say so;
    # with proto 0 every small response waited ~40 ms for a delayed ACK
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock
