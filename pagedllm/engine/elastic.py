"""The engine's memory at run time: a new budget (``set_memory``), the machine's budget followed
(``memory="follow"``), and an idle engine's cache pages given back (``idle_release_after``).

Every move happens on the thread that steps, between two steps, so no step ever sees a cache
changing under it. Shrinking loses no request: the scheduler preempts the newest until what runs
fits, the blocks past the new end are copied down, and only then do their pages go back to the
OS (``KVCache.resize``). Growing needs no restart: the cache's mapping reserved the room at start.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from dataclasses import replace
from typing import TYPE_CHECKING

from ..engine_config import ConfigError
from ..errors import CacheDoesNotFitError
from ..memory.budget import resolve_budget, total_memory
from ..memory.follow import FOLLOW, MachineWatch
from ..memory.machine import resident_bytes, return_freed_heap
from ..memory.planner import MemoryPlan
from ..sizes import parse_memory

if TYPE_CHECKING:
    from .llm_engine import LLMEngine

log = logging.getLogger(__name__)  # at INFO under `pagedllm serve`: each move is logged
MiB = 2**20
# A grown budget's new blocks go to running requests at once, to new admissions only once the
# budget has held this long: a budget that drops again soon (memory="follow" beside a neighbour
# that comes and goes) would preempt, and recompute, everything admitted into the extra room.
GROW_SETTLE_S = float(os.environ.get("PAGEDLLM_GROW_SETTLE_S", 10))


class ElasticMemory:
    """The run-time budget of one engine (``LLMEngine.memory``)."""

    def __init__(self, engine: LLMEngine):
        # a weak reference: a cycle would keep a dropped engine (its weights, its cache) alive
        # until the garbage collector runs, and the next engine would plan around it
        self.engine: LLMEngine = weakref.proxy(engine)
        # memory="follow": the budget moves with the machine (a split model's only at its start, for now)
        config = engine.config
        self.following = MachineWatch.from_env() if config.memory == FOLLOW and engine.ranks is None else None
        self._next_look = 0.0
        self.resizes = 0  # budgets changed at run time, whoever asked (set_memory, follow)
        self.idle_releases = 0
        self._last_busy = time.monotonic()  # when a step last computed something
        self._released_at_step = -1  # the step count at the last idle release (once per idle spell)
        self._settled_at: float | None = None  # when a grown budget opens to new admissions

    # ---- a new budget --------------------------------------------------------------------------

    def set_memory(self, memory: str | int | None = None, memory_fraction: float | None = None) -> MemoryPlan:
        """Moves the engine to a new budget while it keeps its requests: the planner solves the
        cache for it (the step budget too, only if the cache alone cannot make it fit), and the
        cache shrinks or grows in place. ``memory_fraction``: that fraction of the memory this
        engine could have now (what is free plus what the engine's processes hold). Raises
        CacheDoesNotFitError, changing nothing, when even the smallest cache does not fit."""
        engine = self.engine
        if engine.ranks is not None:
            raise ConfigError("memory", "a split model's budget cannot change at run time yet")
        if engine.drafter is not None:
            raise ConfigError("memory", "with a draft model the budget cannot change at run time yet")
        budget = self._budget_bytes(memory, memory_fraction)
        old = engine.memory_plan
        kept = engine.config.replace(
            memory=budget,
            memory_fraction=None,
            num_blocks=None,
            max_batch_tokens=old.max_batch_tokens,
            max_num_seqs=old.max_num_seqs,
            max_model_len=old.max_model_len,
        )
        try:
            plan = engine.replan(kept)
        except CacheDoesNotFitError:
            plan = engine.replan(kept.replace(max_batch_tokens=None))  # raises if nothing fits
        if plan.num_blocks > engine.kv_cache.capacity_blocks:
            plan = replace(plan, num_blocks=engine.kv_cache.capacity_blocks)
        self._resize(plan)
        log.info(
            "memory budget %.0f -> %.0f MiB: plan %.0f -> %.0f MiB, %d -> %d KV blocks, step budget %d -> %d tokens",
            old.budget_bytes / MiB,
            plan.budget_bytes / MiB,
            old.total_bytes / MiB,
            plan.total_bytes / MiB,
            old.num_blocks,
            plan.num_blocks,
            old.max_batch_tokens,
            plan.max_batch_tokens,
        )
        return plan

    def _budget_bytes(self, memory: str | int | None, memory_fraction: float | None) -> int:
        if (memory is None) == (memory_fraction is None):
            raise ConfigError("memory", "give memory or memory_fraction (one of them)")
        plan = self.engine.memory_plan
        if memory_fraction is not None:
            if not 0 < memory_fraction <= 1:
                raise ConfigError("memory_fraction", f"must be in (0, 1], got {memory_fraction}")
            held = resident_bytes()[0] + plan.api_process_bytes
            return resolve_budget(None, memory_fraction, str(self.engine.backend.device), already_used=held)[0]
        assert memory is not None
        budget = parse_memory(memory)
        if budget > total_memory():
            raise ConfigError("memory", f"{memory}: more than this machine has ({total_memory() / 2**30:.1f} GiB)")
        return budget

    def _resize(self, plan: MemoryPlan) -> None:
        """The cache, the block manager and the limits to ``plan``. Shrinking: the newest
        requests are preempted until what runs fits, the blocks past the new end are moved down
        (a copy each, 8-bit scales included), then their pages go back to the OS."""
        engine = self.engine
        n, old = plan.num_blocks, engine.blocks.num_blocks
        scheduler = engine.scheduler
        if n < old:
            engine.kv_cache.copy_blocks(scheduler.shrink_cache(n))
            engine.kv_cache.resize(n)
            return_freed_heap()
            scheduler.admission_limit = None if scheduler.admission_limit is None else min(n, scheduler.admission_limit)
        else:
            engine.kv_cache.resize(n)
            engine.blocks.resize(n)
            if GROW_SETTLE_S > 0:  # new admissions stay within the old cache until the budget holds
                scheduler.admission_limit = min(old, scheduler.admission_limit or old)
                self._settled_at = time.monotonic() + GROW_SETTLE_S
        scheduler.max_batch_tokens = plan.max_batch_tokens
        engine.limits = replace(engine.limits, num_blocks=n)
        engine.memory_plan = plan
        engine.config = engine.config.replace(memory=plan.budget_bytes, memory_fraction=None)
        self.resizes += 1

    # ---- the machine's budget ----------------------------------------------------------------

    def follow_machine(self) -> None:
        """With ``memory="follow"``: at most every poll interval, the budget the machine allows
        now (``memory.follow``); the engine moves to it when it changed by more than 1%."""
        watch = self.following
        if watch is None or time.monotonic() < self._next_look:
            return
        self._next_look = time.monotonic() + watch.interval_s
        budget, why = watch.budget(resident_bytes()[0], total_memory())
        old = self.engine.memory_plan
        if abs(budget - old.budget_bytes) <= max(16 * MiB, old.budget_bytes // 100):
            return
        log.info("memory=follow: %s allows %.0f MiB", why, budget / MiB)
        try:
            self.set_memory(budget)
        except (CacheDoesNotFitError, ConfigError) as e:
            log.warning("memory=follow: keeping the plan (%s)", e)

    # ---- idle ---------------------------------------------------------------------------------

    def stepped(self, computed: bool) -> None:
        """After every step: a step that computed something ends an idle spell."""
        if computed:
            self._last_busy = time.monotonic()
        self.follow_machine()

    def settle(self) -> None:
        """A grown budget that has held for ``GROW_SETTLE_S``: new admissions may use all of it."""
        if self._settled_at is not None and time.monotonic() >= self._settled_at:
            self.engine.scheduler.admission_limit = None
            self._settled_at = None

    def while_idle(self) -> None:
        """Called by a serving loop while nothing runs: follows the machine and, once idle for
        ``idle_release_after`` seconds, gives the cache's free pages back (once per idle spell)."""
        self.settle()
        self.follow_machine()
        engine = self.engine
        after = engine.config.idle_release_after
        steps = engine.scheduler.counters.steps
        if after is None or engine.has_unfinished() or self._released_at_step == steps:
            return
        if time.monotonic() - self._last_busy >= after:
            self.release_idle(engine.config.idle_keep_prefix_cache)
            self._released_at_step = steps

    def release_idle(self, keep_prefix_cache: bool = False) -> int:
        """With nothing running: gives the pages of every free block back to the OS, and returns
        the bytes of resident memory that went. The prefix cache's blocks go too unless
        ``keep_prefix_cache`` (then they are moved to the bottom of the cache, and kept). The
        blocks stay in the plan: the next request's blocks fault their pages back in as written."""
        engine = self.engine
        if engine.has_unfinished():
            raise RuntimeError("release_idle: requests are running")
        before = resident_bytes()[0]
        moves, end = engine.scheduler.compact_idle_cache(keep_prefix_cache)
        engine.kv_cache.copy_blocks(moves)
        engine.kv_cache.release_pages(end)
        return_freed_heap()
        after = resident_bytes()[0]
        self.idle_releases += 1
        log.info(
            "idle for %.0f s: the KV cache's free pages given back (%d of %d blocks kept for the prefix cache); "
            "resident %.0f -> %.0f MiB",
            time.monotonic() - self._last_busy,
            end,
            engine.blocks.num_blocks,
            before / MiB,
            after / MiB,
        )
        return before - after
