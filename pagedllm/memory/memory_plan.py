"""MemoryPlan: what an engine will hold at its peak, part by part, and the sizes that produce it;
its report (``table``, ``to_dict``): what ``pagedllm plan`` prints and the server's page shows."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..sizes import ceil_div, gib
from .costs import OVERHEAD_BYTES


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
    overhead_bytes: int  # OVERHEAD_BYTES + grammar caches + the disk tier's buffers (``disk_tier_bytes``)
    loader_bytes: int  # what loading holds above the weights, freed before the cache exists
    weights_format: str = ""  # e.g. "int4 weights, bfloat16 activations"; empty: plain dtype
    disk_tier_bytes: int = 0  # the prefix cache's disk tier's buffers, in overhead_bytes
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
    # layers that keep a fixed state per running sequence (``kinds.SequenceState``): every
    # sequence that may run at once, max_num_seqs of them, and the checkpoints kept for prefixes
    # (``costs.STATE_CHECKPOINTS_PER_SEQUENCE`` per sequence: ``checkpoint_slots``)
    state_bytes: int = 0
    checkpoint_slots: int = 0

    @property
    def state_count(self) -> int:
        """States the plan holds: one per running sequence, and the prefix checkpoints."""
        return self.max_num_seqs + self.checkpoint_slots

    @property
    def pool_blocks(self) -> list[int]:
        """Blocks of every pool, pool 0 first (``KVCache``, ``BlockPools``)."""
        return [self.num_blocks, *(blocks for _, blocks, _ in self.window_pools)]

    @property
    def total_bytes(self) -> int:
        """The peak under load: everything resident at once."""
        return (
            self.baseline_bytes
            + self.weights_bytes
            + self.kv_cache_bytes
            + self.state_bytes
            + self.activation_bytes
            + self.overhead_bytes
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

    def _kv_rows(self) -> list[tuple[str, str]]:
        """The KV cache's row, each sliding window's pool beside it, and the sequences' states."""
        draft = f"; the draft model's {self.draft_kv_bytes_per_block / 1024:.1f} KiB of each block"
        rows = [
            (
                "KV cache",
                f"{gib(self.kv_cache_bytes, 8)}  ({'full-attention layers: ' if self.window_pools else ''}"
                f"{self.num_blocks} blocks x {self.block_size} tokens = "
                f"{self.cache_tokens} tokens, {self.full_length_requests} requests of "
                f"{self.max_model_len} tokens ({self.max_model_len_source}); {self.kv_dtype}"
                f"{draft if self.draft_kv_bytes_per_block else ''})",
            )
        ]
        for w, n, b in self.window_pools:
            rows.append(
                (
                    f"  window {w}",
                    f"{gib(n * b, 8)}  ({n} blocks x {self.block_size} tokens = {n * self.block_size} tokens: "
                    f"the last {w} tokens of each running sequence, for its {w}-token-window layers)",
                )
            )
        if self.window_pools:
            rows.append(
                (
                    "  one shared pool",
                    f"would hold {self.shared_pool_tokens} tokens in the same memory "
                    f"({self.cache_tokens / max(1, self.shared_pool_tokens):.1f}x fewer)",
                )
            )
        if self.state_bytes:
            rows.append(
                (
                    "sequence states",
                    f"{gib(self.state_bytes, 8)}  ({self.state_bytes // self.state_count} bytes per sequence x "
                    f"{self.max_num_seqs} running + {self.checkpoint_slots} prefix checkpoints)",
                )
            )
        return rows

    def _overhead_parts(self) -> str:
        """The overhead beyond OVERHEAD_BYTES, named: grammar caches, the disk tier's buffers."""
        mib = 1024**2
        grammar = self.overhead_bytes - OVERHEAD_BYTES - self.disk_tier_bytes
        parts = [f"{grammar // mib} MiB of grammar caches"] if grammar > 0 else []
        if self.disk_tier_bytes:
            parts.append(f"{self.disk_tier_bytes // mib} MiB of the prefix cache's disk writes")
        return "".join(", " + p for p in parts)

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
            *self._kv_rows(),
            (
                "activation peak",
                f"{gib(self.activation_bytes, 8)}  (max_batch_tokens={self.max_batch_tokens}, "
                f"max_num_seqs={self.max_num_seqs})",
            ),
            (
                "overhead",
                f"{gib(self.overhead_bytes, 8)}  (allocator, requests, buffers{self._overhead_parts()})",
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
