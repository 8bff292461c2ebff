"""``cpu-torch``: every op in plain PyTorch. The reference the compiled kernels are tested
against, and what runs where no C++ compiler is (one log line says so)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ...layers import pointwise
from ...layers import quantized as quant
from .. import base
from ..base import Attention, Backend, PlanFacts
from . import attention
from .kv_cache import KVCache
from .threads import ThreadGovernor
from .workspace import DEQUANT_CHUNK_ELEMENTS, GATHER_BUDGET, PAIRS_BUDGET, padded_rows

if TYPE_CHECKING:
    from ...config import ModelConfig
    from ...engine.step import StepInput


class CPUTorchBackend(Backend):
    name = "cpu-torch"
    device = torch.device("cpu")
    kernels = "torch"  # what the memory planner's workspace terms follow
    # attention's tiles (``workspace``): the backend's own, so every rank and replay of a step tiles alike
    pairs_budget = PAIRS_BUDGET
    gather_budget = GATHER_BUDGET

    # ---- the KV cache and attention -------------------------------------------------------

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """Head-major and flat, ``[KVH, slots, D]``: a write is one indexed copy by slot, a read one
        gather by slot, and each KV head's gathered keys are contiguous (the bf16 GEMMs need it)."""
        return (num_kv_heads, num_blocks * block_size, head_dim)

    def allocate_kv_cache(
        self,
        cfg: ModelConfig,
        num_blocks: int | list[int],
        block_size: int,
        dtype: torch.dtype | str,
        resident: bool,
        capacity_blocks: int | list[int] | None = None,
        state_slots: int = 0,
        checkpoint_slots: int = 0,
    ) -> KVCache:
        if cfg.state_bytes_per_sequence() and state_slots < 1:
            raise ValueError("a model whose layers keep a state per sequence needs state_slots (max_num_seqs)")

        def shape(blocks: int) -> tuple[int, ...]:
            return self.kv_cache_shape(blocks, block_size, cfg.num_kv_heads, cfg.head_dim)

        return KVCache(
            cfg,
            num_blocks,
            block_size,
            dtype,
            self.device,
            resident=resident,
            shape=shape,
            capacity_blocks=capacity_blocks,
            state_slots=state_slots,
            checkpoint_slots=checkpoint_slots,
        )

    def attention_metadata(self, step: StepInput, group_size: int) -> attention.StepLayout:
        return attention.StepLayout.from_step(
            step, group_size, pairs_budget=self.pairs_budget, gather_budget=self.gather_budget
        )

    def attention(self, kv_cache: base.KVCache, layout: base.AttentionLayout) -> Attention:
        return attention.TorchPagedAttention(*cpu_step(kv_cache, layout))

    # ---- pointwise ------------------------------------------------------------------------

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return pointwise.rms_norm(x, weight, eps)

    def add_rms_norm(self, residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return pointwise.rms_norm(residual.add_(x), weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return pointwise.silu_mul(gate_up)

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return pointwise.gelu_tanh_mul(gate_up)  # the compiled backend too: no kernel of its own yet

    def rotary_(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        pointwise.rotary_(q, k, cos, sin)

    # ---- weights --------------------------------------------------------------------------

    def pack_weight(self, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """bf16 and fp32 weights in oneDNN's blocked layout, once: eager ``F.linear`` re-lays bf16
        out every call, and runs fp32 on MKL's sgemm, which oneDNN on packed weights beats 1.2-2.9x
        on the default model's layers at 1-200 rows (2-core Xeon, AVX-512, no AMX; docs/benchmarks.md).
        The packing ops are private to torch: if they are missing or refuse, the layer stays on
        ``F.linear``."""
        if weight.dtype not in (torch.bfloat16, torch.float32) or not torch.backends.mkldnn.is_available():
            return None
        try:
            packed = _reorder(weight)
            probe = torch.linspace(-1, 1, weight.shape[1], dtype=weight.dtype)[None]
            expected = F.linear(probe, weight, bias)
            got = torch.ops.mkldnn._linear_pointwise(probe, packed, bias, "none", [], "")
            # the same products summed in another order (bf16: then rounded to 8 bits of mantissa)
            tolerance = 1e-4 if weight.dtype == torch.float32 else 1.6e-2
            if not torch.allclose(got, expected, rtol=tolerance, atol=tolerance * float(expected.abs().max())):
                raise RuntimeError("packed weights give other results")
        except (AttributeError, RuntimeError) as e:
            _warn_once(f"oneDNN weight packing unavailable ({type(e).__name__}: {e}); using F.linear")
            return None
        return packed

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: bool) -> torch.Tensor:
        if not packed:
            return F.linear(x, weight, bias)
        rows = x.shape[0]
        padded = padded_rows(rows)
        if padded != rows:  # one oneDNN kernel per row bucket, not one per row count
            x = torch.cat([x, x.new_zeros(padded - rows, x.shape[1])])
        y = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
        return y[:rows] if padded != rows else y

    def dequantize(
        self, w: quant.QuantizedWeight, dtype: torch.dtype, rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        return quant.dequantize_reference(w, dtype, rows)

    def quantized_matmul(self, x: torch.Tensor, w: quant.QuantizedWeight) -> torch.Tensor:
        """Dequantize the layer (at most ``DEQUANT_CHUNK_ELEMENTS`` weights at a time) + GEMM."""
        return chunked_matmul(x, w, lambda part: F.linear(x, self.dequantize(part, x.dtype)))

    def int8_matmul(self, x: torch.Tensor, w: quant.QuantizedWeight) -> torch.Tensor:
        """oneDNN's int8 GEMM (VNNI dot products, int32 sums) on x rounded per row, then one
        float pass scaling the sums by each row's and each channel's step. The int32 sums and
        their float copy are the step's transients (``memory.footprint``)."""
        if not w.int8_per_row:
            raise ValueError("w8a8 multiplies int8 weights with one scale per row, not this layout")
        xq, step = quant.quantize_per_token(x)
        sums = torch._int_mm(xq, w.qweight.t())
        y = sums.to(torch.float32)
        del sums
        y.mul_(step).mul_(w.scale.view(1, -1))
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    # ---- sampling -------------------------------------------------------------------------

    def mask_logits(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], vocab_size: int) -> None:
        import xgrammar as xgr  # only a process that builds Grammars gets here

        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab_size, indices=rows)

    # ---- the machine ----------------------------------------------------------------------

    def thread_policy(self, max_threads: int | None = None, cpus: list[int] | None = None) -> ThreadGovernor:
        # pinning needs the compiled kernels; the count still applies
        return ThreadGovernor(pin=None, max_threads=max_threads, cpus=cpus)

    def plan_facts(self, dtype: str) -> PlanFacts:
        from .onednn_probe import gemm_kind_to_plan

        kind = gemm_kind_to_plan(dtype)
        return PlanFacts(kernels=self.kernels, gemm_kind=kind, amx_tiles=False, device=self.device.type)


def _reorder(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's blocked layout for ``weight`` (what inductor's freezing emits)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


log = logging.getLogger(__name__)
_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning(message)


def chunked_matmul(
    x: torch.Tensor, w: quant.QuantizedWeight, product: Callable[[quant.QuantizedWeight], torch.Tensor]
) -> torch.Tensor:
    """x @ w^T as ``product`` of at most ``DEQUANT_CHUNK_ELEMENTS`` weights' rows at a time (one
    dequantized chunk alive at once), into one output; the whole layer where it fits one chunk."""
    n, k = w.shape
    chunk = max(1, DEQUANT_CHUNK_ELEMENTS // k)
    if n <= chunk:
        return product(w)
    out = x.new_empty(x.shape[0], n)
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        out[:, start:stop] = product(w.rows(start, stop))
    return out


def cpu_step(kv_cache: base.KVCache, layout: base.AttentionLayout) -> tuple[KVCache, attention.StepLayout]:
    """The CPU's own cache and layout behind the protocols the engine hands back (a cache or a
    layout another device made is a programming error, said as one)."""
    if not isinstance(kv_cache, KVCache) or not isinstance(layout, attention.StepLayout):
        raise TypeError(f"a CPU backend's attention over {type(kv_cache).__name__} and {type(layout).__name__}")
    return kv_cache, layout
