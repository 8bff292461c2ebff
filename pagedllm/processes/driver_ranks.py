"""Between the driver of a split model and its other ranks: what crosses (the setup every rank
shares, the requests in place of a step), and where each rank sits (its place as a launcher gave
it, its share of the host's cores; a worker's watch on the driver that started it).

The steps themselves cross as ``engine.step.StepInput`` (plain data), broadcast over the group's
collectives (``distributed.group``); ``None`` in place of a step ends every rank.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from .. import env
from ..engine_config import EngineConfig
from ..host import allowed_cpus, numa_node, physical_cores

MEMORY = "memory"  # in place of a step: every rank reports (resident before loading, peak resident)


@dataclass(frozen=True)
class RankSetup:
    """What the driver decided that every rank must share: the engine's config and the cache the
    driver's plan allows (its plan bounds every rank: the others hold less)."""

    config: EngineConfig
    num_blocks: list[int]  # each KV pool's (``MemoryPlan.pool_blocks``)
    block_size: int
    kv_dtype: str


@dataclass(frozen=True)
class Launched:
    """What a launcher (torchrun) says of this process: its rank of ``size``, and of this host's."""

    rank: int
    size: int
    local_rank: int
    local_size: int

    def cpus(self) -> list[int]:
        return rank_cpus(self.local_rank, self.local_size)


def launched_rank() -> Launched | None:
    """This process's place when a launcher (torchrun) started it as one rank, else None."""
    if env.RANK.is_set() and env.WORLD_SIZE.is_set() and env.MASTER_ADDR.is_set():
        rank, size = env.RANK.get(), env.WORLD_SIZE.get()
        local_rank = env.LOCAL_RANK.get() if env.LOCAL_RANK.is_set() else rank
        return Launched(rank, size, local_rank, env.LOCAL_WORLD_SIZE.get() or size)
    return None


def rank_cpus(local_rank: int, local_size: int) -> list[int]:
    """This rank's share of the host's cores (one CPU per physical core), within one NUMA node
    where the counts allow (its memory, first touched by its own threads, then stays on its
    node); all CPUs when there are more ranks than cores (the ranks then share, unpinned)."""
    cores = physical_cores(allowed_cpus())
    share = split_cores(cores, {cpu: numa_node(cpu) for cpu in cores}, local_rank, local_size)
    return share or allowed_cpus()


def split_cores(cores: list[int], node_of: dict[int, int], rank: int, size: int) -> list[int]:
    """Rank ``rank`` of ``size``'s cores: the ``rank``-th equal slice of the cores ordered by NUMA
    node (so a rank's cores share a node wherever the counts allow); [] when there are fewer cores
    than ranks."""
    ordered = sorted(cores, key=lambda c: (node_of[c], c))
    each = len(ordered) // size
    return ordered[rank * each : (rank + 1) * each]


def watch_parent(parent_pid: int) -> None:
    """On a thread of a worker the driver started: exit when the driver is gone (killed, or ended
    without closing the group), so no rank outlives it."""
    while True:
        if os.getppid() != parent_pid:
            os._exit(1)
        time.sleep(0.5)
