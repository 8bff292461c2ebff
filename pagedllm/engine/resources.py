"""EngineMemory: the one owner, and the only writer, of what an engine's memory is made of.

The plan, the budget it was made for (the config's ``memory``), the KV cache, the block manager,
the request limits and the capacity reserved for growth change together or not at all: a new
budget moves all of them between two steps (``resize``), an idle engine gives its free pages back
(``release_idle``). Everything else reads them here; the policy that decides when to move
(``engine.elastic``) calls these methods and sees nothing else of the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from ..memory.machine import resident_bytes, return_freed_heap

if TYPE_CHECKING:
    from ..backends.base import KVCache
    from ..engine_config import EngineConfig
    from ..layers.expert_cache import ExpertCache
    from ..limits import RequestLimits
    from ..memory.planner import MemoryPlan
    from .block_pools import BlockPools
    from .scheduler import Scheduler


class EngineMemory:
    """``replan(config, plan)``: the plan for ``config`` with this process's facts as they were
    when ``plan`` was made (its baseline, its weights, the API process beside it)."""

    def __init__(
        self,
        plan: MemoryPlan,
        config: EngineConfig,
        kv_cache: KVCache,
        blocks: BlockPools,
        limits: RequestLimits,
        scheduler: Scheduler,
        replan: Callable[[EngineConfig, MemoryPlan], MemoryPlan],
        experts: ExpertCache | None = None,
    ):
        self._plan, self._config, self._limits = plan, config, limits
        self._kv_cache, self._blocks, self._scheduler = kv_cache, blocks, scheduler
        self._replan = replan
        self._experts = experts  # a mixture's expert cache, whose slots a new budget moves first

    # ---- what there is (read-only to everyone else) --------------------------------------------

    @property
    def plan(self) -> MemoryPlan:
        return self._plan

    @property
    def config(self) -> EngineConfig:
        """The engine's config, its ``memory`` the budget the plan was made for."""
        return self._config

    @property
    def kv_cache(self) -> KVCache:
        return self._kv_cache

    @property
    def blocks(self) -> BlockPools:
        return self._blocks

    @property
    def limits(self) -> RequestLimits:
        return self._limits

    @property
    def pool_capacity(self) -> list[int]:
        """The most blocks each pool can grow to without a restart."""
        return list(self._kv_cache.pool_capacity)

    @property
    def capacity_blocks(self) -> int:
        """The most blocks the cache can grow to without a restart (its mapping reserved them)."""
        return self._kv_cache.capacity_blocks

    def replan(self, config: EngineConfig) -> MemoryPlan:
        return self._replan(config, self._plan)

    def has_unfinished(self) -> bool:
        return self._scheduler.has_unfinished()

    def blocks_to_finish(self) -> int:
        """``Scheduler.blocks_to_finish``, at least the blocks in use now."""
        return max(self._blocks.num_used, self._scheduler.blocks_to_finish())

    @property
    def steps(self) -> int:
        return self._scheduler.counters.steps

    # ---- moves -------------------------------------------------------------------------------

    def resize(self, plan: MemoryPlan, hold_growth: bool) -> None:
        """The cache, the block manager, the step budget and the limits to ``plan``. Shrinking:
        the newest requests are preempted until what runs fits, the blocks past the new end are
        moved down (a copy each, 8-bit scales included), then their pages go back to the OS.
        Growing with ``hold_growth``: new admissions stay within the old cache until
        ``open_admissions`` (running requests may use the new blocks at once)."""
        n, old = plan.num_blocks, self._blocks.num_blocks
        sizes = plan.pool_blocks
        scheduler = self._scheduler
        if self._experts is not None:  # fewer experts resident before any request is preempted
            self._experts.resize(plan.expert_slots or self._experts.capacity)
        checkpoints = self._blocks.checkpoints
        if checkpoints is not None and plan.checkpoint_slots != checkpoints.slots:  # shed (or regrown) first too
            self._kv_cache.resize_checkpoints(plan.checkpoint_slots, checkpoints.resize(plan.checkpoint_slots))
        shrinks = any(new < was for new, was in zip(sizes, self._blocks.pool_sizes))
        # what lives past a shrinking pool's end moves down first; a growing pool just grows
        self._kv_cache.copy_blocks(scheduler.shrink_cache(sizes))
        self._kv_cache.resize(sizes)
        if shrinks:
            return_freed_heap()
        if n < old and scheduler.admission_limit is not None:
            scheduler.limit_admissions(min(n, scheduler.admission_limit))
        elif n > old and hold_growth:
            scheduler.limit_admissions(min(old, scheduler.admission_limit or old))
        scheduler.set_step_budget(plan.max_batch_tokens)
        self._limits = replace(self._limits, num_blocks=n)
        self._plan = plan
        self._config = self._config.replace(memory=plan.budget_bytes, memory_fraction=None)

    def open_admissions(self) -> None:
        """New admissions may use the whole cache again (a grown budget has held)."""
        self._scheduler.limit_admissions(None)

    def release_idle(self, keep_prefix_cache: bool = False) -> tuple[int, int]:
        """With nothing running: gives the pages of every free block back to the OS, and returns
        the bytes of resident memory that went. The prefix cache's blocks go too unless
        ``keep_prefix_cache`` (then they are moved to the bottom of the cache, and kept). The
        blocks stay in the plan: the next request's blocks fault their pages back in as written.
        Returns (the bytes given back, the blocks kept)."""
        if self._scheduler.has_unfinished():
            raise RuntimeError("release_idle: requests are running")
        before = resident_bytes()[0]
        moves, ends = self._scheduler.compact_idle_cache(keep_prefix_cache)
        self._kv_cache.copy_blocks(moves)
        for pool, end in enumerate(ends):
            self._kv_cache.release_pages(pool, end)
        return_freed_heap()
        return before - resident_bytes()[0], ends[0]
