"""The ranks of a split model as one group: the collectives a step needs, over torch.distributed.

gloo carries every collective on CPU, on one
host or across hosts (NCCL would be the GPU path behind the same methods); ranks that all share one
host sum through shared memory instead (``shm``: microseconds where gloo's loopback TCP takes a
millisecond or more), unless ``PAGEDLLM_TP_SHM=0`` or the backend has no compiled kernels (then
gloo). A step costs, per layer, two all-reduces of the hidden states (after the row-parallel o and
down projections), one more for the vocab-parallel embedding, one gather of the logits rows onto the
driver, and one broadcast of the step input from it.

A rank that dies (killed, out of memory, an exception) closes its sockets: every other rank's
next collective raises, and ``RankGroup`` turns that into ``RankLost``, which the driver reports
as the engine's failure. A rank that hangs is caught by the group's timeout
(``PAGEDLLM_TP_TIMEOUT``, seconds).
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .. import env
from ..errors import RankLost
from .shm import SharedMemoryAllReduce

IDLE_TIMEOUT = timedelta(days=365)  # how long a worker waits for the driver's next step


def timeout() -> timedelta:
    return timedelta(seconds=env.TP_TIMEOUT.get())


class RankGroup:
    """This process's place in the split: ``rank`` of ``size``; rank 0 is the driver.

    Step inputs go through a group of their own with no timeout to speak of: a worker waits for
    the next step as long as the driver has nothing to run (a dead driver still ends the wait at
    once: its sockets close)."""

    def __init__(self, rank: int, size: int):
        self.rank = rank
        self.size = size
        self.steps = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        self.shm: SharedMemoryAllReduce | None = None
        self.reduced = self.gathered = 0  # this step's collectives so far (``DecoderLM.finish_collectives``)

    def new_step(self) -> None:
        self.reduced = self.gathered = 0

    def any_failed(self, failed: bool) -> bool:
        """Whether any rank says its step failed (one more all-reduce, of a flag): every rank then
        gives up the same step together, and the driver retries it smaller."""
        flag = torch.tensor([1.0 if failed else 0.0])
        return bool(self.all_reduce_(flag).item())

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the ranks, in place (and returned)."""
        self.reduced += 1
        if self.shm is not None:
            return self.shm.all_reduce_(t)
        flat = t if t.is_contiguous() else t.contiguous()  # gloo sums a strided view's storage, not it
        self._call(dist.all_reduce, flat)
        if flat is not t:
            t.copy_(flat)
        return t

    def gather_rows(self, t: torch.Tensor) -> torch.Tensor | None:
        """Every rank's ``t`` ([R, C], the same shape on all) side by side, [R, size * C], on the
        driver; None elsewhere."""
        self.gathered += 1
        if self.shm is not None:
            return self.shm.gather_rows(t)
        t = t.contiguous()
        if not self.is_driver:
            self._call(dist.gather, t, None, 0)
            return None
        parts = [torch.empty_like(t) for _ in range(self.size)]
        self._call(dist.gather, t, parts, 0)
        return torch.cat(parts, dim=1)

    def broadcast(self, obj: Any = None) -> Any:
        """The driver's ``obj`` (picklable: ints, lists, tensors, dataclasses of them) on every rank;
        waits for the driver without a timeout (the next step may be hours away)."""
        box = [obj]
        self._call(dist.broadcast_object_list, box, 0, self.steps)
        return box[0]

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        out: list[Any] = [None] * self.size
        self._call(dist.all_gather_object, out, obj)
        return out

    def _call(self, collective, *args) -> None:
        try:
            collective(*args)
        except (RuntimeError, dist.DistBackendError) as e:
            raise RankLost(
                f"tensor parallelism: a rank of {self.size} stopped answering ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else 'no message'}); the engine cannot go on"
            ) from None

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def join(rank: int, size: int, init_method: str, shm_ops: Any = None) -> RankGroup:
    """Joins (or, on the driver, opens) the group over gloo, and the shared-memory all-reduce
    when every rank is on this host and has ``shm_ops`` (``Backend.shared_memory_ops``); every
    rank calls it."""
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=size, timeout=timeout())
    group = RankGroup(rank, size)
    ops = shm_ops if env.TP_SHM.get() else None
    where = group.gather_objects((socket.gethostname(), os.getpid(), ops is not None))
    if len({host for host, _, _ in where}) == 1 and all(ok for _, _, ok in where):
        path = group.broadcast(SharedMemoryAllReduce.create(ops, size) if rank == 0 else None)
        group.shm = SharedMemoryAllReduce(
            ops, path, rank, size, [pid for _, pid, _ in where], timeout().total_seconds()
        )
        group.gather_objects(None)  # every rank has mapped it: the name can go
        if rank == 0:
            os.unlink(path)
    return group
