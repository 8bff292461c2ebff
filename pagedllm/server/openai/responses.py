"""OpenAI's Responses API, ``POST /v1/responses``: stateless, a chat under another format.

A Responses request is a chat: it becomes a ``ChatCompletionRequest`` (input items as chat
messages, ``instructions`` as the first system message, ``text.format`` as ``response_format``,
flat function tools as chat tools), which ``prompting.chat_job`` makes the internal request, as
it does the chat API's; the generation's whole result, or its events as they come, become a
Response object or the Responses events. The same request through either API gives the same
text and the same usage.

Stateless: nothing is stored, so ``store`` is accepted, and what needs a stored response
(``previous_response_id``, ``conversation``, ``prompt``, ``item_reference`` inputs) is a 400 that
says so. Fields that would change the answer and are not implemented (``reasoning``, built-in
tools such as ``web_search``, ``background``, ``include``...) are a 400 naming the field, never
ignored. ``reasoning`` items in ``input`` (an earlier answer's thinking) are left out of the
prompt, as chat templates leave out earlier turns' thinking.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, Field, ValidationError

from ...errors import RequestRejected
from ..errors import APIError
from ..events import Event, Failure, Finish, ReasoningDelta, Result, TextDelta, ToolCalls, Usage
from ..generation import start
from ..openapi import ERROR_BODY
from ..prompting import chat_job
from ..protocol import STRICT, ChatCompletionRequest
from ..sse import STREAM, sse

router = APIRouter()

# Fields that need a response or a conversation stored on the server, which keeps none.
STATEFUL = {
    "previous_response_id": "this server is stateless: it stores no responses to continue from; "
    "send the whole conversation in input (earlier output items included)",
    "conversation": "this server is stateless: it keeps no conversations; send the whole conversation in input",
    "prompt": "this server stores no prompt templates; send the text in instructions and input",
}
# Fields that would change the answer and are not implemented: refused when set.
NOT_IMPLEMENTED = {
    "reasoning": "reasoning effort and summaries are not supported",
    "background": "background responses are not supported (nothing is stored to poll)",
    "include": "include is not supported: no extra output (logprobs, encrypted reasoning) is produced",
    "max_tool_calls": "max_tool_calls is not supported",
    "top_logprobs": "top_logprobs is not supported on /v1/responses (the chat API has logprobs)",
    "context_management": "context_management is not supported",
}
TEXT_PARTS = ("input_text", "output_text", "text")
ROLES = ("user", "system", "developer", "assistant")
# The chat request's field names in its errors, as this API names them.
PARAMS = {
    "messages": "input",
    "prompt": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "structured_output": "text.format",
}
# The statuses and the stream this route answers besides the ones app.openapi adds (400, 401, 413).
EVENTS = {"schema": {"type": "string", "description": "Responses events, when stream is true"}}
OPENAPI_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/event-stream": EVENTS}},
    404: {"description": "unknown model", "content": {"application/json": {"schema": ERROR_BODY}}},
    429: {
        "description": "more than --max-waiting requests queued",
        "content": {"application/json": {"schema": ERROR_BODY}},
    },
}


class ResponsesRequest(BaseModel):
    """The body of ``POST /v1/responses``; unknown fields are ignored, as in ``protocol``."""

    model_config = STRICT

    model: str | None = None
    input: str | list[Any] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    text: dict | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    stream: bool = False
    store: bool | None = None  # accepted: nothing is stored either way
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: str | None = None
    # refused when set (STATEFUL, NOT_IMPLEMENTED)
    previous_response_id: str | None = None
    conversation: str | dict | None = None
    prompt: dict | None = None
    reasoning: dict | None = None
    background: bool | None = None
    include: list[Any] | None = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None
    context_management: list[Any] | None = None


@router.post("/v1/responses", responses=OPENAPI_RESPONSES)
async def create_response(req: ResponsesRequest, request: Request):
    refuse_what_is_not_implemented(req)
    chat = chat_request(req)
    frame = Frame.of(req, request.app.state.model_name)
    try:
        generation = await start(request, await chat_job(request, chat))
    except RequestRejected as e:
        e.param = responses_param(e.param)
        raise
    if req.stream:
        return StreamingResponse(response_events(frame, generation.events()), media_type=STREAM)
    result = await generation.result()
    if result is None:
        return Response(status_code=499)  # the client went away
    return frame.from_result(result)


# ---- the request: refusals, then the chat request ------------------------------------------------


def refuse_what_is_not_implemented(req: ResponsesRequest) -> None:
    for name, reason in {**STATEFUL, **NOT_IMPLEMENTED}.items():
        if is_set(getattr(req, name)):
            raise RequestRejected(f"{name}: {reason}", param=name, code="unsupported_parameter")
    if req.truncation not in (None, "disabled"):
        raise RequestRejected(
            'truncation: only "disabled" (an input too long for the context is a 400)', param="truncation"
        )
    verbosity = (req.text or {}).get("verbosity")
    if verbosity not in (None, "medium"):
        raise RequestRejected("text.verbosity is not supported", param="text.verbosity", code="unsupported_parameter")


def is_set(value: Any) -> bool:
    """Whether a refused field asks for something: ``null``, ``false``, ``0``, ``[]`` and
    ``{"effort": null}`` ask for nothing."""
    if isinstance(value, dict):
        return any(is_set(v) for v in value.values())
    if isinstance(value, list):
        return bool(value)
    return value is not None and value is not False and value != 0


def chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    fields = {
        "model": req.model,
        "messages": chat_messages(req.instructions, req.input),
        "max_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "response_format": response_format(req.text),
        "tools": chat_tools(req.tools),
        "tool_choice": chat_tool_choice(req.tool_choice),
        "parallel_tool_calls": req.parallel_tool_calls,
        "stream": req.stream,
    }
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as e:
        first = e.errors()[0]
        where = responses_param(str(first["loc"][0])) if first["loc"] else None
        raise RequestRejected(f"{where}: {first['msg']}", param=where) from None


def responses_param(param: str | None) -> str | None:
    """A chat request's field, as this API names it (``tools[0].function.parameters`` is ``tools[0].parameters``)."""
    if param is None:
        return None
    if param.startswith("tools["):
        return param.replace(".function.", ".")
    return PARAMS.get(param, param)


def chat_messages(instructions: str | None, given: str | list[Any] | None) -> list[dict]:
    """``instructions`` as a system message, then ``input`` as chat messages."""
    if given is None:
        raise RequestRejected("input is required: a string or a list of input items", param="input")
    messages = [{"role": "system", "content": instructions}] if instructions else []
    items = [{"role": "user", "content": given}] if isinstance(given, str) else given
    for i, item in enumerate(items):
        add_input_item(messages, item, f"input[{i}]")
    if not messages:
        raise RequestRejected("input must not be empty", param="input")
    return messages


def add_input_item(messages: list[dict], item: Any, where: str) -> None:
    if not isinstance(item, dict):
        raise RequestRejected(f"{where} must be an object: a message or a function_call(_output) item", param=where)
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ROLES:
            raise RequestRejected(f"{where}.role must be one of {', '.join(ROLES)}", param=f"{where}.role")
        messages.append({"role": role, "content": text_of(item.get("content"), f"{where}.content")})
    elif kind == "function_call":
        add_function_call(messages, item, where)
    elif kind == "function_call_output":
        output = text_of(item.get("output"), f"{where}.output")
        messages.append({"role": "tool", "tool_call_id": string(item, "call_id", where), "content": output})
    elif kind == "reasoning":
        return  # an earlier answer's thinking: chat templates leave it out of the prompt
    elif kind == "item_reference":
        raise RequestRejected(
            f"{where}: this server is stateless and stores no items; send the item itself", param=where
        )
    else:
        raise RequestRejected(
            f"{where}: input items of type {kind!r} are not supported (messages, function_call and "
            "function_call_output are)",
            param=f"{where}.type",
        )


def add_function_call(messages: list[dict], item: dict, where: str) -> None:
    """A call the model made earlier: one more tool call of the assistant turn it belongs to."""
    call = {
        "id": string(item, "call_id", where),
        "type": "function",
        "function": {"name": string(item, "name", where), "arguments": string(item, "arguments", where)},
    }
    if messages and messages[-1]["role"] == "assistant":
        messages[-1].setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise RequestRejected(f"{where}.{key} must be a string", param=f"{where}.{key}")
    return value


def text_of(content: Any, where: str) -> str:
    """A message's content (a string or a list of text parts) as one string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestRejected(f"{where} must be a string or a list of input_text parts", param=where)
    return "".join(part_text(part, f"{where}[{j}]") for j, part in enumerate(content))


def part_text(part: Any, where: str) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in TEXT_PARTS and isinstance(part.get("text"), str):
        return part["text"]
    if kind == "refusal" and isinstance(part.get("refusal"), str):
        return part["refusal"]
    if isinstance(kind, str) and kind.startswith("input_") and kind != "input_text":
        raise RequestRejected(f"{where}: {kind} parts are not supported: this server serves a text model", param=where)
    raise RequestRejected(f'{where} must be {{"type": "input_text", "text": "..."}}', param=where)


def response_format(text: dict | None) -> dict | None:
    """``text.format`` as the chat API's ``response_format``."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise RequestRejected("text.format json_schema needs a schema (an object)", param="text.format.schema")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name") or "response", "schema": schema}}
    raise RequestRejected(
        'text.format must be {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "schema": {...}}',
        param="text.format",
    )


def chat_tools(tools: list[Any] | None) -> list[dict] | None:
    """Flat function tools as chat tools; built-in tools (web_search, file_search...) are a 400."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise RequestRejected(
                f"tools[{i}]: {kind!r} tools are not implemented here; only function tools "
                '({"type": "function", "name": ..., "parameters": {...}})',
                param=f"tools[{i}].type",
                code="unsupported_parameter",
            )
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise RequestRejected(f"tools[{i}].name must be a non-empty string", param=f"tools[{i}].name")
        function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: str | dict | None) -> str | dict | None:
    if choice is None or isinstance(choice, str):
        return choice  # the chat path checks the value
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise RequestRejected(
        'tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}', param="tool_choice"
    )


# ---- the answer: a Response object -----------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def status_of(finish_reason: str | None) -> str:
    """A chat choice's finish reason as a response's status: cut short is "incomplete"."""
    return "completed" if finish_reason in ("stop", "tool_calls") else "incomplete"


def message_item(item_id: str, text: str | None, status: str) -> dict:
    """An assistant message; ``text`` None: just opened, no content part yet."""
    content = [] if text is None else [text_part("message", text)]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def reasoning_item(item_id: str, text: str | None, status: str) -> dict:
    content = [] if text is None else [text_part("reasoning", text)]
    return {"type": "reasoning", "id": item_id, "status": status, "summary": [], "content": content}


def text_part(kind: str, text: str) -> dict:
    if kind == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": []}


def function_call_item(item_id: str, call: dict, arguments: str, status: str) -> dict:
    """A chat tool call (``{"id", "function": {"name", "arguments"}}``) as a function_call item."""
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": arguments,
        "status": status,
    }


def responses_usage(usage: Usage) -> dict:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.total_tokens,
    }


@dataclass(frozen=True)
class Frame:
    """What every Response object of one request carries besides its output: its id, time,
    model and the request's fields it repeats (the client's model requires some of them)."""

    id: str
    created_at: int
    model: str
    echo: dict

    @classmethod
    def of(cls, req: ResponsesRequest, model: str) -> Frame:
        echo = {
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {},
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "text": {"format": (req.text or {}).get("format") or {"type": "text"}},
            "tool_choice": req.tool_choice or "auto",
            "tools": req.tools or [],
            "truncation": "disabled",
            "user": req.user,
        }
        return cls(new_id("resp"), int(time.time()), model, echo)

    def response(self, status: str, output: list[dict], usage: dict | None = None, error: dict | None = None) -> dict:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": error,
            "incomplete_details": incomplete,
            "model": self.model,
            "output": output,
            "usage": usage,
            **self.echo,
        }

    def from_result(self, result: Result) -> dict:
        """The whole answer (its first, only choice)."""
        answer = result.answers[0]
        status = status_of(answer.finish_reason)
        output = []
        if answer.reasoning:
            output.append(reasoning_item(new_id("rs"), answer.reasoning, "completed"))
        calls = [c.as_openai() for c in answer.calls]
        if answer.text or not calls:
            output.append(message_item(new_id("msg"), answer.text or "", status))
        for call in calls:
            output.append(function_call_item(new_id("fc"), call, call["function"]["arguments"], "completed"))
        return self.response(status, output, responses_usage(result.usage))


# ---- the answer streamed: Responses events from the generation's ---------------------------------------


@dataclass
class OpenText:
    """An output item whose text is being streamed: a "message" or a "reasoning"."""

    kind: str
    index: int
    item_id: str
    text: str = ""


TEXT_EVENTS = {"message": "response.output_text", "reasoning": "response.reasoning_text"}


@dataclass
class ResponseEvents:
    """The events of one streamed response, made from the generation's events as they come: each
    output item opens (``output_item.added``), grows by deltas, and closes (``output_item.done``)
    with the item the final response holds. Tool calls come whole when the answer ends, so each
    function call is opened, given its arguments and closed at once."""

    frame: Frame
    sequence: int = 0
    output: list[dict] = field(default_factory=list)  # by output_index, each as last sent
    open: dict[str, OpenText] = field(default_factory=dict)
    status: str = "incomplete"  # until a finish reason says otherwise
    usage: dict | None = None

    def event(self, type_: str, **fields: Any) -> str:
        payload = {"type": type_, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return sse(payload, type_)

    def opening(self) -> list[str]:
        response = self.frame.response("in_progress", [])
        return [
            self.event("response.created", response=response),
            self.event("response.in_progress", response=response),
        ]

    def take(self, batch: list[Event]) -> list[str]:
        """The events of one batch (one choice: the request has n = 1). Its finish reason sets
        the status first, as the message it closes carries it."""
        events = []
        for finish in (e for e in batch if isinstance(e, Finish)):
            self.status = status_of(finish.reason)
        for e in batch:
            if isinstance(e, Usage):
                self.usage = responses_usage(e)
            elif isinstance(e, ReasoningDelta):
                events += self.grow("reasoning", e.text)
            elif isinstance(e, TextDelta):
                events += self.close("reasoning") + self.grow("message", e.text)
            elif isinstance(e, ToolCalls):
                events += self.close("reasoning") + self.close("message")
                for call in e.calls:
                    events += self.function_call(call.as_openai())
            elif isinstance(e, Finish):
                if not any(item["type"] in ("message", "function_call") for item in self.output):
                    events += self.grow("message", "")  # an empty answer is an empty message
                events += self.close("reasoning") + self.close("message")
        return events

    def closing(self) -> list[str]:
        """The last events: what is still open closes, then the whole response."""
        events = self.close("reasoning") + self.close("message")
        response = self.frame.response(self.status, self.output, self.usage)
        kind = "response.completed" if self.status == "completed" else "response.incomplete"
        return [*events, self.event(kind, response=response)]

    def failed(self, error: APIError) -> str:
        """A failure after the 200 was sent, as ``response.failed``."""
        detail = {"code": "server_error", "message": str(error.message or "the request failed")}
        return self.event("response.failed", response=self.frame.response("failed", self.output, self.usage, detail))

    def add_item(self, item: dict) -> tuple[int, str]:
        self.output.append(item)
        index = len(self.output) - 1
        return index, self.event("response.output_item.added", output_index=index, item=item)

    def grow(self, kind: str, delta: str) -> list[str]:
        events = []
        text = self.open.get(kind)
        if text is None:
            item_id = new_id("msg" if kind == "message" else "rs")
            empty = message_item if kind == "message" else reasoning_item
            index, added = self.add_item(empty(item_id, None, "in_progress"))
            text = self.open[kind] = OpenText(kind, index, item_id)
            part = text_part(kind, "")
            events += [added, self.event("response.content_part.added", **self.where(text), part=part)]
        text.text += delta
        logprobs: dict = {"logprobs": []} if kind == "message" else {}
        return [*events, self.event(TEXT_EVENTS[kind] + ".delta", **self.where(text), delta=delta, **logprobs)]

    def close(self, kind: str) -> list[str]:
        text = self.open.pop(kind, None)
        if text is None:
            return []
        status = self.status if kind == "message" else "completed"
        item = (message_item if kind == "message" else reasoning_item)(text.item_id, text.text, status)
        self.output[text.index] = item
        logprobs: dict = {"logprobs": []} if kind == "message" else {}
        return [
            self.event(TEXT_EVENTS[kind] + ".done", **self.where(text), text=text.text, **logprobs),
            self.event("response.content_part.done", **self.where(text), part=text_part(kind, text.text)),
            self.event("response.output_item.done", output_index=text.index, item=item),
        ]

    @staticmethod
    def where(text: OpenText) -> dict:
        return {"item_id": text.item_id, "output_index": text.index, "content_index": 0}

    def function_call(self, call: dict) -> list[str]:
        item_id, arguments = new_id("fc"), call["function"]["arguments"]
        index, added = self.add_item(function_call_item(item_id, call, "", "in_progress"))
        done = self.output[index] = function_call_item(item_id, call, arguments, "completed")
        at = {"item_id": item_id, "output_index": index}
        return [
            added,
            self.event("response.function_call_arguments.delta", **at, delta=arguments),
            self.event("response.function_call_arguments.done", **at, arguments=arguments),
            self.event("response.output_item.done", output_index=index, item=done),
        ]


async def response_events(frame: Frame, batches: AsyncGenerator[list[Event], None]) -> AsyncIterator[str]:
    """The SSE of a streamed response (``event: <type>`` and ``data: {...}``), from the
    generation's events; closing it closes them, which aborts what still runs."""
    events = ResponseEvents(frame)
    for event in events.opening():
        yield event
    try:
        async for batch in batches:
            if isinstance(batch[0], Failure):
                yield events.failed(batch[0].error)
                return
            for event in events.take(batch):
                yield event
        for event in events.closing():
            yield event
    finally:
        await batches.aclose()
