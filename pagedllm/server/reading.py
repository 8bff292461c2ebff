"""How a choice's output text reads: thinking, answer and tool calls, whole or so far.

A thinking model's text splits into reasoning and answer (``reasoning.py``) before tool calls
are read from the answer (``tool_calls.py``); without a parser or tools the text is all answer.
Streamed, a tail that may still be part of a think tag waits for the next token, and answer text
that may be a call is held back until the output ends, then read as whole calls; so the deltas
add up to the whole answer for any chunking (tests/test_reasoning.py).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from ..outputs import RequestOutput
from .events import Answer, Event, Prompt, ReasoningDelta, TextDelta, ToolCalls
from .reasoning import Reasoning, all_content
from .tool_calls import ToolCall, ToolUse


@dataclass(frozen=True)
class Reader:
    """One request's reading: ``reasoning`` how its outputs split (None: all answer), ``tools``
    its tools, whose calls the answer may hold (None: none)."""

    reasoning: Reasoning | None = None
    tools: ToolUse | None = None

    def answer(self, i: int, out: RequestOutput, prompt: Prompt | None = None) -> Answer:
        """Choice ``i``'s whole answer from its finished output: calls are read from the answer
        text only, never from the thinking; a stop after calls is "tool_calls"."""
        reasoning, content = self.reasoning.parse(out.text) if self.reasoning else (None, out.text)
        calls: tuple[ToolCall, ...] = ()
        if self.tools is not None and content is not None:
            content, parsed = self.tools.parse(content)
            calls = tuple(ToolCall(c.name, c.arguments, c.id or "call_" + uuid.uuid4().hex[:24]) for c in parsed)
        reason = "tool_calls" if calls and out.finish_reason == "stop" else out.finish_reason
        return Answer(i, content, reasoning, calls, reason, out.token_ids, out.logprobs, prompt)

    def delta(self, i: int, out: RequestOutput, sent: int) -> tuple[list[Event], str | None, int]:
        """Choice ``i``'s new reasoning, answer text and calls after the ``sent`` characters of
        its text already streamed, its finish reason once it is done (None for an aborted
        choice), and the characters sent after them."""
        finished = out.finished and out.finish_reason != "abort"
        reason = out.finish_reason if finished else None
        text = out.text
        split = self.reasoning.split(text, finished) if self.reasoning else all_content(text)
        calls: tuple[ToolCall, ...] = ()
        end = split.settled
        if self.tools is not None and split.content is not None:
            end = split.content + self.tools.held_back(text[split.content : split.settled])
            if finished:
                whole = self.answer(i, out)
                calls, reason = whole.calls, whole.finish_reason
                end = end if calls else split.settled
        end = max(end, sent)
        reasoning, content = split.between(text, sent, end)
        events: list[Event] = [ReasoningDelta(i, reasoning)] if reasoning else []
        if content:
            events.append(TextDelta(i, content))
        if calls:
            events.append(ToolCalls(i, calls))
        return events, reason, end
