"""When an engine's memory moves: a new budget (``set_memory``), the machine's budget followed
(``memory="follow"``), and an idle engine's cache pages given back (``idle_release_after``).
The policy only: the moves themselves are ``EngineMemory``'s (``engine.resources``), the one
owner of the plan, the cache, the blocks and the limits; this module sees nothing else.

Every move happens on the thread that steps, between two steps, so no step ever sees a cache
changing under it. Shrinking loses no request: the scheduler preempts the newest until what runs
fits, the blocks past the new end are copied down, and only then do their pages go back to the
OS (``KVCache.resize``). Growing needs no restart: the cache's mapping reserved the room at start.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from .. import env
from ..engine_config import ConfigError
from ..errors import CacheDoesNotFitError
from ..memory.budget import resolve_budget, total_memory
from ..memory.follow import FOLLOW, MachineWatch
from ..memory.machine import resident_bytes
from ..memory.planner import MemoryPlan
from ..sizes import parse_memory
from .resources import EngineMemory

log = logging.getLogger(__name__)  # at INFO under `pagedllm serve`: each move is logged
MiB = 2**20
# A grown budget's new blocks go to running requests at once, to new admissions only once the
# budget has held this long: a budget that drops again soon (memory="follow" beside a neighbour
# that comes and goes) would preempt, and recompute, everything admitted into the extra room.
GROW_SETTLE_S = env.GROW_SETTLE_S.get()


class ElasticMemory:
    """The run-time budget of one engine. ``fixed``: why its budget cannot move (a split model, a
    draft model), or None; ``device``: where its memory is (what ``memory_fraction`` reads)."""

    def __init__(self, memory: EngineMemory, device: str, fixed: str | None = None):
        self.memory = memory
        self.device, self.fixed = device, fixed
        # memory="follow": the budget moves with the machine (a split model's only at its start, for now)
        follow = memory.config.memory == FOLLOW and fixed is None
        self.following = MachineWatch.from_env() if follow else None
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
        if self.fixed is not None:
            raise ConfigError("memory", self.fixed)
        budget = self._budget_bytes(memory, memory_fraction)
        owner = self.memory
        old = owner.plan
        kept = owner.config.replace(
            memory=budget,
            memory_fraction=None,
            num_blocks=None,
            max_batch_tokens=old.max_batch_tokens,
            max_num_seqs=old.max_num_seqs,
            max_model_len=old.max_model_len,
        )
        try:
            plan = owner.replan(kept)
        except CacheDoesNotFitError:
            plan = owner.replan(kept.replace(max_batch_tokens=None))  # raises if nothing fits
        if plan.num_blocks < owner.blocks_to_finish() and plan.checkpoint_slots:
            plan = self._shed_checkpoints(kept.replace(max_batch_tokens=plan.max_batch_tokens), plan)
        caps = owner.pool_capacity
        if any(n > cap for n, cap in zip(plan.pool_blocks, caps)):
            windows = tuple((w, min(n, cap), b) for (w, n, b), cap in zip(plan.window_pools, caps[1:]))
            plan = replace(plan, num_blocks=min(plan.num_blocks, caps[0]), window_pools=windows)
        grows = plan.num_blocks > old.num_blocks
        owner.resize(plan, hold_growth=GROW_SETTLE_S > 0)
        if grows and GROW_SETTLE_S > 0:  # new admissions stay within the old cache until the budget holds
            self._settled_at = time.monotonic() + GROW_SETTLE_S
        self.resizes += 1
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

    def _shed_checkpoints(self, config, plan: MemoryPlan) -> MemoryPlan:
        """A plan that would preempt running requests (fewer blocks than they hold when finished),
        with as many of the prefix checkpoints of states as still let them all run to the end:
        each shed checkpoint's bytes go to KV blocks. With none kept and still too few blocks,
        the plan without checkpoints (the scheduler then preempts the newest, as for any model)."""
        owner = self.memory
        used = owner.blocks_to_finish()
        best = owner.replan(config.replace(state_checkpoints=0))  # the most checkpoints that keep every request
        if best.num_blocks < used:
            return best
        lo, hi = 0, plan.checkpoint_slots - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            candidate = owner.replan(config.replace(state_checkpoints=mid))
            if candidate.num_blocks >= used:
                lo, best = mid, candidate
            else:
                hi = mid - 1
        log.info(
            "memory budget shrinking: %d of %d prefix checkpoints of states shed",
            plan.checkpoint_slots - lo,
            plan.checkpoint_slots,
        )
        return best

    def _budget_bytes(self, memory: str | int | None, memory_fraction: float | None) -> int:
        if (memory is None) == (memory_fraction is None):
            raise ConfigError("memory", "give memory or memory_fraction (one of them)")
        plan = self.memory.plan
        if memory_fraction is not None:
            if not 0 < memory_fraction <= 1:
                raise ConfigError("memory_fraction", f"must be in (0, 1], got {memory_fraction}")
            held = resident_bytes()[0] + plan.api_process_bytes
            return resolve_budget(None, memory_fraction, self.device, already_used=held)[0]
        assert memory is not None
        budget = parse_memory(memory)
        if budget > total_memory():
            raise ConfigError("memory", f"{memory}: more than this machine has ({total_memory() / 2**30:.1f} GiB)")
        return budget

    # ---- the machine's budget ----------------------------------------------------------------

    def follow_machine(self) -> None:
        """With ``memory="follow"``: at most every poll interval, the budget the machine allows
        now (``memory.follow``); the engine moves to it when it changed by more than 1%."""
        watch = self.following
        if watch is None or time.monotonic() < self._next_look:
            return
        self._next_look = time.monotonic() + watch.interval_s
        budget, why = watch.budget(resident_bytes()[0], total_memory())
        old = self.memory.plan
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
            self.memory.open_admissions()
            self._settled_at = None

    def while_idle(self) -> None:
        """Called by a serving loop while nothing runs: follows the machine and, once idle for
        ``idle_release_after`` seconds, gives the cache's free pages back (once per idle spell)."""
        self.settle()
        self.follow_machine()
        owner = self.memory
        after = owner.config.idle_release_after
        steps = owner.steps
        if after is None or owner.has_unfinished() or self._released_at_step == steps:
            return
        if time.monotonic() - self._last_busy >= after:
            self.release_idle(owner.config.idle_keep_prefix_cache)
            self._released_at_step = steps

    def release_idle(self, keep_prefix_cache: bool = False) -> int:
        """``EngineMemory.release_idle``, counted and logged; returns the bytes given back."""
        before = resident_bytes()[0]
        released, kept = self.memory.release_idle(keep_prefix_cache)
        self.idle_releases += 1
        log.info(
            "idle for %.0f s: the KV cache's free pages given back (%d of %d blocks kept for the prefix cache); "
            "resident %.0f -> %.0f MiB",
            time.monotonic() - self._last_busy,
            kept,
            self.memory.blocks.num_blocks,
            before / MiB,
            (before - released) / MiB,
        )
        return released
