"""Refusal: the error a plan that cannot fit raises (``CacheDoesNotFitError``), with one
consistent set of numbers and the levers that would make it fit."""

from __future__ import annotations

from typing import NoReturn

from ..errors import CacheDoesNotFitError
from ..sizes import ceil_div, dtype_bytes, gib, kv_element_bytes
from .costs import AUTO_MAX_BATCH_TOKENS, Costs, overhead
from .footprint import activation_peak


class Refusal:
    """Raises CacheDoesNotFitError with one consistent set of numbers: what was asked (or the
    smallest engine that serves one request of L tokens), what each part of it needs, and the
    largest values that fit instead, all from the same ``Costs``."""

    def __init__(
        self,
        costs: Costs,
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
            **({"states": c.states} if c.states else {}),
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
