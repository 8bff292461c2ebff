"""One generation request's life, whichever API it came through: the internal request (``Job``)
checked and queued on the engine, its outputs read from its mailbox as typed events
(``events.py``) or as the whole answer, which each API formats in its own way.

Every prompt is validated before any is queued, so a request is refused whole or runs whole. A
client that goes away aborts what it still has running at once, which frees its blocks before
the next step; the disconnect is checked on a clock, as outputs may never pause.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from fastapi import Request

from ..errors import EngineStopped, QueueFull, RequestRejected
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams, StructuredOutput
from .errors import APIError, failed, unavailable
from .events import Event, Failure, Finish, Logprobs, Prompt, Result, Usage
from .mailbox import Mailbox
from .metrics import Metrics
from .protocol import SamplingFields
from .reading import Reader
from .reasoning import Reasoning
from .served import Engine
from .tool_calls import ToolUse

DISCONNECT_CHECK_S = 0.5


@dataclass(frozen=True)
class Job:
    """One generation request as every API hands it over: ``prompts`` (token ids), each run for
    ``fields.n`` samples with ``fields``' sampling settings and up to ``max_tokens`` tokens (None:
    the rest of the context); ``logprobs``: how many top logprobs per token (None: none);
    ``constraint``: the structured output every prompt is held to; ``tools``: a chat request's
    tools, whose calls the answer is read for; ``reasoning``: how a thinking model's answer
    splits; ``echo``: each prompt's text, to put before its completions."""

    prompts: list[list[int]]
    fields: SamplingFields
    max_tokens: int | None
    logprobs: int | None = None
    constraint: StructuredOutput | None = None
    tools: ToolUse | None = None
    reasoning: Reasoning | None = None
    echo: list[str] | None = None


async def start(request: Request, job: Job) -> Generation:
    """Queues ``job`` (a 400, 429 or 503 is raised here, before any answer is sent)."""
    state = request.app.state
    engine: Engine = state.engine
    if state.draining:
        raise unavailable("the server is shutting down; retry on another")
    created = int(time.time())
    # the prompt's own logprobs: vLLM's prompt_logprobs, and as many as echo shows with logprobs
    wanted = [k for k in (job.fields.prompt_logprobs, job.logprobs if job.echo else None) if k is not None]
    prompt_logprobs = max(wanted) if wanted else None
    base, ids, sink = await submit(
        engine, job.fields, job.prompts, job.max_tokens, job.logprobs, job.constraint, prompt_logprobs
    )
    outputs = outputs_of(request, engine, state.metrics, ids, job.fields.n, sink)
    return Generation(base, created, job, outputs, len(ids) * job.fields.n)


@dataclass
class Generation:
    """A queued job: its outputs, read once, as events (a stream) or as the whole ``Result``.
    ``id``: the request's, which each API prefixes; ``num_choices``: prompts times samples."""

    id: str
    created: int
    job: Job
    outputs: AsyncGenerator[tuple[int, RequestOutput], None]
    num_choices: int

    async def events(self) -> AsyncGenerator[list[Event], None]:
        """Each engine output's events as one batch, a ``Failure`` (ending the choices) if a
        request fails, then the ``Usage``. Closing this aborts what still runs."""
        reader = Reader(self.job.reasoning, self.job.tools)
        show_prompt = self.job.echo is not None or self.job.fields.prompt_logprobs is not None
        sent = [0] * self.num_choices  # tokens whose logprobs each choice has sent
        sent_chars = [0] * self.num_choices  # characters of text each choice has sent
        prompted: set[int] = set()  # choices whose prompt part went out
        completion_tokens = 0
        try:
            async for i, out in self.outputs:
                if out.finish_reason == "error":
                    yield [Failure(failed(out))]
                    break
                batch: list[Event] = []
                if show_prompt and i not in prompted:
                    prompted.add(i)
                    batch.append(self.prompt(i, out))
                if out.finished:
                    completion_tokens += len(out.token_ids)
                text, reason, sent_chars[i] = reader.delta(i, out, sent_chars[i])
                batch += text
                if out.logprobs is not None:
                    batch.append(Logprobs(i, out.logprobs[sent[i] : len(out.token_ids)]))
                sent[i] = len(out.token_ids)
                if reason is not None:
                    batch.append(Finish(i, reason, out.token_ids))
                if batch:
                    yield batch
            yield [Usage(self.prompt_tokens, completion_tokens)]
        finally:
            await self.outputs.aclose()

    async def result(self) -> Result | None:
        """The whole answer; None when the client left before the end. A failed request raises
        its ``APIError``."""
        finals: dict[int, RequestOutput] = {}
        try:
            async for i, out in self.outputs:
                if out.finish_reason == "error":
                    raise failed(out)
                if out.finished:
                    finals[i] = out
        finally:
            await self.outputs.aclose()
        if len(finals) < self.num_choices:
            return None
        reader = Reader(self.job.reasoning, self.job.tools)
        answers = [reader.answer(i, finals[i], self.prompt(i, finals[i])) for i in range(self.num_choices)]
        usage = Usage(self.prompt_tokens, sum(len(o.token_ids) for o in finals.values()))
        return Result(self.id, self.created, answers, usage)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.job.prompts)

    def prompt(self, i: int, out: RequestOutput) -> Prompt:
        echo = self.job.echo[i // self.job.fields.n] if self.job.echo is not None else None
        return Prompt(i, echo, out.prompt_token_ids, out.prompt_logprobs)


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
) -> AsyncGenerator[tuple[int, RequestOutput], None]:
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
