"""The footprint of one configuration as the solver and its refusals see it (``Costs``), and the
constants the planner sizes an engine by when the user leaves a size unset."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from ..config import ModelConfig
from .footprint import EngineSettings, activation_peak, kv_bytes_per_block, weight_bytes, window_pool_blocks

# What the process holds beyond the tensors the footprint itemises, under load: library code
# paged in by the first steps, the allocator's kept memory, the capped GEMM kernel caches,
# per-request Python state, the server's buffers. The baseline is measured after the library
# pages are handed back (machine.release_library_pages), so the libraries' working set is paged
# in here: 37-83 MiB measured under the 64-prompt workload (docs/memory.md, "The whole
# process"); 100 MiB leaves a margin.
OVERHEAD_BYTES = 100 * 1024**2
# The process before any weight is loaded, when there is none to measure (``pagedllm plan``):
# Python with torch, transformers and a tokenizer, measured on this machine (docs/memory.md).
ESTIMATED_BASELINE_BYTES = 320 * 1024**2
# CPU throughput vs max_batch_tokens flattens out by 512 tokens per step on this class of
# machine (docs/memory.md has the sweep); larger steps only cost memory.
AUTO_MAX_BATCH_TOKENS = 512
# The context a residency plan keeps a cache for (one request), unless max_model_len says: the
# rest of the budget goes to the expert cache, and the solve gives the KV cache what is left.
EXPERT_CACHE_CONTEXT = 4096

# checkpoints of states kept for prefixes, per sequence that may run (a planned, evictable pool)
STATE_CHECKPOINTS_PER_SEQUENCE = 1


# the prefix cache's disk tier (engine.disk_prefix_cache): blocks copied out, not yet written, at most
DISK_TIER_WRITE_BUFFER_BYTES = 32 * 1024**2


def overhead(s: EngineSettings) -> int:
    """OVERHEAD_BYTES, plus structured output's grammar caches at their bound when it is on and
    the disk tier's buffers when there is one."""
    return OVERHEAD_BYTES + s.grammar_cache_bytes + s.disk_tier_bytes


AUTO_MAX_NUM_SEQS = 64


@dataclass(frozen=True)
class Costs:
    """The footprint of one configuration, as the solver and the error messages see it."""

    cfg: ModelConfig
    s: EngineSettings
    seqs: int
    baseline: int
    loader: int

    @property
    def weights(self) -> int:
        """The model's weights, and a draft model's beside them."""
        if self.s.weights_bytes is not None:
            return self.s.weights_bytes + self.s.draft_weights_bytes
        return weight_bytes(self.cfg, self.s.dtype, self.s.quantization) + self.s.draft_weights_bytes

    @property
    def per_block(self) -> int:
        """A block of pool 0 (every layer, when there is one kind), and one of a draft model's
        (it holds as many)."""
        pool = 0 if len(self.cfg.kv_pools) > 1 else None
        return kv_bytes_per_block(self.cfg, self.s.block_size, self.s.kv, pool) + self.s.draft_kv_bytes_per_block

    @cached_property  # (the solver asks once per candidate N)
    def windows(self) -> list[tuple[int, int]]:
        """(window, bytes per block) of each pool beside pool 0 (pools past 0 have windows)."""
        pools = self.cfg.kv_pools
        return [(w, kv_bytes_per_block(self.cfg, self.s.block_size, self.s.kv, p)) for p, w in _windowed(pools)]

    def window_blocks(self, n: int, m: int) -> list[int]:
        """Each window pool's blocks beside N blocks of pool 0: what its sequences can hold at
        once, and never more than pool 0 (a sequence holds a window block only where it holds a
        pool 0 one)."""
        return [min(n, window_pool_blocks(w, self.s.block_size, m, self.seqs)) for w, _ in self.windows]

    def kv(self, n: int, m: int) -> int:
        """The cache's bytes with N blocks of pool 0, the window pools beside it."""
        return n * self.per_block + sum(b * blocks for (_, b), blocks in zip(self.windows, self.window_blocks(n, m)))

    @property
    def checkpoint_slots(self) -> int:
        """Checkpoints of states kept for prefixes (``engine.state_checkpoints``): the user's
        number, else STATE_CHECKPOINTS_PER_SEQUENCE per sequence; none without states."""
        if not self.cfg.state_bytes_per_sequence():
            return 0
        given = self.s.state_checkpoints
        return self.seqs * STATE_CHECKPOINTS_PER_SEQUENCE if given is None else given

    @property
    def states(self) -> int:
        """The fixed state of every sequence that may run at once (``SequenceState`` layers), and
        the checkpoints of states kept for prefixes, each as large."""
        return (self.seqs + self.checkpoint_slots) * self.cfg.state_bytes_per_sequence()

    def fixed(self, m: int, max_len: int) -> int:
        """Everything but the paged cache, at step budget ``m`` and context ``max_len``."""
        activations = activation_peak(self.cfg, self.s, m, self.seqs, max_len)
        return self.baseline + self.weights + self.states + activations + overhead(self.s)

    def total(self, n: int, m: int, max_len: int) -> int:
        return self.fixed(m, max_len) + self.kv(n, m)

    def largest_n(self, budget: int, m: int, max_len: int) -> int:
        room = budget - self.fixed(m, max_len)
        lo, hi = 0, max(0, room // self.per_block)  # kv(n) grows with n, by per_block at least
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.kv(mid, m) <= room:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def shared_pool_tokens(self, budget: int, m: int, max_len: int) -> int:
        """What one pool for every layer would hold in the same budget (0 with one kind of layer)."""
        if not self.windows:
            return 0
        every_layer = kv_bytes_per_block(self.cfg, self.s.block_size, self.s.kv) + self.s.draft_kv_bytes_per_block
        return max(0, (budget - self.fixed(m, max_len)) // every_layer) * self.s.block_size

    def largest_m(self, budget: int, n: int, max_len: int, cap: int) -> int:
        """Largest M in [1, cap] with total(n, M) <= budget (0 if none)."""
        if self.total(n, 1, max_len) > budget:
            return 0
        lo, hi = 1, cap
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.total(n, mid, max_len) <= budget:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def longest_context(self, budget: int, m: int, limit: int) -> int:
        """Largest L in [block_size, limit], a whole number of blocks unless it is the limit,
        such that the cache that fits holds one request of L tokens (0 if none)."""
        bs = self.s.block_size

        def holds(length: int) -> bool:
            return self.largest_n(budget, m, length) * bs >= length

        if holds(limit):
            return limit
        lo, hi = 0, limit // bs  # in blocks
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if holds(mid * bs):
                lo = mid
            else:
                hi = mid - 1
        return lo * bs


def _windowed(pools: tuple[int | None, ...]) -> list[tuple[int, int]]:
    return [(p, w) for p, w in enumerate(pools) if p > 0 and w is not None]
