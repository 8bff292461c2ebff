"""What ``kernels/csrc/moe.cpp``'s ``moe_quant_experts`` takes of a sparse layer: the weights of
every expert, where each is one quantized matrix per projection in one shared format. The
backend's ``sparse_experts`` and the compiled decode step (``decode_program``) both ask it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...layers import quantized as quant

if TYPE_CHECKING:
    from ...layers.moe import SparseMoE


def quantized_expert_arguments(moe: SparseMoE) -> tuple | None:
    """moe_quant_experts' weight arguments (gate/up's and down's qweights, scales, zeros, bits and
    group, one of each per expert), or None where an expert is not one quantized matrix each of a
    format shared by the layer."""
    columns: list[tuple] = []
    for name in ("gate_up_proj", "down_proj"):
        layers = [getattr(expert, name) for expert in moe.expert_mlps()]
        if any(e.limit is not None for e in moe.expert_mlps()):
            return None
        if not all(
            isinstance(q, quant.QuantizedLinear) and len(q.segments) == 1 and q.bias is None and not q.int8_activations
            for q in layers
        ):
            return None
        segments = [q.segments[0] for q in layers]
        if len({(s.layout, s.group) for s in segments}) != 1:
            return None
        columns.append(
            (
                [s.qweight for s in segments],
                [s.scale for s in segments],
                [s.zero for s in segments],
                segments[0].layout,
                segments[0].group,
            )
        )
    return (*columns[0], *columns[1])
