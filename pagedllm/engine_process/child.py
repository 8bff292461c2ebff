"""The engine's process: ``python -m pagedllm.engine_process.child FD``, started by ``client``.

Its main thread builds the engine and then steps it (``AsyncEngine.run``: the thread that
built the engine owns torch's OpenMP team); a reader thread hands the API process's messages to
the engine; each batch of outputs goes back as one ``Report`` of deltas. The process owns the
cores while it steps: no HTTP, JSON or SSE work shares its interpreter. It ignores SIGINT and
SIGTERM (the API process drains and then stops it) and exits when the API process goes away.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from dataclasses import asdict
from multiprocessing.connection import Connection

from ..errors import CacheDoesNotFitError, RequestRejected
from ..outputs import RequestOutput
from ..processes import api_engine as m

UNBOUNDED = 1 << 30  # the API process bounds the queue (it answers 429 itself)


class ParentLink:
    """The sink of every request: collects each sample's new tokens and text, and sends them as one
    ``Report`` when the engine thread has delivered a batch (``flush``)."""

    def __init__(self, conn: Connection, engine) -> None:
        self.conn, self.engine = conn, engine
        self.send_lock = threading.Lock()  # the stepping thread's reports, the reader's answers
        self._deltas: list[m.Delta] = []
        self._sent: dict[tuple[str, int], tuple[int, int]] = {}  # sample -> (tokens, logprobs) sent
        self._elapsed: float | None = None
        self.adds_taken = 0

    def send(self, message) -> None:
        with self.send_lock:
            self.conn.send(message)

    def observe(self, _outputs, elapsed: float) -> None:
        self._elapsed = elapsed

    def put(self, out: RequestOutput) -> None:
        key = (out.request_id, out.index)
        tokens, logprobs = self._sent.pop(key, (0, 0))
        if not out.finished:
            self._sent[key] = (len(out.token_ids), len(out.logprobs or ()))
        self._deltas.append(delta(out, tokens, logprobs))

    def flush(self) -> None:
        """On the stepping thread, after each delivery (the only thread that puts)."""
        deltas, self._deltas = self._deltas, []
        elapsed, self._elapsed = self._elapsed, None
        self.report(deltas, elapsed)

    def report(self, deltas: list[m.Delta], elapsed: float | None = None) -> None:
        self.send(m.Report(deltas, asdict(self.engine.engine.stats), elapsed, self.adds_taken))


def delta(out: RequestOutput, tokens_sent: int, logprobs_sent: int) -> m.Delta:
    return m.Delta(
        out.request_id,
        out.index,
        out.token_ids[tokens_sent:],
        out.delta_text,
        out.logprobs[logprobs_sent:] if out.logprobs is not None else None,
        out.finished,
        out.finish_reason,
        out.error,
        out.error_kind,
        out.metrics,
        out.request_finished,
        out.prompt_logprobs if tokens_sent == 0 else None,
        out.embedding,
    )


def serve(conn: Connection) -> int:
    """The engine's life: start handshake, then messages until Shutdown (0) or a failure (1)."""
    from ..engine.builder import build_engine
    from ..loading import resolve_model_dir
    from .engine_thread import AsyncEngine

    start = conn.recv()
    try:
        model_dir, name = resolve_model_dir(start.config.model)
        conn.send(m.Resolved(model_dir, name))
        build = conn.recv()
        llm_engine = build_engine(start.config, api_process_bytes=build.api_process_bytes)
    except CacheDoesNotFitError as e:  # the API process raises it again, with its figures
        conn.send(m.StartFailed(type(e).__name__, str(e), e.breakdown, e.suggestions))
        return 1
    except Exception as e:
        conn.send(m.StartFailed(type(e).__name__, str(e)))
        return 1
    engine = AsyncEngine(llm_engine, max_waiting=UNBOUNDED, beside_event_loop=False)
    link = ParentLink(conn, engine)
    engine.observers.append(link.observe)
    engine.on_delivered.append(link.flush)
    engine.on_failure.append(lambda e: died(link, e))
    link.send(m.Ready(llm_engine.memory_plan, llm_engine.limits, asdict(llm_engine.stats)))
    reader = threading.Thread(target=run_messages, args=(conn, engine, link), name="pagedllm-messages", daemon=True)
    reader.start()
    engine.run()  # until Shutdown (a failure exits the process from the engine's on_failure)
    reader.join()
    llm_engine.close()  # the disk tier's queued blocks written, a split model's ranks ended
    # then out at once: the interpreter's teardown of torch and the model took ~0.6 s of an
    # idle server's 1.0 s exit, the time a server with several models waits to load another
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_messages(conn: Connection, engine, link: ParentLink) -> None:
    """On the reader thread, until Shutdown; the process exits at once if the API process goes."""
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the API process is gone: nobody to answer
            os._exit(0)
        if isinstance(message, m.Add):
            link.adds_taken += 1
            add(engine, message, link)
        elif isinstance(message, m.Abort):
            engine.abort(message.request_id)
        elif isinstance(message, m.AbortAll):
            engine.abort_all()
        elif isinstance(message, m.Compile):
            link.send(m.Compiled(message.ticket, compile_rejection(engine, message.constraint)))
        elif isinstance(message, m.SetMemory):
            answer_when_set(engine.set_memory_later(message.memory, message.memory_fraction), message.ticket, link)
        elif isinstance(message, m.Shutdown):
            engine.stop()
            return


def add(engine, message: m.Add, link: ParentLink) -> None:
    """Queues the request; one the engine refuses (the API process checked the limits; a grammar
    can still fail) is answered with a failed output, as the engine thread answers its own."""
    try:
        engine.add(message.request_id, message.prompt, message.params, link)
    except RequestRejected as e:  # (on this thread: its own report, not the engine thread's batch)
        link.report([delta(RequestOutput.failed(message.request_id, [], e.message, kind="rejected"), 0, 0)])


def answer_when_set(done, ticket: int, link: ParentLink) -> None:
    """Sends ``MemorySet`` once the engine thread has moved to the new budget or refused it."""

    def send(future) -> None:
        error = future.exception()
        link.send(m.MemorySet(ticket, None if error else future.result(), str(error) if error else None))

    done.add_done_callback(send)


def compile_rejection(engine, constraint) -> tuple[str, str | None, str | None] | None:
    try:
        engine.engine.validate_constraint(constraint)
    except RequestRejected as e:
        return (e.message, e.param, e.code)
    return None


def died(link: ParentLink, error: BaseException) -> None:
    """On the engine's thread, after every request has had its error: say why, then exit 1."""
    try:
        link.send(m.Died(f"{type(error).__name__}: {error}"))
    finally:
        os._exit(1)


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C: the API process drains first
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a supervisor's, sent to the whole group: likewise
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("pagedllm.engine.elastic").setLevel(logging.INFO)  # each change of budget is logged
    return serve(Connection(int(argv[0])))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
