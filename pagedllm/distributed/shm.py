"""The all-reduce (and the logits' gather) of ranks on one host, through shared memory
(``kernels/csrc/shm_exchange.cpp``).

gloo's all-reduce crosses the loopback's TCP stack: here ~1.7 ms for one row of 576 floats with
the cores busy, and a decode step runs two a layer. Ranks on one host instead map one region of
``/dev/shm`` and sum through it. The driver creates the file, every rank maps it, and the driver
unlinks it at once: the mapping lives as long as the ranks, and nothing is left behind in
``/dev/shm`` whatever ends them.

While it waits for the other ranks, a rank checks every ``POLL_S`` that they are still alive (a
process that is gone or a zombie): a dead rank ends the wait at once with ``RankLost``, a silent
one after the group's timeout.
"""

from __future__ import annotations

import mmap
import os
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from ..errors import RankLost
from ..sizes import SHM_SLOT_BYTES

SLOT_BYTES = SHM_SLOT_BYTES  # a larger tensor goes through in pieces of this size
POLL_S = 0.2


class SharedMemoryAllReduce:
    def __init__(self, ops: Any, path: str, rank: int, world: int, pids: list[int], timeout_s: float):
        self.ops, self.rank, self.world, self.pids, self.timeout_s = ops, rank, world, pids, timeout_s
        size = ops.shm_region_bytes(world, SLOT_BYTES)
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self.region = torch.frombuffer(self._map, dtype=torch.uint8, count=size)
        self.seq = 0

    @staticmethod
    def create(ops: Any, world: int) -> str:
        """A new zero-filled region file for ``world`` ranks (the driver's); returns its path."""
        path = f"/dev/shm/pagedllm-tp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, ops.shm_region_bytes(world, SLOT_BYTES))
        finally:
            os.close(fd)
        return path

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the ranks in place, in rank order (every rank gets the same bits)."""
        flat = t.view(-1) if t.is_contiguous() else t.contiguous().view(-1)
        step = SLOT_BYTES // flat.element_size()
        for first in range(0, flat.numel(), step):
            self._one(flat[first : first + step])
        if flat.data_ptr() != t.data_ptr():
            t.copy_(flat.view(t.shape))
        return t

    def gather_rows(self, t: torch.Tensor) -> torch.Tensor | None:
        """Every rank's ``t`` ([R, C], the same shape on all) side by side, [R, world * C], on rank
        0 (None elsewhere): each rank publishes its rows, a slot's worth at a time, and rank 0
        copies them out of the slots."""
        t = t.contiguous()
        rows, columns = t.shape
        out = t.new_empty(rows, self.world * columns) if self.rank == 0 else None
        step = max(1, SLOT_BYTES // max(1, columns * t.element_size()))
        for first in range(0, rows, step):
            piece = t[first : first + step]
            self._one(piece, reduce=False)
            if out is None:
                continue
            n = piece.numel()
            for r in range(self.world):
                offset = self.ops.shm_slot_offset(self.world, SLOT_BYTES, self.seq, r)
                slot = self.region[offset : offset + n * t.element_size()].view(t.dtype).view(piece.shape)
                out[first : first + piece.shape[0], r * columns : (r + 1) * columns] = slot
        return out

    def _one(self, piece: torch.Tensor, reduce: bool = True) -> None:
        self.seq += 1
        started = time.monotonic()
        published = False
        while not self.ops.shm_exchange(
            piece, self.region, self.rank, self.world, SLOT_BYTES, self.seq, POLL_S, published, reduce
        ):
            published = True
            gone = [r for r, pid in enumerate(self.pids) if r != self.rank and not _alive(pid)]
            if gone or time.monotonic() - started > self.timeout_s:
                why = f"rank {gone[0]} has exited" if gone else f"no answer in {self.timeout_s:.0f} s"
                raise RankLost(f"tensor parallelism: {why} (shared-memory all-reduce); the engine cannot go on")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")
