"""AsyncEngine: one LLMEngine stepped on its own thread, fed and drained from other threads.

A step is seconds of CPU work at worst; run on the event loop it would stall every connection.
So the engine lives on one thread that owns it outright: requests and aborts reach it through a
queue it drains between steps, and each step's outputs are left in the request's sink: the
server's Mailbox, which merges what its reader has not taken yet (bounded memory for slow
clients). Requests from all
clients share every step (continuous batching). The server uses it in its own process
(``pagedllm serve --engine-in-thread``, or ``create_app(llm)``), and ``child`` runs it inside the
engine's process, with a sink that forwards outputs to the API process.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from ..errors import EngineStopped, QueueFull, RequestRejected
from ..outputs import ErrorKind, RequestOutput
from ..sampling_params import SamplingParams, StructuredOutput

if TYPE_CHECKING:
    from ..engine import LLMEngine
    from ..engine.llm_engine import EngineStats
    from ..memory.planner import MemoryPlan

log = logging.getLogger(__name__)


class Sink(Protocol):
    """Where a request's outputs go (the server's ``Mailbox``; in the engine process, the link
    to the API process). ``put`` is called on the engine thread and must not block."""

    def put(self, out: RequestOutput) -> None: ...


@dataclass
class _Add:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    sink: Sink
    arrival: float = field(default_factory=time.perf_counter)


@dataclass
class _Abort:
    request_id: str


class _AbortAll:
    """Abort every request added before this (see ``AsyncEngine.abort_all``)."""


@dataclass
class _SetMemory:
    """A new budget (``LLMEngine.set_memory``), applied between steps; the answer in ``done``."""

    memory: str | int | None
    memory_fraction: float | None
    done: Future


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_waiting: int = 256, beside_event_loop: bool = True):
        """``beside_event_loop``: this process also runs a server's event loop, so the engine's
        threads are left unpinned (``ThreadPolicy.share_process``); the engine's own process
        keeps them pinned, one per core: unpinned, the kernel wakes an OpenMP worker on its
        waker's core and a step took 1.3-2.3x longer (docs/benchmarks.md, "Serving")."""
        self.engine = engine
        self.beside_event_loop = beside_event_loop
        self.max_waiting = max_waiting
        self._ops: queue.SimpleQueue[_Add | _Abort | _AbortAll | _SetMemory] = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pagedllm-engine", daemon=True)
        self._pending = 0  # adds queued for the engine thread, not yet in the engine
        self._aborts_all = 0  # abort_all calls queued, not yet done (adds before them fail)
        self._lock = threading.Lock()
        self.observers: list[Callable[[list[RequestOutput], float], None]] = []  # on the engine thread
        self.on_failure: list[Callable[[BaseException], None]] = []  # after the thread failed, on it
        self.on_delivered: list[Callable[[], None]] = []  # after each batch of outputs is in the sinks
        self.error: BaseException | None = None
        self._fail_lock = threading.Lock()  # the dead thread's last delivery vs. a late add's

    def start(self) -> None:
        """Steps on a thread of its own (a server's process, whose main thread runs the loop)."""
        if self.beside_event_loop:
            self.engine.threads.share_process()  # the event loop runs beside the engine's threads
        self._thread.start()

    def run(self) -> None:
        """Steps on the calling thread until ``stop`` or a failure: for a process whose main
        thread built the engine and has nothing else to do (the engine's own process). Stepping
        on the thread that built the engine matters: OpenMP gives each thread that starts
        parallel work a team of its own, and once a process holds more OpenMP threads than cores
        (two teams of two on two cores) libgomp stops spinning between parallel regions, so every
        region waits for its workers to wake: the 64-prompt workload ran at 219-271 tok/s on a
        second thread (1.5 cores busy) against 320-360 on the building one (2.0)."""
        self._run()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def num_unfinished(self) -> int:
        return self._pending + len(self._sinks)

    @property
    def stats(self) -> EngineStats:
        return self.engine.stats

    @property
    def pids(self) -> list[int]:
        """The processes whose memory the budget bounds: this one."""
        return [os.getpid()]

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def validate(self, prompt: list[int], params: SamplingParams) -> None:
        """Raises RequestRejected for a request that can never run (reads static limits only)."""
        self.engine.validate(prompt, params)

    async def compile(self, constraint: StructuredOutput) -> None:
        """Raises RequestRejected if the constraint's grammar does not compile (cached after)."""
        self.engine.validate_constraint(constraint)

    def add(self, request_id: str, prompt: list[int], params: SamplingParams, sink: Sink) -> Sink:
        """Queues a request; its outputs arrive in ``sink``, one per sample (``index``), the last
        one with ``request_finished`` set. Several requests may share one sink."""
        if self.error is not None:
            raise EngineStopped(f"the engine has stopped: {self.error}")
        stats = self.engine.stats
        if stats.waiting + self._pending >= self.max_waiting:
            raise QueueFull(f"{stats.waiting + self._pending} requests are waiting (limit {self.max_waiting})")
        self.validate(prompt, params)
        with self._lock:
            self._pending += 1
        self._ops.put(_Add(request_id, prompt, params, sink))
        self._wake.set()
        if self.error is not None:  # the thread died since the check above: nobody else will answer it
            self._fail_everything(f"engine failure: {self.error}")
        return sink

    def abort(self, request_id: str) -> None:
        """Aborts a request wherever it is; its blocks are freed before the next step."""
        self._ops.put(_Abort(request_id))
        self._wake.set()

    async def set_memory(self, memory: str | int | None, memory_fraction: float | None = None) -> MemoryPlan:
        """The engine moved to a new budget between two steps (``LLMEngine.set_memory``); raises
        what it raises (CacheDoesNotFitError: nothing changed)."""
        return await asyncio.wrap_future(self.set_memory_later(memory, memory_fraction))

    def set_memory_later(self, memory: str | int | None, memory_fraction: float | None = None) -> Future:
        """``set_memory`` from any thread: a future of the new plan."""
        done: Future = Future()
        self._ops.put(_SetMemory(memory, memory_fraction, done))
        self._wake.set()
        return done

    def abort_all(self) -> None:
        """Ends everything added so far (for shutdown): requests in the engine are aborted, and
        adds still queued fail without entering it. Done on the engine thread, like every change
        to the engine; ``stop`` right after still does it."""
        with self._lock:
            self._aborts_all += 1
        self._ops.put(_AbortAll())
        self._wake.set()

    # ---- the engine thread -------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._apply_ops()
                if not self.engine.has_unfinished():
                    self._wake.wait(0.5)
                    self._wake.clear()
                    before = _memory_moves(self.engine.stats)
                    self.engine.while_idle()  # memory="follow" moves an idle engine too; idle release
                    if _memory_moves(self.engine.stats) != before:
                        self._deliver([])  # no outputs, but whoever reports the stats hears of it
                    continue
                start = time.perf_counter()
                outputs = self.engine.step()
                elapsed = time.perf_counter() - start
                for observer in self.observers:
                    observer(outputs, elapsed)
                self._deliver(outputs)
            self._apply_ops()  # aborts queued just before stop() still free their blocks
            self._fail_everything("the server is shutting down")  # so no reader waits forever
        except BaseException as e:  # a bug, not bad input: answer every request with an error at once
            log.exception("engine thread failed")
            self.error = e
            self._fail_everything(f"engine failure: {e}")
            for callback in self.on_failure:  # the server exits non-zero (cmd_serve), for a supervisor
                callback(e)

    def _queued_ops(self):
        """Takes the queued ops, oldest first, until the queue is empty."""
        while True:
            try:
                yield self._ops.get_nowait()
            except queue.Empty:
                return

    def _fail_everything(self, error: str) -> None:
        """Fails every request with a reader, and the adds still queued (no engine runs them now)."""
        with self._fail_lock:
            for op in self._queued_ops():
                if isinstance(op, _Add):
                    self._take_pending()
                    self._sinks[op.request_id] = op.sink
            self._deliver([RequestOutput.failed(rid, [], error, kind="engine") for rid in list(self._sinks)])

    def _apply_ops(self) -> None:
        for op in self._queued_ops():
            if isinstance(op, _Add):
                self._add(op, aborted=self._take_pending())
            elif isinstance(op, _SetMemory):
                try:
                    op.done.set_result(self.engine.set_memory(op.memory, op.memory_fraction))
                    self._deliver([])  # (the new stats reported)
                except Exception as e:  # the planner's refusal, or a budget that does not parse
                    op.done.set_exception(e)
            elif isinstance(op, _Abort):
                self._deliver(self.engine.abort(op.request_id))
                self._sinks.pop(op.request_id, None)
            else:  # shutdown: each request still running ends with an error saying so
                for rid in list(self.engine.requests):
                    self.engine.abort(rid)  # frees its blocks
                    error = "the server shut down before this request finished; retry on another"
                    self._deliver([RequestOutput.failed(rid, [], error, kind="shutdown")])
                with self._lock:
                    self._aborts_all -= 1

    def _take_pending(self) -> bool:
        """Counts a queued add as taken; True if an abort_all queued after it is not done yet."""
        with self._lock:
            self._pending -= 1
            return self._aborts_all > 0

    def _add(self, op: _Add, aborted: bool) -> None:
        self._sinks[op.request_id] = op.sink
        if aborted:
            error = "the server is shutting down; the request was aborted before it started"
            self._deliver([RequestOutput.failed(op.request_id, op.prompt, error, kind="shutdown")])
            return
        try:
            self.engine.add_request(op.prompt, op.params, request_id=op.request_id, arrival_time=op.arrival)
        except Exception as e:  # fails this request only; the engine is unchanged
            client_error = isinstance(e, RequestRejected)  # anything else (a ValueError too) is a bug: 500
            if not client_error:
                log.exception("adding request %s failed", op.request_id)
            kind: ErrorKind = "rejected" if client_error else "engine"
            self._deliver([RequestOutput.failed(op.request_id, op.prompt, str(e), kind=kind)])

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Leaves each output in its request's mailbox; the mailbox is forgotten after the
        request's last output (the engine marks only that one ``request_finished``)."""
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue
            sink.put(out)
            if out.request_finished:  # after the put: num_unfinished == 0 means all is delivered
                del self._sinks[out.request_id]
        for callback in self.on_delivered:
            callback()


def _memory_moves(stats) -> tuple[int, int]:
    return stats.memory_resizes, stats.idle_releases
