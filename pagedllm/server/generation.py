"""One generation request's life: checked and queued on the engine, its outputs read from its
mailbox, and answered whole or streamed as they come.

Every prompt is validated before any is queued, so a request is refused whole or runs whole. A
client that goes away aborts what it still has running at once, which frees its blocks before
the next step; the disconnect is checked on a clock, as outputs may never pause.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from ..errors import EngineStopped, QueueFull, RequestRejected
from ..outputs import RequestOutput
from ..prompts import decode_one
from ..sampling_params import SamplingParams, StructuredOutput
from .errors import APIError, failed, unavailable
from .mailbox import Mailbox
from .metrics import Metrics
from .protocol import SamplingFields
from .reasoning import Reasoning
from .responses import DONE, Reply, sse, usage
from .served import Engine
from .tool_calls import ToolUse

DISCONNECT_CHECK_S = 0.5


async def generate(
    request: Request,
    req: SamplingFields,
    prompts: list[list[int]],
    max_tokens: int | None,
    logprobs: int | None,
    chat: bool,
    constraint: StructuredOutput | None = None,
    tools: ToolUse | None = None,
    reasoning: Reasoning | None = None,
    echo: list[str] | None = None,
) -> Response | dict:
    """Runs ``prompts`` (each for ``req.n`` samples) and answers: the whole body, an SSE stream,
    or 499 when the client left before the end. ``constraint``: the structured output every
    prompt is held to; ``tools``: the chat request's tools, whose calls the answer reads;
    ``reasoning``: how a thinking model's answer splits into reasoning and content; ``echo``:
    each prompt's text, put before its completions (with its tokens' logprobs when ``logprobs``)."""
    state = request.app.state
    engine: Engine = state.engine
    if state.draining:
        raise unavailable("the server is shutting down; retry on another")
    created = int(time.time())
    # the prompt's own logprobs: vLLM's prompt_logprobs, and as many as echo shows with logprobs
    wanted = [k for k in (req.prompt_logprobs, logprobs if echo else None) if k is not None]
    prompt_logprobs = max(wanted) if wanted else None
    base, ids, sink = await submit(engine, req, prompts, max_tokens, logprobs, constraint, prompt_logprobs)
    token_text = decode_one(state.model.tokenizer)
    reply = Reply(
        ("chatcmpl-" if chat else "cmpl-") + base,
        chat,
        created,
        state.model_name,
        token_text,
        tools,
        reasoning,
        echo=echo,
        n=req.n,
        prompt_logprobs=req.prompt_logprobs is not None,
    )
    outputs = outputs_of(request, engine, state.metrics, ids, req.n, sink)
    num_choices = len(ids) * req.n
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        events = stream(reply, outputs, num_choices, prompts, include_usage)
        return StreamingResponse(events, media_type="text/event-stream")
    finals: dict[int, RequestOutput] = {}
    async for i, out in outputs:
        if out.finish_reason == "error":
            raise failed(out)
        if out.finished:
            finals[i] = out
    if len(finals) < num_choices:
        return Response(status_code=499)  # the client went away
    return reply.body([finals[i] for i in range(num_choices)], prompts)


def sampling_params(
    req: SamplingFields,
    prompt_len: int,
    max_tokens: int | None,
    logprobs: int | None,
    max_len: int,
    constraint: StructuredOutput | None = None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """The request's sampling fields for one prompt; no ``max_tokens`` means the rest of the context."""
    if max_tokens is None:
        max_tokens = max(1, max_len - prompt_len)
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            min_p=req.min_p,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty,
            seed=req.seed,
            stop=req.stop,
            n=req.n,
            min_tokens=min(req.min_tokens, max_tokens),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            structured_output=constraint,
        )
    except ValueError as e:  # its field checks, the only ValueErrors it raises, on the client's values
        raise RequestRejected(str(e).removeprefix("SamplingParams: "), param=None) from None


async def submit(
    engine: Engine,
    req: SamplingFields,
    prompts: list[list[int]],
    max_tokens: int | None,
    logprobs: int | None,
    constraint: StructuredOutput | None = None,
    prompt_logprobs: int | None = None,
) -> tuple[str, list[str], Mailbox]:
    """The request's sampling fields for every prompt, queued (``queue_all``). Each is one
    engine request for ``n`` samples, which share the prompt's KV blocks."""
    params = [
        sampling_params(req, len(p), max_tokens, logprobs, engine.max_model_len, constraint, prompt_logprobs)
        for p in prompts
    ]
    return await queue_all(engine, prompts, params, constraint)


async def queue_all(
    engine: Engine, prompts: list[list[int]], params: list[SamplingParams], constraint: StructuredOutput | None = None
) -> tuple[str, list[str], Mailbox]:
    """Validates every prompt first, then queues them all on one shared mailbox. A full queue
    takes back what was queued and answers 429. The constraint's grammar is compiled by the
    engine (wherever it runs) before anything is queued, so a bad schema is a 400, even when
    streaming."""
    base = uuid.uuid4().hex[:24]
    jobs = []
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.validate(prompt, p)  # RequestRejected: the app answers 400 naming the field
        jobs.append((f"{base}-{i}", prompt, p))
    try:
        if constraint is not None:
            await engine.compile(constraint)
    except EngineStopped as e:
        raise unavailable(f"{e}; retry on a restarted server", retry_after_s=5) from None
    sink = Mailbox()
    ids: list[str] = []
    try:
        for rid, prompt, one in jobs:
            engine.add(rid, prompt, one, sink)
            ids.append(rid)
    except QueueFull as e:
        for rid in ids:
            engine.abort(rid)
        raise APIError(
            429, f"server busy: {e}; retry later", "rate_limit_error", headers={"Retry-After": "1"}
        ) from None
    except EngineStopped as e:  # the process is on its way out; its supervisor starts a new one
        raise unavailable(f"{e}; retry on a restarted server", retry_after_s=5) from None
    return base, ids, sink


async def outputs_of(
    request: Request, engine: Engine, metrics: Metrics, ids: list[str], n: int, sink: Mailbox
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yields (choice index, output) until every request finished, observing the latency
    histograms; aborts whatever is unfinished when the client disconnects (or the reader stops)."""
    first_choice = {rid: i * n for i, rid in enumerate(ids)}
    open_ids = set(ids)
    last_time: dict[tuple[str, int], float] = {}
    next_check = time.monotonic() + DISCONNECT_CHECK_S
    try:
        while open_ids:
            if time.monotonic() >= next_check:
                if await request.is_disconnected():
                    return
                next_check = time.monotonic() + DISCONNECT_CHECK_S
            try:
                out = await asyncio.wait_for(sink.get(), timeout=DISCONNECT_CHECK_S)
            except TimeoutError:
                continue
            now, key = time.perf_counter(), (out.request_id, out.index)
            if out.token_ids and key not in last_time and out.metrics:
                metrics.ttft.observe(now - out.metrics.arrival_time)
            elif key in last_time and out.token_ids:
                metrics.itl.observe(now - last_time[key])
            last_time[key] = now
            if out.request_finished:
                open_ids.discard(out.request_id)
            yield first_choice[out.request_id] + out.index, out
    finally:
        for rid in open_ids:
            engine.abort(rid)


async def stream(
    reply: Reply,
    outputs: AsyncIterator[tuple[int, RequestOutput]],
    num_choices: int,
    prompts: list[list[int]],
    include_usage: bool,
) -> AsyncIterator[str]:
    """The SSE events of a streamed answer: each choice's new text as it comes, an error event
    if a request fails (the 200 is already sent), the usage if asked, then ``[DONE]``."""
    if reply.chat:
        yield reply.role_chunk(num_choices)
    sent = [0] * num_choices  # tokens whose logprobs each choice has sent
    sent_chars = [0] * num_choices  # characters of text each choice has sent
    prompted: set[int] = set()  # choices whose prompt part (echo, prompt logprobs) went out
    completion_tokens = 0
    async for i, out in outputs:
        if out.finish_reason == "error":
            yield sse(failed(out).body())
            break
        if i not in prompted:
            prompted.add(i)
            if (first := reply.prompt_chunk(i, out)) is not None:
                yield first
        lp = reply.logprobs(out, sent[i], len(out.token_ids))
        sent[i] = len(out.token_ids)
        if out.finished:
            completion_tokens += len(out.token_ids)
        choice, sent_chars[i] = reply.delta_choice(i, out, lp, sent_chars[i])
        if choice is not None:
            yield reply.chunk([choice])
    if include_usage:
        yield reply.chunk([], usage=usage(prompts, completion_tokens))
    yield DONE
