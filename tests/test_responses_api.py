"""OpenAI's Responses API on `pagedllm serve`: the official client's `responses.create`,
`responses.stream` and `responses.parse` work against it, every body and event is one the
client's own types accept, and each answer is the chat API's answer to the same request (the
endpoint makes the same internal request; greedy is deterministic, so the chat endpoint on the same server is
the oracle). What it does not implement is a 400 naming the field, and the server keeps serving."""

import asyncio
import json

import httpx
import jsonschema
import pytest
from openai import BadRequestError, OpenAI
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, Field, TypeAdapter
from server_process import ServerProcess

from pagedllm.server.errors import APIError
from pagedllm.server.events import Answer, Failure, Finish, ReasoningDelta, Result, TextDelta, ToolCalls, Usage
from pagedllm.server.openai.responses import Frame, ResponsesRequest, response_events
from pagedllm.server.tool_calls import ToolCall

slow = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
QUESTION = "What is the capital of France?"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
TIME = {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}}
TOOLS = [WEATHER, TIME]
CAPITAL = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "country": {"type": "string", "maxLength": 12}},
    "required": ["city", "country"],
    "additionalProperties": False,
}
EVENT = TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--memory", "2GiB", "--max-num-seqs", "8", "--max-model-len", "2048")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def chat_tool(tool: dict) -> dict:
    return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}


def chat_answer(client, messages, max_tokens, **fields):
    """The chat API's greedy answer: (its choice, its usage)."""
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, **fields)
    return r.choices[0], r.usage


def respond(client, max_output_tokens, **fields) -> Response:
    return client.responses.create(model=MODEL, max_output_tokens=max_output_tokens, temperature=0, **fields)


def calls_of(response) -> list[tuple[str, dict]]:
    return [(o.name, json.loads(o.arguments)) for o in response.output if o.type == "function_call"]


def assert_same_answer(response, choice, usage) -> None:
    """The response says what the chat choice says, in the same tokens."""
    assert response.output_text == (choice.message.content or "")
    chat_calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []]
    assert calls_of(response) == chat_calls
    assert response.status == ("incomplete" if choice.finish_reason == "length" else "completed")
    assert (response.usage.input_tokens, response.usage.output_tokens, response.usage.total_tokens) == (
        usage.prompt_tokens,
        usage.completion_tokens,
        usage.total_tokens,
    )


def events_of(sse: str) -> list[dict]:
    """A streamed body's events, each checked against the client's own event types, with its
    `event:` line naming its type and sequence numbers counting from 0."""
    events = []
    for block in sse.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        data = json.loads(lines["data"])
        assert lines["event"] == data["type"]
        EVENT.validate_python(data)
        events.append(data)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def streamed(server, body: dict) -> list[dict]:
    r = httpx.post(server.url + "/v1/responses", json={**body, "stream": True}, timeout=120)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    return events_of(r.text)


@slow
def test_a_string_input_is_answered_as_the_chat_api_answers_it(client, server):
    whole = httpx.post(
        server.url + "/v1/responses",
        json={"model": MODEL, "input": QUESTION, "max_output_tokens": 24, "temperature": 0},
        timeout=120,
    ).json()
    response = Response.model_validate(whole)  # every field the client's type requires, typed
    choice, usage = chat_answer(client, [{"role": "user", "content": QUESTION}], 24)
    assert "Paris" in response.output_text
    assert_same_answer(response, choice, usage)
    assert response.id.startswith("resp_") and response.object == "response" and response.model == MODEL
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert response.temperature == 0 and response.max_output_tokens == 24  # the request's fields, echoed


@slow
def test_instructions_are_a_system_message_before_the_input_items(client):
    history = [
        {"role": "user", "content": [{"type": "input_text", "text": "Hello!"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Hi! How can I help?"}]},
        {"role": "user", "content": QUESTION},
    ]
    instructions = "Answer in one short sentence."
    response = respond(client, 16, instructions=instructions, input=history)
    as_chat = [{"role": "system", "content": instructions}, *[{**m, "content": text(m)} for m in history]]
    assert_same_answer(response, *chat_answer(client, as_chat, 16))
    assert response.instructions == instructions


def text(message: dict) -> str:
    content = message["content"]
    return content if isinstance(content, str) else "".join(p["text"] for p in content)


@slow
@pytest.mark.parametrize("tool_choice", [None, "required"], ids=["text", "tool_call"])
def test_a_streamed_response_is_typed_events_that_add_up_to_the_whole(client, server, tool_choice):
    fields: dict = {"input": "What is the weather in Paris?"}
    if tool_choice:
        fields |= {"tools": TOOLS, "tool_choice": tool_choice, "parallel_tool_calls": False}
    whole = respond(client, 40, **fields)
    assert bool(calls_of(whole)) == bool(tool_choice)
    events = streamed(server, {"model": MODEL, "max_output_tokens": 40, "temperature": 0, **fields})
    types = [e["type"] for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == f"response.{whole.status}"
    assert types[2] == "response.output_item.added" and types[-2] == "response.output_item.done"
    final = Response.model_validate(events[-1]["response"])
    assert final.output_text == whole.output_text and calls_of(final) == calls_of(whole)
    assert final.usage == whole.usage
    text_deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    argument_deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert text_deltas == whole.output_text
    assert argument_deltas == [o.arguments for o in whole.output if o.type == "function_call"]
    done = {e["item"]["id"]: e["item"] for e in events if e["type"] == "response.output_item.done"}
    assert [done[item["id"]] for item in events[-1]["response"]["output"]] == events[-1]["response"]["output"]


@slow
def test_the_clients_stream_helper_gets_the_whole_response(client):
    fields = dict(model=MODEL, input=QUESTION, max_output_tokens=16, temperature=0)
    whole = client.responses.create(**fields)
    with client.responses.stream(**fields) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == whole.output_text
    assert final.usage == whole.usage and final.status == "completed"


@slow
def test_a_cut_answer_is_incomplete_with_reason_max_output_tokens(client):
    story = "Write a long story about a dragon."
    response = respond(client, 8, input=story)
    choice, usage = chat_answer(client, [{"role": "user", "content": story}], 8)
    assert choice.finish_reason == "length"
    assert_same_answer(response, choice, usage)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 8 and response.output[0].status == "incomplete"
    last = list(client.responses.create(model=MODEL, input=story, max_output_tokens=8, temperature=0, stream=True))[-1]
    assert last.type == "response.incomplete" and last.response.status == "incomplete"
    assert last.response.incomplete_details.reason == "max_output_tokens"
    assert last.response.output_text == response.output_text and last.response.output[0].status == "incomplete"


class Capital(BaseModel):
    city: str = Field(max_length=12)
    country: str = Field(max_length=12)


@slow
def test_text_format_json_schema_and_json_object_constrain_the_output(client):
    ask = "What is the capital of France? Reply in JSON."
    fmt = {"type": "json_schema", "name": "capital", "schema": CAPITAL, "strict": True}
    response = respond(client, 40, input=ask, text={"format": fmt})
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), CAPITAL)
    parsed = client.responses.parse(model=MODEL, input=ask, max_output_tokens=40, temperature=0, text_format=Capital)
    assert isinstance(parsed.output_parsed, Capital)
    response = respond(client, 16, input=ask, text={"format": {"type": "json_object"}})
    messages = [{"role": "user", "content": ask}]
    assert_same_answer(response, *chat_answer(client, messages, 16, response_format={"type": "json_object"}))


@slow
def test_a_function_call_and_its_output_make_a_round_trip(client):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    tools = {t["name"]: t for t in TOOLS}
    for choice, name in (({"type": "function", "name": "get_time"}, "get_time"), ("required", "get_weather")):
        first = respond(client, 40, input=ask, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False)
        [call] = [o for o in first.output if o.type == "function_call"]
        assert call.call_id.startswith("call_") and call.status == "completed" and call.name == name
        jsonschema.validate(json.loads(call.arguments), tools[name]["parameters"])
    result = json.dumps({"temperature": 18, "unit": "celsius"})
    turn = [
        *ask,
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": result},
    ]
    second = respond(client, 24, input=turn, tools=TOOLS)
    as_chat = [
        *ask,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": result},
    ]
    assert_same_answer(second, *chat_answer(client, as_chat, 24, tools=[chat_tool(t) for t in TOOLS]))
    assert second.usage.input_tokens > first.usage.input_tokens  # the call and its result are in the prompt


REFUSED = [
    ({"previous_response_id": "resp_123"}, "previous_response_id", "stateless"),
    ({"conversation": "conv_123"}, "conversation", "stateless"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", "web_search"),
    ({"reasoning": {"effort": "high"}}, "reasoning", "reasoning"),
    ({"background": True}, "background", "background"),
    ({"include": ["message.output_text.logprobs"]}, "include", "include"),
    (
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        "input[0].content[0]",
        "input_image",
    ),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]", "stateless"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema", "schema"),
    ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
]


@slow
@pytest.mark.parametrize("fields, param, said", REFUSED, ids=[r[1] for r in REFUSED])
def test_what_is_not_implemented_is_a_400_naming_the_field_and_the_server_keeps_serving(client, fields, param, said):
    with pytest.raises(BadRequestError) as e:
        client.responses.create(model=MODEL, **{"input": QUESTION, **fields})
    assert e.value.param == param and said in e.value.message, e.value.body
    assert respond(client, 2, input=QUESTION).status in ("completed", "incomplete")


# ---- without a model: what a thinking model's answer becomes ---------------------------------


CALL = ToolCall("get_time", {}, "call_1")
THINKING_STREAM = [  # the events a generation yields, one batch per engine output
    [ReasoningDelta(0, "The user wants ")],
    [ReasoningDelta(0, "the time.")],
    [TextDelta(0, "Let me check.")],
    [ToolCalls(0, (CALL,)), Finish(0, "tool_calls", [1, 2])],
    [Usage(5, 7)],
]
THINKING_RESULT = Result(
    "1",
    0,
    [Answer(0, "Let me check.", "The user wants the time.", (CALL,), "tool_calls", [1, 2], None, None)],
    Usage(5, 7),
)


def sse_of(frame: Frame, batches: list[list]) -> str:
    async def events():
        for batch in batches:
            yield batch

    async def collect():
        return "".join([event async for event in response_events(frame, events())])

    return asyncio.run(collect())


def test_reasoning_content_becomes_a_reasoning_item_before_the_message_whole_and_streamed():
    frame = Frame.of(ResponsesRequest(input="What time is it?", tools=[TIME]), MODEL)
    whole = Response.model_validate(frame.from_result(THINKING_RESULT))
    sse = sse_of(frame, THINKING_STREAM)
    events = events_of(sse)
    final = Response.model_validate(events[-1]["response"])
    # the client's stream helper reads the same events into the same response
    answer = httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})
    offline = OpenAI(
        base_url="http://test/v1",
        api_key="unused",
        http_client=httpx.Client(transport=httpx.MockTransport(lambda _: answer)),
    )
    with offline.responses.stream(model=MODEL, input="What time is it?") as stream:
        helped = stream.get_final_response()
    for response in (whole, final, helped):
        assert [o.type for o in response.output] == ["reasoning", "message", "function_call"]
        assert response.output[0].content[0].text == "The user wants the time." and response.output[0].summary == []
        assert response.output_text == "Let me check." and calls_of(response) == [("get_time", {})]
        assert response.usage.output_tokens == 7 and response.status == "completed"
    reasoning = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert reasoning == "The user wants the time."


def test_a_failure_after_the_answer_began_ends_the_response_as_failed():
    frame = Frame.of(ResponsesRequest(input="hi"), MODEL)
    error = Failure(APIError(500, "non-finite logits", "server_error"))
    batches = [[TextDelta(0, "Hel")], [error], [Usage(3, 1)]]
    events = events_of(sse_of(frame, batches))
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["error"] == {"code": "server_error", "message": "non-finite logits"}
