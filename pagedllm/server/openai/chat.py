"""``POST /v1/chat/completions``: the messages through the chat template (``prompting``), the
answer as a chat completion, whole or as SSE chunks (``shaping``)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from ..generation import start
from ..prompting import chat_job
from ..protocol import ChatCompletionRequest
from .shaping import answer, shape_of

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(req: ChatCompletionRequest, request: Request):
    generation = await start(request, await chat_job(request, req))
    shape = shape_of(request, generation, chat=True, prompt_logprobs=req.prompt_logprobs is not None)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return await answer(generation, shape, req.stream, include_usage)
