"""The front of a fleet: one API on one port for every model; each request goes to its model's
own server (``fleet.Fleet``), the answer streamed back as it comes.

A generation request names its model in its JSON body (``model``), a GET in the query
(``?model=``); with one model the name may be left out. ``/v1/models`` lists every model with
its state and planned bytes; ``/health`` and ``/metrics`` are the front's own (``/metrics?model=``:
that model's server's).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..errors import APIError, error_body
from ..guards import Guards
from ..web import router as web_router
from .fleet import Fleet, FleetError

# hop-by-hop and length headers: the front's own connection decides them
DROPPED_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}


def create_fleet_app(fleet: Fleet, *, api_key: str | None, max_body_bytes: int) -> FastAPI:
    errors: dict[int, int] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10))
        keeper = asyncio.create_task(fleet.keep_alive_loop())
        for entry in fleet.entries.values():
            if entry.pinned:
                fleet.release(await fleet.acquire(entry.spec.name))
        yield
        keeper.cancel()
        await fleet.stop_all()
        await app.state.client.aclose()

    app = FastAPI(title="pagedllm fleet", lifespan=lifespan, exception_handlers={APIError: api_error})
    app.state.fleet, app.state.draining, app.state.errors = fleet, False, errors
    app.state.api_key_required = api_key is not None  # (the page asks for it)
    app.include_router(web_router)  # the page and its files, served here: they load no model
    fleet.api_key = api_key
    app.add_middleware(
        Guards, api_key=api_key, max_body_bytes=max_body_bytes, on_error=lambda status: count_error(errors, status)
    )

    @app.get("/health")
    async def health(request: Request):
        if request.app.state.draining:
            return JSONResponse({"status": "draining"}, status_code=503, headers={"Retry-After": "1"})
        return {"status": "ok", "models": {e["id"]: e["state"] for e in fleet.listing()}}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": fleet.listing()}

    @app.get("/metrics")
    async def metrics(request: Request):
        if "model" in request.query_params:
            return await forward(request, b"")
        return Response(render_metrics(fleet, errors), media_type="text/plain; version=0.0.4")

    @app.api_route("/{path:path}", methods=["GET", "POST", "DELETE"])
    async def routed(path: str, request: Request):
        return await forward(request, await request.body())

    return app


async def forward(request: Request, body: bytes) -> Response:
    """The request to its model's server (loaded first where it is not), its answer streamed back."""
    fleet: Fleet = request.app.state.fleet
    if request.app.state.draining:
        return failure(request, 503, "the server is shutting down", {"Retry-After": "1"})
    try:
        name = model_of(request, body, list(fleet.entries))
    except ValueError as e:
        return failure(request, 404 if "does not exist" in str(e) else 400, str(e))
    try:
        resident = await fleet.acquire(name)
    except FleetError as e:
        return failure(request, 503, str(e), {"Retry-After": "5"})
    client: httpx.AsyncClient = request.app.state.client
    headers = {k: v for k, v in request.headers.items() if k.lower() not in DROPPED_HEADERS}
    url = resident.url + request.url.path + (f"?{request.url.query}" if request.url.query else "")
    try:
        upstream = await client.send(
            client.build_request(request.method, url, content=body, headers=headers), stream=True
        )
    except httpx.HTTPError as e:
        fleet.release(resident)
        return failure(request, 503, f"model {name!r} did not answer: {e}", {"Retry-After": "1"})

    async def stream() -> AsyncIterator[bytes]:
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        finally:
            await upstream.aclose()
            fleet.release(resident)

    kept = {k: v for k, v in upstream.headers.items() if k.lower() not in DROPPED_HEADERS}
    return StreamingResponse(stream(), status_code=upstream.status_code, headers=kept)


def failure(request: Request, status: int, message: str, headers: dict | None = None) -> JSONResponse:
    count_error(request.app.state.errors, status)
    kind = "not_found_error" if status == 404 else "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse(error_body(message, kind, "model"), status_code=status, headers=headers)


def count_error(errors: dict[int, int], status: int) -> None:
    errors[status] = errors.get(status, 0) + 1


async def api_error(request: Request, e: APIError) -> JSONResponse:
    return failure(request, e.status, e.body()["error"]["message"])


def model_of(request: Request, body: bytes, names: list[str]) -> str:
    """The request's model: the body's ``model`` (a POST), or ``?model=``; the only one where
    there is one, the first for a GET. ValueError where it names none of them."""
    name = request.query_params.get("model")
    if name is None and body:
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None  # the model's server answers the bad body
        if isinstance(parsed, dict) and isinstance(parsed.get("model"), str):
            name = parsed["model"]
    if name is None:  # a GET without one (the web page, /v1/plan) goes to the first model
        if len(names) == 1 or request.method == "GET":
            return names[0]
        raise ValueError(f"say which model: 'model' is one of {names}")
    if name not in names:
        raise ValueError(f"model {name!r} does not exist; this server serves {names}")
    return name


def render_metrics(fleet: Fleet, errors: dict[int, int]) -> str:
    """The fleet's own: each model's state, share and loads, the budget and what is free."""
    lines = [
        "# TYPE pagedllm_fleet_budget_bytes gauge",
        f"pagedllm_fleet_budget_bytes {fleet.budget}",
        "# TYPE pagedllm_fleet_free_bytes gauge",
        f"pagedllm_fleet_free_bytes {fleet.free_bytes}",
        "# TYPE pagedllm_fleet_unloads_total counter",
        f"pagedllm_fleet_unloads_total {fleet.unloads}",
    ]
    for metric, kind, field in (
        ("resident", "gauge", None),
        ("share_bytes", "gauge", "share_bytes"),
        ("loads_total", "counter", "loads"),
        ("last_switch_seconds", "gauge", "last_switch_seconds"),
    ):
        lines.append(f"# TYPE pagedllm_fleet_model_{metric} {kind}")
        for m in fleet.listing():
            value = int(m["state"] == "resident") if field is None else m[field]
            lines.append(f'pagedllm_fleet_model_{metric}{{model="{m["id"]}"}} {value}')
    lines.append("# TYPE pagedllm_http_errors counter")
    lines += [f'pagedllm_http_errors{{status="{s}"}} {n}' for s, n in sorted(errors.items())]
    return "\n".join(lines) + "\n"
