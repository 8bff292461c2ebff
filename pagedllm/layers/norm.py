"""RMSNorm in HF transformers' order of operations and dtypes (the norm in float32, then cast),
so fp32 logits agree with transformers to rounding. ``add_rms_norm`` fuses the residual add
that precedes every norm after the first."""

from __future__ import annotations

import torch
from torch import nn

from ..kernels import compiled_ops


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = compiled_ops()
        if ops is not None and x.dim() == 2 and x.is_contiguous():
            return ops.rms_norm(x, self.weight, self.eps)
        return _rms_norm(x, self.weight, self.eps)


def add_rms_norm(residual: torch.Tensor, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
    """``residual += x`` in place (HF's ``residual + hidden``, in the activation dtype), then
    returns ``norm(residual)``."""
    ops = compiled_ops()
    if ops is not None:
        return ops.add_rms_norm(residual, x, norm.weight, norm.eps)
    return _rms_norm(residual.add_(x), norm.weight, norm.eps)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # HF's order of operations; the last multiply is done in place (same values, no copy).
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x.to(dtype).mul_(weight)
