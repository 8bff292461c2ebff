"""Tool calls and the server's structured-output fields, without a model: what each tool_choice
constrains, how the template's call formats are read back, and which requests are refused."""

import json

import pytest

from pagedllm.errors import RequestRejected
from pagedllm.sampling_params import SamplingParams, StructuredOutput
from pagedllm.server import tool_calls as tc
from pagedllm.server.protocol import ChatCompletionRequest, CompletionRequest

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
HERMES_TEMPLATE = "{% for tool in tools %}{{ tool | tojson }}{% endfor %}<tool_call>"
LLAMA3_TEMPLATE = "{% if tools %}{{ tools | tojson }}{% endif %}<|python_tag|>"


def use(choice="auto", template=HERMES_TEMPLATE, parallel=True):
    return tc.tool_use([WEATHER, TIME], choice, parallel, template)


def test_hermes_calls_are_read_with_the_content_before_them():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    text += '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    content, calls = use().parse(text)
    assert content == "Let me check."
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": "Paris"}), ("get_time", {})]


def test_llama3_json_calls_are_read():
    content, calls = use(template=LLAMA3_TEMPLATE).parse(
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    )
    assert content is None and [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": "Oslo"})]
    _, calls = use(template=LLAMA3_TEMPLATE).parse('{"name": "get_time", "parameters": {}}')
    assert [c.name for c in calls] == ["get_time"]


@pytest.mark.parametrize(
    "text",
    [
        "The weather is fine.",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>',  # broken JSON
        '<tool_call>\n{"name": "launch_rockets", "arguments": {}}\n</tool_call>',  # not one of the tools
    ],
)
def test_auto_output_that_is_not_a_valid_call_stays_content(text):
    assert use().parse(text) == (text, [])


def test_required_constrains_to_an_array_of_calls_of_the_given_tools():
    constraint = use("required").constraint()
    assert constraint is not None and constraint.json is not None
    schema = constraint.json
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    assert [c["properties"]["name"] for c in schema["items"]["anyOf"]] == [
        {"const": "get_weather"},
        {"const": "get_time"},
    ]
    assert use("required", parallel=False).constraint().json["maxItems"] == 1
    content, calls = use("required").parse('[{"name": "get_time", "parameters": {}}]')
    assert content is None and [c.name for c in calls] == ["get_time"]


def test_a_named_function_constrains_to_its_arguments():
    named = use({"type": "function", "function": {"name": "get_weather"}})
    assert named.constraint().json == WEATHER["function"]["parameters"]
    _, calls = named.parse('{"city": "Rome"}')
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": "Rome"})]


def test_none_and_auto_do_not_constrain_and_none_never_reads_calls():
    assert use("none").constraint() is None and use("auto").constraint() is None
    text = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    assert use("none").parse(text) == (text, [])


def test_streamed_text_is_held_back_from_where_a_call_may_begin():
    auto = use()
    assert auto.held_back("Sure, ") == len("Sure, ")
    assert auto.held_back("Sure, <tool") == len("Sure, ")  # half a marker
    assert auto.held_back("Sure, <tool_call>\n{") == len("Sure, ")
    assert use("required").held_back("[{") == 0
    assert use("none").held_back("<tool_call>") == len("<tool_call>")


def test_openai_call_objects_carry_ids_and_json_text_arguments():
    call = tc.ToolCall("get_weather", {"city": "Zürich"}).as_openai()
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert json.loads(call["function"]["arguments"]) == {"city": "Zürich"}


@pytest.mark.parametrize(
    "tools, choice, param",
    [
        ([{"type": "function", "function": {"description": "no name"}}], "auto", "tools"),
        ([{"type": "function", "function": {"name": "f", "parameters": "not a schema"}}], "auto", "tools"),
        ([WEATHER, WEATHER], "auto", "tools"),
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
        ([WEATHER], "sometimes", "tool_choice"),
    ],
)
def test_bad_tools_are_rejected_naming_the_field(tools, choice, param):
    with pytest.raises(RequestRejected) as e:
        tc.tool_use(tools, choice, True, HERMES_TEMPLATE)
    assert e.value.param == param


def test_a_template_without_tools_gets_them_in_a_system_message_and_history_as_hermes_text():
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c1", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": '{"temperature": 18}'},
    ]
    out = tc.messages_for_template(history, use(), renders_tools=False)
    assert (
        out[0]["role"] == "system" and out[0]["content"].startswith("Be brief.") and "get_weather" in out[0]["content"]
    )
    assert json.loads(out[2]["content"].split("<tool_call>\n")[1].split("\n</tool_call>")[0]) == {
        "name": "get_weather",
        "arguments": {"city": "Paris"},
    }
    assert out[3] == {"role": "user", "content": '<tool_response>\n{"temperature": 18}\n</tool_response>'}
    # a template that renders tools gets the messages as they are, arguments as objects
    kept = tc.messages_for_template(history, use(), renders_tools=True)
    assert kept[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"} and kept[3] == history[3]


def test_template_formats_are_recognised():
    assert tc.template_format(HERMES_TEMPLATE) == tc.HERMES
    assert tc.template_format(LLAMA3_TEMPLATE) == tc.LLAMA3_JSON
    assert tc.template_format("{{ messages }}") == tc.HERMES  # taught by our system message
    assert tc.template_renders_tools(HERMES_TEMPLATE) and not tc.template_renders_tools("{{ messages }}")


# ---- the request fields -----------------------------------------------------------------------


def chat(**fields):
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields)


@pytest.mark.parametrize(
    "fields, expected",
    [
        ({}, None),
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, StructuredOutput(json_object=True)),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}},
            StructuredOutput(json={"type": "object"}),
        ),
        ({"guided_regex": "[0-9]+"}, StructuredOutput(regex="[0-9]+")),
        ({"guided_choice": ["a", "b"]}, StructuredOutput(choice=["a", "b"])),
        ({"guided_json": {"type": "object"}}, StructuredOutput(json={"type": "object"})),
        ({"guided_grammar": 'root ::= "x"'}, StructuredOutput(grammar='root ::= "x"')),
        ({"structured_outputs": {"choice": ["a"]}}, StructuredOutput(choice=["a"])),
        ({"structured_outputs": {"json_object": True}}, StructuredOutput(json_object=True)),
    ],
)
def test_each_request_field_becomes_its_constraint(fields, expected):
    got = chat(**fields).structured_output()
    assert (got.key() if got else None) == (expected.key() if expected else None)
    got = CompletionRequest(prompt="hi", **fields).structured_output()
    assert (got.key() if got else None) == (expected.key() if expected else None)


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "x"}, "guided_regex"),
        ({"structured_outputs": {"regex": "x", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"lark": "x"}}, "structured_outputs"),
        ({"guided_choice": []}, "guided_choice"),
    ],
)
def test_malformed_or_several_constraints_are_rejected_naming_the_field(fields, param):
    with pytest.raises(RequestRejected) as e:
        chat(**fields).structured_output()
    assert e.value.param == param


def test_structured_output_takes_exactly_one_constraint_and_not_with_ignore_eos():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutput()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutput(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="grammar decides"):
        SamplingParams(ignore_eos=True, structured_output=StructuredOutput(regex="a"))
    # the same schema written in another key order is the same grammar (one compile)
    assert StructuredOutput(json={"a": 1, "b": 2}).key() == StructuredOutput(json={"b": 2, "a": 1}).key()


def test_the_tool_call_protocol_imports_without_the_http_stack_or_torch():
    import subprocess
    import sys

    code = "import sys, pagedllm.server.tool_calls; print('fastapi' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["False", "False"], out.stderr
