"""A chat request as the internal request (``generation.Job``): the messages and tools through
the model's chat template, a tool choice as a constraint, a thinking model's reasoning parser.

Every chat-shaped API comes through here: the chat API directly, the Responses and Messages
APIs after turning their messages and tools into the chat request's (which the templates read),
so a conversation gets the same prompt, hence the same answer, whichever API carried it.
Templating runs on the tokenizer thread (``routes.off_loop``), never on the event loop.
"""

from __future__ import annotations

from fastapi import Request

from ..errors import EngineStopped, RequestRejected
from ..sampling_params import StructuredOutput
from . import tool_calls
from .errors import unavailable
from .generation import Job
from .protocol import ChatCompletionRequest
from .reasoning import Reasoning, opens_thinking
from .routes import check_model, off_loop
from .served import Engine, ServedModel


async def chat_job(request: Request, req: ChatCompletionRequest) -> Job:
    """The job that answers ``req``; what the client got wrong is raised as ``RequestRejected``
    (or a 404 for another model's name)."""
    check_model(request, req.model)
    model = request.app.state.model
    constraint = req.structured_output()
    tools = await chat_tools(model, request.app.state.engine, req)
    if tools is not None and tools.constraint() is not None:
        if constraint is not None:
            raise RequestRejected(
                "tool_choice 'required' or a named function already constrains the output: drop response_format",
                param="tool_choice",
            )
        constraint = tools.constraint()
    tool_list = [t.as_openai() for t in tools.tools] if tools is not None else None
    renders_tools = tool_calls.template_renders_tools(model.chat_template_source(tool_list)) if tool_list else True
    messages = tool_calls.messages_for_template([m.for_template() for m in req.messages], tools, renders_tools)
    prompt = await off_loop(request, chat_prompt, model, messages, tool_list if renders_tools else None)
    max_tokens = req.max_completion_tokens or req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    reasoning = None
    if request.app.state.reasoning_parser is not None:
        tail = await off_loop(request, model.tokenizer.decode, prompt[-16:])  # does the prompt open a think block?
        reasoning = Reasoning(request.app.state.reasoning_parser, opens_thinking(tail), constraint is not None)
    return Job([prompt], req, max_tokens, logprobs, constraint, tools, reasoning)


async def chat_tools(model: ServedModel, engine: Engine, req: ChatCompletionRequest) -> tool_calls.ToolUse | None:
    """The request's tools, checked: each one's parameters compile as a JSON schema (the
    compiler's message and the tool's field in the 400 if not)."""
    if not req.tools:
        if req.tool_choice not in (None, "none", "auto"):
            raise RequestRejected("tool_choice needs tools", param="tool_choice")
        return None
    source = model.chat_template_source([{"type": "function", "function": {"name": "f"}}])
    use = tool_calls.tool_use(req.tools, req.tool_choice, req.parallel_tool_calls, source)
    for i, tool in enumerate(use.tools):
        constraint = StructuredOutput(json=tool.parameters, param=f"tools[{i}].function.parameters")
        try:
            await engine.compile(constraint)
        except EngineStopped as e:
            raise unavailable(f"{e}; retry on a restarted server", retry_after_s=5) from None
    return use


def chat_prompt(model: ServedModel, messages: list[dict], tools: list[dict] | None) -> list[int]:
    """The prompt ids of a chat request: the template's refusals of the client's messages are
    RequestRejected naming ``messages`` (400); anything else raised is a bug (500)."""
    return model.apply_chat_template(messages, tools)
