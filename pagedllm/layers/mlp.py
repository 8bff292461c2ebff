"""The SwiGLU feed-forward block of Llama-family decoders."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, i, b = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=b)
        self.up_proj = nn.Linear(h, i, bias=b)
        self.down_proj = nn.Linear(i, h, bias=b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # down(silu(gate(x)) * up(x)), with silu and the product in place: two [T, I] buffers.
        gate = self.gate_proj(x)
        F.silu(gate, inplace=True)
        gate.mul_(self.up_proj(x))
        return self.down_proj(gate)
