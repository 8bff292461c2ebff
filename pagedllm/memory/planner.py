"""The memory planner: solves the footprint polynomial (``footprint``) for what the user left
unset, under a budget (``budget``); says in GiB what does not fit and what would.

Pure arithmetic over ``ModelConfig``: no torch, no engine imports, no weights.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from functools import cached_property, partial
from typing import TYPE_CHECKING, NoReturn

from .. import backends
from ..config import ModelConfig
from ..distributed.shards import rank_config, shard_layout
from ..engine_config import ConfigError, EngineConfig
from ..errors import CacheDoesNotFitError
from ..sizes import GRAMMAR_CACHE_BYTES, QUANTIZED, ceil_div, dtype_bytes, gib, kv_element_bytes
from .budget import resolve_budget
from .footprint import (
    EngineSettings,
    RoutedExperts,
    StreamableLayers,
    activation_peak,
    kv_bytes_per_block,
    loader_bytes,
    weight_bytes,
    window_pool_blocks,
)
from .machine import usable_cpus

if TYPE_CHECKING:
    from ..backends.facts import PlanFacts

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


def overhead(s: EngineSettings) -> int:
    """OVERHEAD_BYTES, plus structured output's grammar caches at their bound when it is on."""
    return OVERHEAD_BYTES + s.grammar_cache_bytes


AUTO_MAX_NUM_SEQS = 64


@dataclass
class MemoryPlan:
    """What the process will hold at its peak, part by part, and the sizes that produce it."""

    model: str
    budget_bytes: int
    budget_source: str
    num_blocks: int
    block_size: int
    max_batch_tokens: int
    max_num_seqs: int
    max_model_len: int
    max_model_len_source: str  # "given", "the model's", or "solved: what the cache holds"
    dtype: str
    kv_dtype: str
    baseline_bytes: int
    baseline_source: str  # "measured" (RSS before loading) or "estimated"
    weights_bytes: int
    kv_cache_bytes: int
    kv_bytes_per_block: int
    activation_bytes: int
    overhead_bytes: int
    loader_bytes: int  # what loading holds above the weights, freed before the cache exists
    weights_format: str = ""  # e.g. "int4 weights, bfloat16 activations"; empty: plain dtype
    api_process_bytes: int = 0  # the server's API process, in the baseline (engine in its own process)
    tensor_parallel_size: int = 1  # above 1: this is one rank's plan (the driver's, which bounds them all)
    # speculative decoding's draft model, included in weights_bytes and kv_bytes_per_block
    draft_weights_bytes: int = 0
    draft_kv_bytes_per_block: int = 0
    # the pools of sliding-window layers beside pool 0 (``engine.block_pools``): each one's
    # window, blocks and bytes per block; and what one pool for every layer would hold instead
    window_pools: tuple[tuple[int, int, int], ...] = ()
    shared_pool_tokens: int = 0
    # a mixture whose weights exceed the budget (or expert_slots): how many of its routed experts
    # stay resident (0: all of them, loaded), of how many, each's bytes, and what a token is
    # expected to read from the file with a router that chooses uniformly (layers/expert_cache.py)
    expert_slots: int = 0
    routed_experts: int = 0
    expert_slot_bytes: int = 0
    expert_reads_per_token: int = 0
    # a dense model whose weights exceed the budget (or resident_layers): its decoder layers from
    # ``resident_layers`` on are read from the file every step into ``layer_slots`` slots of
    # ``layer_slot_bytes`` (0 slots: every layer loaded), ``layer_reads_per_step`` bytes a step
    resident_layers: int = 0
    model_layers: int = 0
    layer_slots: int = 0
    layer_slot_bytes: int = 0
    layer_reads_per_step: int = 0

    @property
    def pool_blocks(self) -> list[int]:
        """Blocks of every pool, pool 0 first (``KVCache``, ``BlockPools``)."""
        return [self.num_blocks, *(blocks for _, blocks, _ in self.window_pools)]

    @property
    def total_bytes(self) -> int:
        """The peak under load: everything resident at once."""
        return (
            self.baseline_bytes + self.weights_bytes + self.kv_cache_bytes + self.activation_bytes + self.overhead_bytes
        )

    @property
    def loading_peak_bytes(self) -> int:
        return self.baseline_bytes + self.weights_bytes + self.loader_bytes

    @property
    def headroom_bytes(self) -> int:
        return self.budget_bytes - max(self.total_bytes, self.loading_peak_bytes)

    @property
    def cache_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def full_length_requests(self) -> int:
        return self.num_blocks // ceil_div(self.max_model_len, self.block_size)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(
            total_bytes=self.total_bytes,
            loading_peak_bytes=self.loading_peak_bytes,
            headroom_bytes=self.headroom_bytes,
            cache_tokens=self.cache_tokens,
            full_length_requests=self.full_length_requests,
        )
        d["window_pools"] = [{"window": w, "blocks": n, "bytes_per_block": b} for w, n, b in self.window_pools]
        return d

    def _expert_rows(self) -> list[tuple[str, str]]:
        if not self.expert_slots:
            return []
        return [
            (
                "  experts",
                f"{gib(self.expert_slots * self.expert_slot_bytes, 8)} of them: {self.expert_slots} of the "
                f"{self.routed_experts} routed experts resident, the others read from the file when chosen "
                f"(~{self.expert_reads_per_token / 1024**2:.0f} MiB a token with a uniform router; "
                "less as the router repeats itself)",
            )
        ]

    def _layer_rows(self) -> list[tuple[str, str]]:
        if not self.layer_slots:
            return []
        streamed = self.model_layers - self.resident_layers
        return [
            (
                "  layers",
                f"{self.resident_layers} of the {self.model_layers} decoder layers resident; the other {streamed} "
                f"read from the file every step into {self.layer_slots} slot(s) of "
                f"{gib(self.layer_slot_bytes, 8)} (~{self.layer_reads_per_step / 1024**2:.0f} MiB a step)",
            )
        ]

    def table(self) -> str:
        rows = [("model", self.model)]
        if self.tensor_parallel_size > 1:
            rows.append(
                (
                    "ranks",
                    f"{self.tensor_parallel_size}: each rank's process (the figures below; rank 0, the driver, "
                    f"which also gathers the logits and samples, bounds the others); all ranks together "
                    f"{gib(self.tensor_parallel_size * self.total_bytes, 8)}",
                )
            )
        rows += [
            ("budget", f"{gib(self.budget_bytes, 8)}  ({self.budget_source}; the whole process's peak RSS)"),
            (
                "process baseline",
                f"{gib(self.baseline_bytes, 8)}  ({self.baseline_source}: Python, libraries, tokenizer)",
            ),
            (
                "weights",
                f"{gib(self.weights_bytes, 8)}  ({self.weights_format or self.dtype}"
                + (f"; the draft model's {gib(self.draft_weights_bytes, 8)})" if self.draft_weights_bytes else ")"),
            ),
            *self._expert_rows(),
            *self._layer_rows(),
            (
                "KV cache",
                f"{gib(self.kv_cache_bytes, 8)}  ({'full-attention layers: ' if self.window_pools else ''}"
                f"{self.num_blocks} blocks x {self.block_size} tokens = "
                f"{self.cache_tokens} tokens, {self.full_length_requests} requests of "
                f"{self.max_model_len} tokens ({self.max_model_len_source}); {self.kv_dtype}"
                + (
                    f"; the draft model's {self.draft_kv_bytes_per_block / 1024:.1f} KiB of each block)"
                    if self.draft_kv_bytes_per_block
                    else ")"
                ),
            ),
            *(
                (
                    f"  window {w}",
                    f"{gib(n * b, 8)}  ({n} blocks x {self.block_size} tokens = {n * self.block_size} tokens: "
                    f"the last {w} tokens of each running sequence, for its {w}-token-window layers)",
                )
                for w, n, b in self.window_pools
            ),
            *(
                [
                    (
                        "  one shared pool",
                        f"would hold {self.shared_pool_tokens} tokens in the same memory "
                        f"({self.cache_tokens / max(1, self.shared_pool_tokens):.1f}x fewer)",
                    )
                ]
                if self.window_pools
                else []
            ),
            (
                "activation peak",
                f"{gib(self.activation_bytes, 8)}  (max_batch_tokens={self.max_batch_tokens}, "
                f"max_num_seqs={self.max_num_seqs})",
            ),
            (
                "overhead",
                f"{gib(self.overhead_bytes, 8)}  (allocator, requests, buffers"
                + (
                    f", {(self.overhead_bytes - OVERHEAD_BYTES) // 1024**2} MiB of grammar caches)"
                    if self.overhead_bytes > OVERHEAD_BYTES
                    else ")"
                ),
            ),
            ("total", f"{gib(self.total_bytes, 8)}  (peak under load)"),
            (
                "loading peak",
                f"{gib(self.loading_peak_bytes, 8)}  (baseline + weights + "
                f"{self.loader_bytes // 1024**2} MiB held while loading)",
            ),
            ("headroom", gib(self.headroom_bytes, 8)),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


@dataclass(frozen=True)
class _Costs:
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

    def fixed(self, m: int, max_len: int) -> int:
        """Everything but the cache, at step budget ``m`` and context ``max_len``."""
        return (
            self.baseline + self.weights + activation_peak(self.cfg, self.s, m, self.seqs, max_len) + overhead(self.s)
        )

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


def plan(
    cfg: ModelConfig,
    budget_bytes: int,
    *,
    budget_source: str = "given",
    model_name: str = "model",
    settings: EngineSettings | None = None,
    num_blocks: int | None = None,
    max_batch_tokens: int | None = None,
    max_num_seqs: int | None = None,
    cap_blocks: int | None = None,
    baseline_bytes: int = 0,
    baseline_source: str = "not counted",
) -> MemoryPlan:
    """Solves for what the user left unset; raises CacheDoesNotFitError if nothing fits.

    ``budget_bytes`` bounds the whole process: ``baseline_bytes`` (the process before loading)
    plus everything the engine adds. N = num_blocks, M = max_batch_tokens, L = max_model_len:

    - N and M given: checked. One given: the other is the largest that fits. Neither: M =
      AUTO_MAX_BATCH_TOKENS (smaller if one block does not fit), N the largest that fits.
    - L given (``settings.max_model_len``): the cache must hold one request of L tokens, else
      the error says which L fits. L unset: the model's context, or, if the cache is smaller,
      the longest context the cache holds (a solved N is solved together with it).
    - S unset: AUTO_MAX_NUM_SEQS, or N when the cache has fewer blocks (each running sequence
      holds one, so no more ever run at once), freeing their logits and sampler rows.
    Results are integers, rounded down, never above the budget, and maximal (one more block or
    token would not fit). ``cap_blocks`` bounds a solved N (more could never be used at once)."""
    s = settings or EngineSettings()
    model_len = cfg.max_position_embeddings
    given_len = min(s.max_model_len, model_len) if s.max_model_len else None
    costs = _Costs(cfg, s, max_num_seqs or AUTO_MAX_NUM_SEQS, baseline_bytes, loader_bytes(cfg, s))
    fail = _Failure(costs, budget_bytes, budget_source, num_blocks, max_batch_tokens, given_len or model_len)
    slots, costs = _residency_plan(costs, budget_bytes, given_len, model_len, max_batch_tokens, fail)
    layer_plan, costs = _layer_residency_plan(costs, budget_bytes, given_len, model_len, max_batch_tokens, fail)
    if costs.baseline + costs.weights + overhead(s) > budget_bytes:
        fail("the process baseline and the weights alone exceed the budget")
    solve = partial(
        _solve,
        budget=budget_bytes,
        num_blocks=num_blocks,
        max_batch_tokens=max_batch_tokens,
        given_len=given_len,
        cap=cap_blocks if cap_blocks is not None else 1 << 62,
        fail=fail,
    )
    n, m, max_len = solve(costs)
    if max_num_seqs is None and n < costs.seqs:
        costs = _fewer_seqs(costs, solve)
        fail.costs = costs
        n, m, max_len = solve(costs)
    source = "given" if given_len else ("the model's" if max_len == model_len else "solved: what the cache holds")
    return MemoryPlan(
        model_name,
        budget_bytes,
        budget_source,
        n,
        s.block_size,
        m,
        costs.seqs,
        max_len,
        source,
        s.dtype,
        s.kv,
        costs.baseline,
        baseline_source,
        costs.weights,
        costs.kv(n, m),
        costs.per_block,
        activation_peak(cfg, s, m, costs.seqs, max_len),
        overhead(s),
        costs.loader,
        _weights_format(s),
        draft_weights_bytes=s.draft_weights_bytes,
        draft_kv_bytes_per_block=s.draft_kv_bytes_per_block,
        window_pools=tuple((w, n_w, b) for (w, b), n_w in zip(costs.windows, costs.window_blocks(n, m))),
        shared_pool_tokens=costs.shared_pool_tokens(budget_bytes, m, max_len),
        **_residency(cfg, s.routed_experts, slots),
        **_layer_residency(s.streamable_layers, layer_plan),
    )


def _residency_plan(
    costs: _Costs, budget: int, given_len: int | None, model_len: int, max_batch_tokens: int | None, fail
) -> tuple[int, _Costs]:
    """(how many routed experts stay resident, the costs with only those among the weights, which
    the failure's figures take too): 0 (all loaded) unless ``expert_slots`` bounds them or every
    expert resident leaves no room for one request of ``context`` tokens (min(the model's, 4096)
    unless max_model_len says)."""
    s, experts = costs.s, costs.s.routed_experts
    context = given_len or min(model_len, EXPERT_CACHE_CONTEXT)
    m = max_batch_tokens or AUTO_MAX_BATCH_TOKENS
    if experts is None:
        return 0, costs
    one_request = costs.kv(ceil_div(context, s.block_size), m) + activation_peak(costs.cfg, s, m, costs.seqs, context)
    if not s.expert_slots and costs.baseline + costs.weights + overhead(s) + one_request <= budget:
        return 0, costs
    slots = _expert_slots(costs, experts, budget, context, m, fail)
    if slots >= experts.count:
        return 0, costs
    resident = costs.weights - s.draft_weights_bytes - experts.total_bytes
    fail.costs = replace(costs, s=replace(s, weights_bytes=resident + slots * experts.slot_bytes))
    return slots, fail.costs


def _expert_slots(costs: _Costs, experts: RoutedExperts, budget: int, context: int, m: int, fail) -> int:
    """How many routed experts stay resident: the user's bound, else as many as the budget holds
    beside everything else with a cache for one request of ``context`` tokens (the solve then
    gives the cache what is left); fewer than the floor does not plan."""
    s = costs.s
    if s.expert_slots is not None:
        if s.expert_slots < experts.floor:
            fail(
                f"expert_slots={s.expert_slots} is below the {experts.floor} experts a step's layer may choose at once"
            )
        return s.expert_slots
    resident = costs.weights - experts.total_bytes
    kv = costs.kv(ceil_div(context, s.block_size), m)
    need = costs.baseline + resident + activation_peak(costs.cfg, s, m, costs.seqs, context) + overhead(s) + kv
    slots = max(0, budget - need) // experts.slot_bytes
    if slots < experts.floor:  # the figures the error gives: with the smallest expert cache
        fail.costs = replace(costs, s=replace(s, weights_bytes=resident + experts.floor * experts.slot_bytes))
        fail(
            f"the weights exceed the budget, and beside what every token reads the budget holds {slots} of the "
            f"{experts.count} routed experts, fewer than the {experts.floor} a step's layer may choose at once"
        )
    return slots


def _residency(cfg: ModelConfig, experts: RoutedExperts | None, slots: int) -> dict:
    """MemoryPlan's expert fields."""
    if not slots or experts is None or cfg.moe is None:
        return {}
    chosen_per_token = cfg.moe.top_k * sum(cfg.moe.layers)
    missed = chosen_per_token * (experts.count - slots) / experts.count
    return {
        "expert_slots": slots,
        "routed_experts": experts.count,
        "expert_slot_bytes": experts.slot_bytes,
        "expert_reads_per_token": int(missed * experts.slot_bytes),
    }


def _all_resident_else_streamed(cfg: ModelConfig, budget: int, *, settings: EngineSettings, **arguments) -> MemoryPlan:
    """The plan with every layer resident; where that does not fit, with the last layers read
    from the file every step (as many resident as fit); where neither does, the first's error."""
    try:
        return plan(cfg, budget, settings=replace(settings, streamable_layers=None), **arguments)
    except CacheDoesNotFitError as refused:
        try:
            return plan(cfg, budget, settings=replace(settings, resident_layers=-1), **arguments)  # -1: solve
        except CacheDoesNotFitError:
            raise refused from None


def _layer_residency_plan(
    costs: _Costs, budget: int, given_len: int | None, model_len: int, max_batch_tokens: int | None, fail
) -> tuple[tuple[int, int], _Costs]:
    """((resident layers, slots), the costs with only those among the weights) where a dense
    model's last layers are read from the file every step; ((0, 0), costs) where all load.

    Every step reads every streamed layer, so no cache of layers helps: as many whole layers stay
    resident as fit beside a cache for one request of ``context`` tokens (the solve then gives the
    KV cache what is left), the first ones, and the others take turns in two slots (one read
    ahead while the other computes), or one where two do not fit. ``plan`` asks this only where
    every layer resident does not plan, or ``resident_layers`` says how many stay (-1: solve)."""
    s, layers = costs.s, costs.s.streamable_layers
    if layers is None or s.resident_layers is None:
        return (0, 0), costs
    sizes, count = layers.layer_bytes, len(layers.layer_bytes)
    if 0 <= s.resident_layers < count:
        resident, slots = s.resident_layers, min(2, count - s.resident_layers)
    elif s.resident_layers >= count:
        return (0, 0), costs
    else:
        context = given_len or min(model_len, EXPERT_CACHE_CONTEXT)
        m = max_batch_tokens or AUTO_MAX_BATCH_TOKENS
        one_request = costs.kv(ceil_div(context, s.block_size), m)
        one_request += activation_peak(costs.cfg, s, m, costs.seqs, context)
        room = budget - (costs.baseline + costs.weights - sum(sizes) + overhead(s) + one_request)
        fits = [(r, k) for k in (2, 1) for r in range(count - k, -1, -1) if _held(sizes, r, k) <= room]
        if not fits:
            fail.costs = replace(costs, s=replace(s, weights_bytes=costs.weights - sum(sizes) + max(sizes)))
            fail(
                "the weights exceed the budget, and beside what every step reads the budget holds no slot for one "
                f"decoder layer read from the file ({max(sizes) / 1024**2:.0f} MiB) with a cache for {context} tokens"
            )
        resident, slots = fits[0]
    weights = costs.weights - sum(sizes) + _held(sizes, resident, slots)
    fail.costs = replace(costs, s=replace(s, weights_bytes=weights))
    return (resident, slots), fail.costs


def _held(sizes: tuple[int, ...], resident: int, slots: int) -> int:
    """The layers' bytes in memory with the first ``resident`` loaded and the rest in ``slots`` slots."""
    return sum(sizes[:resident]) + slots * max(sizes[resident:])


def _layer_residency(layers: StreamableLayers | None, layer_plan: tuple[int, int]) -> dict:
    """MemoryPlan's layer fields."""
    resident, slots = layer_plan
    if not slots or layers is None:
        return {}
    streamed = layers.layer_bytes[resident:]
    return {
        "resident_layers": resident,
        "model_layers": len(layers.layer_bytes),
        "layer_slots": slots,
        "layer_slot_bytes": max(streamed),
        "layer_reads_per_step": sum(streamed),
    }


def _windowed(pools: tuple[int | None, ...]) -> list[tuple[int, int]]:
    return [(p, w) for p, w in enumerate(pools) if p > 0 and w is not None]


def _fewer_seqs(costs: _Costs, solve) -> _Costs:
    """Every running sequence holds a block, so no more than N ever run at once: a solved
    max_num_seqs above N only reserves logits and sampler rows that never exist. The largest S
    whose cache still has S blocks (fewer rows reserved, more blocks)."""
    lo, hi = 1, costs.seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if solve(replace(costs, seqs=mid))[0] >= mid:
            lo = mid
        else:
            hi = mid - 1
    return replace(costs, seqs=lo)


def _weights_format(s: EngineSettings) -> str:
    if not s.quantized_weights:
        return ""
    kind = s.quantization if s.quantization in QUANTIZED else "quantized as stored"
    return f"{kind} weights, {s.dtype} activations"


def _solve(
    costs: _Costs,
    *,
    budget: int,
    num_blocks: int | None,
    max_batch_tokens: int | None,
    given_len: int | None,
    cap: int,
    fail: _Failure,
) -> tuple[int, int, int]:
    """(N, M, L) for one max_num_seqs: see ``plan``."""
    s, model_len = costs.s, costs.cfg.max_position_embeddings
    max_len = given_len or model_len
    if num_blocks is not None:
        n = num_blocks
        if given_len is None:
            max_len = min(model_len, n * s.block_size)
        m = max_batch_tokens or costs.largest_m(budget, n, max_len, max(1, budget))
        if m == 0:
            fail(f"num_blocks={num_blocks} leaves no room for even one token per step")
    else:
        # With a given L, the largest M under AUTO that still fits its request; if none does,
        # the M that fits one block, so the error below is about the context, not the step.
        m = max_batch_tokens or _auto_m(costs, budget, max_len if given_len else 1) or _auto_m(costs, budget, 1)
        if m == 0:
            fail("not even one block and one token per step fit")
        if given_len is None:
            max_len = costs.longest_context(budget, m, model_len)
            if max_len == 0:
                fail(f"max_batch_tokens={m} leaves no room for even one block")
        n = min(cap, costs.largest_n(budget, m, max_len))
    if costs.total(n, m, max_len) > budget:
        fail("the requested sizes exceed the budget", n=n, m=m)
    if n * s.block_size < max_len:
        fail(
            f"the KV cache ({n} blocks x {s.block_size} = {n * s.block_size} tokens) cannot hold one request of "
            f"max_model_len={max_len} tokens ({ceil_div(max_len, s.block_size)} blocks)",
            n=n,
            m=m,
        )
    return n, m, max_len


def _auto_m(costs: _Costs, budget: int, min_tokens: int) -> int:
    """AUTO_MAX_BATCH_TOKENS, or the largest M below it with which a cache of ``min_tokens``
    still fits (0 if none)."""
    blocks = ceil_div(min_tokens, costs.s.block_size)
    return costs.largest_m(budget, blocks, max(min_tokens, costs.s.block_size), AUTO_MAX_BATCH_TOKENS)


class _Failure:
    """Raises CacheDoesNotFitError with one consistent set of numbers: what was asked (or the
    smallest engine that serves one request of L tokens), what each part of it needs, and the
    largest values that fit instead, all from the same ``_Costs``."""

    def __init__(
        self,
        costs: _Costs,
        budget: int,
        source: str,
        num_blocks: int | None,
        max_batch_tokens: int | None,
        max_len: int,
    ):
        self.costs, self.budget, self.source = costs, budget, source
        self.num_blocks, self.max_batch_tokens, self.max_len = num_blocks, max_batch_tokens, max_len

    def __call__(self, reason: str, n: int | None = None, m: int | None = None) -> NoReturn:
        c, s, budget, max_len = self.costs, self.costs.s, self.budget, self.max_len
        min_blocks = ceil_div(max_len, s.block_size)
        m = m or self.max_batch_tokens or AUTO_MAX_BATCH_TOKENS
        n = max(n or self.num_blocks or 0, min_blocks)
        act = activation_peak(c.cfg, s, m, c.seqs, max_len)
        need = c.total(n, m, max_len)
        breakdown = {
            "baseline": c.baseline,
            "weights": c.weights,
            "kv_cache": c.kv(n, m),
            "activations": act,
            "overhead": overhead(s),
            "total": need,
            "budget": budget,
        }
        suggestions: dict = {"memory_bytes": need}
        lines = [
            f"{reason}.",
            f"  needs {gib(need)}: process baseline {gib(c.baseline)} + weights {gib(c.weights)} ({s.dtype}) + "
            f"KV cache {gib(c.kv(n, m))} ({n} blocks x {s.block_size} tokens) + activations {gib(act)} "
            f"(max_batch_tokens={m}, max_num_seqs={c.seqs}, max_model_len={max_len}) + overhead "
            f"{gib(overhead(s))}",
            f"  budget: {gib(budget)} ({self.source})",
        ]
        if c.baseline + c.weights + overhead(s) <= budget:
            if self.num_blocks is not None:
                best_m = c.largest_m(budget, self.num_blocks, max_len, m * 64)
                if best_m:
                    suggestions["max_batch_tokens"] = best_m
                    lines.append(f"  largest max_batch_tokens that fits with num_blocks={self.num_blocks}: {best_m}")
            best_n = c.largest_n(budget, m, max_len)
            if best_n:
                suggestions["num_blocks"] = best_n
                lines.append(
                    f"  largest num_blocks that fits with max_batch_tokens={m}: {best_n} "
                    f"({best_n * s.block_size} tokens)"
                )
            fits_len = c.longest_context(budget, m, max_len)
            if self.num_blocks is not None:  # the cache the user gave holds no more than its blocks
                fits_len = min(fits_len, self.num_blocks * s.block_size)
            if 0 < fits_len < max_len:  # 0: no context fits at this step budget
                suggestions["max_model_len"] = fits_len
                lines.append(f"  longest max_model_len whose request fits with max_batch_tokens={m}: {fits_len}")
        lines.append(
            f"  smallest memory that fits (num_blocks={n}, max_batch_tokens={m}, max_model_len={max_len}): {gib(need)}"
        )
        levers = []
        if kv_element_bytes(s.kv) > 1:
            levers.append("an 8-bit KV cache (kv_cache_dtype='fp8' or 'int8') holds 2-4x the tokens")
        if s.quantization in (None, "none") and s.weights_bytes is None:
            levers.append("quantization='int8' or 'int4' shrinks the weights 2-8x")
        if dtype_bytes(s.dtype) == 4:
            levers.append("dtype='bfloat16' halves the weights")
        levers.append("a smaller max_model_len shrinks the smallest cache and the gather buffers")
        levers.append("block_size does not change bytes per token, only the rounding")
        lines.append("  other levers: " + "; ".join(levers))
        raise CacheDoesNotFitError("\n".join(lines), breakdown, suggestions)


def _one_rank(
    cfg: ModelConfig, c: EngineConfig, weights_bytes: int | None, quantized_weights: bool | None
) -> tuple[ModelConfig, dict]:
    """The config one of ``c.tensor_parallel_size`` ranks runs, and the EngineSettings fields of
    the split (none at tp=1): the driver gathers every rank's logits, the padded vocabulary wide.
    Weights stored quantized are sized from the checkpoint's header (``weights_bytes``, the
    rank's share)."""
    tp = c.tensor_parallel_size
    if tp == 1:
        return cfg, {}
    if quantized_weights and c.quantization not in QUANTIZED and weights_bytes is None:
        raise ConfigError(
            "tensor_parallel_size", "planning a split of weights stored quantized (a GGUF) needs the checkpoint"
        )
    return rank_config(cfg, tp), {"tensor_parallel": tp, "gathered_vocab": shard_layout(cfg, tp).padded_vocab}


def plan_engine(
    cfg: ModelConfig,
    config: EngineConfig | None = None,
    *,
    model_name: str = "model",
    backend: PlanFacts | None = None,
    baseline_bytes: int | None = None,
    already_loaded: int = 0,
    weights_bytes: int | None = None,
    quantized_weights: bool | None = None,
    grammar_cache_bytes: int = 0,
    api_process_bytes: int = 0,
    draft: tuple[ModelConfig, int] | None = None,
    routed: RoutedExperts | None = None,
    layers: StreamableLayers | None = None,
) -> MemoryPlan:
    """The plan an engine starts from: the budget, then ``plan``. Everything the user chose is in
    ``config`` (default: ``EngineConfig()``); the rest are facts of this process and checkpoint.

    ``config.memory`` bounds the whole process, ``baseline_bytes`` (its resident memory before any
    weight is loaded; estimated when not given) included. ``config.memory_fraction`` is a fraction
    of the memory free now (host or container), which the baseline has already taken, so the process
    may reach ``baseline + fraction x free``. ``already_loaded``: weights the caller holds already,
    counted as free. ``backend``: the kernels, the bf16 GEMMs' kind and whether quantized rows run
    on AMX tiles (``Backend.plan_facts``; default: ``backends.facts``, the device's own guess
    without torch). ``weights_bytes``: the weights' exact size when the checkpoint is at hand (else
    computed from the config; with ``tensor_parallel_size`` > 1, one rank's share);
    ``quantized_weights``: whether they run quantized (default: when ``config.quantization`` says
    so). With no budget given, a solved cache is capped at what ``max_num_seqs`` requests of
    ``max_model_len`` tokens can use at once, so a small model does not reserve the whole host.
    ``grammar_cache_bytes``: the bound of structured output's caches (when it is on), counted in the
    overhead. ``api_process_bytes``: the peak of the server's API process when the engine runs in
    its own (``engine_process``): the budget bounds the sum of both processes, so it joins the
    baseline. ``draft``: a draft model's config and weights' bytes. ``routed``: a mixture's
    routed experts as the checkpoint stores them (``loading.routed_experts``), which may then stay
    in the file when the weights exceed the budget (or ``config.expert_slots`` bounds them).
    ``layers``: a dense model's layers as stored (``loading.streamable_layers``): the last ones
    may then be read from the file every step, where every layer resident does not plan (or
    ``config.resident_layers`` says how many stay).
    """
    c = config or EngineConfig()
    cfg, split = _one_rank(cfg, c, weights_bytes, quantized_weights)
    baseline = (baseline_bytes if baseline_bytes is not None else ESTIMATED_BASELINE_BYTES) + api_process_bytes
    budget, source = resolve_budget(
        c.memory, c.memory_fraction, "cpu" if backend is None else backend.device, already_loaded
    )
    if c.memory is None:
        budget, source = budget + baseline, f"{source} + the process baseline"
    settings = _settings(c, backend, weights_bytes, quantized_weights, grammar_cache_bytes, split)
    if routed is not None and c.tensor_parallel_size == 1:
        settings = replace(settings, routed_experts=routed, expert_slots=c.expert_slots)
    if layers is not None and c.tensor_parallel_size == 1:
        settings = replace(settings, streamable_layers=layers, resident_layers=c.resident_layers)
    if draft is not None:
        settings = _with_draft(settings, cfg, *draft)
    seqs = c.max_num_seqs or AUTO_MAX_NUM_SEQS
    longest = min(c.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
    cap = seqs * ceil_div(longest, c.block_size) if not c.budgeted else None
    measured_source = "measured" if baseline_bytes is not None else "estimated"
    if api_process_bytes:
        measured_source += f", with the API process's {api_process_bytes / 1024**2:.0f} MiB"
    solver = _all_resident_else_streamed if settings.streamable_layers and c.resident_layers is None else plan
    result = solver(
        cfg,
        budget,
        budget_source=source,
        model_name=model_name,
        settings=settings,
        num_blocks=c.num_blocks,
        max_batch_tokens=c.max_batch_tokens,
        max_num_seqs=c.max_num_seqs,
        cap_blocks=cap,
        baseline_bytes=baseline,
        baseline_source=measured_source,
    )
    return replace(result, api_process_bytes=api_process_bytes, tensor_parallel_size=c.tensor_parallel_size)


def plan_for(
    config: EngineConfig,
    cfg: ModelConfig,
    model_name: str,
    facts: PlanFacts,
    *,
    grammars: bool,
    weights_bytes: int | None,
    quantized_weights: bool | None,
    baseline_bytes: int,
    already_loaded: int = 0,
    api_process_bytes: int = 0,
    draft: tuple[ModelConfig, int] | None = None,
    routed: RoutedExperts | None = None,
    layers: StreamableLayers | None = None,
) -> MemoryPlan:
    """The one way an engine is planned (``build_engine`` before loading, ``LLMEngine`` after, and
    again at each new budget): the config, the backend's facts, the checkpoint's weights, the
    structured-output caches when they can be used (``grammars``: on, with a tokenizer and
    xgrammar), the server's API process when the engine runs in a process of its own
    (``api_process_bytes``), a draft model's config and weights (``draft``)."""
    return plan_engine(
        cfg,
        config,
        model_name=model_name,
        backend=facts,
        baseline_bytes=baseline_bytes,
        already_loaded=already_loaded,
        weights_bytes=weights_bytes,
        quantized_weights=quantized_weights,
        grammar_cache_bytes=GRAMMAR_CACHE_BYTES if grammars else 0,
        api_process_bytes=api_process_bytes,
        draft=draft,
        routed=routed,
        layers=layers,
    )


def _settings(
    c: EngineConfig,
    backend: PlanFacts | None,
    weights_bytes: int | None,
    quantized_weights: bool | None,
    grammar_cache_bytes: int,
    split: dict,
) -> EngineSettings:
    """What the footprint depends on, from the user's config and this process's facts."""
    assumed = backends.facts(c.backend, c.dtype)  # `pagedllm plan`: the device's facts, without torch
    facts = backend or assumed
    isa = facts.gemm_kind or assumed.gemm_kind or "avx2"
    settings = EngineSettings(
        dtype=c.dtype,
        kv_dtype=c.kv_cache_dtype,
        block_size=c.block_size,
        max_model_len=c.max_model_len,
        device=facts.device,
        gemm_isa=isa,
        kernels=facts.kernels,
        threads=c.threads or usable_cpus(),
        quantization=c.quantization,
        weights_bytes=weights_bytes,  # one rank's when split (``checkpoint_weights`` with its shard)
        quantized_weights=c.quantization in QUANTIZED if quantized_weights is None else quantized_weights,
        packed=backends.workspace(facts.device).packs_weights(isa, c.dtype),
        amx_tiles=facts.amx_tiles,
        quant_float_max_rows=facts.quant_float_max_rows,
        grammar_cache_bytes=grammar_cache_bytes,
        **split,
    )
    return settings


def _with_draft(s: EngineSettings, cfg: ModelConfig, draft: ModelConfig, draft_weights: int) -> EngineSettings:
    """The settings with a draft model's weights and its K/V beside each block. The plan bounds
    the draft's passes by the model's activation term: so no width of the draft may exceed the
    model's (a draft is the smaller model anyway)."""
    widths = {
        "hidden_size": (draft.hidden_size, cfg.hidden_size),
        "intermediate_size": (draft.intermediate_size, cfg.intermediate_size),
        "attention width": (draft.num_heads * draft.head_dim, cfg.num_heads * cfg.head_dim),
        "vocab_size": (draft.vocab_size, cfg.vocab_size),
    }
    wider = [f"{name} {mine} > {theirs}" for name, (mine, theirs) in widths.items() if mine > theirs]
    if wider:
        raise ConfigError("draft_model", "the draft model is wider than the model: " + ", ".join(wider))
    return replace(
        s, draft_weights_bytes=draft_weights, draft_kv_bytes_per_block=kv_bytes_per_block(draft, s.block_size, s.kv)
    )
