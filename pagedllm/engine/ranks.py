"""Starting the ranks of a split model (``tensor_parallel_size`` > 1), on the driver's side.

Two ways a group comes to be:

- **one host, started by the driver** (``LLM(tensor_parallel_size=N)``, any ``pagedllm`` command
  with ``-tp N``): the driver starts ranks 1..N-1 as processes of their own
  (``python -m pagedllm.engine.rank_worker``), so a plain script needs no ``__main__`` guard; they
  meet it over gloo on 127.0.0.1 and exit when it closes the group or goes away;
- **launched** (``torchrun``, or ``--nnodes/--node-rank/--master-addr/--master-port``): every
  rank runs the same command; ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` say who is
  who, rank 0 drives and the others serve it headless (``rank_worker.serve``).

Each rank takes its own share of the host's cores (``LOCAL_RANK`` of ``LOCAL_WORLD_SIZE``): the
ranks' OpenMP teams never share a core.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import subprocess
import sys
from dataclasses import dataclass, field

from ..backends.base import Backend
from ..distributed.group import RankGroup, RankLost, join
from ..engine_config import ConfigError, EngineConfig
from ..memory.machine import resident_bytes
from ..processes.driver_ranks import MEMORY, launched_rank, rank_cpus

log = logging.getLogger(__name__)


@dataclass
class Ranks:
    """The group as the driver holds it: the collectives, and the workers it started (if any)."""

    group: RankGroup
    cpus: list[int]  # the driver's own cores
    workers: list[subprocess.Popen] = field(default_factory=list)
    closed: bool = False
    interpreter_bytes: int = field(default_factory=lambda: resident_bytes()[0])  # the driver's, before loading

    def memory(self) -> list[tuple[int, int]]:
        """Every rank's (resident before loading, peak resident) bytes, in rank order."""
        self.group.broadcast(MEMORY)
        return self.group.gather_objects((self.interpreter_bytes, resident_bytes()[1]))

    def close(self) -> None:
        """Tells every rank to stop (``None`` in place of a step), then waits for the workers it
        started; a worker that does not end in 10 s is killed. Safe to call twice."""
        if self.closed:
            return
        self.closed = True
        try:
            self.group.broadcast(None)
        except RankLost:
            pass  # a rank is gone already: the others' collectives fail and they exit
        for worker in self.workers:
            try:
                worker.wait(timeout=10)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
        self.group.close()


def start(config: EngineConfig, backend: Backend) -> Ranks:
    """Rank 0 of ``config.tensor_parallel_size``: joins a launched group, or starts its workers on
    this host and opens one. Raises ConfigError when a launcher's world size is not the config's."""
    shm_ops = backend.shared_memory_ops()
    size = config.tensor_parallel_size
    launched = launched_rank()
    if launched is not None:
        if launched.size != size:
            raise ConfigError(
                "tensor_parallel_size", f"{size}, but the launcher started {launched.size} ranks (WORLD_SIZE)"
            )
        ranks = Ranks(join(launched.rank, size, "env://", shm_ops), launched.cpus())
        atexit.register(ranks.close)  # the headless ranks wait for it to stop
        return ranks
    address = f"tcp://127.0.0.1:{_free_port()}"
    workers = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pagedllm.engine.rank_worker",
                str(rank),
                str(size),
                address,
                str(os.getpid()),
                config.backend,
            ],
            stdin=subprocess.DEVNULL,
        )
        for rank in range(1, size)
    ]
    try:
        group = join(0, size, address, shm_ops)
    except Exception:
        for w in workers:
            w.kill()
        raise
    log.info("tensor parallelism: %d ranks on this host (workers %s)", size, [w.pid for w in workers])
    ranks = Ranks(group, rank_cpus(0, size), workers)
    atexit.register(ranks.close)  # a script that never calls close() still ends its workers cleanly
    return ranks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
