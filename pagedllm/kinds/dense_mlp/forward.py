"""The SwiGLU feed-forward block of Llama-family decoders: down(silu(gate(x)) * up(x)), with gate
and up stacked into one GEMM; gpt-oss's experts clamp it (``clamped_swiglu``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ...config import ModelConfig
from ...layers.linear import Linear

if TYPE_CHECKING:
    from ...backends.base import Backend


# the checkpoint's name of the part under ``model.layers.N.``
CHECKPOINT_NAME = "mlp"


def build(cfg: ModelConfig, layer: int, backend: Backend) -> MLP:
    return MLP(cfg, backend)


class MLP(nn.Module):
    """``width``: the intermediate width (default the config's; an expert's is its own).
    ``swiglu_limit``: clamp the activation as gpt-oss's experts do (``clamped_swiglu``)."""

    def __init__(
        self,
        cfg: ModelConfig,
        backend: Backend,
        width: int | None = None,
        swiglu_limit: float | None = None,
        swiglu_alpha: float = 1.0,
    ):
        super().__init__()
        h, i, b = cfg.hidden_size, width or cfg.intermediate_size, cfg.mlp_bias
        self.gate_up_proj = Linear(h, [i, i], bias=b, backend=backend)
        self.down_proj = Linear(i, [h], bias=b, backend=backend)
        self.backend = backend
        self.limit, self.alpha = swiglu_limit, swiglu_alpha
        self.activation = backend.gelu_tanh_mul if cfg.activation == "gelu_tanh" else backend.silu_mul

    def checkpoint_roles(self) -> dict[Linear, tuple[str, ...]]:
        """Its linear layers -> the roles of their parts (``family.Family.name_of``)."""
        return {self.gate_up_proj: ("gate", "up"), self.down_proj: ("down",)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # gate/up's output is a temporary of the activation's call, gone before down runs
        if self.limit is not None:
            return self.down_proj(clamped_swiglu(self.gate_up_proj(x), self.alpha, self.limit))
        return self.down_proj(self.activation(self.gate_up_proj(x)))


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's activation: the gate clamped below ``limit``, up within +-``limit``, then
    (up + 1) * gate * sigmoid(alpha * gate), the same products as transformers'. Plain PyTorch on
    every backend, clamped in place in ``gate_up`` (this step's own output), so it holds one new
    [rows, width] tensor, as silu_mul does: the planner's phases are the same."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate.clamp_(max=limit)
    up.clamp_(min=-limit, max=limit).add_(1)
    out = gate * alpha
    return out.sigmoid_().mul_(gate).mul_(up)
