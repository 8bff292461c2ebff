"""Anthropic's Messages API (``POST /v1/messages``): a chat under Anthropic's format.

A Messages request is a chat: it becomes a ``ChatCompletionRequest`` (the system prompt a system
message, ``tool_use`` blocks an assistant's ``tool_calls``, ``tool_result`` blocks ``tool``
messages, ``tools`` OpenAI function tools, ``tool_choice`` any -> "required" and tool -> a named
function), which ``prompting.chat_job`` makes the internal request, as it does the chat API's;
the generation's whole result, or its events as they come, become Anthropic's message or
Anthropic's typed events. So a conversation gets the chat API's answer and usage.

What is refused (400), because it would change the answer and cannot be honoured: ``thinking``
other than ``{"type": "disabled"}``, any field this module does not know (Anthropic's API refuses
unknown fields too), image and document blocks, Anthropic's server tools, and a conversation that
ends with an assistant message (Anthropic continues such a "prefill"; the chat template would start
a new turn). Accepted and without effect here: ``metadata``, ``service_tier``, ``cache_control``.

Errors keep Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``, with the
statuses the rest of the server uses; ``error`` also carries the OpenAI body's ``param`` and
``code`` (the field to blame), so every error of the server fits one schema.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import PydanticCustomError

from ...errors import RequestRejected
from ...prompts import decode_one
from ..events import Event, Failure, Finish, ReasoningDelta, Result, TextDelta, ToolCalls, Usage
from ..generation import start
from ..prompting import chat_job
from ..protocol import MAX_MESSAGES, ChatCompletionRequest
from ..sse import STREAM, sse
from ..tool_calls import ToolCall

# ---- the request -------------------------------------------------------------------------------

BLOCK_TYPES = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")
BLOCKS = ConfigDict(strict=True, extra="ignore")  # (cache_control and citations change nothing here)


class TextBlock(BaseModel):
    model_config = BLOCKS

    type: Literal["text"]
    text: str


class ToolUseBlock(BaseModel):
    """An assistant's earlier call of a tool."""

    model_config = BLOCKS

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict


class ToolResultBlock(BaseModel):
    """What a tool answered (in a user message), text only."""

    model_config = BLOCKS

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False


class ThinkingBlock(BaseModel):
    """An earlier turn's thinking: dropped, as Anthropic drops it from earlier turns' context."""

    model_config = BLOCKS

    type: Literal["thinking", "redacted_thinking"]


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")]


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    role: Literal["user", "assistant"]
    content: str | list[Block]

    @field_validator("content", mode="before")
    @classmethod
    def _supported_blocks(cls, value: Any) -> Any:
        """A clear refusal of an image or a document (the union's own error names every branch)."""
        for block in value if isinstance(value, list) else ():
            kind = block.get("type") if isinstance(block, dict) else None
            if kind not in BLOCK_TYPES:
                raise PydanticCustomError(
                    "unsupported_block",
                    "content block type {kind} is not supported (text, tool_use, tool_result are)",
                    {"kind": repr(kind)},
                )
        return value


class ToolDefinition(BaseModel):
    model_config = BLOCKS

    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict
    type: str | None = None

    @field_validator("type")
    @classmethod
    def _custom_only(cls, value: str | None) -> str | None:
        if value not in (None, "custom"):
            raise PydanticCustomError(
                "unsupported_tool",
                "server tools ({kind}) are not supported: give tools with an input_schema",
                {"kind": value},
            )
        return value


class ToolChoice(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class MessagesRequest(BaseModel):
    """The body of ``POST /v1/messages``. Sampling fields left out take the model's defaults,
    as on the chat endpoint."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: str
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int = Field(ge=1)
    system: str | list[TextBlock] | None = None
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    stop_sequences: list[str] | None = None
    stream: bool = False
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    thinking: dict | None = None
    metadata: dict | None = None
    service_tier: str | None = None
    cache_control: dict | None = None

    @field_validator("thinking")
    @classmethod
    def _no_thinking(cls, value: dict | None) -> dict | None:
        if value is not None and value.get("type") != "disabled":
            raise PydanticCustomError(
                "unsupported_thinking",
                'extended thinking is not supported: leave thinking out or send {"type": "disabled"}',
            )
        return value


# ---- Messages request -> chat request ----------------------------------------------------------


def chat_request(req: MessagesRequest) -> ChatCompletionRequest:
    """The chat request that answers ``req``."""
    fields: dict[str, Any] = {
        "model": req.model,
        "messages": chat_messages(req),
        "max_tokens": req.max_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "stop": req.stop_sequences,
        "stream": req.stream,
    }
    if req.tools:
        fields["tools"] = [chat_tool(t) for t in req.tools]
    if req.tool_choice is not None:
        fields["tool_choice"] = chat_tool_choice(req.tool_choice)
        fields["parallel_tool_calls"] = not req.tool_choice.disable_parallel_tool_use
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as e:  # a limit of the chat fields (e.g. at most 16 stop sequences)
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        param = messages_param(where)
        raise RequestRejected(f"{param}: {first['msg']}", param=param) from None


def chat_messages(req: MessagesRequest) -> list[dict]:
    system = req.system if isinstance(req.system, str) else "".join(b.text for b in req.system or [])
    out = [{"role": "system", "content": system}] if req.system is not None else []
    for i, message in enumerate(req.messages):
        out += chat_turn(message, f"messages[{i}]")
    if req.messages[-1].role == "assistant":
        raise RequestRejected(
            "the last message must be the user's: continuing an assistant message (prefill) is not supported",
            param="messages",
        )
    return out


def chat_turn(message: Message, where: str) -> list[dict]:
    """One Messages turn as chat messages: an assistant's text and calls as one message; a
    user's text as user messages and each tool result as a ``tool`` message, in their order."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    misplaced = ToolResultBlock if message.role == "assistant" else ToolUseBlock
    if any(isinstance(b, misplaced) for b in message.content):
        kind = "tool_result" if message.role == "assistant" else "tool_use"
        raise RequestRejected(f"{where}: a {message.role} message cannot hold a {kind} block", param="messages")
    if message.role == "assistant":
        return [assistant_message(message.content)]
    out: list[dict] = []
    for block in message.content:
        if isinstance(block, ToolResultBlock):
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": tool_result_text(block)})
        elif isinstance(block, TextBlock):
            if out and out[-1]["role"] == "user":
                out[-1]["content"].append(block.model_dump())
            else:
                out.append({"role": "user", "content": [block.model_dump()]})
    return out


def assistant_message(blocks: list) -> dict:
    """Text blocks as content parts (joined as the chat endpoint joins them), tool_use blocks as
    ``tool_calls``; thinking blocks are dropped."""
    text = [b.model_dump() for b in blocks if isinstance(b, TextBlock)]
    calls = [
        {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
        for b in blocks
        if isinstance(b, ToolUseBlock)
    ]
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    return message


def tool_result_text(block: ToolResultBlock) -> str:
    """A chat tool message has no error flag: a failed call's text starts with "Error: ", so the
    model still reads that it failed."""
    text = block.content if isinstance(block.content, str) else "".join(b.text for b in block.content)
    return "Error: " + text if block.is_error else text


def chat_tool(tool: ToolDefinition) -> dict:
    function = {"name": tool.name, "description": tool.description or "", "parameters": tool.input_schema}
    return {"type": "function", "function": function}


def chat_tool_choice(choice: ToolChoice) -> str | dict:
    if choice.type == "tool":
        if not choice.name:
            raise RequestRejected('tool_choice {"type": "tool"} needs the tool\'s name', param="tool_choice")
        return {"type": "function", "function": {"name": choice.name}}
    return {"any": "required"}.get(choice.type, choice.type)


# ---- the answer -> Messages answer -------------------------------------------------------------


@dataclass(frozen=True)
class StopReading:
    """Why a Messages answer stopped, from the answer's finish reason and its tokens.

    The engine says "stop" both when the model ended its turn (an end token) and when a stop
    sequence ended the text, and exposes no more. What tells them apart is the last token (each
    token's text is ``token_text`` of its id, as the chat API's logprobs list it): a turn ends on
    a special token (EOS, or another stop token), whose text decodes to nothing once special
    tokens are skipped, as the answer's text is decoded; a stop sequence ends on an ordinary
    token, the one that completed it (a special token adds no text, so it cannot complete one).
    Which sequence: the one found first in the tokens' text, as the engine cuts the text at the
    earliest match; if per-token text hides it (a tokenizer that spells a word
    differently alone), the first one given."""

    stop_sequences: list[str]
    tokenizer: Any
    token_text: Callable[[int], str]

    def read(self, finish_reason: str | None, token_ids: Sequence[int]) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence)."""
        token_texts = [self.token_text(t) for t in token_ids] if self.stop_sequences else []
        if finish_reason == "length":
            return "max_tokens", None
        if finish_reason == "tool_calls":
            return "tool_use", None
        if finish_reason != "stop" or not self.stop_sequences or not token_texts:
            return "end_turn", None
        if self._is_special(token_texts[-1]):
            return "end_turn", None
        text = "".join(token_texts)
        found = [(text.find(s), k) for k, s in enumerate(self.stop_sequences) if s in text]
        return "stop_sequence", self.stop_sequences[min(found)[1] if found else 0]

    def _is_special(self, token_text: str) -> bool:
        if self.tokenizer is None:
            return True  # no text, so no stop sequence can have matched
        ids = self.tokenizer.encode(token_text, add_special_tokens=False)
        return bool(ids) and self.tokenizer.decode(ids, skip_special_tokens=True) == ""


def anthropic_usage(usage: Usage) -> dict:
    return {"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens}


def tool_use_block(call: ToolCall) -> dict:
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": call.arguments}


def message_body(message_id: str, model: str, result: Result, stops: StopReading) -> dict:
    """The answer's first (only) choice as Anthropic's message."""
    answer = result.answers[0]
    content: list[dict] = []
    if answer.reasoning:
        content.append({"type": "thinking", "thinking": answer.reasoning, "signature": ""})
    if answer.text:
        content.append({"type": "text", "text": answer.text})
    content += [tool_use_block(call) for call in answer.calls]
    stop_reason, stop_sequence = stops.read(answer.finish_reason, answer.token_ids)
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": anthropic_usage(result.usage),
    }


def event(kind: str, payload: dict) -> str:
    """One of Anthropic's typed server-sent events."""
    return sse({"type": kind, **payload}, kind)


@dataclass
class EventStream:
    """The generation's events in, Anthropic's events out: each run of text, thinking or one tool
    call becomes a content block (start, deltas, stop). ``message_start`` says 0 input tokens and
    ``message_delta`` has both counts, from the usage at the end (the SDK's accumulated message
    takes them from there)."""

    stops: StopReading
    index: int = -1
    open: str | None = None  # the open block: "text", "thinking" or "tool_use:<call index>"
    finish_reason: str | None = None
    token_ids: Sequence[int] = ()
    usage: Usage = Usage(0, 0)

    def start(self, message_id: str, model: str) -> str:
        message: dict[str, Any] = {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        }
        return event("message_start", {"message": message})

    def take(self, batch: list[Event]) -> Iterator[str]:
        for e in batch:
            if isinstance(e, ReasoningDelta):
                yield from self._text("thinking", e.text)
            elif isinstance(e, TextDelta):
                yield from self._text("text", e.text)
            elif isinstance(e, ToolCalls):
                for k, call in enumerate(e.calls):
                    yield from self._tool_call(k, call)
            elif isinstance(e, Finish):
                self.finish_reason, self.token_ids = e.reason, e.token_ids
            elif isinstance(e, Usage):
                self.usage = e

    def end(self) -> Iterator[str]:
        yield from self._close()
        stop_reason, stop_sequence = self.stops.read(self.finish_reason, self.token_ids)
        delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
        yield event("message_delta", {"delta": delta, "usage": anthropic_usage(self.usage)})
        yield event("message_stop", {})

    def _open(self, key: str, block: dict) -> Iterator[str]:
        if self.open != key:
            yield from self._close()
            self.index, self.open = self.index + 1, key
            yield event("content_block_start", {"index": self.index, "content_block": block})

    def _close(self) -> Iterator[str]:
        if self.open is not None:
            yield event("content_block_stop", {"index": self.index})
            self.open = None

    def _text(self, kind: Literal["text", "thinking"], text: str) -> Iterator[str]:
        block: dict[str, Any] = {"type": kind, kind: ""} | ({"signature": ""} if kind == "thinking" else {})
        yield from self._open(kind, block)
        delta = {"type": f"{kind}_delta", kind: text}
        yield event("content_block_delta", {"index": self.index, "delta": delta})

    def _tool_call(self, k: int, call: ToolCall) -> Iterator[str]:
        """A call's block opens with its id and name; its input follows as one JSON delta."""
        yield from self._open(f"tool_use:{k}", {**tool_use_block(call), "input": {}})
        arguments = call.as_openai()["function"]["arguments"]
        if arguments:
            delta = {"type": "input_json_delta", "partial_json": arguments}
            yield event("content_block_delta", {"index": self.index, "delta": delta})


async def anthropic_events(
    message_id: str, model: str, batches: AsyncGenerator[list[Event], None], events: EventStream
) -> AsyncIterator[str]:
    """The generation's events as Anthropic's. A failure (the 200 was sent) becomes Anthropic's
    ``error`` event, which ends the stream. Closing this closes the generation's events, so a
    client that leaves aborts its request at once."""
    yield events.start(message_id, model)
    try:
        async for batch in batches:
            if isinstance(batch[0], Failure):  # (refused by the engine: the client's fault; else the server's)
                error = batch[0].error.body()["error"]
                status = 400 if error["type"] == "invalid_request_error" else 500
                yield event("error", {"error": anthropic_error_fields(status, error)})
                return
            for out in events.take(batch):
                yield out
        for out in events.end():
            yield out
    finally:
        await batches.aclose()


# ---- errors ------------------------------------------------------------------------------------

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def anthropic_error_fields(status: int, openai_error: dict) -> dict:
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    param = messages_param(openai_error.get("param"))
    return {"type": kind, "message": openai_error["message"], "param": param, "code": openai_error.get("code")}


def messages_param(param: str | None) -> str | None:
    """A chat request's field, as this API names it."""
    if param is None:
        return None
    return "stop_sequences" if param == "stop" else param.replace("function.parameters", "input_schema")


Handler = Callable[[Request, Any], Coroutine[Any, Any, Response]]


async def anthropic_error(request: Request, e: Exception) -> Response:
    """The app's own answer to ``e`` (its status, message, headers, metrics and logging; a bug
    stays a logged 500), in Anthropic's shape. The app's handlers are looked up by the
    exception's class, as Starlette looks them up."""
    handlers: dict[Any, Handler] = request.app.exception_handlers
    handler = next((handlers[c] for c in type(e).__mro__ if c in handlers), None)
    if handler is None:
        raise e
    answer = await handler(request, e)
    body = json.loads(bytes(answer.body))
    headers = {k: v for k, v in answer.headers.items() if k.lower() not in ("content-length", "content-type")}
    error = {"type": "error", "error": anthropic_error_fields(answer.status_code, body["error"])}
    return JSONResponse(error, status_code=answer.status_code, headers=headers)


class AnthropicErrors(APIRoute):
    """A route whose errors, its body's validation included, are answered in Anthropic's shape.
    Caught here rather than in the app's handlers: they stay one definition for every route,
    and this route alone changes the shape."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()

        async def handle_or_answer_error(request: Request) -> Response:
            try:
                return await handle(request)
            except Exception as e:
                return await anthropic_error(request, e)

        return handle_or_answer_error


# ---- the endpoint ------------------------------------------------------------------------------

ERROR_BODY = {
    "type": "object",
    "required": ["type", "error"],
    "properties": {
        "type": {"const": "error"},
        "error": {
            "type": "object",
            "required": ["type", "message"],
            "properties": {
                "type": {"type": "string"},
                "message": {"type": "string", "minLength": 1},
                "param": {"type": ["string", "null"]},  # (the field to blame, as in OpenAI's error body)
                "code": {"type": ["string", "null"]},
            },
        },
    },
}
router = APIRouter(route_class=AnthropicErrors)


@router.post(
    "/v1/messages",
    responses={
        200: {"content": {"text/event-stream": {"schema": {"type": "string", "description": "events when stream"}}}},
        404: {"description": "unknown model", "content": {"application/json": {"schema": ERROR_BODY}}},
        429: {
            "description": "more than --max-waiting queued requests",
            "content": {"application/json": {"schema": ERROR_BODY}},
        },
    },
)
async def messages(req: MessagesRequest, request: Request):
    """Anthropic's Messages API (see the module's docstring)."""
    generation = await start(request, await chat_job(request, chat_request(req)))
    tokenizer, model = request.app.state.model.tokenizer, request.app.state.model_name
    stops = StopReading(req.stop_sequences or [], tokenizer, decode_one(tokenizer))
    message_id = "msg_" + generation.id
    if req.stream:
        events = anthropic_events(message_id, model, generation.events(), EventStream(stops))
        return StreamingResponse(events, media_type=STREAM)
    result = await generation.result()
    if result is None:
        return Response(status_code=499)  # the client left
    return message_body(message_id, model, result, stops)
