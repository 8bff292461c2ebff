"""``POST /v1/completions``: text or token-id prompts, each answered for ``n`` samples, with
OpenAI's legacy ``echo`` and logprobs and vLLM's ``prompt_logprobs``."""

from __future__ import annotations

from fastapi import APIRouter, Request

from ...errors import RequestRejected
from ..generation import Job, start
from ..protocol import CompletionRequest
from ..routes import check_model, off_loop
from .shaping import answer, shape_of

router = APIRouter()


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
    job = Job(prompts, req, req.max_tokens, req.logprobs, constraint, echo=echo)
    generation = await start(request, job)
    shape = shape_of(request, generation, chat=False, prompt_logprobs=req.prompt_logprobs is not None)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return await answer(generation, shape, req.stream, include_usage)
