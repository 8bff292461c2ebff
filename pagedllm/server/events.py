"""What a generation request produces, whichever API asked for it: typed events while it runs,
and the whole answer when it is done (``generation.py`` makes both from the engine's outputs).

Every API formats these and nothing else (``openai/``, ``anthropic/``), so the same text, tool
calls, finish reason and usage come through each of them, as llama.cpp's server formats every
API from one internal result. Choice ``i`` is prompt ``i // n``'s sample ``i % n``.

A streamed answer is a sequence of batches: the events one engine output made, in the order
below (a prompt part, reasoning, text, tool calls, logprobs, the finish), so an API that sends
one chunk per step (the chat API) can put a batch in one chunk. After every choice, a ``Usage``
batch ends the stream, even after a ``Failure``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .errors import APIError
from .tool_calls import ToolCall


@dataclass(frozen=True)
class Prompt:
    """A choice's prompt part, first in its first batch when the request echoes its prompt or
    asks for prompt logprobs: ``echo`` the prompt's text (None: not echoed), ``token_ids`` its
    tokens, ``logprobs`` theirs (the engine's entries, the first None; None: not computed)."""

    choice: int
    echo: str | None
    token_ids: Sequence[int]
    logprobs: Sequence[dict | None] | None


@dataclass(frozen=True)
class ReasoningDelta:
    """New thinking (a reasoning parser split it from the answer)."""

    choice: int
    text: str


@dataclass(frozen=True)
class TextDelta:
    """New answer text (for a chat request with tools: text that cannot be a call)."""

    choice: int
    text: str


@dataclass(frozen=True)
class ToolCalls:
    """The calls read from a finished answer, whole, each with its id."""

    choice: int
    calls: tuple[ToolCall, ...]


@dataclass(frozen=True)
class Logprobs:
    """The new tokens' logprobs, in every batch of a request that asked for them (maybe none
    new): the engine's entries, {"token": (id, logprob), "top": [(id, logprob), ...]}."""

    choice: int
    entries: Sequence[dict]


@dataclass(frozen=True)
class Finish:
    """A choice is done: ``reason`` "stop", "length" or "tool_calls" (stopped after calls);
    ``token_ids`` all it generated. An aborted choice has none."""

    choice: int
    reason: str
    token_ids: Sequence[int]


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Failure:
    """A request failed after its answer began (the 200 was sent): the error it would have been."""

    error: APIError


Event = Prompt | ReasoningDelta | TextDelta | ToolCalls | Logprobs | Finish | Usage | Failure


@dataclass(frozen=True)
class Answer:
    """One choice's whole answer: ``text`` the answer (None: none, e.g. only calls),
    ``reasoning`` the thinking (None: none), ``calls`` the tool calls read from the answer,
    ``finish_reason`` as ``Finish`` has it ("abort" too), ``logprobs`` every token's (None: not
    asked), ``prompt`` the prompt part (when asked, as in the stream)."""

    index: int
    text: str | None
    reasoning: str | None
    calls: tuple[ToolCall, ...]
    finish_reason: str | None
    token_ids: Sequence[int]
    logprobs: Sequence[dict] | None
    prompt: Prompt | None


@dataclass(frozen=True)
class Result:
    """A whole answer: its id (each API prefixes it), when it was made, every choice, the usage."""

    id: str
    created: int
    answers: list[Answer]
    usage: Usage
