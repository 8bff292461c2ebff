"""RMSNorm in HF transformers' order of operations and dtypes (the norm in float32, then cast),
so fp32 logits agree with transformers to rounding."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # HF's order of operations; the last multiply is done in place (same values, no copy).
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x.to(dtype).mul_(self.weight)
