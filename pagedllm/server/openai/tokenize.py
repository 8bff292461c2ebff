"""vLLM's ``POST /tokenize`` and ``POST /detokenize``: a prompt's or a chat's token ids, as the
generation endpoints count them, and token ids back to text."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from ... import prompts
from ...errors import RequestRejected
from .. import tool_calls
from ..openapi import ERROR_BODY
from ..protocol import DetokenizeRequest, TokenizeRequest
from ..routes import check_model, off_loop
from ..served import ServedModel

router = APIRouter()

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
        # RequestRejected without a tokenizer, or for text it cannot encode
        return prompts.encode(model.tokenizer, text)
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
