"""The OpenAI-compatible HTTP API over one AsyncEngine: the app, its state and its error answers.

Every error is OpenAI's error body with the right status; bad input is a 4xx and never touches
the engine, so everyone else keeps being served. Whose fault an error is goes by its type:
``RequestRejected`` (raised where the request is checked) is the client's 400, any other exception
is the server's 500, logged with its traceback. The server's own routes are in ``routes.py``,
each API's in ``openai/`` and ``anthropic/`` (its request into the internal one, ``generation.Job``,
and the typed events back into its format), the API key and body limit in ``guards.py``; ``run.py``
serves the app over HTTP.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import RequestRejected
from . import reasoning
from .anthropic import messages
from .errors import APIError, error_body, rejected
from .guards import Guards
from .metrics import Metrics, ThroughputMeter
from .openai import chat, completions, embeddings, responses, tokenize
from .openapi import document_responses
from .routes import router
from .served import Engine, ServedModel
from .web import router as web_router

log = logging.getLogger(__name__)


def create_app(
    model: ServedModel,
    *,
    served_model_name: str | None = None,
    api_key: str | None = None,
    max_body_bytes: int = 4 * 1024 * 1024,
    max_waiting: int = 256,
    shutdown_timeout: float = 30.0,
    reasoning_parser: str = "auto",
) -> FastAPI:
    """``model``: an ``LLM`` (its engine steps on a thread of this process) or an
    ``EngineProcess`` (the engine has a process of its own, as ``pagedllm serve`` runs it).
    ``reasoning_parser``: "auto", "qwen3", "deepseek_r1" or "none" (``reasoning.py``)."""
    engine = model.async_engine(max_waiting)
    throughput = ThroughputMeter()
    engine.observers.append(throughput.observe)
    model_name = served_model_name or model.name
    metrics = Metrics(engine, throughput, model_name, plan=lambda: model.memory_plan)

    app = FastAPI(title="pagedllm", lifespan=lifespan, exception_handlers=ERROR_HANDLERS)
    document_responses(app)
    app.state.model = model
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.model_name = model_name
    app.state.tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="pagedllm-tokenize")
    app.state.shutdown_timeout = shutdown_timeout
    app.state.api_key_required = api_key is not None  # (the page asks for it)
    app.state.draining = False  # set by drain(): new generation requests get 503, /health too
    app.state.reasoning_parser = reasoning.choose(reasoning_parser, model)  # None: chat text as is
    app.add_middleware(Guards, api_key=api_key, max_body_bytes=max_body_bytes, on_error=metrics.count_error)
    app.include_router(router)
    for api in (completions, chat, tokenize, embeddings, messages, responses):
        app.include_router(api.router)
    app.include_router(web_router)
    return app


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Starts the engine thread; at shutdown lets what is in flight finish for up to
    ``shutdown_timeout`` seconds, then aborts the rest."""
    state = app.state
    engine: Engine = state.engine
    engine.start()
    log.info("serving %s; memory plan:\n%s", state.model_name, state.model.memory_plan.table())
    yield
    # Connections are closed (or given up on) by now; finish or abort what is left.
    deadline = time.monotonic() + state.shutdown_timeout
    while engine.num_unfinished and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    engine.abort_all()
    engine.stop()
    state.tokenizer_thread.shutdown(wait=False)


def drain(app: FastAPI, on_done: Callable[[], None]) -> None:
    """Graceful shutdown, in a thread: new generation requests get 503 with Retry-After (and
    /health says so, for load balancers) while the ones in flight finish, for up to
    ``shutdown_timeout`` seconds; then the rest end with a 503 error each, and ``on_done`` runs
    (the CLI stops the HTTP server then, and exits 0)."""
    state = app.state
    engine: Engine = state.engine

    def until_idle(seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while engine.num_unfinished and time.monotonic() < deadline:
            time.sleep(0.05)

    def run() -> None:
        until_idle(state.shutdown_timeout)
        engine.abort_all()
        until_idle(10)  # the handlers write the errors out
        on_done()

    state.draining = True
    threading.Thread(target=run, name="pagedllm-drain", daemon=True).start()


# ---- errors: OpenAI's error body, counted by status ----------------------------------------------


def respond(request: Request, status: int, body: dict, headers: Mapping[str, str] | None = None) -> JSONResponse:
    request.app.state.metrics.count_error(status)
    return JSONResponse(body, status_code=status, headers=headers)


async def api_error(request: Request, e: APIError) -> JSONResponse:
    return respond(request, e.status, e.body(), e.headers)


async def request_rejected(request: Request, e: RequestRejected) -> JSONResponse:
    """A request refused before anything was queued: a 400 with its ``param`` and ``code``.
    Only this type is the client's fault; any other exception, a ValueError too, is a bug (500)."""
    return await api_error(request, rejected(e))


async def validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
    """A body that does not parse or fit the schema: a 400 naming the field (never FastAPI's 422)."""
    first = e.errors()[0] if e.errors() else {}
    where = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
    if first.get("type") == "json_invalid":
        message, where = "the request body is not valid JSON", None
    else:
        message = f"{where or 'body'}: {first.get('msg', 'invalid request')}"
    return respond(request, 400, error_body(message, "invalid_request_error", where))


async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
    kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
    return respond(request, e.status_code, error_body(str(e.detail), kind), e.headers)  # (405: Allow)


async def bug(request: Request, e: Exception) -> JSONResponse:
    """A bug: logged with its traceback, answered without it."""
    log.exception("internal error")
    return respond(request, 500, error_body("internal server error", "server_error"))


ERROR_HANDLERS: dict[int | type[Exception], Callable[[Request, Any], Coroutine[Any, Any, Response]]] = {
    APIError: api_error,
    RequestRejected: request_rejected,
    RequestValidationError: validation_error,
    StarletteHTTPException: http_error,
    Exception: bug,
}
