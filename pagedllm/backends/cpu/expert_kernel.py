"""What ``kernels/csrc/moe.cpp``'s ``moe_quant_experts`` takes of a sparse layer: the weights of
every expert, where each is one quantized matrix per projection in one shared format, with
gpt-oss's biases and clamp where the layer has them. The backend's ``sparse_experts`` and the
compiled decode step (``decode_program``) both ask it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ...layers import quantized as quant

if TYPE_CHECKING:
    from ...kinds.sparse_moe.forward import SparseMoE


def quantized_expert_arguments(moe: SparseMoE) -> tuple | None:
    """moe_quant_experts' weight arguments (gate/up's and down's qweights, scales, zeros, bits and
    group, one of each per expert; then their biases, empty lists for none; the SwiGLU's clamp,
    0 for none, and alpha), or None where an expert is not one quantized matrix each of a format
    shared by the layer."""
    mlps = moe.expert_mlps()
    limits = {e.limit for e in mlps}
    if len(limits) != 1 or (limit := limits.pop()) is not None and limit <= 0:
        return None
    columns: list[tuple] = []
    biases: list[list[torch.Tensor]] = []
    for name in ("gate_up_proj", "down_proj"):
        layers = [getattr(expert, name) for expert in mlps]
        if not all(
            isinstance(q, quant.QuantizedLinear) and len(q.segments) == 1 and not q.int8_activations for q in layers
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
        biases.append([q.bias.data for q in layers if q.bias is not None])
    if any(0 < len(b) < len(mlps) for b in biases) or len(biases[0]) != len(biases[1]):
        return None  # every expert biased alike, or none
    return (*columns[0], *columns[1], *biases, float(limit or 0.0), float(mlps[0].alpha))
