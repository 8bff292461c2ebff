"""The SwiGLU feed-forward block of Llama-family decoders: down(silu(gate(x)) * up(x)), with gate
and up stacked into one GEMM."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..kernels import compiled_ops
from .linear import Linear


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, i, b = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_up_proj = Linear(h, [i, i], bias=b)
        self.down_proj = Linear(i, [h], bias=b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_up_proj(x)))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] along the last dim, in the activation dtype as HF."""
    ops = compiled_ops()
    if ops is not None:
        return ops.silu_mul(gate_up)
    inner = gate_up.shape[-1] // 2
    out = F.silu(gate_up[:, :inner])
    return out.mul_(gate_up[:, inner:])
