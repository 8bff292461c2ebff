"""The endpoints. Each reads what it serves from ``request.app.state`` (set by ``create_app``):
``model`` (a ``served.ServedModel``), ``engine`` (its ``served.Engine``), ``metrics``, ``model_name``,
``tokenizer_thread`` and ``reasoning_parser`` (``reasoning.py``; None: chat text as is).

The generation endpoints only turn their body into token-id prompts; ``generation.generate``
runs them. Tokenizing and chat templating (a body may carry megabytes of text) run on one
worker thread, never on the event loop, which must keep streaming to everyone else meanwhile.
What the client got wrong is raised as ``RequestRejected`` where it is found (the app answers it
400); nothing here catches a ValueError, so a bug below stays a 500.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ..engine_config import ConfigError
from ..errors import CacheDoesNotFitError, EngineStopped, RequestRejected
from ..sampling_params import StructuredOutput
from . import tool_calls
from .errors import APIError, unavailable
from .generation import generate
from .openapi import ERROR_BODY
from .protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, MemoryRequest, TokenizeRequest
from .reasoning import Reasoning, opens_thinking
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
    echo = None
    if req.echo:  # the prompt as given, or as its ids decode
        decode = request.app.state.model.tokenizer.decode
        echo = [p if isinstance(p, str) else await off_loop(request, decode, list(p)) for p in texts]
    return await generate(
        request, req, prompts, req.max_tokens, req.logprobs, chat=False, constraint=constraint, echo=echo
    )


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
    reasoning = None
    if request.app.state.reasoning_parser is not None:
        tail = await off_loop(request, model.tokenizer.decode, prompt[-16:])  # does the prompt open a think block?
        reasoning = Reasoning(request.app.state.reasoning_parser, opens_thinking(tail), constraint is not None)
    return await generate(
        request, req, [prompt], max_tokens, logprobs, chat=True, constraint=constraint, tools=tools, reasoning=reasoning
    )


NOT_FOUND: dict[int | str, dict[str, Any]] = {
    404: {"description": "unknown model", "content": {"application/json": {"schema": ERROR_BODY}}}
}


@router.post("/tokenize", responses=NOT_FOUND)
async def tokenize(req: TokenizeRequest, request: Request):
    """vLLM's: a ``prompt``'s or chat ``messages``' token ids, as the generation endpoints count them."""
    check_model(request, req.model)
    model = request.app.state.model
    ids = await off_loop(request, prompt_ids, model, req)
    body: dict = {"count": len(ids), "max_model_len": model.max_model_len, "tokens": ids}
    if req.return_token_strs:
        body["token_strs"] = await off_loop(request, token_strs, model.tokenizer, ids)
    return body


@router.post("/detokenize", responses=NOT_FOUND)
async def detokenize(req: DetokenizeRequest, request: Request):
    """vLLM's: token ids back to text; an id outside the tokenizer's vocabulary is a 400."""
    check_model(request, req.model)
    tokenizer = request.app.state.model.tokenizer
    if tokenizer is None:
        raise RequestRejected("this model directory has no tokenizer", param="tokens")
    pieces = await off_loop(request, token_strs, tokenizer, req.tokens)
    unknown = [i for i, piece in zip(req.tokens, pieces) if piece is None]
    if unknown:
        raise RequestRejected(f"token ids outside the vocabulary: {unknown[:8]}", param="tokens")
    return {"prompt": await off_loop(request, tokenizer.decode, req.tokens)}


def prompt_ids(model: ServedModel, req: TokenizeRequest) -> list[int]:
    """``/tokenize``'s ids. Messages by default give the very prompt ``/v1/chat/completions``
    runs (template, generation prompt, no special tokens added), a prompt its text's ids with
    the tokenizer's special tokens (a BOS), as vLLM's defaults have it."""
    if req.messages is not None:
        messages = tool_calls.messages_for_template([m.for_template() for m in req.messages], None, True)
        ids = model.apply_chat_template(messages)  # the template's refusals: RequestRejected naming messages
        if req.add_generation_prompt and not req.add_special_tokens:
            return ids
        text = model.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=req.add_generation_prompt
        )
        special = bool(req.add_special_tokens)
    elif req.prompt is not None:
        text, special = req.prompt, req.add_special_tokens is not False
    else:
        raise RequestRejected("give a prompt (text) or messages (a chat) to tokenize", param="prompt")
    if not special or model.tokenizer is None:
        return model.encode(text)  # RequestRejected without a tokenizer, or for text it cannot encode
    try:
        return model.tokenizer.encode(text, add_special_tokens=True)
    except Exception as e:  # (as prompts.encode: text the tokenizer cannot encode is the client's fault)
        message = f"the tokenizer cannot encode this text: {type(e).__name__}: {e}"
        raise RequestRejected(message, param="prompt") from None


def token_strs(tokenizer, ids: list[int]) -> list[str | None]:
    """Each id's entry in the tokenizer's vocabulary, None for one outside it."""
    backend = getattr(tokenizer, "backend", None)  # pagedllm's Tokenizer (tokenizers' Rust one inside)
    if backend is not None:
        return [backend.id_to_token(i) if 0 <= i < 2**32 else None for i in ids]
    size = len(tokenizer)  # a transformers tokenizer
    return [tokenizer.convert_ids_to_tokens(i) if 0 <= i < size else None for i in ids]


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
