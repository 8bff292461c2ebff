"""EngineProcess: the API process's handle on an engine running in a process of its own.

Why: a step is Python between C++ calls, and so is HTTP parsing, JSON and SSE. In one
interpreter they take turns on one lock, and the step got one core of two (issue 27). Here the
engine's process only steps; this process tokenizes, checks requests against the engine's
limits, shapes responses and rebuilds each sample's output from the deltas the engine sends.

It offers the surface of ``engine_thread.AsyncEngine`` (add, abort, abort_all, validate, compile,
stats, error, on_failure, observers), so the server runs on either, and the model-facing part of
``LLM`` the server reads (name, tokenizer, memory_plan, encode, chat template). A reader thread
takes each ``Report`` off the socket and leaves the rebuilt outputs in the requests' sinks.
Torch-free: importing it loads no torch into the API process.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from types import SimpleNamespace
from typing import Any

from .. import prompts
from ..engine_config import EngineConfig
from ..errors import CacheDoesNotFitError, EngineStopped, PagedLLMError, QueueFull, RequestRejected
from ..loading import load_tokenizer
from ..memory.machine import bound_allocator_slack, resident_bytes
from ..outputs import RequestOutput
from ..processes import api_engine as m
from ..sampling_params import SamplingParams, StructuredOutput

# What the API process adds to its resident memory after it has measured itself at start-up:
# connections, request bodies and SSE buffers, mailboxes, the rebuilt outputs. Measured under
# three rounds of tests/test_process_memory.py's 32 streams: 4 MiB (docs/memory.md, "Two processes").
API_PROCESS_GROWTH_BYTES = 16 * 1024**2


class EngineStartError(PagedLLMError):
    """The engine's process could not build the engine (its message says why)."""


@dataclass
class _Sample:
    """One sample's output so far, rebuilt from its deltas."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict] | None = None


class Outputs:
    """Deltas back to whole outputs, as ``LLMEngine`` would have made them."""

    def __init__(self) -> None:
        self.prompts: dict[str, list[int]] = {}
        self._samples: dict[tuple[str, int], _Sample] = {}
        self._prompt_logprobs: dict[str, list[dict | None]] = {}  # by request, from its first delta

    def rebuild(self, d: m.Delta) -> RequestOutput:
        key = (d.request_id, d.index)
        sample = self._samples.pop(key, None) or _Sample()
        sample.text += d.text
        sample.token_ids += d.token_ids
        if d.logprobs is not None:  # (appended in place: a new list per delta is quadratic)
            sample.logprobs = sample.logprobs if sample.logprobs is not None else []
            sample.logprobs += d.logprobs
        if not d.finished:
            self._samples[key] = sample
        prompt = self.prompts.pop(d.request_id, []) if d.request_finished else self.prompts.get(d.request_id, [])
        if d.prompt_logprobs is not None:
            self._prompt_logprobs[d.request_id] = d.prompt_logprobs
        pop_or_get = self._prompt_logprobs.pop if d.request_finished else self._prompt_logprobs.get
        prompt_logprobs = pop_or_get(d.request_id, None)
        return RequestOutput(
            request_id=d.request_id,
            prompt_token_ids=prompt,
            text=sample.text,
            token_ids=list(sample.token_ids),
            finished=d.finished,
            finish_reason=d.finish_reason,
            delta_text=d.text,
            error=d.error,
            error_kind=d.error_kind,
            logprobs=list(sample.logprobs) if sample.logprobs is not None else None,
            metrics=d.metrics,
            index=d.index,
            request_finished=d.request_finished,
            prompt_logprobs=prompt_logprobs,
            embedding=d.embedding,
        )


class EngineProcess:
    """One engine in a process of its own, and this process's side of the socket to it."""

    def __init__(self, config: EngineConfig, *, max_waiting: int = 256):
        """Starts the engine's process and waits until its engine is built (the model loaded);
        raises what building it raised (CacheDoesNotFitError when the plan does not fit)."""
        self.config = config
        self.max_waiting = max_waiting
        ours, theirs = socket.socketpair()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pagedllm.engine_process.child", str(theirs.fileno())], pass_fds=[theirs.fileno()]
        )
        theirs.close()
        self.conn = Connection(ours.detach())
        self._send_lock = threading.Lock()
        try:
            self._start(config)
        except BaseException:
            self.proc.kill()
            self.proc.wait()
            raise
        self._sinks: dict[str, Any] = {}
        self._outputs = Outputs()
        self._adds_sent = 0
        self._adds_taken = 0
        self._tickets = itertools.count()
        self._answers: dict[int, Future] = {}  # answered on the reader thread
        self._stopping = False
        self._lock = threading.Lock()  # a late add vs. the failure that answers everyone
        self.error: BaseException | None = None
        self.on_failure: list[Callable[[BaseException], None]] = []  # on the reader thread
        self.observers: list[Callable[[list[RequestOutput], float], None]] = []  # per step, on the reader thread
        self._reader = threading.Thread(target=self._read, name="pagedllm-engine-reader", daemon=True)

    def _start(self, config: EngineConfig) -> None:
        """The handshake: the engine process resolves the checkpoint; this one loads the tokenizer
        and measures itself; the engine is planned for both processes and built."""
        self.conn.send(m.Start(config))
        resolved = self._answer(m.Resolved)
        self.name = resolved.name
        self.model_dir = resolved.model_dir
        self.tokenizer = load_tokenizer(resolved.model_dir)
        if config.budgeted:  # this process's peak is counted too: glibc gives freed memory back
            bound_allocator_slack()
        now, peak = resident_bytes()  # the peak so far: parsing the tokenizer's JSON, freed since
        self.conn.send(m.Build(max(peak, now + API_PROCESS_GROWTH_BYTES)))
        ready = self._answer(m.Ready)
        self.memory_plan = ready.plan
        self.limits = ready.limits
        self.stats = SimpleNamespace(**ready.stats)

    def _answer(self, kind: type):
        try:
            message = self.conn.recv()
        except (EOFError, OSError):
            raise EngineStartError(f"the engine process exited during start-up (code {self.proc.wait()})") from None
        if isinstance(message, m.StartFailed):
            if message.kind == "CacheDoesNotFitError":
                raise CacheDoesNotFitError(message.message, message.breakdown or {}, message.suggestions or {})
            raise EngineStartError(f"{message.kind}: {message.message}")
        assert isinstance(message, kind), message
        return message

    # ---- the model, as the server reads it ---------------------------------------------------

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len

    def encode(self, text: str) -> list[int]:
        return prompts.encode_prompt(self.tokenizer, text)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        return prompts.apply_chat_template(self.tokenizer, messages, tools)

    def chat_template_source(self, tools: list[dict] | None = None) -> str:
        return prompts.chat_template_source(self.tokenizer, tools)

    def async_engine(self, max_waiting: int) -> EngineProcess:
        """The server's handle on the engine: this object (``max_waiting``: the queue's bound)."""
        self.max_waiting = max_waiting
        return self

    # ---- requests -------------------------------------------------------------------------------

    @property
    def num_unfinished(self) -> int:
        return len(self._sinks)

    @property
    def pids(self) -> list[int]:
        """The processes whose memory the budget bounds: this (the API's) and the engine's."""
        return [os.getpid(), self.proc.pid]

    def is_open(self, request_id: str) -> bool:
        """Whether a request with this id was added and has not finished."""
        return request_id in self._sinks

    def validate(self, prompt: list[int], params: SamplingParams) -> None:
        """RequestRejected for a request that can never run (the engine's limits, checked here)."""
        self.limits.check(prompt, params)

    async def compile(self, constraint: StructuredOutput) -> None:
        """RequestRejected if the engine cannot compile the constraint's grammar (asked over the
        socket; the event loop goes on meanwhile)."""
        _raise_rejection(await asyncio.wrap_future(self._ask_compile(constraint)))

    def compile_now(self, constraint: StructuredOutput) -> None:
        """``compile``, waiting on this thread (for ``LLM``)."""
        _raise_rejection(self._ask_compile(constraint).result())

    async def set_memory(self, memory: str | int | None, memory_fraction: float | None = None):
        """The engine moved to a new budget (``LLMEngine.set_memory``, in its process); raises
        CacheDoesNotFitError with the planner's message when it refused (nothing changed)."""
        return self._memory_set(await asyncio.wrap_future(self._ask_set_memory(memory, memory_fraction)))

    def set_memory_now(self, memory: str | int | None, memory_fraction: float | None = None):
        """``set_memory``, waiting on this thread (for ``LLM``)."""
        return self._memory_set(self._ask_set_memory(memory, memory_fraction).result())

    def _ask_set_memory(self, memory: str | int | None, memory_fraction: float | None) -> Future:
        return self._ask(lambda ticket: m.SetMemory(ticket, memory, memory_fraction))

    def _memory_set(self, answer: tuple):
        plan, error = answer
        if error is not None:
            raise CacheDoesNotFitError(error, {}, {})  # (its figures stayed in the engine process)
        self.memory_plan = plan
        return plan

    def _ask_compile(self, constraint: StructuredOutput) -> Future:
        return self._ask(lambda ticket: m.Compile(ticket, constraint))

    def _ask(self, message: Callable[[int], Any]) -> Future:
        """Sends ``message(ticket)``; the reader thread resolves the future with its answer."""
        if self.error is not None:
            raise EngineStopped(f"the engine has stopped: {self.error}")
        ticket = next(self._tickets)
        answer: Future = Future()
        self._answers[ticket] = answer
        self._send(message(ticket))
        return answer

    def add(self, request_id: str, prompt: list[int], params: SamplingParams, sink) -> Any:
        """Queues a request; its outputs arrive in ``sink`` (as ``AsyncEngine.add``)."""
        if self.error is not None:
            raise EngineStopped(f"the engine has stopped: {self.error}")
        waiting = self.stats.waiting + self._adds_sent - self._adds_taken
        if waiting >= self.max_waiting:
            raise QueueFull(f"{waiting} requests are waiting (limit {self.max_waiting})")
        self.validate(prompt, params)
        self._outputs.prompts[request_id] = prompt
        self._adds_sent += 1
        with self._lock:
            self._sinks[request_id] = sink
        self._send(m.Add(request_id, prompt, params, time.perf_counter()))
        if self.error is not None:  # the engine died since the check above: nobody else will answer it
            self._failed(str(self.error))
        return sink

    def abort(self, request_id: str) -> None:
        """Aborts a request wherever it is; its final outputs come back like any others."""
        if request_id in self._sinks:
            self._send(m.Abort(request_id))

    def abort_all(self) -> None:
        self._send(m.AbortAll())

    def _send(self, message) -> None:
        with self._send_lock:
            try:
                self.conn.send(message)
            except OSError:  # the engine is gone; the reader reports it
                pass

    # ---- the engine process's life ----------------------------------------------------------------

    def start(self) -> None:
        self._reader.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Asks the engine process to exit (what it still runs ends with an error), then waits."""
        self._stopping = True
        self._send(m.Shutdown())
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self._reader.is_alive():
            self._reader.join(timeout)

    def _read(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                if not self._stopping and self.error is None:
                    self._failed(f"the engine process exited unexpectedly (status {self.proc.wait()})")
                return
            if isinstance(message, m.Report):
                self._deliver(message)
            elif isinstance(message, m.Compiled):
                self._answers.pop(message.ticket).set_result(message.rejection)
            elif isinstance(message, m.MemorySet):
                self._answers.pop(message.ticket).set_result((message.plan, message.error))
            elif isinstance(message, m.Died):
                self._failed(message.error)

    def _deliver(self, report: m.Report) -> None:
        outputs = [self._outputs.rebuild(d) for d in report.deltas]
        self.stats = SimpleNamespace(**report.stats)
        self._adds_taken = report.adds_taken
        if report.elapsed is not None:
            for observer in self.observers:
                observer(outputs, report.elapsed)
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue
            sink.put(out)
            if out.request_finished:
                del self._sinks[out.request_id]

    def _failed(self, reason: str) -> None:
        """Answers every request still open with the failure, then tells the server."""
        first = self.error is None
        error = self.error = self.error or EngineStopped(reason)
        with self._lock:
            sinks, self._sinks = self._sinks, {}
        for rid, sink in sinks.items():
            sink.put(RequestOutput.failed(rid, [], f"engine failure: {reason}", kind="engine"))
        for answer in self._answers.values():
            answer.set_exception(error)
        if first:
            for callback in self.on_failure:
                callback(error)


def _raise_rejection(rejection: tuple[str, str | None, str | None] | None) -> None:
    if rejection is not None:
        message, param, code = rejection
        raise RequestRejected(message, param=param, code=code)


class LLMEngineOverProcess:
    """What ``LLM`` drives of an ``LLMEngine`` (add_request, step, abort, ...), over an engine in
    its own process: ``LLM(model, engine_process=True)``. ``step`` waits for the engine's next
    outputs; the engine steps on its own meanwhile, so the caller's Python costs it nothing."""

    def __init__(self, process: EngineProcess):
        self.process = process
        self._ready: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
        self._ids = itertools.count()
        process.start()

    @property
    def stats(self):
        return self.process.stats

    @property
    def memory_plan(self):
        return self.process.memory_plan

    @property
    def max_model_len(self) -> int:
        return self.process.max_model_len

    def encode(self, text: str) -> list[int]:
        return self.process.encode(text)

    def put(self, out: RequestOutput) -> None:
        """The sink of every request (the process's reader thread calls it)."""
        self._ready.put(out)

    def validate(self, ids: list[int], params: SamplingParams, compile_grammar: bool = True) -> None:
        self.process.validate(ids, params)
        if params.structured_output is not None and compile_grammar:
            self.process.compile_now(params.structured_output)

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        arrival_time: float | None = None,
    ) -> str:
        params = params or SamplingParams()
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if self.process.is_open(request_id):
            raise RequestRejected(f"request id {request_id!r} is already in use", param=None)
        self.validate(ids, params)
        self.process.add(request_id, ids, params, self)
        return request_id

    def abort(self, request_id: str) -> list[RequestOutput]:
        self.process.abort(request_id)  # its final outputs come back through step()
        return []

    def has_unfinished(self) -> bool:
        return self.process.num_unfinished > 0 or not self._ready.empty()

    def step(self) -> list[RequestOutput]:
        """The outputs that arrived since the last call, waiting for one if there is none yet."""
        if not self.has_unfinished():
            return []
        outputs = [self._ready.get()]
        while not self._ready.empty():
            outputs.append(self._ready.get())
        return outputs

    def close(self) -> None:
        self.process.stop()
