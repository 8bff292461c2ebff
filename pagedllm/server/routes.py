"""The server's own endpoints (health, the model, the memory plan, metrics) and what every API's
endpoints share: reading what is served from ``request.app.state`` (set by ``create_app``:
``model``, a ``served.ServedModel``; ``engine``, its ``served.Engine``; ``metrics``,
``model_name``, ``tokenizer_thread`` and ``reasoning_parser``, ``reasoning.py``; None: chat
text as is), the model-name check, and the tokenizer thread.

Tokenizing and chat templating (a body may carry megabytes of text) run on that one worker
thread (``off_loop``), never on the event loop, which must keep streaming to everyone else
meanwhile. What the client got wrong is raised as ``RequestRejected`` where it is found (the app
answers it 400); nothing here catches a ValueError, so a bug below stays a 500.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ..engine_config import ConfigError
from ..errors import CacheDoesNotFitError, RequestRejected
from .errors import APIError
from .protocol import MemoryRequest
from .served import Engine

router = APIRouter()
T = TypeVar("T")


@router.get("/health")
async def health(request: Request):
    engine: Engine = request.app.state.engine
    if engine.error is not None:
        return JSONResponse({"status": "error", "error": str(engine.error)}, status_code=503)
    if request.app.state.draining:
        return JSONResponse({"status": "draining"}, status_code=503, headers={"Retry-After": "1"})
    return {"status": "ok"}


@router.get("/v1/models")
async def models(request: Request):
    state = request.app.state
    model = {
        "id": state.model_name,
        "object": "model",
        "created": 0,
        "owned_by": "pagedllm",
        "max_model_len": state.model.max_model_len,
    }
    return {"object": "list", "data": [model]}


@router.get("/v1/plan")
async def plan(request: Request):
    return request.app.state.model.memory_plan.to_dict()


@router.get("/v1/memory")
async def memory(request: Request):
    """The plan the engine runs under now (``POST`` changes it)."""
    return request.app.state.model.memory_plan.to_dict()


@router.post("/v1/memory")
async def set_memory(req: MemoryRequest, request: Request):
    """``{"memory": "640MiB"}`` or ``{"memory_fraction": 0.5}``: a new budget for the running
    engine (``LLMEngine.set_memory``); the new plan back, or 400 with the planner's reason
    (nothing changed)."""
    try:
        plan = await request.app.state.engine.set_memory(req.memory, req.memory_fraction)
    except (CacheDoesNotFitError, ConfigError, ValueError) as e:
        raise RequestRejected(str(e), param="memory") from None
    request.app.state.model.memory_plan = plan
    return plan.to_dict()


@router.get("/metrics")
async def prometheus(request: Request):
    return Response(request.app.state.metrics.render(), media_type="text/plain; version=0.0.4")


def check_model(request: Request, name: str | None) -> None:
    """The model field may name the served model or be left out; anything else is a 404."""
    served = request.app.state.model_name
    if name is not None and name != served:
        raise APIError(
            404,
            f"model {name!r} does not exist; this server serves {served!r}",
            "not_found_error",
            "model",
            "model_not_found",
        )


async def off_loop(request: Request, fn: Callable[..., T], *args) -> T:
    """``fn(*args)`` on the tokenizer thread."""
    return await asyncio.get_running_loop().run_in_executor(request.app.state.tokenizer_thread, fn, *args)
