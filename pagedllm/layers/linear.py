"""Linear layers whose weights are stored the way this CPU multiplies them fastest.

A ``Linear`` may hold several checkpoint tensors stacked by rows (q, k and v; gate and up), so a
sub-layer runs one GEMM where the checkpoint has three. The loader writes each checkpoint tensor
into its rows (``load_part``); ``pack`` then hands bfloat16 weights to oneDNN once, in its own
blocked layout, so no call re-lays them out (eager ``F.linear`` in bf16 does, every call). The
packing ops are private to torch: if they are missing or refuse, the layer stays on ``F.linear``.

fp32 stays on ``F.linear`` (MKL's sgemm): measured here, oneDNN's prepacked fp32 weights were
slower at one row and no faster at 64 (docs/benchmarks.md). MKL's sgemm needs no per-shape
kernel; oneDNN's bf16 kernels are built per input shape, so packed layers pad their rows to a
few buckets (``padded_rows``).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from .workspace import padded_rows

log = logging.getLogger(__name__)


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
    def __init__(self, in_features: int, parts: list[int], bias: bool):
        super().__init__(in_features, parts)
        rows = sum(parts)
        self.weight = nn.Parameter(torch.empty(rows, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(rows), requires_grad=False) if bias else None
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
        """Re-lays bf16 weights out for oneDNN, once. A no-op for other dtypes."""
        if self.packed or self.weight.dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
            return
        try:
            packed = _reorder(self.weight.data)
            probe = torch.zeros(1, self.in_features, dtype=torch.bfloat16)
            expected = F.linear(probe, self.weight.data, None if self.bias is None else self.bias.data)
            got = torch.ops.mkldnn._linear_pointwise(probe, packed, self.bias, "none", [], "")
            if not torch.equal(got, expected):
                raise RuntimeError("packed weights give other results")
        except (AttributeError, RuntimeError) as e:
            _warn_once(f"oneDNN weight packing unavailable ({type(e).__name__}: {e}); using F.linear")
            return
        self.weight = nn.Parameter(packed, requires_grad=False)
        self.packed = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.packed:
            return F.linear(x, self.weight, self.bias)
        rows = x.shape[0]
        padded = padded_rows(rows)
        if padded != rows:  # one oneDNN kernel per row bucket, not one per row count
            x = torch.cat([x, x.new_zeros(padded - rows, x.shape[1])])
        y = torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return y[:rows] if padded != rows else y


def _reorder(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's blocked layout for ``weight`` (what inductor's freezing emits)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning(message)
