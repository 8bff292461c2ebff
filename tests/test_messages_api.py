"""Anthropic's Messages API on `pagedllm serve`: Anthropic's own SDK works against it, and its
answers are the chat endpoint's answers. Greedy decoding is deterministic, so the oracle of each
Messages request is the same request through the OpenAI chat endpoint of the same server: the
same text, the same token counts, a stop sequence cutting the same text, the same reply to the
same tool result. Bad input is Anthropic's error, and the server keeps serving."""

import json

import httpx
import jsonschema
import pytest
from server_process import ServerProcess

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"  # what `pagedllm serve` serves with no model argument
KEY = "messages-test-key"
GREEDY = {"temperature": 0}  # (the SDK takes no sampling fields: they go in the body as extra_body)
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER_SCHEMA}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
GOOD = {"model": MODEL, "messages": FRANCE, "max_tokens": 2}


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--api-key", KEY, "--max-model-len", "1024", "--max-num-seqs", "8")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    import anthropic

    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def chat(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def chat_answer(chat, messages, max_tokens, **fields):
    r = chat.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, **fields)
    return r.choices[0], r.usage


def text_of(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


CONVERSATIONS = {  # name: (system, messages, max_tokens, the same conversation as chat messages)
    "a question answered to its end": (None, FRANCE, 24, FRANCE),
    "cut at max_tokens": (None, [{"role": "user", "content": "Write a long story about a dragon."}], 8, None),
    "a system prompt": ("You are a pirate. Always answer like a pirate.", FRANCE, 16, None),
    "a system prompt as blocks, text blocks, an earlier turn": (
        [{"type": "text", "text": "Answer in French."}],
        [
            {"role": "user", "content": [{"type": "text", "text": "Hello!"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Bonjour !"}]},
            {
                "role": "user",
                "content": [{"type": "text", "text": "What is the capital of "}, {"type": "text", "text": "Italy?"}],
            },
        ],
        16,
        [
            {"role": "system", "content": "Answer in French."},
            {"role": "user", "content": "Hello!"},
            {"role": "assistant", "content": "Bonjour !"},
            {"role": "user", "content": "What is the capital of Italy?"},
        ],
    ),
}


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_the_answer_is_the_chat_endpoints_answer(client, chat, name):
    system, messages, max_tokens, as_chat = CONVERSATIONS[name]
    if as_chat is None:
        as_chat = ([{"role": "system", "content": system}] if system else []) + messages
    extra = {"system": system} if system is not None else {}
    m = client.messages.create(model=MODEL, messages=messages, max_tokens=max_tokens, extra_body=GREEDY, **extra)
    expected, usage = chat_answer(chat, as_chat, max_tokens)
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == expected.message.content
    assert m.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[expected.finish_reason]
    assert m.stop_sequence is None
    assert (m.usage.input_tokens, m.usage.output_tokens) == (usage.prompt_tokens, usage.completion_tokens)
    if name == "cut at max_tokens":
        assert m.stop_reason == "max_tokens" and m.usage.output_tokens == max_tokens


@pytest.mark.parametrize("system", [None, "You are a pirate. Always answer like a pirate."])
def test_streamed_events_add_up_to_the_whole_message(client, system):
    args = dict(
        model=MODEL, messages=FRANCE, max_tokens=16, extra_body=GREEDY, **({"system": system} if system else {})
    )
    whole = client.messages.create(**args)
    with client.messages.stream(**args) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(pieces) > 1 and "".join(pieces) == text_of(whole)
    assert [(b.type, b.text) for b in final.content] == [(b.type, b.text) for b in whole.content]
    assert (final.stop_reason, final.stop_sequence) == (whole.stop_reason, whole.stop_sequence)
    assert final.usage.input_tokens == whole.usage.input_tokens > 0
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_a_stop_sequence_cuts_the_chat_answer_and_is_named(client, chat):
    expected, _ = chat_answer(chat, FRANCE, 24)
    full = expected.message.content
    assert "Paris" in full and expected.finish_reason == "stop"
    args = dict(model=MODEL, messages=FRANCE, max_tokens=24, extra_body=GREEDY, stop_sequences=["Rome", "Paris"])
    m = client.messages.create(**args)
    assert text_of(m) == full[: full.index("Paris")]
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", "Paris")
    with client.messages.stream(**args) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text_of(m) and (final.stop_reason, final.stop_sequence) == ("stop_sequence", "Paris")
    # stop sequences that never come: the model ends its turn (on its end token), not on one of them
    unmatched = client.messages.create(**{**args, "stop_sequences": ["Rome", "zebra"]})
    assert text_of(unmatched) == full
    assert (unmatched.stop_reason, unmatched.stop_sequence) == ("end_turn", None)


def test_a_named_tool_is_called_with_valid_input_and_its_result_answered(client, chat):
    args = dict(model=MODEL, max_tokens=24, extra_body=GREEDY, tools=[WEATHER])
    m = client.messages.create(messages=ASK_WEATHER, tool_choice={"type": "tool", "name": "get_weather"}, **args)
    assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["tool_use"]
    call = m.content[0]
    assert call.name == "get_weather" and call.id
    jsonschema.validate(call.input, WEATHER_SCHEMA)
    with client.messages.stream(messages=ASK_WEATHER, tool_choice={"type": "tool", "name": "get_weather"}, **args) as s:
        streamed = s.get_final_message()
    assert [(b.type, b.name, b.input) for b in streamed.content] == [("tool_use", call.name, call.input)]
    # the call and its result, as Anthropic's blocks and as chat messages, get the same reply
    as_chat_call = {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": json.dumps(call.input)},
    }
    for result, is_error, chat_text in [
        ("18 degrees and sunny", False, "18 degrees and sunny"),
        ([{"type": "text", "text": "service down"}], True, "Error: service down"),
    ]:
        turn = {"type": "tool_result", "tool_use_id": call.id, "content": result, "is_error": is_error}
        conversation = [*ASK_WEATHER, {"role": "assistant", "content": m.content}, {"role": "user", "content": [turn]}]
        reply = client.messages.create(messages=conversation, **args)
        expected, usage = chat_answer(
            chat,
            [
                *ASK_WEATHER,
                {"role": "assistant", "content": None, "tool_calls": [as_chat_call]},
                {"role": "tool", "tool_call_id": call.id, "content": chat_text},
            ],
            24,
            tools=[
                {
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "description": WEATHER["description"],
                        "parameters": WEATHER_SCHEMA,
                    },
                }
            ],
        )
        assert reply.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[expected.finish_reason]
        assert text_of(reply) == expected.message.content and reply.usage.input_tokens == usage.prompt_tokens


BAD = {  # name: (body fields, status, Anthropic's error type, the field named)
    "max_tokens missing": ({"max_tokens": None}, 400, "invalid_request_error", "max_tokens"),
    "an unknown role": (
        {"messages": [{"role": "system", "content": "hi"}]},
        400,
        "invalid_request_error",
        "messages.0.role",
    ),
    "thinking enabled": (
        {"thinking": {"type": "enabled", "budget_tokens": 1024}},
        400,
        "invalid_request_error",
        "thinking",
    ),
    "an image block": (
        {"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}]},
        400,
        "invalid_request_error",
        "messages.0.content",
    ),
    "an unknown field": ({"output_config": {"effort": "low"}}, 400, "invalid_request_error", "output_config"),
    "a prefill": (
        {"messages": [*FRANCE, {"role": "assistant", "content": "The"}]},
        400,
        "invalid_request_error",
        "messages",
    ),
    "a named tool that is not given (the chat path's refusal)": (
        {"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "launch"}},
        400,
        "invalid_request_error",
        "tool_choice",
    ),
    "an unknown model": ({"model": "claude-opus"}, 404, "not_found_error", "model"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_gets_anthropics_error_and_the_server_keeps_serving(server, name):
    fields, status, kind, param = BAD[name]
    body = {"model": MODEL, "messages": FRANCE, "max_tokens": 4, **fields}
    body = {k: v for k, v in body.items() if v is not None}
    r = httpx.post(server.url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == kind and error["error"]["message"]
    assert error["error"]["param"] == param
    ok = httpx.post(server.url + "/v1/messages", json=GOOD, headers={"x-api-key": KEY}, timeout=60)
    assert ok.status_code == 200 and ok.json()["content"][0]["text"], ok.text


def test_the_sdk_raises_its_own_errors(client):
    import anthropic

    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(
            model=MODEL, messages=FRANCE, max_tokens=4, thinking={"type": "enabled", "budget_tokens": 1024}
        )
    assert bad.value.body["error"]["type"] == "invalid_request_error" and "thinking" in bad.value.message
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-opus", messages=FRANCE, max_tokens=4)


def test_the_api_key_is_taken_as_x_api_key_on_messages_only(server):
    """Anthropic's API takes the key as x-api-key (its SDK of 2.x sends a Bearer token, as the
    client fixture does here); the OpenAI routes keep taking only the Bearer token."""
    import anthropic

    wrong = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        wrong.messages.create(model=MODEL, messages=FRANCE, max_tokens=2)
    for headers, status in [
        ({"x-api-key": KEY}, 200),
        ({"x-api-key": "wrong"}, 401),
        ({"Authorization": f"Bearer {KEY}"}, 200),
        ({"Authorization": "Bearer wrong", "x-api-key": "wrong"}, 401),
    ]:
        assert httpx.post(server.url + "/v1/messages", json=GOOD, headers=headers, timeout=60).status_code == status
    assert httpx.post(server.url + "/v1/chat/completions", json=GOOD, headers={"x-api-key": KEY}).status_code == 401
