"""A Mamba-2 layer as a module (Granite-4.0-H's): one stacked projection (z, then x/B/C, then dt:
one GEMM), the causal convolution over x/B/C continued from each sequence's state, the scan
(``scan.py``) on each sequence's state, D x added, the output gated by silu(z) and RMS-normed per
group (in that order: transformers' ``norm_before_gate=False``), and the output projection.

Which state each sequence of the step starts from, and where checkpoints are copied out, is
``layers.recurrence.RecurrentMixer``'s (shared with the Gated DeltaNet). A prompt's chunk runs in
the backend's kernel where it has one (``Backend.mamba2_prefill``: token after token, the state in
place), else in chunked form (``scan.chunked``, PyTorch); a decode row's update likewise
(``Backend.mamba2_decode``: the state in place in its slot)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ...config import ModelConfig
from ...layers.linear import Linear
from ...layers.recurrence import CausalConv, NormScale, RecurrentMixer
from . import scan

if TYPE_CHECKING:
    from ...backends.base import Backend

# the checkpoint's name of the part under ``model.layers.N.``
CHECKPOINT_NAME = "mamba"


def build(cfg: ModelConfig, layer: int, backend: Backend) -> Mamba2:
    return Mamba2(cfg, layer, backend)


class Mamba2(RecurrentMixer):
    def __init__(self, cfg: ModelConfig, layer: int, backend: Backend):
        super().__init__()
        m = cfg.mamba2
        assert m is not None
        self.layer, self.eps, self.backend = layer, cfg.rms_norm_eps, backend
        self.heads, self.head_dim, self.state_size, self.groups = m.heads, m.head_dim, m.state_size, m.groups
        self.dt_limit = m.time_step_limit
        self.widths = [m.inner, m.conv_channels, m.heads]  # z, x/B/C, dt
        # one tensor in the checkpoint, split after the GEMM
        self.in_proj = Linear(cfg.hidden_size, [sum(self.widths)], bias=m.projection_bias, backend=backend)
        self.out_proj = Linear(m.inner, [cfg.hidden_size], bias=m.projection_bias, backend=backend)
        self.conv1d = CausalConv(m.conv_channels, m.conv_kernel, m.conv_bias)
        self.norm = NormScale(m.inner)
        self.dt_bias = nn.Parameter(torch.empty(m.heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(m.heads), requires_grad=False)
        self.D = nn.Parameter(torch.empty(m.heads), requires_grad=False)

    def checkpoint_roles(self) -> dict[Linear, tuple[str, ...]]:
        """Its linear layers -> the roles of their parts (``family.Family.name_of``)."""
        return {self.in_proj: ("mamba_in",), self.out_proj: ("mamba_out",)}

    def forward(self, x: torch.Tensor, ropes, attn) -> torch.Tensor:
        """``ropes`` unused (no positions: the state is the order); ``attn``: the step's seam."""
        z, mixed, dt = self.in_proj(x).split(self.widths, dim=-1)
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(*self.dt_limit)
        decay = dt * -self.A_log.float().exp()  # g = dt A <= 0
        out = torch.empty(x.shape[0], self.heads, self.head_dim, dtype=torch.float32)
        self.recur(mixed, (dt, decay), attn, out)
        return self.out_proj(self._gated_norm(out.view(x.shape[0], -1), z).to(x.dtype))

    def chunk(self, convolved, gates, rows, state) -> torch.Tensor:
        x, k, q, v = self._heads(convolved, gates[0][rows])
        out = self.backend.mamba2_prefill(state, q, k, v, gates[1][rows])
        if out is None:
            out = scan.chunked(q, k, v, gates[1][rows], state)
        return out + self.D.float()[:, None] * x

    def step(self, convolved, gates, rows, pool, slots) -> torch.Tensor:
        """The states updated in place in their slots by the backend's kernel, or gathered,
        updated and put back."""
        x, k, q, v = self._heads(convolved, gates[0][rows])
        out = self.backend.mamba2_decode(pool, slots, q, k, v, gates[1][rows])
        if out is None:
            recurrent = pool[slots]
            out = scan.recurrent_step(q, k, v, gates[1][rows], recurrent)
            pool[slots] = recurrent
        return out + self.D.float()[:, None] * x

    def _heads(self, convolved: torch.Tensor, dt: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The convolved channels [n, channels] as x per head, B (k) and C (q) per head (head h
        takes group h // (heads / groups)'s), and v = dt x."""
        n, per_group = convolved.shape[0], self.heads // self.groups
        x, b, c = convolved.split([self.heads * self.head_dim, *[self.groups * self.state_size] * 2], dim=-1)
        x = x.reshape(n, self.heads, self.head_dim)
        k, q = (y.reshape(n, self.groups, self.state_size).repeat_interleave(per_group, dim=1) for y in (b, c))
        return x, k, q, x * dt[..., None]

    def _gated_norm(self, out: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """out [n, inner] times silu(z), RMS-normed over each group's share of the channels, scaled
        (float32 until the cast)."""
        gated = (out * F.silu(z.float())).view(out.shape[0], self.groups, -1)
        normed = gated * torch.rsqrt(gated.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.view_as(out) * self.norm.weight.float()
