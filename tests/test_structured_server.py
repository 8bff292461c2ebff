"""Structured output and tool calls through the server, with the official openai client:
response_format, vLLM's fields, tools with every tool_choice, streamed tool-call deltas, tool
results in the next request, and a 400 naming the field for whatever does not compile."""

import json

import httpx
import jsonschema
import pytest
from server_process import ServerProcess

from pagedllm.bench.schemas import SCHEMAS

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a timezone",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 40}},
            "required": ["timezone"],
        },
    },
}
TOOLS = [WEATHER_TOOL, TIME_TOOL]
ASK_WEATHER = [{"role": "user", "content": "What's the weather in Paris?"}]


def call_example(city: str, call_id: str) -> list[dict]:
    arguments = json.dumps({"city": city})
    return [
        {"role": "user", "content": f"What's the weather in {city}?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
            ],
        },
    ]


# Two earlier calls teach the 135M model the Hermes format well enough that, greedy, it calls again.
FEW_SHOT = call_example("Berlin", "c1") + call_example("Rome", "c2") + [{"role": "user", "content": "And in Paris?"}]


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--memory", "2GiB", "--max-num-seqs", "16", "--max-model-len", "2048")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_response_format_json_schema_answers_validate(client):
    name, schema = "person", SCHEMAS["person"]  # all eight schemas: tests/test_structured_output.py
    for params in (dict(temperature=0), dict(temperature=0.8, seed=4)):
        r = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Invent a {name}."}],
            max_tokens=300,
            response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema}},
            **params,
        )
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_response_format_json_object_and_vllm_fields_on_both_endpoints(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe Paris."}],
        max_tokens=200,
        temperature=0,  # the model's own sampling defaults would make the length a draw
        response_format={"type": "json_object"},
    )
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.completions.create(
        model=MODEL,
        prompt="Is the sky blue? Answer:",
        max_tokens=5,
        temperature=0,
        extra_body={"guided_choice": ["yes", "no"]},
    )
    assert r.choices[0].text in ("yes", "no")
    r = client.completions.create(
        model=MODEL,
        prompt="A date:",
        max_tokens=20,
        temperature=0,
        extra_body={"structured_outputs": {"regex": "20[0-9]{2}-[01][0-9]-[0-3][0-9]"}},
    )
    assert len(r.choices[0].text) == 10 and r.choices[0].text.startswith("20")
    r = client.completions.create(
        model=MODEL,
        prompt="A city as JSON:",
        max_tokens=100,
        temperature=0,
        extra_body={
            "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMAS["weather"]}}
        },
    )
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMAS["weather"])


def test_tool_choice_required_and_named_return_valid_calls(client):
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        r = client.chat.completions.create(
            model=MODEL, messages=ASK_WEATHER, tools=TOOLS, tool_choice=choice, max_tokens=200, temperature=0
        )
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None and c.message.tool_calls
        for call in c.message.tool_calls:
            assert call.id.startswith("call_") and call.type == "function"
            tool = {t["function"]["name"]: t for t in TOOLS}[call.function.name]
            jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
        if isinstance(choice, dict):
            assert [call.function.name for call in c.message.tool_calls] == ["get_time"]


def test_tool_choice_auto_reads_the_models_hermes_call_and_none_leaves_text(client):
    r = client.chat.completions.create(
        model=MODEL, messages=FEW_SHOT, tools=TOOLS, tool_choice="auto", max_tokens=60, temperature=0
    )
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and [t.function.name for t in c.message.tool_calls] == ["get_weather"]
    assert json.loads(c.message.tool_calls[0].function.arguments) == {"city": "Paris"}
    r = client.chat.completions.create(
        model=MODEL, messages=FEW_SHOT, tools=TOOLS, tool_choice="none", max_tokens=60, temperature=0
    )
    assert r.choices[0].message.tool_calls is None and "<tool_call>" in r.choices[0].message.content


@pytest.mark.parametrize("messages, choice", [(ASK_WEATHER, "required"), (FEW_SHOT, "auto")])
def test_streamed_tool_calls_arrive_as_deltas_equal_to_the_whole_answer(client, messages, choice):
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice=choice, max_tokens=200, temperature=0
    )
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, tools=TOOLS, tool_choice=choice, max_tokens=200, temperature=0, stream=True
        )
    )
    deltas = [t for ch in chunks if ch.choices for t in ch.choices[0].delta.tool_calls or []]
    assert [(d.index, d.function.name, json.loads(d.function.arguments)) for d in deltas] == [
        (k, t.function.name, json.loads(t.function.arguments))
        for k, t in enumerate(whole.choices[0].message.tool_calls)
    ]
    assert all(d.id.startswith("call_") and d.type == "function" for d in deltas)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == (
        whole.choices[0].message.content or ""
    )
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == [
        "tool_calls"
    ]


def test_a_tool_result_goes_back_in_the_next_request(client):
    first = client.chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, tools=TOOLS, tool_choice="required", max_tokens=200, temperature=0
    )
    call = first.choices[0].message.tool_calls[0]
    messages = ASK_WEATHER + [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "unit": "celsius"})},
    ]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=40, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result are in the prompt


def test_a_constrained_answer_cut_by_max_tokens_ends_with_length(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "A recipe."}],
        max_tokens=5,
        response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMAS["recipe"]}},
    )
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content.startswith("{")


@pytest.mark.parametrize(
    "body, param, message",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
            "response_format",
            "invalid JSON schema",
        ),
        ({"guided_regex": "[a-"}, "guided_regex", "invalid regex"),
        ({"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs", "invalid grammar"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}]},
            "tools[0].function.parameters",
            "invalid JSON schema",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
            "drop response_format",
        ),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ],
)
def test_what_does_not_compile_is_a_400_naming_the_field_and_the_server_keeps_serving(
    server, client, body, param, message
):
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": ASK_WEATHER, "max_tokens": 5, **body},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"]
    ok = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, max_tokens=3, temperature=0)
    assert ok.choices[0].message.content


@pytest.mark.parametrize("field", [{"ignore_eos": True}, {"min_tokens": 2}], ids=["ignore_eos", "min_tokens"])
@pytest.mark.parametrize(
    "endpoint, constraint",
    [
        ("chat", {"response_format": {"type": "json_object"}}),
        ("chat", {"guided_choice": ["yes", "no"]}),
        ("chat", {"tools": TOOLS, "tool_choice": "required"}),
        ("completions", {"structured_outputs": {"regex": "[a-z]{3}"}}),
        ("completions", {"guided_json": SCHEMAS["person"]}),
    ],
    ids=["response_format", "guided_choice", "tool_choice", "structured_outputs", "guided_json"],
)
def test_ignore_eos_and_min_tokens_with_a_constraint_are_a_400_naming_the_field(server, endpoint, constraint, field):
    """docs/structured-output.md: `ignore_eos` and `min_tokens` are refused with a clear error for
    a constrained request, whichever field carries the constraint: a 400 whose message names the
    field, nothing queued; the same request without the constraint is served."""
    body = {"model": MODEL, "max_tokens": 4, "temperature": 0, **field}
    body.update({"messages": ASK_WEATHER} if endpoint == "chat" else {"prompt": "The weather in Paris is"})
    url = f"{server.url}/v1/{'chat/completions' if endpoint == 'chat' else 'completions'}"
    r = httpx.post(url, json={**body, **constraint}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and next(iter(field)) in error["message"], error
    assert httpx.post(url, json=body, timeout=60).status_code == 200


def test_without_xgrammar_a_constrained_request_is_a_400_with_the_install_command():
    """docs/structured-output.md: "without xgrammar a constrained request is refused with the
    command to install it", through `pagedllm serve` (the engine in its own process, under a
    budget, where xgrammar would load at start): a 400 naming the field, and the server serves on."""
    s = ServerProcess(
        "--memory", "2GiB", "--max-model-len", "512", prelude="import sys\nsys.modules['xgrammar'] = None\n"
    )
    try:
        for path, body in [
            ("/v1/chat/completions", {"messages": ASK_WEATHER, "response_format": {"type": "json_object"}}),
            ("/v1/completions", {"prompt": "Is it raining?", "guided_choice": ["yes", "no"]}),
        ]:
            r = httpx.post(s.url + path, json={"model": MODEL, "max_tokens": 4, **body}, timeout=60)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert "pip install --no-deps xgrammar" in error["message"], error
            assert error["param"] == next(k for k in body if k not in ("messages", "prompt")), error
        ok = httpx.post(
            s.url + "/v1/chat/completions",
            json={"model": MODEL, "messages": ASK_WEATHER, "max_tokens": 4, "temperature": 0},
            timeout=60,
        )
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"], ok.text
    finally:
        s.stop()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_top_logprobs_of_a_constrained_answer_are_json_and_list_only_allowed_tokens(server, stream):
    """docs/structured-output.md: "a forbidden token never appears among the top ones", through
    the server: a choice answered with top_logprobs=5 is a 200 of standard JSON, and each step's
    top tokens extend the text so far towards one of the choices (or end it, once it is one)."""
    choices = ["yes", "no", "maybe"]
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Is the sky green?"}],
        "guided_choice": choices,
        "logprobs": True,
        "top_logprobs": 5,
        "temperature": 0,
        "stream": stream,
    }

    def strict_json(text: str):
        return json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} is not JSON"))

    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    if stream:
        chunks = [strict_json(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        steps = [s for c in chunks if c["choices"][0]["logprobs"] for s in c["choices"][0]["logprobs"]["content"]]
    else:
        steps = strict_json(r.text)["choices"][0]["logprobs"]["content"]
    text = ""
    for step in steps:
        for top in step["top_logprobs"]:
            extends = any(c.startswith(text + top["token"]) for c in choices)
            assert extends or (text in choices and top["token"] == "<|im_end|>"), (text, top)
        text += step["token"] if step["token"] != "<|im_end|>" else ""
    assert text in choices
