"""Response shaping: engine outputs as OpenAI's completion and chat bodies, whole or as SSE chunks.

Pure functions of the outputs (no FastAPI, no engine), so both endpoints and both modes share
one definition of a choice, of logprobs and of usage, and a streamed answer adds up to the whole
one. Choice ``i`` is prompt ``i // n``'s sample ``i % n``. A chat answer's text is split into
reasoning and content (``reasoning.py``) before tool calls are read from the content.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..outputs import RequestOutput
from .reasoning import Reasoning, all_content
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


def echoed_logprobs(out: RequestOutput, token_text: TokenText) -> dict:
    """The prompt's tokens in the completions API's logprobs shape (its first token has none)."""
    entries = out.prompt_logprobs or []
    return {
        "tokens": [token_text(t) for t in out.prompt_token_ids],
        "token_logprobs": [e["token"][1] if e else None for e in entries],
        "top_logprobs": [{token_text(t): v for t, v in e["top"]} if e else None for e in entries],
        "text_offset": [],
    }


def vllm_prompt_logprobs(out: RequestOutput, token_text: TokenText) -> list[dict | None]:
    """vLLM's ``prompt_logprobs``: per prompt token (the first None), the prompt token's and the
    top ones', by token id: {"id": {"logprob", "rank", "decoded_token"}}."""

    def entry(e: dict) -> dict:
        token, value = e["token"]
        ranked = {
            str(t): {"logprob": v, "rank": r + 1, "decoded_token": token_text(t)} for r, (t, v) in enumerate(e["top"])
        }
        ranked.setdefault(str(token), {"logprob": value, "rank": e["rank"], "decoded_token": token_text(token)})
        return ranked

    return [entry(e) if e else None for e in (out.prompt_logprobs or [])]


@dataclass(frozen=True)
class Reply:
    """One response: what its body or every chunk of it carries, and how its choices look."""

    id: str
    chat: bool
    created: int
    model: str
    token_text: TokenText
    tools: ToolUse | None = None  # a chat request with tools: outputs are read as tool calls
    reasoning: Reasoning | None = None  # a chat request to a thinking model: its reasoning apart
    # completions' echo: each prompt's text, put before its choices' text (with its logprobs first)
    echo: Sequence[str] | None = None
    n: int = 1  # samples per prompt: choice i answers prompt i // n
    prompt_logprobs: bool = False  # vLLM's prompt_logprobs field on each choice (chat: the body)

    def logprobs(self, out: RequestOutput, start: int, end: int) -> dict | None:
        shape = chat_logprobs if self.chat else completion_logprobs
        return shape(out, start, end, self.token_text)

    def body(self, finals: Sequence[RequestOutput], prompts: Sequence[Sequence[int]]) -> dict:
        """The whole answer, from each choice's finished output (in choice order)."""
        choices = []
        for i, out in enumerate(finals):
            lp = self.logprobs(out, 0, len(out.token_ids))
            if self.chat:
                reasoning, content, calls = self._read(out)
                message: dict = {"role": "assistant", "content": content}
                if self.reasoning is not None:
                    message["reasoning_content"] = reasoning
                if calls:
                    message["tool_calls"] = calls
                reason = "tool_calls" if calls and out.finish_reason == "stop" else out.finish_reason
                choices.append({"index": i, "message": message, "logprobs": lp, "finish_reason": reason})
            else:
                choice = {"index": i, "text": out.text, "logprobs": lp, "finish_reason": out.finish_reason}
                choices.append(self._with_prompt(choice, i, out))
        body: dict = {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage(prompts, sum(len(o.token_ids) for o in finals)),
        }
        if self.chat and self.prompt_logprobs and finals:
            body["prompt_logprobs"] = vllm_prompt_logprobs(finals[0], self.token_text)
        return body

    def _with_prompt(self, choice: dict, i: int, out: RequestOutput) -> dict:
        """A completion choice with its prompt: echoed before its text (and the prompt tokens'
        logprobs before its own, the first token's None, as OpenAI's legacy API gives them),
        and vLLM's ``prompt_logprobs`` when asked."""
        if self.prompt_logprobs:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(out, self.token_text)
        if self.echo is None:
            return choice
        choice["text"] = self.echo[i // self.n] + choice["text"]
        if choice["logprobs"] is not None:
            prompt = echoed_logprobs(out, self.token_text)
            choice["logprobs"] = {k: prompt[k] + choice["logprobs"][k] for k in prompt}
        return choice

    def prompt_chunk(self, i: int, out: RequestOutput) -> str | None:
        """A streamed completion choice's first chunk when it echoes its prompt or reports
        prompt logprobs: the prompt's part, before any generated text."""
        if self.chat or (self.echo is None and not self.prompt_logprobs):
            return None
        lp = completion_logprobs(out, 0, 0, self.token_text)
        choice = self._with_prompt({"index": i, "text": "", "logprobs": lp, "finish_reason": None}, i, out)
        return self.chunk([choice])

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

    def _read(self, out: RequestOutput) -> tuple[str | None, str | None, list[dict]]:
        """A finished chat output's (reasoning, content, OpenAI tool calls): calls are read from
        the content only, never from the thinking."""
        reasoning, content = self.reasoning.parse(out.text) if self.reasoning else (None, out.text)
        if self.tools is None or content is None:
            return reasoning, content, []
        content, calls = self.tools.parse(content)
        return reasoning, content, [c.as_openai() for c in calls]

    def delta_choice(self, i: int, out: RequestOutput, lp: dict | None, sent: int) -> tuple[dict | None, int]:
        """Choice ``i``'s chunk: its text after the ``sent`` characters already streamed, and its
        finish reason once it is done (none for an aborted choice); None when there is nothing
        to send. Returns the characters sent after it. A chat choice's text goes out as
        ``reasoning_content`` and ``content`` deltas; what may still be part of a think tag
        waits for the next token. With tools, content that may be a call is held back until the
        output ends, then sent as tool-call deltas (whole calls)."""
        finished = out.finished and out.finish_reason != "abort"
        reason = out.finish_reason if finished else None
        text = out.text
        if not self.chat:
            delta_text = text[sent:]
            if not delta_text and not finished and not lp:
                return None, sent
            return {"index": i, "text": delta_text, "logprobs": lp, "finish_reason": reason}, len(text)
        split = self.reasoning.split(text, finished) if self.reasoning else all_content(text)
        calls: list[dict] = []
        end = split.settled
        if self.tools is not None and split.content is not None:
            end = split.content + self.tools.held_back(text[split.content : split.settled])
            if finished:
                calls = self._read(out)[2]
                end = end if calls else split.settled
                reason = "tool_calls" if calls and reason == "stop" else reason
        end = max(end, sent)
        reasoning, content = split.between(text, sent, end)
        delta: dict = {"reasoning_content": reasoning} if reasoning else {}
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = [{"index": k, **c} for k, c in enumerate(calls)]
        if not delta and reason is None and not lp:
            return None, sent
        return {"index": i, "delta": delta, "logprobs": lp, "finish_reason": reason}, end
