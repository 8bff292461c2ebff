"""``pagedllm serve`` with several models: each planned (a model that cannot fit even alone
refused here, with the planner's reason), the front served until SIGTERM, which drains the front
and then every model's server (each finishes what it has in flight)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import signal
import sys
import time
from pathlib import Path

import uvicorn

from ...engine_config import ConfigError, EngineConfig
from ...memory.machine import resident_bytes
from ...sizes import parse_memory
from ..run import bound_socket
from .app import create_fleet_app
from .fleet import Entry, Fleet
from .models import parse_specs
from .planning import ModelRefused, plan_model

# Above the front's own RSS when it starts serving: the request bodies and streams in flight
FRONT_MARGIN_BYTES = 48 * 1024**2
# Engine flags the fleet sets per model itself
FLEET_FIELDS = ("model", "memory", "memory_fraction")


def serve_fleet(args, models: list[str]) -> int:
    if args.memory is None:
        raise ConfigError("memory", "several models share one budget: give --memory (e.g. --memory 8GiB)")
    specs = parse_specs(models, args.models_dir)
    unknown = set(args.pin or ()) - {s.name for s in specs}
    if unknown:
        raise ConfigError("pin", f"no model named {sorted(unknown)}")
    budget = parse_memory(args.memory)
    reserve = resident_bytes()[0] + FRONT_MARGIN_BYTES
    engine_flags = _engine_flags(args)
    entries = []
    for spec in specs:
        try:
            plan = plan_model(spec, budget - reserve, engine_flags)
        except ModelRefused as e:
            print(f"pagedllm serve: {e}", file=sys.stderr)
            return 3
        entries.append(Entry(spec, plan, pinned=spec.name in (args.pin or ())))
    fleet = Fleet(
        entries,
        budget,
        reserve,
        engine_flags + _server_flags(args),
        keep_alive=args.keep_alive,
        load_timeout=args.load_timeout,
        shutdown_timeout=args.shutdown_timeout,
    )
    app = create_fleet_app(fleet, api_key=args.api_key, max_body_bytes=args.max_body_bytes)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning"))
    _take_signals(app, server, fleet, args.shutdown_timeout)
    sock = bound_socket(args.host, args.port)
    if args.port_file:
        Path(args.port_file).write_text(f"{sock.getsockname()[1]}\n")
    names = ", ".join(
        f"{e.spec.name} ({e.plan.need_bytes / 2**30:.2f}-{e.plan.full_bytes / 2**30:.2f} GiB)" for e in entries
    )
    print(f"pagedllm serve: {len(entries)} models under {budget / 2**30:.2f} GiB: {names}", file=sys.stderr)
    print(f"pagedllm serve: listening on http://{args.host}:{sock.getsockname()[1]}", file=sys.stderr, flush=True)
    server.run(sockets=[sock])
    return 0


def _take_signals(app, server: uvicorn.Server, fleet: Fleet, timeout: float) -> None:
    """SIGTERM/SIGINT: new requests 503, the front's in flight finish (up to ``timeout``), then
    the server stops (the lifespan drains every model's server). A second signal: at once."""
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]

    async def drain() -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(
            e.resident is not None and e.resident.in_flight for e in fleet.entries.values()
        ):
            await asyncio.sleep(0.05)
        server.should_exit = True

    def on_signal(*_) -> None:
        if app.state.draining:
            server.should_exit = server.force_exit = True
            return
        app.state.draining = True
        loop = asyncio.get_event_loop()
        loop.call_soon_threadsafe(lambda: loop.create_task(drain()))

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)


def _engine_flags(args) -> list[str]:
    """The engine flags given, for every model's server (each field as ``add_flags`` spells it)."""
    flags: list[str] = []
    for f in dataclasses.fields(EngineConfig):
        value = getattr(args, f.name, f.default)
        if f.name in FLEET_FIELDS or value == f.default:
            continue
        if isinstance(f.default, bool):
            flags.append(f.metadata["flag"])
        else:
            flags += ["--" + f.name.replace("_", "-"), str(value)]
    return flags


def _server_flags(args) -> list[str]:
    flags = ["--max-waiting", str(args.max_waiting), "--max-body-bytes", str(args.max_body_bytes)]
    flags += ["--shutdown-timeout", str(args.shutdown_timeout), "--reasoning-parser", args.reasoning_parser]
    if args.api_key:
        flags += ["--api-key", args.api_key]
    return flags
