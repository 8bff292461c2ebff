"""Response shaping: engine outputs as OpenAI's completion and chat bodies, whole or as SSE chunks.

Pure functions of the outputs (no FastAPI, no engine), so both endpoints and both modes share
one definition of a choice, of logprobs and of usage, and a streamed answer adds up to the whole
one. Choice ``i`` is prompt ``i // n``'s sample ``i % n``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..outputs import RequestOutput
from .tool_calls import ToolUse

TokenText = Callable[[int], str]  # one token id as the text a client sees
DONE = "data: [DONE]\n\n"


def sse(payload: dict) -> str:
    """One server-sent event."""
    return "data: " + json.dumps(payload) + "\n\n"


def usage(prompts: Sequence[Sequence[int]], completion_tokens: int) -> dict:
    prompt_tokens = sum(len(p) for p in prompts)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def chat_logprobs(out: RequestOutput, start: int, end: int, token_text: TokenText) -> dict | None:
    """Tokens [start, end) of ``out`` in the chat API's shape (with each token's UTF-8 bytes)."""
    if out.logprobs is None:
        return None

    def entry(token_id: int, logprob: float) -> dict:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    content = []
    for lp in out.logprobs[start:end]:
        top = [entry(t, v) for t, v in lp["top"]]
        content.append({**entry(*lp["token"]), "top_logprobs": top})
    return {"content": content}


def completion_logprobs(out: RequestOutput, start: int, end: int, token_text: TokenText) -> dict | None:
    """Tokens [start, end) of ``out`` in the completions API's (legacy, column-wise) shape."""
    if out.logprobs is None:
        return None
    entries = out.logprobs[start:end]
    return {
        "tokens": [token_text(lp["token"][0]) for lp in entries],
        "token_logprobs": [lp["token"][1] for lp in entries],
        "top_logprobs": [{token_text(t): v for t, v in lp["top"]} for lp in entries],
        "text_offset": [],
    }


@dataclass(frozen=True)
class Reply:
    """One response: what its body or every chunk of it carries, and how its choices look."""

    id: str
    chat: bool
    created: int
    model: str
    token_text: TokenText
    tools: ToolUse | None = None  # a chat request with tools: outputs are read as tool calls

    def logprobs(self, out: RequestOutput, start: int, end: int) -> dict | None:
        shape = chat_logprobs if self.chat else completion_logprobs
        return shape(out, start, end, self.token_text)

    def body(self, finals: Sequence[RequestOutput], prompts: Sequence[Sequence[int]]) -> dict:
        """The whole answer, from each choice's finished output (in choice order)."""
        choices = []
        for i, out in enumerate(finals):
            lp = self.logprobs(out, 0, len(out.token_ids))
            if self.chat:
                content, calls = self._read(out)
                message: dict = {"role": "assistant", "content": content}
                if calls:
                    message["tool_calls"] = calls
                reason = "tool_calls" if calls and out.finish_reason == "stop" else out.finish_reason
                choices.append({"index": i, "message": message, "logprobs": lp, "finish_reason": reason})
            else:
                choices.append({"index": i, "text": out.text, "logprobs": lp, "finish_reason": out.finish_reason})
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage(prompts, sum(len(o.token_ids) for o in finals)),
        }

    def chunk(self, choices: list[dict], **extra) -> str:
        """One SSE chunk of the streamed answer."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return sse(
            {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices, **extra}
        )

    def role_chunk(self, num_choices: int) -> str:
        """A chat stream opens by giving every choice the assistant's role."""
        delta = {"role": "assistant", "content": ""}
        return self.chunk(
            [{"index": i, "delta": delta, "logprobs": None, "finish_reason": None} for i in range(num_choices)]
        )

    def _read(self, out: RequestOutput) -> tuple[str | None, list[dict]]:
        """A finished chat output's (content, OpenAI tool calls)."""
        if self.tools is None:
            return out.text, []
        content, calls = self.tools.parse(out.text)
        return content, [c.as_openai() for c in calls]

    def delta_choice(self, i: int, out: RequestOutput, lp: dict | None, sent: int) -> tuple[dict | None, int]:
        """Choice ``i``'s chunk: its text after the ``sent`` characters already streamed, and its
        finish reason once it is done (none for an aborted choice); None when there is nothing
        to send. Returns the characters sent after it. With tools, text that may be a call is
        held back until the output ends, then sent as tool-call deltas (whole calls)."""
        finished = out.finished and out.finish_reason != "abort"
        reason = out.finish_reason if finished else None
        text = out.text
        if not self.chat:
            delta_text = text[sent:]
            if not delta_text and not finished and not lp:
                return None, sent
            return {"index": i, "text": delta_text, "logprobs": lp, "finish_reason": reason}, len(text)
        calls: list[dict] = []
        end = len(text)
        if self.tools is not None:
            end = self.tools.held_back(text)
            if finished:
                content, calls = self._read(out)
                end = end if calls else len(text)
                reason = "tool_calls" if calls and reason == "stop" else reason
        end = max(end, sent)
        delta: dict = {"content": text[sent:end]} if end > sent else {}
        if calls:
            delta["tool_calls"] = [{"index": k, **c} for k, c in enumerate(calls)]
        if not delta and reason is None and not lp:
            return None, sent
        return {"index": i, "delta": delta, "logprobs": lp, "finish_reason": reason}, end
