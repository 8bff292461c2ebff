"""Mailbox: where the engine thread leaves a request's outputs until its HTTP handler reads them.

The engine emits one output per sample per step, each a snapshot of all the text so far. A
consumer slower than the engine (a client reading a stream slowly, a busy event loop) would let
those snapshots pile up, memory growing with the square of the output length. Instead, an
unread output is replaced by the next one of the same sample, their ``delta_text`` joined: a
mailbox holds at most one output per sample, so its memory is bounded by the final output, and
a slow reader simply gets bigger pieces. Generation never waits for a reader.
"""

from __future__ import annotations

import asyncio
import threading

from ..outputs import RequestOutput


class Mailbox:
    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()  # the reader's loop
        self._ready = asyncio.Event()
        self._lock = threading.Lock()
        self._unread: dict[tuple[str, int], RequestOutput] = {}  # (request, sample) -> latest
        self._wake_scheduled = False
        self.most_unread = 0  # the most outputs ever held at once (checked by the tests)

    def __len__(self) -> int:
        return len(self._unread)

    def put(self, out: RequestOutput) -> None:
        """Called from any thread; never blocks on the reader."""
        with self._lock:
            key = (out.request_id, out.index)
            older = self._unread.pop(key, None)
            if older is not None:
                out.delta_text = older.delta_text + out.delta_text
            self._unread[key] = out
            self.most_unread = max(self.most_unread, len(self._unread))
            if self._wake_scheduled:
                return
            self._wake_scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._wake)
        except RuntimeError:  # the loop is closed: nobody is reading any more
            pass

    def _wake(self) -> None:
        with self._lock:
            self._wake_scheduled = False
        self._ready.set()

    async def get(self) -> RequestOutput:
        """The oldest unread output (merged with any that followed it for the same sample)."""
        while True:
            with self._lock:
                if self._unread:
                    return self._unread.pop(next(iter(self._unread)))
                self._ready.clear()
            await self._ready.wait()
