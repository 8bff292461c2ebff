"""Request bodies of the OpenAI API as pydantic models, with pagedllm's documented limits.

Unknown fields are ignored, as OpenAI's clients send many; known fields are type-checked
strictly (``"2"`` is not a number, ``true`` is not 1, ``1.0`` is not an integer), and the ones
pagedllm does not implement are refused when set, never silently ignored.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

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

    @field_validator("echo", "suffix", "best_of")
    @classmethod
    def _unsupported(cls, v, info):
        if v is True or v not in (None, False, 1):  # (True == 1: echo=true must not pass)
            raise ValueError(f"{info.field_name} is not supported")
        return v


class TextPart(BaseModel):
    model_config = STRICT

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = STRICT

    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list | None = None
    response_format: dict | None = None

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, v, info):
        return _refuse_if_set(v, info)

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, v):
        if v and v.get("type") not in (None, "text"):
            raise ValueError("only response_format type 'text' is supported")
        return v
