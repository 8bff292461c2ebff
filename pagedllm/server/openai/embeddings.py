"""``POST /v1/embeddings`` (OpenAI's shape): each input's embedding, the model's last hidden
states pooled and L2-normalised (``SamplingParams.pooling``), computed by the same engine and
under the same memory plan as generation, batched with it.

``pooling`` (an extension; default "last", as vLLM pools a decoder model) chooses the last
token's state or the mean of all. ``encoding_format`` "base64" is the float32 vector's little-endian
bytes (what the official client asks for by default). ``dimensions`` cannot shorten the vector:
a value other than the model's hidden size is refused.
"""

from __future__ import annotations

import base64
import struct
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field

from ...errors import RequestRejected
from ...outputs import RequestOutput
from ...sampling_params import SamplingParams
from ..errors import failed, unavailable
from ..generation import outputs_of, queue_all
from ..openapi import ERROR_BODY
from ..protocol import MAX_PROMPTS, STRICT
from ..routes import check_model, off_loop

router = APIRouter()
ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"description": why, "content": {"application/json": {"schema": ERROR_BODY}}}
    for status, why in ((404, "unknown model"), (429, "more than --max-waiting queued requests (see Retry-After)"))
}


class EmbeddingRequest(BaseModel):
    model_config = STRICT

    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    pooling: Literal["last", "mean"] = "last"

    def inputs(self) -> list[str | list[int]]:
        raw = self.input
        items: list = [raw] if isinstance(raw, str) or (raw and isinstance(raw[0], int)) else list(raw)
        if not items or any(len(i) == 0 for i in items):
            raise RequestRejected("input must not be empty", param="input")
        if len(items) > MAX_PROMPTS:
            raise RequestRejected(f"at most {MAX_PROMPTS} inputs per request", param="input")
        return items


@router.post("/v1/embeddings", responses=ERRORS)
async def embeddings(req: EmbeddingRequest, request: Request):
    check_model(request, req.model)
    state = request.app.state
    if state.draining:
        raise unavailable("the server is shutting down; retry on another")
    encode = state.model.encode
    prompts = [await off_loop(request, encode, i) if isinstance(i, str) else list(i) for i in req.inputs()]
    params = [SamplingParams(max_tokens=1, pooling=req.pooling)] * len(prompts)
    _, ids, sink = await queue_all(state.engine, prompts, params)
    finals: dict[int, RequestOutput] = {}
    async for i, out in outputs_of(request, state.engine, state.metrics, ids, 1, sink):
        if out.finish_reason == "error":
            raise failed(out)
        if out.finished:
            finals[i] = out
    if len(finals) < len(prompts):
        return Response(status_code=499)  # the client went away
    vectors = [finals[i].embedding or [] for i in range(len(prompts))]
    if req.dimensions is not None and req.dimensions != len(vectors[0]):
        raise RequestRejected(
            f"dimensions: this model's embeddings have {len(vectors[0])} dimensions and cannot be shortened",
            param="dimensions",
        )
    tokens = sum(len(p) for p in prompts)
    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": encoded(v, req.encoding_format)}
            for i, v in enumerate(vectors)
        ],
        "model": state.model_name,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


def encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    """A vector as JSON numbers, or base64 of its float32 little-endian bytes."""
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
