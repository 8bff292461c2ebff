"""How many threads the step runs on, and where.

Default: one torch thread per physical core the process may use, each pinned to its core (a
thread that stays on its core keeps its caches). The compiled kernels bind torch's worker
threads; the caller's own thread, which is torch's thread 0, is bound to the first core only
while a step runs (``running``), so processes and threads it starts between steps keep every CPU. A step runs many
parallel regions, each ending in a barrier, so a single descheduled thread stalls all of them:
next to another busy process, two threads on two shared cores ran a 24-token request 5-30x
slower than one thread did. So the engine watches the machine between steps: when other
processes keep cores busy, it drops to the cores left free and unpins (the scheduler then places
its threads on whichever cores are idle); when they go quiet, it comes back.

``EngineConfig.threads`` (or ``PAGEDLLM_THREADS=N``) sets the most threads; ``PAGEDLLM_PIN_THREADS=0`` never pins;
``PAGEDLLM_ADAPT_THREADS=0`` keeps the count fixed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from ... import env
from ...host import allowed_cpus, physical_cores

log = logging.getLogger(__name__)

CHECK_INTERVAL_S = 0.5  # how often the load of other processes is read
BUSY_CORE = 0.5  # another process's use of a core, in cores, from which the core counts as taken


class ThreadGovernor:
    """Sets torch's thread count and affinity at start, then adjusts them between steps.

    ``pin(cpus, each)`` binds torch's worker threads (one per CPU of ``cpus`` if ``each``, else
    all to the set): the compiled kernels' ``pin_threads``. Without it only the count applies.
    ``cpus``: the cores of one rank of a split model, which shares the host with the other ranks
    by design: its threads stay on them and their count never adapts to the others' load."""

    def __init__(
        self,
        pin: Callable[[torch.Tensor, bool], int] | None = None,
        max_threads: int | None = None,
        cpus: list[int] | None = None,
    ):
        self._pin = pin
        self.cpus = sorted(cpus) if cpus else allowed_cpus()
        self.cores = physical_cores(self.cpus)
        self.max_threads = max_threads or env.THREADS.get() or len(self.cores)
        self.pin = env.PIN_THREADS.get() and pin is not None
        self.adapt = not cpus and env.ADAPT_THREADS.get() and _proc_stat() is not None
        self.threads = 0
        self.pinned = False
        self._pinned_for: int | None = None  # the thread whose worker team the pinning applies to
        self._last: tuple[float, float, float] | None = None
        self._next_check = 0.0
        self.read_load = _proc_stat  # (busy, total) CPU time of the host; tests inject theirs
        self.apply(self.max_threads, pin=self.pin)

    def apply(self, threads: int, pin: bool) -> None:
        """``threads`` torch threads; pinned one per physical core, or free to run anywhere."""
        threads = max(1, min(threads, self.max_threads))
        if threads != self.threads:
            torch.set_num_threads(threads)
            self.threads = threads
        if self._pin is None:  # nothing to pin with; the count alone applies
            return
        if pin:
            self._pin(torch.tensor(self.cores[:threads], dtype=torch.long), True)
        else:
            self._pin(torch.tensor(self.cpus, dtype=torch.long), False)
        self.pinned = pin
        self._pinned_for = threading.get_ident()

    def share_process(self) -> None:
        """Never pins from now on: this process runs other busy threads (the server's event
        loop), which the OS must be free to put on any core. A pinned worker that the loop
        preempts cannot move, and every parallel region waits for it. Measured with 64 streamed
        requests at once (standard workload, bf16, 2 cores): 239 and 290 output tok/s pinned,
        329 and 394 unpinned."""
        self.pin = False
        self.apply(self.threads, pin=False)

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Binds the calling thread to the first core for the duration of a step, if pinned.

        OpenMP gives every thread that starts parallel work its own team of workers, so a step
        run on another thread than the one that pinned (the server's engine thread) would run on
        workers never pinned, created inside the first step and so inheriting the caller's
        one-core binding: the whole step on one core (measured: 183 output tok/s served, 324
        with this). Such a thread pins its own team first."""
        if not self.pinned:
            yield
            return
        if self._pinned_for != threading.get_ident():
            self.apply(self.threads, pin=True)
        os.sched_setaffinity(0, {self.cores[0]})
        try:
            yield
        finally:
            os.sched_setaffinity(0, self.cpus)

    def after_step(self) -> None:
        """Cheap unless CHECK_INTERVAL_S has passed: then one read of /proc/stat."""
        if not self.adapt:
            return
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + CHECK_INTERVAL_S
        sample = self.read_load()
        if sample is None:
            return
        own = sum(os.times()[:2])
        busy, total = sample
        if self._last is not None:
            d_busy, d_total, d_own = busy - self._last[0], total - self._last[1], own - self._last[2]
            if d_total > 0:
                # cores' worth of CPU time others used over the interval (jiffies -> cores)
                per_core = d_total / len(self.cpus)
                others = max(0.0, (d_busy - d_own * _HZ) / per_core)
                taken = int(others + (1 - BUSY_CORE))  # a core counts as taken from BUSY_CORE on
                want = max(1, len(self.cores) - taken)
                if want != self.threads:
                    log.info("other processes use %.1f cores: running on %d thread(s)", others, want)
                    self.apply(want, pin=self.pin and want >= self.max_threads)
        self._last = (busy, total, own)


_HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _proc_stat() -> tuple[float, float] | None:
    """(busy, total) jiffies of all CPUs since boot; busy includes steal (time the host took)."""
    try:
        fields = [float(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])
    return total - idle, total
