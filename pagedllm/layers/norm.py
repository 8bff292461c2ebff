"""RMSNorm, computed by the model's backend (the reference arithmetic is
``layers.pointwise.rms_norm``). ``add_rms_norm`` fuses the residual add that precedes every norm
after the first."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from ..backends.base import Backend


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, backend: Backend):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.rms_norm(x, self.weight, self.eps)


def add_rms_norm(residual: torch.Tensor, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
    """``residual += x`` in place (HF's ``residual + hidden``, in the activation dtype), then
    returns ``norm(residual)``."""
    return norm.backend.add_rms_norm(residual, x, norm.weight, norm.eps)
