"""The chat and completions APIs' JSON: a generation's whole ``Result`` as a body, its events as
SSE chunks (``events.py``).

Pure functions of the events (no engine), so both endpoints and both modes share one definition
of a choice, of logprobs and of usage, and a streamed answer adds up to the whole one. Choice
``i`` is prompt ``i // n``'s sample ``i % n``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from ...prompts import decode_one
from ..events import (
    Answer,
    Event,
    Failure,
    Finish,
    Logprobs,
    Prompt,
    ReasoningDelta,
    Result,
    TextDelta,
    ToolCalls,
    Usage,
)
from ..generation import Generation
from ..sse import DONE, STREAM, sse

TokenText = Callable[[int], str]  # one token id as the text a client sees


def usage(u: Usage) -> dict:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens, "total_tokens": u.total_tokens}


def chat_logprobs(entries: Sequence[dict], token_text: TokenText) -> dict:
    """Tokens' logprobs in the chat API's shape (with each token's UTF-8 bytes)."""

    def entry(token_id: int, logprob: float) -> dict:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**entry(*lp["token"]), "top_logprobs": [entry(t, v) for t, v in lp["top"]]} for lp in entries]}


def completion_logprobs(entries: Sequence[dict], token_text: TokenText) -> dict:
    """Tokens' logprobs in the completions API's (legacy, column-wise) shape."""
    return {
        "tokens": [token_text(lp["token"][0]) for lp in entries],
        "token_logprobs": [lp["token"][1] for lp in entries],
        "top_logprobs": [{token_text(t): v for t, v in lp["top"]} for lp in entries],
        "text_offset": [],
    }


def echoed_logprobs(prompt: Prompt, token_text: TokenText) -> dict:
    """The prompt's tokens in the completions API's logprobs shape (its first token has none)."""
    entries = prompt.logprobs or []
    return {
        "tokens": [token_text(t) for t in prompt.token_ids],
        "token_logprobs": [e["token"][1] if e else None for e in entries],
        "top_logprobs": [{token_text(t): v for t, v in e["top"]} if e else None for e in entries],
        "text_offset": [],
    }


def vllm_prompt_logprobs(prompt: Prompt | None, token_text: TokenText) -> list[dict | None]:
    """vLLM's ``prompt_logprobs``: per prompt token (the first None), the prompt token's and the
    top ones', by token id: {"id": {"logprob", "rank", "decoded_token"}}."""

    def entry(e: dict) -> dict:
        token, value = e["token"]
        ranked = {
            str(t): {"logprob": v, "rank": r + 1, "decoded_token": token_text(t)} for r, (t, v) in enumerate(e["top"])
        }
        ranked.setdefault(str(token), {"logprob": value, "rank": e["rank"], "decoded_token": token_text(token)})
        return ranked

    return [entry(e) if e else None for e in ((prompt.logprobs if prompt else None) or [])]


@dataclass(frozen=True)
class Shape:
    """How one response looks: what its body or every chunk of it carries."""

    id: str
    chat: bool
    created: int
    model: str
    token_text: TokenText
    reasoning: bool = False  # a chat message carries reasoning_content (a reasoning parser is on)
    prompt_logprobs: bool = False  # vLLM's prompt_logprobs field on each choice (chat: the body)

    def logprobs(self, entries: Sequence[dict] | None) -> dict | None:
        if entries is None:
            return None
        return (chat_logprobs if self.chat else completion_logprobs)(entries, self.token_text)

    def body(self, result: Result) -> dict:
        """The whole answer."""
        body: dict = {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [self.choice(a) for a in result.answers],
            "usage": usage(result.usage),
        }
        if self.chat and self.prompt_logprobs and result.answers:
            body["prompt_logprobs"] = vllm_prompt_logprobs(result.answers[0].prompt, self.token_text)
        return body

    def choice(self, a: Answer) -> dict:
        lp = self.logprobs(a.logprobs)
        if not self.chat:
            return self._with_prompt(
                {"index": a.index, "text": a.text, "logprobs": lp, "finish_reason": a.finish_reason}, a.prompt
            )
        message: dict = {"role": "assistant", "content": a.text}
        if self.reasoning:
            message["reasoning_content"] = a.reasoning
        if a.calls:
            message["tool_calls"] = [c.as_openai() for c in a.calls]
        return {"index": a.index, "message": message, "logprobs": lp, "finish_reason": a.finish_reason}

    def _with_prompt(self, choice: dict, prompt: Prompt | None) -> dict:
        """A completion choice with its prompt: echoed before its text (and the prompt tokens'
        logprobs before its own, the first token's None, as OpenAI's legacy API gives them),
        and vLLM's ``prompt_logprobs`` when asked."""
        if self.prompt_logprobs:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(prompt, self.token_text)
        if prompt is None or prompt.echo is None:
            return choice
        choice["text"] = prompt.echo + choice["text"]
        if choice["logprobs"] is not None:
            echoed = echoed_logprobs(prompt, self.token_text)
            choice["logprobs"] = {k: echoed[k] + choice["logprobs"][k] for k in echoed}
        return choice

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

    def chunks(self, batch: list[Event]) -> list[str]:
        """One engine output's chunks: a completion's prompt part first (when it echoes its
        prompt or reports prompt logprobs), then its new text, logprobs and finish reason."""
        out = []
        prompt = next((e for e in batch if isinstance(e, Prompt)), None)
        with_logprobs = any(isinstance(e, Logprobs) for e in batch)
        if prompt is not None and not self.chat:
            lp = completion_logprobs([], self.token_text) if with_logprobs else None
            choice = {"index": prompt.choice, "text": "", "logprobs": lp, "finish_reason": None}
            out.append(self.chunk([self._with_prompt(choice, prompt)]))
        rest: list[Event] = [e for e in batch if not isinstance(e, Prompt)]
        if rest:
            out.append(self.chunk([self.delta(rest)]))
        return out

    def delta(self, events: list[Event]) -> dict:
        """A choice's chunk from its events: a chat choice's text as ``reasoning_content`` and
        ``content`` deltas, its calls as tool-call deltas (whole calls)."""
        i = events[0].choice  # type: ignore[union-attr]  # (a choice's events)
        text = "".join(e.text for e in events if isinstance(e, TextDelta))
        lp = next((self.logprobs(e.entries) for e in events if isinstance(e, Logprobs)), None)
        reason = next((e.reason for e in events if isinstance(e, Finish)), None)
        if not self.chat:
            return {"index": i, "text": text, "logprobs": lp, "finish_reason": reason}
        reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
        delta: dict = {"reasoning_content": reasoning} if reasoning else {}
        if text:
            delta["content"] = text
        calls = [c for e in events if isinstance(e, ToolCalls) for c in e.calls]
        if calls:
            delta["tool_calls"] = [{"index": k, **c.as_openai()} for k, c in enumerate(calls)]
        return {"index": i, "delta": delta, "logprobs": lp, "finish_reason": reason}


async def stream(shape: Shape, generation: Generation, include_usage: bool) -> AsyncIterator[str]:
    """The SSE of a streamed answer: each choice's new text as it comes, an error event if a
    request fails (the 200 is already sent), the usage if asked, then ``[DONE]``. Closing it
    aborts what still runs."""
    if shape.chat:
        yield shape.role_chunk(generation.num_choices)
    batches = generation.events()
    try:
        async for batch in batches:
            if isinstance(batch[0], Failure):
                yield sse(batch[0].error.body())
            elif isinstance(batch[0], Usage):
                if include_usage:
                    yield shape.chunk([], usage=usage(batch[0]))
            else:
                for chunk in shape.chunks(batch):
                    yield chunk
    finally:
        await batches.aclose()
    yield DONE


async def answer(generation: Generation, shape: Shape, stream_it: bool, include_usage: bool) -> Response | dict:
    """The answer of a chat or completions request: an SSE stream, the whole body, or 499 when
    the client left before the end."""
    if stream_it:
        return StreamingResponse(stream(shape, generation, include_usage), media_type=STREAM)
    result = await generation.result()
    if result is None:
        return Response(status_code=499)  # the client went away
    return shape.body(result)


def shape_of(request: Request, generation: Generation, chat: bool, prompt_logprobs: bool) -> Shape:
    """The shape of a chat (``chat``) or completions answer to ``generation``."""
    state = request.app.state
    return Shape(
        ("chatcmpl-" if chat else "cmpl-") + generation.id,
        chat,
        generation.created,
        state.model_name,
        decode_one(state.model.tokenizer),
        reasoning=generation.job.reasoning is not None,
        prompt_logprobs=prompt_logprobs,
    )
