"""``cpu-compiled``: pagedllm's C++ kernels (``kernels/csrc``, loaded as ``torch.ops.pagedllm``)
for attention in place over the paged cache, the fused pointwise ops, the quantized GEMMs and
the grammar mask; anything they do not cover (a layout, a dtype) runs the reference PyTorch
arithmetic of ``cpu-torch``, for that call only."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch

from ...layers import quantized as quant
from .. import base
from ..base import Attention, PlanFacts
from . import attention, float_rows_rule, machine
from .expert_kernel import quantized_expert_arguments
from .threads import ThreadGovernor
from .torch_backend import CPUTorchBackend, chunked_matmul, cpu_step
from .workspace import PACK_DEQUANTIZED_ROWS, QUANT_KERNEL_MAX_ROWS, tile_packable

if TYPE_CHECKING:
    from ...kinds.sparse_moe.forward import SparseMoE
    from ...models.decoder import DecoderLM
    from ..base import DecodeProgram


# The weight bytes of every model this process holds (``hold_weights``); a model once, while it lives.
_HELD: weakref.WeakKeyDictionary[DecoderLM, int] = weakref.WeakKeyDictionary()


class CPUCompiledBackend(CPUTorchBackend):
    name = "cpu-compiled"
    kernels = "compiled"

    def __init__(self, ops: Any):
        """``ops``: the loaded kernels (``kernels.compiled_ops()``)."""
        self.ops = ops
        # Whether bf16 products run on AMX tiles (quantized weights at many rows, dense bf16
        # weights in the kernels' own layout at any count): built with AMX, the OS grants the
        # tile state, and ONEDNN_MAX_CPU_ISA does not cap it away.
        self.amx_tiles = bool(ops.amx_tiles())
        # How many float32 rows the quantized kernel takes (64 on AVX2; on AVX-512 any count or
        # none beyond ``QUANT_KERNEL_MAX_ROWS``, by the CPU's vendor: ``float_rows_rule``); more
        # dequantize + GEMM, as bf16 rows beyond ``QUANT_KERNEL_MAX_ROWS`` do.
        self.quant_float_max_rows = float_rows_rule.quant_float_max_rows(ops)
        # w8a8's integer sums in the kernels' own AVX2 GEMM (built without VNNI), not oneDNN's:
        # no int32 sums tensor among the step's transients
        self.own_int8_sums = bool(ops.w8a8_own_sums())

    def attention(self, kv_cache: base.KVCache, layout: base.AttentionLayout) -> Attention:
        return attention.CompiledPagedAttention(self.ops, *cpu_step(kv_cache, layout))

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # Qwen3's q/k norms get [T, H, D] views of the qkv rows: the kernel takes a contiguous copy
        rows = x.reshape(-1, x.shape[-1])
        if rows.is_contiguous() and weight.is_contiguous() and weight.dtype == x.dtype:
            return self.ops.rms_norm(rows, weight, eps).view(x.shape)
        return super().rms_norm(x, weight, eps)  # a case the kernel does not take

    def add_rms_norm(self, residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.ops.add_rms_norm(residual, x, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.ops.silu_mul(gate_up)

    def rotary_(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        self.ops.rotary(q, k, cos, sin)

    def delta_rule_decode(self, state, slots, q, k, v, g, beta) -> torch.Tensor | None:
        inputs = [t.float().contiguous() for t in (q, k, v, g, beta)]
        return self.ops.delta_rule_decode(state, slots.long().contiguous(), *inputs)

    def delta_rule_prefill(self, state, q, k, v, g, beta) -> torch.Tensor | None:
        return self.ops.delta_rule_prefill(state, *[t.float().contiguous() for t in (q, k, v, g, beta)])

    def mamba2_prefill(self, state, q, k, v, g) -> torch.Tensor | None:
        return self.ops.mamba2_prefill(state, *[t.float().contiguous() for t in (q, k, v, g)])

    def conv_state_step(self, conv_state, slots, x, weight, bias, silu: bool) -> torch.Tensor | None:
        taps = weight.reshape(weight.shape[0], -1).float().contiguous()
        none = torch.empty(0)
        floats = [x.float().contiguous(), taps, none if bias is None else bias.float().contiguous()]
        return self.ops.conv_state_step(conv_state, slots.long().contiguous(), *floats, silu)

    def gated_deltanet_decode(
        self, conv_state, state, slots, x, conv_weight, g, beta, key_heads, tiled
    ) -> torch.Tensor | None:
        inputs = [t.float().contiguous() for t in (x, conv_weight.reshape(conv_weight.shape[0], -1), g, beta)]
        return self.ops.gated_deltanet_decode(conv_state, state, slots.long().contiguous(), *inputs, key_heads, tiled)

    def gated_deltanet_layer_decode(self, layer, mixed, z, b, a, states, slots) -> torch.Tensor | None:
        taps = layer.conv1d.weight.reshape(layer.conv1d.weight.shape[0], -1)
        floats = [t.float().contiguous() for t in (mixed, taps, b, a, layer.A_log, layer.dt_bias, z, layer.norm.weight)]
        return self.ops.gated_deltanet_layer_decode(
            states["conv"], states["recurrent"], slots, *floats, layer.eps, layer.key_heads, layer.value_heads_tiled
        )

    def mamba2_decode(self, state, slots, q, k, v, g) -> torch.Tensor | None:
        inputs = [t.float().contiguous() for t in (q, k, v, g)]
        return self.ops.mamba2_decode(state, slots.long().contiguous(), *inputs)

    def pack_weight(self, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """With AMX tiles, bf16 weights in the kernels' layout (``kernels/csrc/dense_gemm.cpp``):
        [N/16, K/32, 16 column pairs, 16 channels x 2], which the tiles and the one-row dot
        products both read as it is: a decode step's GEMMs (1-32 rows) run 1.6-1.8x faster than on
        oneDNN's packing, a prefill's about level (benchmarks/dense_gemm.py, docs/benchmarks.md).
        Otherwise, and for shapes the kernel does not take, oneDNN's packing."""
        n, k = weight.shape
        if not (self.amx_tiles and weight.dtype == torch.bfloat16 and tile_packable(n, k)):
            return super().pack_weight(weight, bias)
        pairs = weight.view(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4)  # [block, kk, pair, channel, 2]
        return pairs.reshape(n // 16, k // 32, 16, 32).contiguous()

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: bool) -> torch.Tensor:
        if packed and weight.dim() == 4:  # pack_weight's own layout, not oneDNN's
            return self.ops.dense_linear(x, weight, bias)  # the op makes x contiguous if it must
        return super().linear(x, weight, bias, packed)

    def dequantize(
        self, w: quant.QuantizedWeight, dtype: torch.dtype, rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.ops.dequantize(w.qweight, w.scale, w.zero, w.layout, w.group, rows, dtype)

    def quantized_matmul(self, x: torch.Tensor, w: quant.QuantizedWeight) -> torch.Tensor:
        """The packed-weight kernel for few rows (a step costs the bytes of the 4- or 8-bit
        weights), for float32 rows up to ``quant_float_max_rows`` (with AVX-512 any count where
        it beats dequantize + GEMM on this CPU's vendor: ``float_rows_rule``; with AVX2 up to 64:
        docs/quantization.md), and for any number of bf16 rows on AMX tiles
        (weights dequantized 16 channels at a time into L1); else dequantize the layer + GEMM."""
        tiles = self.amx_tiles and x.dtype == torch.bfloat16 and w.shape[1] % 32 == 0
        if tiles or self.quant_kernel_takes(x.shape[0], x.dtype):
            return self.ops.quant_linear(x.contiguous(), w.qweight, w.scale, w.zero, w.layout, w.group)
        if x.dtype == torch.float32 and x.shape[0] >= PACK_DEQUANTIZED_ROWS:
            return self._packed_chunks_matmul(x, w)
        return super().quantized_matmul(x, w)

    def _packed_chunks_matmul(self, x: torch.Tensor, w: quant.QuantizedWeight) -> torch.Tensor:
        """Float32 rows past the kernel: each chunk of the layer dequantized, packed for oneDNN
        and multiplied as a packed dense layer is (``workspace.PACK_DEQUANTIZED_ROWS``: MKL's
        sgemm on the plain chunk ran 2.4x slower here)."""
        return chunked_matmul(x, w, lambda part: self.linear(x, self._packed(part), None, True))

    def _packed(self, w: quant.QuantizedWeight) -> torch.Tensor:
        """``w`` dequantized to float32 and packed for oneDNN (the plain copy freed on return)."""
        return torch.ops.mkldnn._reorder_linear_weight(self.dequantize(w, torch.float32), None)

    def quant_kernel_takes(self, rows: int, dtype: torch.dtype) -> bool:
        """Few rows, or float32 ones up to what the kernel beats dequantize + GEMM at (AMX tiles
        also take any bf16 rows whose width is a multiple of 32, which the decode step does not
        assume)."""
        return rows <= QUANT_KERNEL_MAX_ROWS or (dtype == torch.float32 and rows <= self.quant_float_max_rows)

    def hold_weights(self, model: DecoderLM) -> None:
        """One bf16 row against a K-quant matrix reads one channel at a time once the weights this
        process holds outgrow the L3 (they stream from memory, where one address stream a thread
        reads fastest), four channels at a time while they fit (the caches serve four streams,
        and the four share each load of x): ``set_k_quant_row_by_channel``. A process holding two
        models (a draft beside its target) counts both."""
        _HELD[model] = model.weight_bytes()
        l3 = machine.l3_bytes()
        self.ops.set_k_quant_row_by_channel(l3 == 0 or sum(_HELD.values()) > l3)

    def decode_program(self, model: DecoderLM) -> DecodeProgram | None:
        from .decode_program import build

        return build(model, torch.classes.pagedllm.DecodeStep)

    def sparse_experts(
        self, moe: SparseMoE, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
    ) -> torch.Tensor | None:
        """``kernels/csrc/moe.cpp``: the layer's loop over its chosen experts in one call, where
        every expert is quantized in one format (as stored or at load; no biases, no clamp) and
        the step's rows are few enough for the packed-weight kernel."""
        if not self.quant_kernel_takes(x.shape[0], x.dtype):
            return None
        if "quant_experts" not in moe.kernel_cache:
            moe.kernel_cache["quant_experts"] = quantized_expert_arguments(moe)
        arguments = moe.kernel_cache["quant_experts"]
        if arguments is None:
            return None
        return self.ops.moe_quant_experts(x.contiguous(), experts, weights, *arguments)

    def int8_matmul(self, x: torch.Tensor, w: quant.QuantizedWeight) -> torch.Tensor:
        """One op (int8_gemm.cpp): x rounded per row in one pass, oneDNN's int8 GEMM, the sums
        scaled straight into the float output; the same integers as the PyTorch path."""
        if not w.int8_per_row:
            return super().int8_matmul(x, w)  # raises, naming the layout
        return self.ops.w8a8_linear(x, w.qweight, w.scale)

    def mask_logits(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], vocab_size: int) -> None:
        if logits.dtype == torch.float32 and logits.stride(1) == 1:
            self.ops.mask_logits(logits, bitmask, rows, vocab_size)  # a 32-bit word of the mask at a time
        else:
            super().mask_logits(logits, bitmask, rows, vocab_size)

    def thread_policy(self, max_threads: int | None = None, cpus: list[int] | None = None) -> ThreadGovernor:
        return ThreadGovernor(pin=self.ops.pin_threads, max_threads=max_threads, cpus=cpus)

    def shared_memory_ops(self) -> Any:
        return self.ops

    def plan_facts(self, dtype: str) -> PlanFacts:
        facts = super().plan_facts(dtype)
        return PlanFacts(
            kernels=self.kernels,
            gemm_kind=facts.gemm_kind,
            amx_tiles=self.amx_tiles,
            quant_float_max_rows=self.quant_float_max_rows,
            own_int8_sums=self.own_int8_sums,
        )
