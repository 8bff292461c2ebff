"""The memory planner: solves the footprint polynomial (``footprint``) for what the user left
unset, under a budget (``budget``); says in GiB what does not fit and what would.

Pure arithmetic over ``ModelConfig``: no torch, no engine imports, no weights.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..config import ModelConfig
from ..errors import CacheDoesNotFitError
from ..sizes import ceil_div, dtype_bytes, gib
from .budget import resolve_budget
from .footprint import EngineSettings, activation_peak, kv_bytes_per_block, weight_bytes
from .machine import cpu_has_amx

# Kept out of the cache for what the footprint does not itemise: per-request Python state,
# tokenizer buffers, allocator rounding.
FIXED_BYTES = 16 * 1024**2
# CPU throughput vs max_batch_tokens flattens out by 512 tokens per step on this class of
# machine (docs/memory.md has the sweep); larger steps only cost memory.
AUTO_MAX_BATCH_TOKENS = 512
AUTO_MAX_NUM_SEQS = 64


@dataclass
class MemoryPlan:
    model: str
    budget_bytes: int
    budget_source: str
    num_blocks: int
    block_size: int
    max_batch_tokens: int
    max_num_seqs: int
    max_model_len: int
    dtype: str
    kv_dtype: str
    weights_bytes: int
    kv_cache_bytes: int
    kv_bytes_per_block: int
    activation_bytes: int
    fixed_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_cache_bytes + self.activation_bytes + self.fixed_bytes

    @property
    def headroom_bytes(self) -> int:
        return self.budget_bytes - self.total_bytes

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
            headroom_bytes=self.headroom_bytes,
            cache_tokens=self.cache_tokens,
            full_length_requests=self.full_length_requests,
        )
        return d

    def table(self) -> str:
        rows = [
            ("model", self.model),
            ("budget", f"{gib(self.budget_bytes, 8)}  ({self.budget_source})"),
            ("weights", f"{gib(self.weights_bytes, 8)}  ({self.dtype})"),
            (
                "KV cache",
                f"{gib(self.kv_cache_bytes, 8)}  ({self.num_blocks} blocks x {self.block_size} tokens = "
                f"{self.cache_tokens} tokens, {self.full_length_requests} requests of "
                f"{self.max_model_len} tokens; {self.kv_dtype})",
            ),
            (
                "activation peak",
                f"{gib(self.activation_bytes, 8)}  (max_batch_tokens={self.max_batch_tokens}, "
                f"max_num_seqs={self.max_num_seqs})",
            ),
            ("fixed", gib(self.fixed_bytes, 8)),
            ("total", gib(self.total_bytes, 8)),
            ("headroom", gib(self.headroom_bytes, 8)),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


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
) -> MemoryPlan:
    """Solves for what the user left unset; raises CacheDoesNotFitError if nothing fits.

    Neither N nor M: M = AUTO_MAX_BATCH_TOKENS (or the largest that fits), the rest to N.
    N set: the largest M. M set: the largest N. Both: check. Results are integers, rounded down,
    never above the budget, and maximal: one more block or one more token would not fit.
    ``cap_blocks`` bounds a solved N (blocks beyond what can ever be used at once are waste).
    """
    s = settings or EngineSettings()
    max_len = min(s.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
    seqs = max_num_seqs or AUTO_MAX_NUM_SEQS
    weights = weight_bytes(cfg, s.dtype)
    per_block = kv_bytes_per_block(cfg, s.block_size, s.kv)
    min_blocks = ceil_div(max_len, s.block_size)  # one request of max_model_len must fit

    def act(m: int) -> int:
        return activation_peak(cfg, s, m, seqs, max_len)

    def fixed_for(m: int) -> int:
        return weights + act(m) + FIXED_BYTES

    def largest_m(blocks: int, cap: int) -> int:
        """Largest M in [1, cap] with fixed_for(M) + blocks * per_block <= budget (0 if none)."""
        room = budget_bytes - blocks * per_block
        if fixed_for(1) > room:
            return 0
        lo, hi = 1, cap
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if fixed_for(mid) <= room:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def largest_n(m: int) -> int:
        return max(0, (budget_bytes - fixed_for(m)) // per_block)

    context = dict(
        cfg=cfg,
        s=s,
        budget=budget_bytes,
        source=budget_source,
        weights=weights,
        per_block=per_block,
        max_len=max_len,
        seqs=seqs,
        act=act,
        largest_m=largest_m,
        largest_n=largest_n,
        min_blocks=min_blocks,
    )
    if weights + FIXED_BYTES > budget_bytes:
        _raise(context, "the weights alone exceed the budget", num_blocks, max_batch_tokens or 1)
    cap = cap_blocks if cap_blocks is not None else 1 << 62
    if num_blocks is not None and max_batch_tokens is not None:
        n, m = num_blocks, max_batch_tokens
    elif num_blocks is not None:
        n, m = num_blocks, largest_m(num_blocks, max(1, budget_bytes))
        if m == 0:
            _raise(context, f"num_blocks={num_blocks} leaves no room for even one token per step", n, 1)
    elif max_batch_tokens is not None:
        m, n = max_batch_tokens, min(cap, largest_n(max_batch_tokens))
    else:
        m = largest_m(min_blocks, AUTO_MAX_BATCH_TOKENS)
        if m == 0:  # not even one full-length request fits, whatever the step size
            n = largest_n(1)
            _raise(
                context,
                f"the KV cache that fits ({n} blocks x {s.block_size} = {n * s.block_size} tokens) "
                f"cannot hold one request of max_model_len={max_len} tokens ({min_blocks} blocks): "
                f"set max_model_len <= {n * s.block_size}, or give more memory",
                None,
                AUTO_MAX_BATCH_TOKENS,
                {"max_model_len": n * s.block_size},
            )
        n = min(cap, largest_n(m))
    if fixed_for(m) + n * per_block > budget_bytes:
        _raise(context, "the requested sizes exceed the budget", n, m)
    if n < min_blocks:
        _raise(
            context,
            f"the KV cache ({n} blocks x {s.block_size} = {n * s.block_size} tokens) cannot hold "
            f"one request of max_model_len={max_len} tokens ({min_blocks} blocks): set "
            f"max_model_len <= {n * s.block_size}, or num_blocks >= {min_blocks}",
            num_blocks,
            m,
            {"max_model_len": n * s.block_size},
        )
    return MemoryPlan(
        model_name,
        budget_bytes,
        budget_source,
        n,
        s.block_size,
        m,
        seqs,
        max_len,
        s.dtype,
        s.kv,
        weights,
        n * per_block,
        per_block,
        act(m),
        FIXED_BYTES,
    )


def _raise(c: dict, reason: str, num_blocks: int | None, m: int, extra: dict | None = None) -> None:
    per_block, budget, max_len, s = c["per_block"], c["budget"], c["max_len"], c["s"]
    n = max(num_blocks if num_blocks is not None else 0, c["min_blocks"])
    act = c["act"](m)
    need = c["weights"] + n * per_block + act + FIXED_BYTES
    breakdown = {
        "weights": c["weights"],
        "kv_cache": n * per_block,
        "activations": act,
        "fixed": FIXED_BYTES,
        "total": need,
        "budget": budget,
    }
    suggestions: dict = dict(extra or {})
    lines = [
        f"{reason}.",
        f"  needs {gib(need)}: weights {gib(c['weights'])} ({s.dtype}) + KV cache {gib(n * per_block)} "
        f"({n} blocks x {s.block_size} tokens) + activations {gib(act)} (max_batch_tokens={m}, "
        f"max_num_seqs={c['seqs']}) + fixed {gib(FIXED_BYTES)}",
        f"  budget: {gib(budget)} ({c['source']})",
    ]
    if c["weights"] + FIXED_BYTES <= budget and num_blocks is not None:
        best_m = c["largest_m"](num_blocks, max(m, 1) * 64)
        if best_m:
            suggestions["max_batch_tokens"] = best_m
            lines.append(f"  largest max_batch_tokens that fits with num_blocks={num_blocks}: {best_m}")
    if c["weights"] + FIXED_BYTES <= budget:
        best_n = c["largest_n"](m)
        if best_n:
            suggestions["num_blocks"] = best_n
            fits_len = best_n * s.block_size
            lines.append(
                f"  largest num_blocks that fits with max_batch_tokens={m}: {best_n} "
                f"({fits_len} tokens{'' if fits_len >= max_len else f'; max_model_len must be <= {fits_len}'})"
            )
            if best_n < c["min_blocks"]:
                suggestions.setdefault("max_model_len", fits_len)
    suggestions["memory_bytes"] = need
    lines.append(f"  smallest memory that fits (num_blocks={n}, max_batch_tokens={m}): {gib(need)}")
    levers = []
    if dtype_bytes(s.kv) == 4:
        levers.append("a bfloat16 KV cache (kv_cache_dtype='bfloat16') halves the cache")
    if dtype_bytes(s.dtype) == 4:
        levers.append("dtype='bfloat16' halves the weights")
    levers.append("a smaller max_model_len shrinks the smallest cache and the gather buffers")
    levers.append("block_size does not change bytes per token, only the rounding")
    lines.append("  other levers: " + "; ".join(levers))
    raise CacheDoesNotFitError("\n".join(lines), breakdown, suggestions)


def plan_engine(
    cfg: ModelConfig,
    *,
    model_name: str = "model",
    dtype: str = "float32",
    kv_cache_dtype: str | None = None,
    block_size: int = 16,
    num_blocks: int | None = None,
    max_batch_tokens: int | None = None,
    max_num_seqs: int | None = None,
    max_model_len: int | None = None,
    memory: str | int | None = None,
    memory_fraction: float | None = None,
    device: str = "cpu",
    already_loaded: int = 0,
) -> MemoryPlan:
    """The plan an engine starts from: the budget (given, or a fraction of what is free), then
    ``plan``. With no budget given, a solved cache is capped at what ``max_num_seqs`` requests of
    ``max_model_len`` tokens can use at once, so a small model does not reserve the whole host."""
    budget, source = resolve_budget(memory, memory_fraction, device, already_loaded)
    settings = EngineSettings(
        dtype=dtype, kv_dtype=kv_cache_dtype, block_size=block_size, max_model_len=max_model_len, amx=cpu_has_amx()
    )
    max_len = min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
    seqs = max_num_seqs or AUTO_MAX_NUM_SEQS
    cap = seqs * -(-max_len // block_size) if memory is None and memory_fraction is None else None
    return plan(
        cfg,
        budget,
        budget_source=source,
        model_name=model_name,
        settings=settings,
        num_blocks=num_blocks,
        max_batch_tokens=max_batch_tokens,
        max_num_seqs=seqs,
        cap_blocks=cap,
    )
