"""The endpoints. Each reads what it serves from ``request.app.state`` (set by ``create_app``):
``model`` (a ``served.ServedModel``), ``engine`` (its ``served.Engine``), ``metrics``, ``model_name``
and ``tokenizer_thread``.

The generation endpoints only turn their body into token-id prompts; ``generation.generate``
runs them. Tokenizing and chat templating (a body may carry megabytes of text) run on one
worker thread, never on the event loop, which must keep streaming to everyone else meanwhile.
What the client got wrong is raised as ``RequestRejected`` where it is found (the app answers it
400); nothing here catches a ValueError, so a bug below stays a 500.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ..engine_config import ConfigError
from ..errors import CacheDoesNotFitError, EngineStopped, RequestRejected
from ..sampling_params import StructuredOutput
from . import tool_calls
from .errors import APIError, unavailable
from .generation import generate
from .protocol import ChatCompletionRequest, CompletionRequest, MemoryRequest
from .served import Engine, ServedModel

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


@router.post("/v1/completions")
async def completions(req: CompletionRequest, request: Request):
    check_model(request, req.model)
    raw = req.prompt
    texts = [raw] if isinstance(raw, str) or isinstance(raw[0], int) else raw
    prompts = []
    encode = request.app.state.model.encode  # RequestRejected for text the tokenizer cannot encode
    for p in texts:
        prompts.append(await off_loop(request, encode, p) if isinstance(p, str) else list(p))
    if any(not p for p in prompts):
        raise RequestRejected("prompt must not be empty", param="prompt")
    constraint = req.structured_output()
    return await generate(request, req, prompts, req.max_tokens, req.logprobs, chat=False, constraint=constraint)


@router.post("/v1/chat/completions")
async def chat_completions(req: ChatCompletionRequest, request: Request):
    check_model(request, req.model)
    model = request.app.state.model
    constraint = req.structured_output()
    tools = await chat_tools(model, request.app.state.engine, req)
    if tools is not None and tools.constraint() is not None:
        if constraint is not None:
            raise RequestRejected(
                "tool_choice 'required' or a named function already constrains the output: drop response_format",
                param="tool_choice",
            )
        constraint = tools.constraint()
    tool_list = [t.as_openai() for t in tools.tools] if tools is not None else None
    renders_tools = tool_calls.template_renders_tools(model.chat_template_source(tool_list)) if tool_list else True
    messages = tool_calls.messages_for_template([m.for_template() for m in req.messages], tools, renders_tools)
    prompt = await off_loop(request, chat_prompt, model, messages, tool_list if renders_tools else None)
    max_tokens = req.max_completion_tokens or req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    return await generate(request, req, [prompt], max_tokens, logprobs, chat=True, constraint=constraint, tools=tools)


async def chat_tools(model: ServedModel, engine: Engine, req: ChatCompletionRequest) -> tool_calls.ToolUse | None:
    """The request's tools, checked: each one's parameters compile as a JSON schema (the
    compiler's message and the tool's field in the 400 if not)."""
    if not req.tools:
        if req.tool_choice not in (None, "none", "auto"):
            raise RequestRejected("tool_choice needs tools", param="tool_choice")
        return None
    source = model.chat_template_source([{"type": "function", "function": {"name": "f"}}])
    use = tool_calls.tool_use(req.tools, req.tool_choice, req.parallel_tool_calls, source)
    for i, tool in enumerate(use.tools):
        constraint = StructuredOutput(json=tool.parameters, param=f"tools[{i}].function.parameters")
        try:
            await engine.compile(constraint)
        except EngineStopped as e:
            raise unavailable(f"{e}; retry on a restarted server", retry_after_s=5) from None
    return use


def chat_prompt(model: ServedModel, messages: list[dict], tools: list[dict] | None) -> list[int]:
    """The prompt ids of a chat request: the template's refusals of the client's messages are
    RequestRejected naming ``messages`` (400); anything else raised is a bug (500)."""
    return model.apply_chat_template(messages, tools)


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
