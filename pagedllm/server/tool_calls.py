"""Tool calls, OpenAI-style, on any chat template: the tools go into the prompt, the choice of
tool becomes a constraint, and the text that comes back becomes ``tool_calls``.

How the prompt teaches tools: a template that reads ``tools`` (Qwen2/3, Llama 3.x, Mistral...)
renders them itself, in the format it was trained on; for one that does not (SmolLM2), a system
message written here describes them in the Hermes format (``<tool_call>`` blocks of JSON), the
most common one among small open models, and earlier calls and results are written the same way.

What each ``tool_choice`` does:
- ``"none"``: the tools are rendered, nothing is constrained or parsed.
- ``"auto"`` (the default): free text, then parsed in the template's format (``FORMATS``); text
  that is not a call stays content.
- ``"required"``: the output is constrained to a JSON array of one or more ``{"name", "parameters"}``
  objects, each valid against its tool's schema (the same shape vLLM uses), whatever the template.
- a named function: the output is constrained to that function's arguments.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from ..errors import RequestRejected
from ..sampling_params import StructuredOutput

# Formats a template may teach, recognised by a marker in its source.
HERMES, LLAMA3_JSON = "hermes", "llama3_json"
FORMATS = {HERMES: "<tool_call>", LLAMA3_JSON: "<|python_tag|>"}

SYSTEM_PROMPT = (
    "You may call functions to answer. Their signatures, as JSON schemas, are listed inside "
    "<tools></tools>:\n<tools>\n{tools}\n</tools>\n"
    "To call one, reply with a <tool_call></tool_call> block holding a JSON object with the "
    "function's name and arguments, one block per call:\n"
    '<tool_call>\n{{"name": <function name>, "arguments": <arguments object>}}\n</tool_call>'
)


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict

    def as_openai(self) -> dict:
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict
    id: str = ""

    def as_openai(self) -> dict:
        return {
            "id": self.id or "call_" + uuid.uuid4().hex[:24],
            "type": "function",
            "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)},
        }


@dataclass(frozen=True)
class ToolUse:
    """One request's tools and what it asked of them: how to constrain and how to read the output."""

    tools: tuple[Tool, ...]
    choice: str  # "none" | "auto" | "required" | "function"
    function: str | None  # the named function, for choice == "function"
    format: str  # the template's format (HERMES or LLAMA3_JSON), for "auto"
    parallel: bool = True

    def constraint(self) -> StructuredOutput | None:
        if self.choice == "required":
            calls = [
                {
                    "type": "object",
                    "properties": {"name": {"const": t.name}, "parameters": t.parameters},
                    "required": ["name", "parameters"],
                }
                for t in self.tools
            ]
            schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
            if not self.parallel:
                schema["maxItems"] = 1
            return StructuredOutput(json=schema, param="tools")
        if self.choice == "function":
            tool = next(t for t in self.tools if t.name == self.function)
            return StructuredOutput(json=tool.parameters, param="tools")
        return None

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls) of a finished output. Constrained output always parses; "auto"
        output that is not a well-formed call of a known tool is content."""
        if self.choice == "none":
            return text, []
        if self.choice in ("required", "function"):
            try:
                value = json.loads(text)
            except json.JSONDecodeError:  # cut short by max_tokens: no call, the text as is
                return text, []
            if self.choice == "function":
                return None, [ToolCall(str(self.function), value)]
            return None, [ToolCall(c["name"], c["parameters"]) for c in value]
        known = {t.name for t in self.tools}
        content, calls = (_parse_hermes if self.format == HERMES else _parse_llama3_json)(text)
        if not calls or any(c.name not in known for c in calls):
            return text, []
        return content, calls

    def held_back(self, text: str) -> int:
        """Where, in streamed "auto" text, a call may begin: content after it waits for the end."""
        if self.choice == "none":
            return len(text)
        if self.choice != "auto":
            return 0
        marker = FORMATS[self.format]
        if self.format == LLAMA3_JSON and text.lstrip().startswith("{"):
            return 0
        at = text.find(marker)
        if at >= 0:
            return at
        for k in range(min(len(marker) - 1, len(text)), 0, -1):  # a marker may be half written
            if marker.startswith(text[-k:]):
                return len(text) - k
        return len(text)


def tool_use(tools: list, tool_choice: Any, parallel: bool, template: str) -> ToolUse:
    """Checks a request's ``tools`` and ``tool_choice`` (RequestRejected naming the field)."""
    parsed = tuple(_tool(i, t) for i, t in enumerate(tools))
    names = [t.name for t in parsed]
    if len(set(names)) != len(names):
        raise RequestRejected("tools: function names must be unique", param="tools")
    function = None
    if tool_choice is None:
        choice = "auto"
    elif tool_choice in ("none", "auto", "required"):
        choice = tool_choice
    elif isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict):
        choice, function = "function", tool_choice["function"].get("name")
        if function not in names:
            raise RequestRejected(f"tool_choice names {function!r}, which is not among the tools", param="tool_choice")
    else:
        raise RequestRejected(
            'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    return ToolUse(parsed, choice, function, template_format(template), parallel)


def _tool(i: int, value: Any) -> Tool:
    where = f"tools[{i}]"
    if not isinstance(value, dict) or value.get("type", "function") != "function":
        raise RequestRejected(f'{where} must be {{"type": "function", "function": {{...}}}}', param="tools")
    fn = value.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise RequestRejected(f"{where}.function must have a name", param="tools")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict):
        raise RequestRejected(f"{where}.function.parameters must be a JSON schema (an object)", param="tools")
    return Tool(fn["name"], str(fn.get("description") or ""), params)


def template_format(template: str) -> str:
    """The call format a chat template teaches; Hermes when it teaches none (we teach it then)."""
    if FORMATS[LLAMA3_JSON] in template and FORMATS[HERMES] not in template:
        return LLAMA3_JSON
    return HERMES


def template_renders_tools(template: str) -> bool:
    return re.search(r"\btools\b", template) is not None


def messages_for_template(messages: list[dict], use: ToolUse | None, renders_tools: bool) -> list[dict]:
    """The conversation as the template should see it. A template that renders tools gets them
    (and earlier calls, arguments as objects) as it expects; for one that does not, the tools go
    into a system message and earlier calls and results into text, both in the Hermes format."""
    if renders_tools:
        return [_with_argument_objects(m) for m in messages]
    out = []
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"})
        elif m["role"] == "assistant" and m.get("tool_calls"):
            blocks = [
                "<tool_call>\n"
                + json.dumps({"name": c["function"]["name"], "arguments": _arguments(c)}, ensure_ascii=False)
                + "\n</tool_call>"
                for c in m["tool_calls"]
            ]
            out.append({"role": "assistant", "content": "\n".join(filter(None, [m.get("content") or "", *blocks]))})
        else:
            out.append({"role": m["role"], "content": m.get("content") or ""})
    if use is not None and use.tools:
        listed = "\n".join(json.dumps(t.as_openai(), ensure_ascii=False) for t in use.tools)
        system = SYSTEM_PROMPT.format(tools=listed)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + system}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def _arguments(call: dict) -> Any:
    args = call["function"].get("arguments")
    if isinstance(args, str):
        try:
            return json.loads(args)
        except json.JSONDecodeError:
            return args
    return args


def _with_argument_objects(message: dict) -> dict:
    if message["role"] != "assistant" or not message.get("tool_calls"):
        return message
    calls = [{**c, "function": {**c["function"], "arguments": _arguments(c)}} for c in message["tool_calls"]]
    return {**message, "tool_calls": calls}


def _parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    calls = []
    for block in re.findall(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", text, flags=re.DOTALL):
        call = _call_object(block)
        if call is None:
            return text, []
        calls.append(call)
    content = text.split("<tool_call>", 1)[0].strip()
    return content or None, calls


def _parse_llama3_json(text: str) -> tuple[str | None, list[ToolCall]]:
    body = text.split(FORMATS[LLAMA3_JSON], 1)[-1].strip()
    calls = [_call_object(part) for part in body.split(";") if part.strip()]
    if not calls or any(c is None for c in calls):
        return text, []
    return None, [c for c in calls if c is not None]


def _call_object(text: str) -> ToolCall | None:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = value.get("arguments", value.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    return ToolCall(value["name"], args) if isinstance(args, dict) else None
