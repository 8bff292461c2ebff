"""Linear layers whose weights are stored the way the backend multiplies them fastest.

A ``Linear`` may hold several checkpoint tensors stacked by rows (q, k and v; gate and up), so a
sub-layer runs one GEMM where the checkpoint has three. The loader writes each checkpoint tensor
into its rows (``load_part``); ``pack`` then hands the weights to the backend once
(``Backend.pack_weight``: on CPU, bf16 weights go to the compiled kernels' tile layout where AMX
is granted, else to oneDNN's blocked layout, so no call re-lays them out as eager ``F.linear``
in bf16 does, every call; fp32 stays on MKL's sgemm).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from ..backends.base import Backend


class StackedRows(nn.Module):
    """A layer whose weight rows are several checkpoint tensors ("parts") one after another."""

    def __init__(self, in_features: int, parts: list[int]):
        super().__init__()
        self.in_features = in_features
        self.parts = list(parts)  # rows of each checkpoint tensor, in order

    def part_rows(self, index: int) -> slice:
        start = sum(self.parts[:index])
        return slice(start, start + self.parts[index])

    def part_shape(self, name: str, index: int) -> tuple[int, ...]:
        """The shape checkpoint tensor ``index`` of ``name`` ('weight' or 'bias') must have."""
        return (self.parts[index], self.in_features) if name == "weight" else (self.parts[index],)

    def load_part(self, name: str, index: int, tensor: torch.Tensor) -> None:
        raise NotImplementedError


class Linear(StackedRows):
    # a layer no quantization or packing touches: a router, whose float32 logits choose the experts
    keep_float = False
    # weights widened to float32 once, at load (a router: its logits are computed in float32)
    in_float32 = False

    def __init__(self, in_features: int, parts: list[int], bias: bool, backend: Backend):
        super().__init__(in_features, parts)
        rows = sum(parts)
        self.weight = nn.Parameter(torch.empty(rows, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(rows), requires_grad=False) if bias else None
        self.backend = backend
        self.packed = False

    def part_view(self, name: str, index: int, dtype: torch.dtype) -> torch.Tensor:
        """The rows of ``name`` ('weight' or 'bias') that checkpoint tensor ``index`` fills; the
        stacked tensor is allocated on first use, in ``dtype``."""
        param = getattr(self, name)
        if param.is_meta:
            param = nn.Parameter(torch.empty(param.shape, dtype=dtype), requires_grad=False)
            setattr(self, name, param)
        return param.data[self.part_rows(index)]

    def load_part(self, name: str, index: int, tensor: torch.Tensor) -> None:
        """Writes one checkpoint tensor into its rows (nothing to do if it was read there)."""
        rows = self.part_view(name, index, tensor.dtype)
        if rows.data_ptr() != tensor.data_ptr():
            rows.copy_(tensor)

    def pack(self) -> None:
        """Re-lays the weights out for the backend, once (a no-op where it keeps them as they are)."""
        if self.in_float32 and self.weight.dtype != torch.float32:
            self.weight = nn.Parameter(self.weight.data.float(), requires_grad=False)
            if self.bias is not None:
                self.bias = nn.Parameter(self.bias.data.float(), requires_grad=False)
        if self.packed or self.keep_float:
            return
        packed = self.backend.pack_weight(self.weight.data, None if self.bias is None else self.bias.data)
        if packed is not None:
            self.weight = nn.Parameter(packed, requires_grad=False)
            self.packed = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.linear(x, self.weight, self.bias, self.packed)
