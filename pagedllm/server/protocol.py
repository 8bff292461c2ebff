"""Request bodies of the OpenAI API as pydantic models, with pagedllm's documented limits.

Unknown fields are ignored, as OpenAI's clients send many; known fields are type-checked
strictly (``"2"`` is not a number, ``true`` is not 1, ``1.0`` is not an integer), and the ones
pagedllm does not implement are refused when set, never silently ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..errors import RequestRejected
from ..sampling_params import StructuredOutput

MAX_N = 16
MAX_LOGPROBS = 20
MAX_STOP = 16
MAX_STOP_LENGTH = 256
MAX_MESSAGES = 1024
MAX_PROMPTS = 256


def _refuse_if_set(value, info):
    """A known OpenAI field pagedllm does not implement: refused when set, never ignored."""
    if value:
        raise ValueError(f"{info.field_name} is not supported")
    return value


STRICT = ConfigDict(strict=True, extra="ignore")


class MemoryRequest(BaseModel):
    """``POST /v1/memory``: the engine's new budget, ``memory`` ("640MiB" or a number of bytes)
    or ``memory_fraction`` (of what is free plus what the server holds now); one of them."""

    model_config = STRICT

    memory: str | int | None = None
    memory_fraction: float | None = None


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False


class SamplingFields(BaseModel):
    model_config = STRICT

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    # Sampling fields left out take the model's defaults, else pagedllm's (SamplingParams.with_defaults)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0, le=10)
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # vLLM's: the prompt's own
    # structured output (docs/structured-output.md): OpenAI's response_format, or vLLM's fields
    response_format: dict | None = None
    structured_outputs: dict | None = (
        None  # vLLM >= 0.10: {"json" | "regex" | "choice" | "grammar" | "json_object": ...}
    )
    guided_json: dict | str | None = None  # vLLM's older fields, one constraint each
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured_output(self) -> StructuredOutput | None:
        """The one constraint the request asks for, or None; RequestRejected naming the field
        when it is malformed or when several are given."""
        found = [c for c in (self._response_format(), self._vllm_fields()) if c is not None]
        guided = {
            "guided_json": "json",
            "guided_regex": "regex",
            "guided_choice": "choice",
            "guided_grammar": "grammar",
        }
        for name, kind in guided.items():
            value = getattr(self, name)
            if value is not None:
                found.append(_constraint(name, **{kind: value}))
        if len(found) > 1:
            raise RequestRejected(
                "give one constraint: response_format, structured_outputs and guided_* are alternatives",
                param=found[1].param,
            )
        return found[0] if found else None

    def _response_format(self) -> StructuredOutput | None:
        rf = self.response_format
        if rf is None or rf.get("type") in (None, "text"):
            return None
        if rf.get("type") == "json_object":
            return _constraint("response_format", json_object=True)
        if rf.get("type") == "json_schema":
            spec = rf.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise RequestRejected(
                    'response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}',
                    param="response_format",
                )
            return _constraint("response_format", json=schema)
        raise RequestRejected(
            "response_format type must be 'text', 'json_object' or 'json_schema'", param="response_format"
        )

    def _vllm_fields(self) -> StructuredOutput | None:
        so = self.structured_outputs
        if not so:
            return None
        known = {"json", "regex", "choice", "grammar", "json_object"}
        given = {k: v for k, v in so.items() if k in known and v not in (None, False)}
        unknown = sorted(set(so) - known - {"disable_any_whitespace", "whitespace_pattern", "backend"})
        if unknown:
            raise RequestRejected(f"structured_outputs: unknown field(s) {unknown}", param="structured_outputs")
        return _constraint("structured_outputs", **given)

    @field_validator("stop")
    @classmethod
    def _bounded_stop(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        if any(not s or len(s) > MAX_STOP_LENGTH for s in stops):
            raise ValueError(f"each stop sequence must have 1 to {MAX_STOP_LENGTH} characters")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, v, info):
        return _refuse_if_set(v, info)


def _constraint(param: str, **fields: Any) -> StructuredOutput:
    try:
        return StructuredOutput(**fields, param=param)
    except (TypeError, ValueError) as e:
        raise RequestRejected(str(e).removeprefix("StructuredOutput: "), param=param) from None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v):
        if isinstance(v, list):
            if not v:
                raise ValueError("prompt must not be empty")
            if len(v) > MAX_PROMPTS and not isinstance(v[0], int):
                raise ValueError(f"at most {MAX_PROMPTS} prompts per request")
        return v

    @field_validator("suffix", "best_of")
    @classmethod
    def _unsupported(cls, v, info):
        if v not in (None, 1) or v is True:  # (True == 1: best_of=true must not pass)
            raise ValueError(f"{info.field_name} is not supported")
        return v


class TextPart(BaseModel):
    model_config = STRICT

    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = STRICT

    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallPart(BaseModel):
    model_config = STRICT

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = STRICT

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCallPart] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""

    def for_template(self) -> dict:
        """The message as chat templates read it (OpenAI's "developer" is their "system")."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (vLLM's): ``prompt`` text, or chat ``messages`` rendered by the template."""

    model_config = STRICT

    model: str | None = None
    prompt: str | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt (e.g. a BOS), False for messages
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, max_length=MAX_MESSAGES)
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    """``POST /detokenize`` (vLLM's): token ids back to text."""

    model_config = STRICT

    model: str | None = None
    tokens: list[int]
