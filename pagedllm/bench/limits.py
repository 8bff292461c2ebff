"""The machine's limits a `pagedllm bench` figure is set against, measured once per run in the
bench's own process (a few seconds, before any engine starts):

- the GEMM rate of each dtype the rows compute in, on the model's own MLP up-projection shape
  ([rows, hidden] x [hidden, intermediate]) with the run's threads: the faster of ``torch.matmul``
  and oneDNN on weights packed once (here 2.4x ``torch.matmul``'s MKL sgemm in float32, which
  vLLM's float32 rows beat: the library's best is the ceiling);
- the memory read bandwidth: summing a buffer far larger than the caches.

A row's **GEMM share** is the dense work its tokens need (2 FLOPs per weight of the decoder's
linear layers for every prompt and output token, and of the lm_head for every output token) over
its elapsed time, as a share of that rate; its **read share** (pagedllm's rows, which report their
steps) is the weights read once per step (all but an untied embedding table, of which a step reads
a row per token) over the elapsed time, as a share of the bandwidth
measured just before and just after that row ran (their mean: a host whose bandwidth drifts
between runs, 33-69 GB/s within an hour on a 2-core EPYC VM, otherwise sets a row against
another moment's limit). A
batched workload is bound by the first, one request alone by the second. In a mixture of experts a
token's work is its top_k experts', and a step reads the experts its rows chose: with the step's
mean rows (output tokens / steps) routed evenly, 1 - (1 - top_k / experts) ** rows of each layer's
experts (one request: top_k / experts of them; a wide batch: nearly all).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

READ_BYTES = 512 * 1024**2  # far beyond any L3 of these machines
GEMM_ROWS = 512  # a full step's worth of rows (the default step budget)


@dataclass(frozen=True)
class MachineLimits:
    gemm_flops: dict[str, float]  # dtype name -> FLOP/s on the model's MLP shape
    read_bytes_per_s: float
    read_bytes: int = READ_BYTES  # the buffer it was read from

    def read_now(self) -> float:
        """The bandwidth again, now, as it was measured (beside a row: ``shares``)."""
        return read_bandwidth(self.read_bytes)

    def describe(self) -> str:
        rates = ", ".join(f"{d} GEMM {r / 1e9:.0f} GFLOP/s" for d, r in self.gemm_flops.items())
        return f"machine limits: {rates}, memory read {self.read_bytes_per_s / 1e9:.1f} GB/s"


def _best_seconds(fn, repeats: int) -> float:
    fn()  # first call: kernel selection, page faults
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def gemm_flops(dtype: torch.dtype, k: int, n: int, rows: int = GEMM_ROWS, repeats: int = 5) -> float:
    import torch

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(rows, k, generator=g).to(dtype), torch.randn(k, n, generator=g).to(dtype)
    seconds = _best_seconds(lambda: torch.matmul(a, b), repeats)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(b.t().contiguous(), None)
        linear = torch.ops.mkldnn._linear_pointwise
        seconds = min(seconds, _best_seconds(lambda: linear(a, packed, None, "none", [], ""), repeats))
    except (AttributeError, RuntimeError):  # a torch without oneDNN's packing ops: matmul's rate
        pass
    return 2 * rows * k * n / seconds


def read_bandwidth(nbytes: int = READ_BYTES, repeats: int = 5) -> float:
    import torch

    buffer = torch.ones(nbytes // 4, dtype=torch.float32)
    return nbytes / _best_seconds(buffer.sum, repeats)


def measure(hidden: int, intermediate: int, dtypes: list[str], read_bytes: int = READ_BYTES) -> MachineLimits:
    import torch

    rates = {d: gemm_flops(getattr(torch, d), hidden, intermediate) for d in dict.fromkeys(dtypes)}
    return MachineLimits(rates, read_bandwidth(read_bytes), read_bytes)


@dataclass(frozen=True)
class Work:
    """What a workload asks of the model's dense layers, whoever runs it."""

    linear_weights: int  # the decoder layers' linear weights each token uses (a mixture: its top_k experts)
    lm_head_weights: int  # used by every output token
    prompt_tokens: int
    expert_share: float = 0.0  # of the model's weights, the routed experts'
    top_k_share: float = 1.0  # of a layer's experts, those one token chooses

    @classmethod
    def of(cls, cfg, prompt_tokens: int) -> Work:
        from ..memory.footprint import active_linear_weights, parameter_count

        work = cls(active_linear_weights(cfg), cfg.vocab_size * cfg.hidden_size, prompt_tokens)
        moe = cfg.moe
        if moe is None:
            return work
        experts = sum(moe.layers) * moe.num_experts * 3 * cfg.hidden_size * moe.expert_size
        return replace(work, expert_share=experts / parameter_count(cfg), top_k_share=moe.top_k / moe.num_experts)

    def read_fraction(self, rows_per_step: float) -> float:
        """Of the weights, those a step of this many rows reads (every one, but unchosen experts)."""
        touched = 1 - (1 - self.top_k_share) ** max(rows_per_step, 1.0)
        return 1 - self.expert_share + self.expert_share * touched

    def flops(self, output_tokens: int) -> int:
        tokens = self.prompt_tokens + output_tokens
        return 2 * (self.linear_weights * tokens + self.lm_head_weights * output_tokens)


def shares(result: dict, limits: MachineLimits, dtype: str, work: Work) -> dict[str, float]:
    """{'gemm': share of the GEMM rate; 'read': share of the bandwidth, for rows that report
    their steps and weight bytes}."""
    out: dict[str, float] = {}
    if dtype in limits.gemm_flops:
        out["gemm"] = work.flops(result["output_tokens"]) / result["elapsed_s"] / limits.gemm_flops[dtype]
    if "steps" in result and "weights_bytes" in result:
        weights = result.get("step_read_bytes", result["weights_bytes"])  # less an untied embedding table
        read = weights * work.read_fraction(result["output_tokens"] / max(result["steps"], 1))
        bandwidth = result.get("read_limit_bytes_per_s", limits.read_bytes_per_s)  # measured beside the row
        out["read"] = read * result["steps"] / result["elapsed_s"] / bandwidth
    return out
