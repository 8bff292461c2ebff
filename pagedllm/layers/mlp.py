"""The SwiGLU feed-forward block of Llama-family decoders: down(silu(gate(x)) * up(x)), with gate
and up stacked into one GEMM."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ..config import ModelConfig
from .linear import Linear

if TYPE_CHECKING:
    from ..backends.base import Backend


class MLP(nn.Module):
    """``width``: the intermediate width (default the config's; an expert's is its own)."""

    def __init__(self, cfg: ModelConfig, backend: Backend, width: int | None = None):
        super().__init__()
        h, i, b = cfg.hidden_size, width or cfg.intermediate_size, cfg.mlp_bias
        self.gate_up_proj = Linear(h, [i, i], bias=b, backend=backend)
        self.down_proj = Linear(i, [h], bias=b, backend=backend)
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.backend.silu_mul(self.gate_up_proj(x)))
